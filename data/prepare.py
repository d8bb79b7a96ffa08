"""Corpus preparation: MiniMind pretrain JSONL -> packed token file (numpy memmap) + fingerprint.

Each line of the source is `{"text": "..."}`. Documents are encoded as BOS + ids + EOS (the byte
tokenizer's, or a tokenizer file's: data/tokenizer), joined, and cut into samples of `seq_len + 1`
tokens (the tail that does not fill a sample is dropped). The packed file `<name>.bin` (uint16, or
uint32 for a vocabulary past 65,536 ids) sits in the cache folder beside `<name>.json`, the
fingerprint, which is written last: a packed file counts only when its fingerprint matches the
source's sha256, the tokenizer and seq_len, so a killed preparation is never mistaken for a cache.
"""
from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import queue
import sys
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np

from checkpoint.files import atomic_file, atomic_write, tmp_prefix

from . import tokenizer

BUILTIN = "stdlib"
"""`data.path` value that selects the built-in corpus: the standard library's docstrings."""
FORMAT = 1
log = logging.getLogger("minimind")
_STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "ensurepip", "turtledemo"}


class DataError(ValueError):
    """Bad corpus input; the message names the file (and line) at fault."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale_temporaries(path: Path) -> list[Path]:
    """Remove temp files of `path` left by a preparation killed on this host (its pid is gone).
    Another host's, or a live process's, are left alone: they may still be writing."""
    removed, prefix = [], tmp_prefix(path)
    for p in path.parent.glob(f".{path.name}.tmp-*"):
        pid = p.name[len(prefix):] if p.name.startswith(prefix) else ""
        if pid.isdigit() and not _alive(int(pid)):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def build_stdlib_corpus(dest: Path) -> Path:
    """Write the docstrings of this Python's standard library as MiniMind JSONL, once.

    Sources are parsed with `ast`, never imported. The result depends on the Python version, which
    the packed file's fingerprint (the source's sha256) records.
    """
    if dest.exists():
        return dest
    root = sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _STDLIB_SKIP)
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest, "w", encoding="utf-8") as out:
        for path in files:
            with open(path, "rb") as f:
                src = f.read()
            try:
                tree = ast.parse(src)
            except (SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 32:
                        out.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    return dest


def resolve_source(path: str, cache_dir: Path, key: str = "data.path") -> Path:
    """The JSONL file behind `data.path` (or the `key` given, e.g. data.val_path), building the
    built-in corpus when asked for."""
    if path == BUILTIN:
        return build_stdlib_corpus(cache_dir / "stdlib_docstrings.jsonl")
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{key}: corpus file {p} does not exist (expected a JSONL file of {{\"text\": ...}} lines, or '{BUILTIN}')")
    return p


def _iter_lines(path: Path):
    """(text, bytes of its line) of every document of a JSONL corpus, streamed; bad lines raise
    DataError naming the file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path}:{lineno}: line is not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f'{path}:{lineno}: expected an object with a string "text" field, got {raw[:80]!r}')
            text = obj["text"]
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:  # JSON allows "\ud800"; UTF-8 does not
                    raise DataError(f"{path}:{lineno}: the text holds a lone surrogate {text[e.start]!r} at character "
                                    f"{e.start}, which is not valid Unicode text") from None
            yield text, len(raw)


def iter_documents(path: Path):
    """The "text" of every document of a JSONL corpus, streamed (bad lines: DataError naming file:line)."""
    for text, _ in _iter_lines(path):
        yield text


def _batches(path: Path, batch_bytes: int):
    """Lists of texts of about `batch_bytes` of source each, with the source bytes they came from."""
    texts, size = [], 0
    for text, n in _iter_lines(path):
        texts.append(text)
        size += n
        if size >= batch_bytes:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


def _read_ahead(batches, depth: int = 2):
    """Iterate `batches` with the next ones produced in a helper thread (reading and parsing JSON
    while the tokenizer encodes the current batch, which releases the GIL); its errors are raised here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done, stop = object(), threading.Event()

    def produce() -> None:
        try:
            for item in batches:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # handed to the consumer, raised there with its message
            q.put(e)

    threading.Thread(target=produce, name="corpus-reader", daemon=True).start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


class _Progress:
    """Packing progress with MB/s: a tqdm bar on a terminal, else a log line every `every_s` seconds."""

    def __init__(self, source: Path, total: int, every_s: float = 5.0) -> None:
        self.source, self.total, self.every_s = source, total, every_s
        self.done, self.t0 = 0, time.monotonic()
        self.last = self.t0
        self.bar = None
        if sys.stderr.isatty() and total > 8 << 20:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"packing {source.name}", mininterval=1.0)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            log.info("packing %s: %.0f of %.0f MB (%.1f MB/s)", self.source, self.done / 1e6, self.total / 1e6,
                     self.done / 1e6 / (now - self.t0))

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return self.done / 1e6 / max(time.monotonic() - self.t0, 1e-9)


def cache_stem(source: Path, seq_len: int, tok) -> str:
    """The packed file's name: the source's stem, a key of its path (and tokenizer), the seq_len."""
    ident = str(source) if tok.name == tokenizer.NAME else f"{source}|{tok.name}"
    return f"{source.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:10]}-L{seq_len}"


def pack(source: Path, seq_len: int, cache_dir: Path, tok=None, batch_bytes: int = 4 << 20) -> tuple[Path, dict]:
    """Return the packed file for `source` under tokenizer `tok` (default: bytes) and its
    fingerprint, building it when stale or missing.

    The source is streamed in batches of about `batch_bytes`, each tokenized at once (the
    `tokenizers` library's parallel batch encoder for a tokenizer file) and appended to a temporary
    file: memory does not grow with the corpus. The ids are uint16 when the vocabulary fits, else
    uint32. The temporary file becomes the packed file (os.replace) and the fingerprint is written
    last, so a killed preparation leaves nothing that is used."""
    tok = tok or tokenizer.ByteTokenizer()
    source = source.resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = cache_stem(source, seq_len, tok)
    bin_path, meta_path = cache_dir / f"{stem}.bin", cache_dir / f"{stem}.json"
    dtype = tokenizer.id_dtype(tok.vocab_size)
    src_sha = sha256_file(source)
    if meta_path.exists() and bin_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            meta = {}
        if (
            meta.get("format") == FORMAT
            and meta.get("source_sha256") == src_sha
            and meta.get("tokenizer") == tok.name
            and meta.get("dtype", "uint16") == dtype.name
            and meta.get("seq_len") == seq_len
            and bin_path.stat().st_size == meta.get("num_samples", -1) * dtype.itemsize * (seq_len + 1)
        ):
            # where this run's tokenizer file is (the cache may have been packed from a copy elsewhere)
            return bin_path, {**meta, "dtype": dtype.name, **({"tokenizer_source": tok.source} if hasattr(tok, "source") else {})}

    for p in clear_stale_temporaries(bin_path) + clear_stale_temporaries(meta_path):
        log.info("removed %s, left by an interrupted preparation", p)
    t0 = time.time()
    n_docs = n_tokens = 0
    progress = _Progress(source, source.stat().st_size)
    try:
        with atomic_file(bin_path, "wb") as out:  # an error or a stop leaves no half-written cache
            for texts, size in _read_ahead(_batches(source, batch_bytes)):
                ids = tok.pack_batch(texts)
                ids.astype(dtype, copy=False).tofile(out)
                n_docs += len(texts)
                n_tokens += len(ids)
                progress.update(size)
            num_samples = n_tokens // (seq_len + 1)
            out.truncate(num_samples * (seq_len + 1) * dtype.itemsize)
            if n_docs == 0:
                raise DataError(f"{source}: the corpus is empty (no {{\"text\": ...}} lines)")
            if num_samples == 0:
                raise DataError(f"{source}: {n_tokens} tokens do not fill one sample of seq_len + 1 = {seq_len + 1} tokens")
    finally:
        mb_per_s = progress.close()
    meta = {
        "format": FORMAT,
        "source": str(source),
        "source_sha256": src_sha,
        "tokenizer": tok.name,
        **({"tokenizer_source": tok.source} if hasattr(tok, "source") else {}),
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "seq_len": seq_len,
        "documents": n_docs,
        "num_tokens": n_tokens,
        "num_samples": num_samples,
        "build_seconds": round(time.time() - t0, 2),
    }
    log.info("packed %s: %d documents, %d tokens, %d samples, %.1f MB/s", source, n_docs, n_tokens, num_samples, mb_per_s)
    atomic_write(meta_path, json.dumps(meta, indent=1))
    return bin_path, meta


def unigram_entropy(bin_path: Path, num_tokens: int | None = None, dtype: str = "uint16") -> float:
    """Entropy in nats of the token distribution of the packed file (its first `num_tokens`):
    the loss of the best model that ignores context."""
    tokens = np.memmap(bin_path, dtype=np.dtype(dtype), mode="r")[:num_tokens]
    counts = np.bincount(tokens)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
