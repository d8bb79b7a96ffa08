"""Corpus preparation: MiniMind pretrain JSONL -> packed token file (numpy memmap) + fingerprint.

Each line of the source is `{"text": "..."}`. Documents are encoded as BOS + bytes + EOS, joined,
and cut into samples of `seq_len + 1` tokens (the tail that does not fill a sample is dropped).
The packed file `<name>.bin` (uint16) sits in the cache folder beside `<name>.json`, the
fingerprint, which is written last: a packed file counts only when its fingerprint matches the
source's sha256, the tokenizer and seq_len, so a killed preparation is never mistaken for a cache.
"""
from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import socket
import sysconfig
import time
from pathlib import Path

import numpy as np

from . import tokenizer

BUILTIN = "stdlib"
"""`data.path` value that selects the built-in corpus: the standard library's docstrings."""
FORMAT = 1
log = logging.getLogger("minimind")
_STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "ensurepip", "turtledemo"}


class DataError(ValueError):
    """Bad corpus input; the message names the file (and line) at fault."""


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


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
    removed, prefix = [], f".{path.name}.tmp-{socket.gethostname()}-"
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
    tmp = _tmp_name(dest)
    with open(tmp, "w", encoding="utf-8") as out:
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
    _fsync_replace(tmp, dest)
    return dest


def resolve_source(path: str, cache_dir: Path) -> Path:
    """The JSONL file behind `data.path` (building the built-in corpus when asked for)."""
    if path == BUILTIN:
        return build_stdlib_corpus(cache_dir / "stdlib_docstrings.jsonl")
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data.path: corpus file {p} does not exist (expected a JSONL file of {{\"text\": ...}} lines, or '{BUILTIN}')")
    return p


def _iter_documents(path: Path):
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
            try:
                obj["text"].encode("utf-8")
            except UnicodeEncodeError as e:  # JSON allows "\ud800"; UTF-8 does not
                raise DataError(f"{path}:{lineno}: the text holds a lone surrogate {obj['text'][e.start]!r} at character "
                                f"{e.start}, which is not valid Unicode text") from None
            yield obj["text"]


def pack(source: Path, seq_len: int, cache_dir: Path) -> tuple[Path, dict]:
    """Return the packed file for `source` and its fingerprint, building it when stale or missing."""
    source = source.resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(source).encode()).hexdigest()[:10]
    stem = f"{source.stem}-{key}-L{seq_len}"
    bin_path, meta_path = cache_dir / f"{stem}.bin", cache_dir / f"{stem}.json"
    src_sha = sha256_file(source)
    if meta_path.exists() and bin_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            meta = {}
        sample_bytes = 2 * (seq_len + 1)
        if (
            meta.get("format") == FORMAT
            and meta.get("source_sha256") == src_sha
            and meta.get("tokenizer") == tokenizer.NAME
            and meta.get("seq_len") == seq_len
            and bin_path.stat().st_size == meta.get("num_samples", -1) * sample_bytes
        ):
            return bin_path, meta

    for p in clear_stale_temporaries(bin_path) + clear_stale_temporaries(meta_path):
        log.info("removed %s, left by an interrupted preparation", p)
    t0 = time.time()
    tmp = _tmp_name(bin_path)
    n_docs = n_tokens = 0
    try:
        with open(tmp, "wb") as out:
            buf: list[int] = []
            for text in _iter_documents(source):
                buf += tokenizer.encode(text, bos=True, eos=True)
                n_docs += 1
                if len(buf) >= 1 << 20:
                    np.asarray(buf, dtype=np.uint16).tofile(out)
                    n_tokens += len(buf)
                    buf = []
            np.asarray(buf, dtype=np.uint16).tofile(out)
            n_tokens += len(buf)
            num_samples = n_tokens // (seq_len + 1)
            out.truncate(num_samples * (seq_len + 1) * 2)
        if n_docs == 0:
            raise DataError(f"{source}: the corpus is empty (no {{\"text\": ...}} lines)")
        if num_samples == 0:
            raise DataError(f"{source}: {n_tokens} tokens do not fill one sample of seq_len + 1 = {seq_len + 1} tokens")
        _fsync_replace(tmp, bin_path)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {
        "format": FORMAT,
        "source": str(source),
        "source_sha256": src_sha,
        "tokenizer": tokenizer.NAME,
        "seq_len": seq_len,
        "documents": n_docs,
        "num_tokens": n_tokens,
        "num_samples": num_samples,
        "build_seconds": round(time.time() - t0, 2),
    }
    tmp_meta = _tmp_name(meta_path)
    tmp_meta.write_text(json.dumps(meta, indent=1))
    _fsync_replace(tmp_meta, meta_path)
    return bin_path, meta


def unigram_entropy(bin_path: Path, num_tokens: int | None = None) -> float:
    """Entropy in nats of the token distribution of the packed file (its first `num_tokens`):
    the loss of the best model that ignores context."""
    tokens = np.memmap(bin_path, dtype=np.uint16, mode="r")[:num_tokens]
    counts = np.bincount(tokens, minlength=tokenizer.VOCAB_SIZE)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
