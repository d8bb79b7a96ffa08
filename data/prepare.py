"""Corpus preparation: MiniMind pretrain JSONL -> packed token file (numpy memmap) + fingerprint.

The source is one file, a directory or a glob of `.jsonl` / `.jsonl.gz` files (data/sources.py);
each line is `{"text": "..."}`. Documents are encoded as BOS + ids + EOS (the byte
tokenizer's, or a tokenizer file's: data/tokenizer), joined, and cut into samples of `seq_len + 1`
tokens (the tail that does not fill a sample is dropped). The packed file `<name>.bin` (uint16, or
uint32 for a vocabulary past 65,536 ids) sits in the cache folder beside `<name>.json`, the
fingerprint, which is written last: a packed file counts only when its fingerprint matches the
source files, the tokenizer and seq_len, so a killed preparation is never mistaken for a cache.
`python -m data.prepare` packs ahead of a run (docs/data.md).
"""
from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from common.files import atomic_file, atomic_write, tmp_prefix
from common.store import is_url, parse, store_of

from . import chunked, sources, tokenizer
from .remote import local_cache
from .dataset import counts_path
from .formats import builtin, format_of, formats
from .sources import Corpus, DataError, batches, read_ahead, sha256_file, stat_identity

BUILTIN = "stdlib"
"""`data.path` value that selects the built-in corpus: the standard library's docstrings."""
BUILTIN_PREFERENCE = "stdlib-preference"
"""`data.path` value that selects the built-in preference pairs: the built-in chat corpus's answers
against another question's (for data.format=preference; data/preference.py)."""
BUILTIN_ARITH = "stdlib-arith"
"""`data.path` value that selects the built-in verifiable task: small sums with their answers (for
data.format=prompts; data/prompts.py)."""
BUILTIN_AGENT = "stdlib-agent"
"""`data.path` value that selects the built-in agent task: arithmetic with MiniMind's calculator tool (for
data.format=agent; data/agent.py)."""
BUILTIN_AGENT_CHAT = "stdlib-agent-chat"
"""`data.path` value that selects the built-in agent task's fine-tuning conversations: the calculator
called in the assistant's text, its result, the answer (for data.format=chat; data/agent.py)."""
BUILTIN_CHAT = "stdlib-chat"
"""`data.path` value that selects the built-in chat corpus: questions about the standard library
answered by its docstrings (for data.format=chat)."""
FORMAT = 2
"""Of the fingerprint file: 2 records each source file's identity and the token counts beside the cache."""
RACY_NS = 2_000_000_000
"""A file modified this close before its identity was recorded may change again within the same
mtime tick: its stat is not trusted, its bytes are hashed again (as git does for its index)."""
VERIFY = ("stat", "full")
log = logging.getLogger("minimind")
_STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "ensurepip", "turtledemo"}


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


_QUESTIONS = ("What does {name} do?", "Explain {name}.", "What is {name} in Python's {module} module?",
              "Describe {name} briefly.", "{name}: what is it for?")


def _stdlib_docstrings():
    """(module, qualified name, docstring) of the standard library's modules, classes and functions,
    in a fixed order; sources parsed with `ast`, never imported."""
    root = sysconfig.get_paths()["stdlib"]
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _STDLIB_SKIP)
        for n in sorted(names):
            if not n.endswith(".py"):
                continue
            path = os.path.join(d, n)
            with open(path, "rb") as f:
                src = f.read()
            try:
                tree = ast.parse(src)
            except (SyntaxError, ValueError):
                continue
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield module, module if isinstance(node, ast.Module) else f"{module}.{node.name}", doc


def build_stdlib_chat(dest: Path) -> Path:
    """Write the built-in chat corpus once: for each documented module, class or function of the
    standard library, a user asks about it (one of a few phrasings, chosen by its position) and the
    assistant answers with the docstring's first paragraph (24 to 100 characters); every seventh conversation has a system
    turn. MiniMind's SFT format ({"conversations": [...]})."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest, "w", encoding="utf-8") as out:
        k = 0
        for module, name, doc in _stdlib_docstrings():
            answer = doc.split("\n\n")[0].strip()
            if not 24 <= len(answer) <= 100:  # a conversation fits configs/sft_tiny.yaml's 256 byte tokens
                continue
            turns = [{"role": "system", "content": "You answer questions about Python's standard library."}] if k % 7 == 0 else []
            turns += [{"role": "user", "content": _QUESTIONS[k % len(_QUESTIONS)].format(name=name, module=module)},
                      {"role": "assistant", "content": answer}]
            out.write(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")
            k += 1
    return dest


def build_stdlib_corpus(dest: Path) -> Path:
    """Write the docstrings of this Python's standard library as MiniMind JSONL, once.

    Sources are parsed with `ast`, never imported. The result depends on the Python version, which
    the packed file's fingerprint (the source's sha256) records.
    """
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest, "w", encoding="utf-8") as out:
        for _, _, doc in _stdlib_docstrings():
            if len(doc) >= 32:
                out.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    return dest


def resolve_source(path: str, cache_dir: Path, key: str = "data.path") -> Corpus:
    """The corpus behind `data.path` (or the `key` given, e.g. data.val_path): a file, a directory
    or a glob (data/sources.py) on a disk or in a store, or a built-in corpus, built when asked for (in
    the staging copy of a cache_dir in a store)."""
    maker = builtin(path)  # a format's own built-in corpus (data/formats)
    if maker is not None:
        return Corpus.of_file(maker(local_cache(cache_dir)))
    return sources.resolve(path, key)


class _Progress:
    """Packing progress with MB/s: a tqdm bar on a terminal, else a log line every `every_s` seconds.
    `watch(done, total)`, when given, sees every update (the packer's heartbeat on the launch's board, data/run.py)."""

    def __init__(self, label: str, total: int, every_s: float = 5.0, watch=None) -> None:
        self.label, self.total, self.every_s, self.watch = label, total, every_s, watch
        self.done, self.t0 = 0, time.monotonic()
        self.last = self.t0
        self.bar = None
        if sys.stderr.isatty() and total > 8 << 20:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"packing {Path(label).name}", mininterval=1.0)

    def update(self, n: int) -> None:
        self.done += n
        if self.watch is not None:
            self.watch(self.done, self.total)
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            log.info("packing %s: %.0f of %.0f MB (%.1f MB/s)", self.label, self.done / 1e6, self.total / 1e6,
                     self.done / 1e6 / (now - self.t0))

    def close(self) -> tuple[float, float]:
        """(MB/s, seconds) since the start."""
        if self.bar is not None:
            self.bar.close()
        seconds = max(time.monotonic() - self.t0, 1e-9)
        return self.done / 1e6 / seconds, seconds


def cache_stem(corpus: Corpus, seq_len: int, tok, options: dict | None = None) -> str:
    """The packed file's name: the corpus's name, a key of its path (and tokenizer, and chat
    options), the seq_len."""
    ident = corpus.label if tok.name == tokenizer.NAME else f"{corpus.label}|{tok.name}"
    if options:
        ident += "|" + json.dumps(options, sort_keys=True)
    return f"{corpus.stem}{'-chat' if options else ''}-{hashlib.sha256(ident.encode()).hexdigest()[:10]}-L{seq_len}"


def side_path(bin_path: Path, chat) -> Path:
    """The file packing writes beside `bin_path`: its format's (data/formats: token counts for text, taught
    tokens per row for chat, pairs per row for preference, ...)."""
    return format_of("text" if chat is None else chat.kind).side(bin_path)


def _trusted(record: dict, identity: dict) -> bool:
    # an object in a store: its ETag changes with its bytes (no clock tick to race)
    return record.get("identity") == identity and ("etag" in identity or identity["mtime_ns"] < record.get("checked_ns", 0) - RACY_NS)


def _reuse(corpus: Corpus, meta: dict, verify: str) -> dict | None:
    """`meta` with refreshed identities when every source file is the one packed (by its size, mtime
    and inode, or its bytes when those are not trusted or `verify` is "full"), else None."""
    records = meta.get("sources")
    if not isinstance(records, list) or [r.get("path") for r in records] != [str(p) for p in corpus.files]:
        return None
    fresh = []
    for path, record in zip(corpus.files, records):
        identity = stat_identity(path)
        if verify == "full" or not _trusted(record, identity):
            checked_ns = time.time_ns()
            if sha256_file(path) != record.get("sha256"):
                log.info("%s changed since it was packed: packing again", path)
                return None
            record = {**record, "identity": identity, "checked_ns": checked_ns}
        fresh.append(record)
    return {**meta, "sources": fresh}


def _fingerprint(corpus: Corpus, records: list[dict]) -> dict:
    """The corpus's identity in a run's fingerprint: one file's sha256 (as before directories were
    read), or a sha256 over the names and hashes of several, and those per file."""
    named = {"source_sha256_source": corpus.label}  # a refused resume names the corpus beside its hash
    if len(records) == 1 and corpus.label == records[0]["path"]:
        return {"source_sha256": records[0]["sha256"], **named}
    listing = "".join(f"{r['sha256']}  {r['name']}\n" for r in records)
    return {"source_sha256": hashlib.sha256(listing.encode()).hexdigest(), **named, "files": {r["name"]: r["sha256"] for r in records}}


def chat_options(tok, chat) -> tuple[dict, object]:
    """What identifies a chat corpus's packing besides the tokenizer and seq_len (the options and the
    template's sha256), and the template; ({}, None) for text."""
    if chat is None:
        return {}, None
    from . import chat as chats

    template = chats.template_of(tok)
    return {**chat.key(), "template_sha256": hashlib.sha256(template.source.encode()).hexdigest()}, template


def pack(source: Corpus | Path, seq_len: int, cache_dir, tok=None, batch_bytes: int = 4 << 20,
         verify: str = "stat", watch=None, chat=None) -> tuple[Path, dict]:
    """The packed file of `source` in `cache_dir` (a folder, or s3://BUCKET/PREFIX: the cache in a store,
    fetched into the staging folder and verified, a repack put back: `_pack_in_store`); see `_pack`."""
    tok = tok or tokenizer.ByteTokenizer()
    if is_url(cache_dir):
        return _pack_in_store(source if isinstance(source, Corpus) else Corpus.of_file(source), seq_len, str(cache_dir), tok,
                              batch_bytes=batch_bytes, verify=verify, watch=watch, chat=chat)
    return _pack(source, seq_len, Path(cache_dir), tok, batch_bytes=batch_bytes, verify=verify, watch=watch, chat=chat)


def _verified_copy(path: Path, entry: dict) -> bool:
    """Is the local `path` the bytes `entry` records (sha256, bytes)? Hashed once after it came down; a
    later launch trusts the stat identity recorded then (a note beside it), as `_reuse` trusts a corpus
    file's, and hashes it again only when that changed."""
    note = path.with_name(f".{path.name}.verified")
    if not path.is_file() or path.stat().st_size != entry["bytes"]:
        return False
    try:
        if json.loads(note.read_text()) == {"sha256": entry["sha256"], **stat_identity(path)}:
            return True
    except (OSError, ValueError):
        pass
    if sha256_file(path) != entry["sha256"]:
        return False
    atomic_write(note, json.dumps({"sha256": entry["sha256"], **stat_identity(path)}))
    return True


def _pack_in_store(corpus: Corpus, seq_len: int, cache_dir: str, tok, **kwargs) -> tuple[Path, dict]:
    """`_pack` over the staging copy of the cache in the store at `cache_dir` (docs/object_storage.md,
    "Corpora and the packed cache"): its files fetched and verified first, a repack put back, the fingerprint last."""
    bucket, prefix = parse(str(cache_dir), "data.cache_dir")
    store = store_of(bucket)  # its first request names the object (a missing bucket, credentials: exit 2)
    local = local_cache(cache_dir)
    local.mkdir(parents=True, exist_ok=True)
    stem = cache_stem(corpus, seq_len, tok, chat_options(tok, kwargs.get("chat"))[0])
    key = lambda name: f"{prefix}/{name}".lstrip("/")  # noqa: E731
    got = store.get(key(f"{stem}.json"))
    record = json.loads(got[0]) if got is not None else None
    fetched = 0
    if record is not None:
        for name, entry in (record.get("cache_files") or {}).items():
            path = local / name
            if "chunks" in entry:  # the packed rows: read a chunk at a time as the run reads them, each verified (data/chunked.py)
                chunked.stage(path, store.url(key(name)), entry)
                continue
            if _verified_copy(path, entry):
                continue  # this node's copy is the record's bytes
            if (bad := store.download(key(name), path, entry["sha256"])) is not None:
                log.warning("data.cache_dir=%s: %s: not used; the corpus is packed again and the cache put back", cache_dir, bad)
                record = None
                (local / f"{stem}.json").unlink(missing_ok=True)  # this node's copy is not trusted either: packed again
                break
            _verified_copy(path, entry)  # its note: the next launch on this node reads nothing of it from the store
            fetched += entry["bytes"]
    if record is not None:
        atomic_write(local / f"{stem}.json", json.dumps({k: v for k, v in record.items() if k != "cache_files"}, indent=1))
    elif chunked.staged(local / f"{stem}.bin"):  # a staging copy with holes, of a cache no longer in the store: never packed over
        chunked.discard(local / f"{stem}.bin")
        (local / f"{stem}.json").unlink(missing_ok=True)
    # A packing writes new files (new inodes); a staging copy's chunks are written in place, by any run on this node.
    before = {p.name: p.stat().st_ino for p in local.glob(f"{stem}.*") if p.is_file()}
    bin_path, meta = _pack(corpus, seq_len, local, tok, **kwargs)
    after = {p.name: p.stat().st_ino for p in local.glob(f"{stem}.*") if p.is_file() and not p.name.endswith(".json")}
    if record is not None and all(before.get(n) == t for n, t in after.items()):
        rows = record["cache_files"].get(bin_path.name, {})
        lazily = (f"; the packed rows ({rows['bytes']} bytes, {len(rows['chunks'])} chunks of {rows['chunk_bytes']}) read a chunk "
                  f"at a time as the run reads them, each verified") if "chunks" in rows else ""
        log.info("data.cache_dir=%s: %s fetched from the store (%d bytes) and verified%s; not packed again", cache_dir, stem, fetched,
                 lazily)
        return bin_path, meta
    chunked.forget(bin_path)  # packed here: a whole file, no staging copy any more
    files = {n: chunked.describe(local / n) if n == bin_path.name else {"sha256": sha256_file(local / n), "bytes": (local / n).stat().st_size}
             for n in sorted(after)}
    for n, entry in files.items():
        store.upload(key(n), local / n, entry["sha256"])
    store.put(key(f"{stem}.json"), json.dumps({**json.loads((local / f"{stem}.json").read_text()), "cache_files": files},
                                              indent=1).encode())  # last: the cache counts from now on
    log.info("data.cache_dir=%s: %s put in the store (%d files, %d bytes)", cache_dir, stem, len(files),
             sum(e["bytes"] for e in files.values()))
    return bin_path, meta


def _pack(source: Corpus | Path, seq_len: int, cache_dir: Path, tok=None, batch_bytes: int = 4 << 20,
          verify: str = "stat", watch=None, chat=None) -> tuple[Path, dict]:
    """Return the packed file for the corpus `source` (a Corpus, or one file) under tokenizer `tok`
    (default: bytes) and its fingerprint, building it when stale or missing. `chat` (data/chat.py
    ChatOptions) packs conversations instead of pretraining text.

    A packed file is reused when its fingerprint names the same tokenizer, seq_len and options and
    the same source files with the same identity (size, mtime, inode) - their bytes are not read
    again, unless `verify` is "full" or an identity is not trusted (docs/data.md).

    The source is streamed in batches of about `batch_bytes`, each tokenized at once (the
    `tokenizers` library's parallel batch encoder for a tokenizer file) and appended to a temporary
    file, while a reader thread parses the next batch and hashes the bytes: memory does not grow
    with the corpus, and the corpus is read once. The temporary file becomes the packed file
    (os.replace), the side files are written, and the fingerprint last, so a killed or failed
    preparation leaves nothing that is used."""
    tok = tok or tokenizer.ByteTokenizer()
    corpus = source if isinstance(source, Corpus) else Corpus.of_file(source)
    if verify not in VERIFY:
        raise DataError(f"data.verify_source: expected one of {', '.join(VERIFY)}, got {verify!r}")
    options, template = chat_options(tok, chat)  # before anything is written: no template, nothing packed
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = cache_stem(corpus, seq_len, tok, options)
    bin_path, meta_path, side = cache_dir / f"{stem}.bin", cache_dir / f"{stem}.json", side_path(cache_dir / f"{stem}.bin", chat)
    dtype = tokenizer.id_dtype(tok.vocab_size + (1 if chat is not None else 0))  # chat targets are stored + 1 (0: none)
    fmt = format_of("text" if chat is None else chat.kind)
    row = fmt.planes * seq_len or seq_len + 1
    here = {"tokenizer_source": tok.source} if hasattr(tok, "source") else {}
    if meta_path.exists() and bin_path.exists() and side.exists():
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            meta = {}
        if (
            meta.get("format") == FORMAT
            and meta.get("tokenizer") == tok.name
            and meta.get("dtype") == dtype.name
            and meta.get("seq_len") == seq_len
            and meta.get("options", {}) == options
            and bin_path.stat().st_size == meta.get("num_samples", -1) * dtype.itemsize * row
            and (fresh := _reuse(corpus, meta, verify)) is not None
        ):
            if fresh != meta:  # identities re-established from the bytes: the next launch trusts them
                try:
                    atomic_write(meta_path, json.dumps(fresh, indent=1))
                except OSError as e:  # a read-only cache still serves; the next launch hashes again
                    log.info("%s: could not record the checked identities (%s)", meta_path, e.strerror)
            # where this run's tokenizer file is (the cache may have been packed from a copy elsewhere)
            return bin_path, {**fresh, **here}

    for p in clear_stale_temporaries(bin_path) + clear_stale_temporaries(meta_path) + clear_stale_temporaries(side):
        log.info("removed %s, left by an interrupted preparation", p)
    progress = _Progress(corpus.label, sum(stat_identity(p)["size"] for p in corpus.files), watch=watch)
    try:
        with atomic_file(bin_path, "wb") as out:  # an error or a stop leaves no half-written cache
            reader = sources.Reader(corpus) if fmt.parse is None else sources.Reader(corpus, parse=fmt.parse)
            stats, side_data, fields = fmt.build(reader, tok, template, chat, seq_len, dtype, out, progress, batch_bytes)
        checked_ns = time.time_ns()
    finally:
        mb_per_s, seconds = progress.close()
    with atomic_file(side, "wb") as f:
        np.save(f, side_data, allow_pickle=False)
    if fields is not None:  # a prompt file's fields, for the rewards (data/prompts.py)
        from .prompts import fields_path, write_fields

        write_fields(fields_path(bin_path), fields)
    records = [{"name": r["name"], "path": r["path"], "sha256": r["sha256"],
                "identity": {k: r[k] for k in ("size", "mtime_ns", "inode", "etag") if k in r}, "checked_ns": checked_ns}
               for r in reader.records]
    meta = {
        "format": FORMAT,
        "source": corpus.label,
        **_fingerprint(corpus, records),
        "tokenizer": tok.name,
        **here,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "seq_len": seq_len,
        **({"options": options} if options else {}),
        **stats,
        "build_seconds": round(seconds, 2),
        "sources": records,
    }
    what = describe(stats)
    log.info("packed %s: %d file(s), %s, %.1f MB/s, %.1f s", corpus.label, len(records), what, mb_per_s, seconds)
    atomic_write(meta_path, json.dumps(meta, indent=1))
    return bin_path, {**meta, **here}


def describe(stats: dict) -> str:
    """'3000 documents, 733076 tokens, 22214 samples' from a fingerprint's counts."""
    return ", ".join(f"{v:,} {k.replace('num_', '').replace('_', ' ')}" for k, v in stats.items()
                     if isinstance(v, int) and k not in ("format", "vocab_size", "seq_len", "build_seconds"))


def _build_text(reader, tok, seq_len: int, dtype, out, progress, batch_bytes: int) -> tuple[dict, np.ndarray]:
    """Pretraining text: BOS + ids + EOS per document, laid end to end, cut into rows of seq_len + 1."""
    n_docs = n_tokens = 0
    totals = np.zeros(tok.vocab_size, dtype=np.uint64)
    for texts, size in read_ahead(batches(reader, batch_bytes)):
        ids = tok.pack_batch(texts).astype(dtype, copy=False)
        totals += np.bincount(ids, minlength=tok.vocab_size).astype(np.uint64)
        ids.tofile(out)
        n_docs += len(texts)
        n_tokens += len(ids)
        progress.update(size)
    if n_docs == 0:
        raise DataError(f"{reader.corpus.label}: the corpus is empty (no {{\"text\": ...}} lines)")
    num_samples = n_tokens // (seq_len + 1)
    if num_samples == 0:
        raise DataError(f"{reader.corpus.label}: {n_tokens} tokens do not fill one sample of seq_len + 1 = {seq_len + 1} tokens")
    kept = num_samples * (seq_len + 1)
    out.flush()
    dropped = np.fromfile(out.name, dtype=dtype, offset=kept * dtype.itemsize)  # the tail that fills no sample
    totals -= np.bincount(dropped, minlength=tok.vocab_size).astype(np.uint64)
    out.truncate(kept * dtype.itemsize)
    stats = {"documents": n_docs, "num_tokens": n_tokens, "num_samples": num_samples, "unigram_entropy": _entropy(totals)}
    return stats, totals


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def unigram_entropy(bin_path: Path, num_tokens: int | None = None, dtype: str = "uint16") -> float:
    """Entropy in nats of the token distribution of the packed file (its first `num_tokens`): the
    loss of the best model that ignores context. With the counts packing wrote beside the file, it
    reads only what lies past `num_tokens` (a held-out tail), or the first `num_tokens` when that is
    less: never the whole corpus."""
    dt = np.dtype(dtype)
    total = Path(bin_path).stat().st_size // dt.itemsize
    num_tokens = total if num_tokens is None else num_tokens
    tokens = np.memmap(bin_path, dtype=dt, mode="r")
    lazy = chunked.Lazy.open(Path(bin_path))  # the staging copy of a cache in the store: what is read is fetched first
    counts_file = counts_path(Path(bin_path))
    if counts_file.exists() and total - num_tokens < num_tokens:
        counts = np.load(counts_file, allow_pickle=False)
        if num_tokens < total:
            if lazy is not None:
                lazy.ensure(num_tokens * dt.itemsize, (total - num_tokens) * dt.itemsize)
            tail = np.bincount(tokens[num_tokens:], minlength=len(counts)).astype(np.uint64)
            counts = counts - tail[: len(counts)]
        return _entropy(counts)
    if lazy is not None:
        lazy.ensure(0, num_tokens * dt.itemsize)
    return _entropy(np.bincount(tokens[:num_tokens]))


def _main(argv: list[str] | None = None) -> int:
    """`python -m data.prepare CORPUS... --tokenizer PATH --seq-len N --cache-dir DIR`: pack ahead of a run."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Pack corpora into the cache a run uses (the same files a launch with data.path=CORPUS, "
                    "data.tokenizer, model.seq_len and data.cache_dir would build), on a CPU machine before a GPU job.")
    parser.add_argument("corpora", nargs="+", help=f"each a JSONL file (.gz or not), a directory, a quoted glob, or '{BUILTIN}'")
    parser.add_argument("--tokenizer", default=tokenizer.BYTES, help="bytes (default) or a tokenizer.json, as data.tokenizer")
    parser.add_argument("--seq-len", type=int, required=True, help="model.seq_len of the run")
    parser.add_argument("--cache-dir", default="data/cache", help="data.cache_dir of the run: a folder or s3://BUCKET/PREFIX (default %(default)s)")
    parser.add_argument("--format", choices=tuple(formats()), default="text", help="as data.format (default %(default)s)")
    parser.add_argument("--loss-on", choices=("assistant", "all"), default="assistant", help="chat: as data.loss_on")
    parser.add_argument("--no-pack", action="store_true", help="chat: one padded conversation per row (data.pack=false)")
    parser.add_argument("--drop-long", action="store_true", help="chat: as data.drop_long")
    parser.add_argument("--system-prompt-ratio", type=float, default=0.0, help="chat: as data.system_prompt_ratio")
    parser.add_argument("--seed", type=int, default=1337, help="chat: the run's seed, used with --system-prompt-ratio")
    parser.add_argument("--verify-source", choices=VERIFY, default="stat",
                        help="stat (default): trust files whose size, mtime and inode are those packed; full: hash them again")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.seq_len <= 0:
        raise DataError(f"--seq-len {args.seq_len}: expected a positive number of tokens")
    tok = tokenizer.load(args.tokenizer)
    chat = None
    if format_of(args.format).chat:
        from .chat import ChatOptions

        chat = ChatOptions(args.loss_on, not args.no_pack, args.drop_long, args.system_prompt_ratio, args.seed, args.format)
    for spec in args.corpora:
        t0 = time.monotonic()
        corpus = resolve_source(spec, args.cache_dir)
        stem = cache_stem(corpus, args.seq_len, tok, chat_options(tok, chat)[0])
        local = local_cache(args.cache_dir)
        before = [p.stat().st_mtime_ns for p in local.glob(f"{stem}.bin")]
        bin_path, meta = pack(corpus, args.seq_len, args.cache_dir, tok, verify=args.verify_source, chat=chat)
        seconds = time.monotonic() - t0
        mb = sum(r["identity"]["size"] for r in meta["sources"]) / 1e6
        done = "already packed" if before == [(local / f"{stem}.bin").stat().st_mtime_ns] else f"{mb / seconds:.1f} MB/s"
        counts = describe({k: meta[k] for k in meta if k in ("documents", "num_tokens", "num_samples", "conversations", "pairs", "prompts", "rows",
                                                             "tokens", "taught", "truncated", "dropped_long", "untaught")})
        rows = f"rows of {args.seq_len} positions" if chat else f"samples of {args.seq_len + 1} tokens"
        print(f"{spec}: {len(meta['sources'])} file(s), {counts} ({rows}) -> {bin_path}; "
              f"{mb:.1f} MB in {seconds:.1f} s ({done})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from common.outcome import command

    return command(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
