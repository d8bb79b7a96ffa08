"""Corpus sources: what `data.path` names, read as one stream of documents (docs/data.md).

`data.path` is a JSONL file (`.gz` compressed or not), a directory, or a glob pattern. A directory
or a glob is the `.jsonl` and `.jsonl.gz` files it holds or matches, in name order (the sort of
their paths), and its documents are those of the first file in line order, then the second's, ...:
a run on a directory packs the same tokens as a run on its files concatenated in that order.

Reading a file also hashes its bytes (the compressed ones for `.gz`), so packing reads the corpus
once, and checks that the file did not change while it was read. A file's identity for the cache is
its size, mtime and inode (`stat_identity`): a later launch compares those instead of rereading the
bytes (docs/data.md, "What a launch reads"). A corpus in an object store (`s3://...`) is files of the
store read the same way (data/remote.py).
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import queue
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from common.outcome import BadInput
from common.store import is_url

SUFFIXES = (".jsonl", ".jsonl.gz")
"""What a directory or a glob may hold: JSONL, plain or gzip-compressed."""


class DataError(BadInput, ValueError):
    """Bad corpus input; the message names the file (and line) at fault."""


@dataclass(frozen=True)
class Corpus:
    """The files of one corpus, in the order their documents are read, and what named them."""

    label: str
    """The absolute file, directory or pattern (or its s3:// URL): the cache's key."""
    files: tuple  # of Path, or of data.remote.RemoteFile for a corpus in the store

    @classmethod
    def of_file(cls, path: Path) -> "Corpus":
        path = Path(path).resolve()
        return cls(str(path), (path,))

    @property
    def stem(self) -> str:
        """A readable start of the cache's file names."""
        if len(self.files) == 1 and self.label == str(self.files[0]):
            return self.files[0].name.split(".")[0] or "corpus"
        name = Path(self.label).name if not _is_pattern(self.label) else Path(self.label).parent.name
        return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "corpus"

    def names(self) -> dict[Path, str]:
        """Each file's name relative to the folder the files share (its identity in the fingerprint)."""
        if self.files and not isinstance(self.files[0], Path):  # objects in a store: relative to their common prefix
            from .remote import names

            return names(self.files)
        if len(self.files) == 1:
            return {self.files[0]: self.files[0].name}
        root = os.path.commonpath([str(p.parent) for p in self.files])
        return {p: os.path.relpath(p, root) for p in self.files}


def _is_pattern(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def resolve(spec: str, key: str = "data.path") -> Corpus:
    """The corpus a file, a directory or a glob names; DataError (naming `key` or the file) when it
    names nothing, or a file the loader does not know."""
    if is_url(spec):  # s3://...: objects in a store (data/remote.py)
        from .remote import resolve as resolve_remote

        return Corpus(*resolve_remote(spec, key, DataError))
    if _is_pattern(spec):
        pattern = os.path.abspath(os.path.expanduser(spec))
        matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
        files = [p for p in matches if not p.is_dir()]
        if not files:
            raise DataError(f"{key}={spec}: the pattern matches no file (expected .jsonl or .jsonl.gz files)")
        label = pattern
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.resolve().iterdir() if not p.name.startswith("."))
            if not files:
                raise DataError(f"{key}={spec}: the directory {path} is empty (expected .jsonl or .jsonl.gz files)")
            label = str(path.resolve())
        elif path.is_file():
            return Corpus.of_file(path)
        else:
            raise DataError(f"{key}: corpus {path} does not exist (expected a JSONL file of {{\"text\": ...}} lines, "
                            f"a directory or a glob of .jsonl / .jsonl.gz files)")
    for p in files:
        if p.is_dir() or not p.name.endswith(SUFFIXES):
            what = "a directory" if p.is_dir() else "not a .jsonl or .jsonl.gz file"
            raise DataError(f"{p}: {what}; {key}={spec} may hold only .jsonl and .jsonl.gz files (move the others away)")
    return Corpus(label, tuple(p.resolve() for p in files))


def stat_identity(path: Path) -> dict:
    """What a launch compares instead of the bytes: size, modification time (ns) and inode (an object
    in a store: its size and ETag, from the listing)."""
    if not isinstance(path, Path):
        return path.identity()
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with (open(path, "rb") if isinstance(path, Path) else path.open()[0]) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class _Hashing(io.RawIOBase):
    """A raw file that hashes every byte read through it and counts them."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        if n:
            self.sha.update(memoryview(b)[:n])
            self.bytes += n
        return n

    def finish(self) -> str:
        """Hash the bytes not read yet (past a gzip stream's end), return the file's sha256."""
        while block := self.f.read(1 << 20):
            self.sha.update(block)
            self.bytes += len(block)
        return self.sha.hexdigest()


class Reader:
    """The documents of a corpus, file after file, as (document, source bytes consumed); `parse`
    (path, line number, line bytes) -> document or None (a line to skip) reads a line.

    After the iteration, `records` holds each file's identity (stat_identity and sha256), taken from
    the same read. A bad line raises DataError naming file:line; a gzip file that is truncated or
    damaged, or a file that changes while it is read, raises DataError naming the file."""

    def __init__(self, corpus: Corpus, parse=None) -> None:
        self.corpus, self.parse = corpus, parse or parse_line
        self.records: list[dict] = []

    def __iter__(self):
        names = self.corpus.names()
        for path in self.corpus.files:
            local = isinstance(path, Path)
            raw, got = (open(path, "rb", buffering=0), None) if local else path.open()
            with raw:
                before = os.fstat(raw.fileno()) if local else None
                hashing = _Hashing(raw)
                buffered = io.BufferedReader(hashing, 1 << 20)
                stream = gzip.GzipFile(fileobj=buffered, mode="rb") if path.name.endswith(".gz") else buffered
                consumed = 0
                try:
                    for lineno, line in enumerate(stream, 1):
                        text = self.parse(path, lineno, line)
                        if text is None:
                            continue
                        read_now = hashing.bytes
                        yield text, read_now - consumed
                        consumed = read_now
                except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                    raise DataError(f"{path}: a truncated or damaged gzip file ({e})") from None
                sha = hashing.finish()
                after = os.fstat(raw.fileno()) if local else None
            if not local:  # one GET is one version of the object: it must be the one the listing named
                if got != path.identity() or hashing.bytes != path.size:
                    raise DataError(f"{path}: the object changed since it was listed (size {path.size} -> {got['size']} bytes, "
                                    f"ETag {path.etag} -> {got['etag']}); nothing was cached: pack again once it is complete")
                self.records.append({"name": names[path], "path": str(path), **path.identity(), "sha256": sha})
                continue
            now = stat_identity(path)
            then = {"size": before.st_size, "mtime_ns": before.st_mtime_ns, "inode": before.st_ino}
            changed = now != then or (after.st_size, after.st_mtime_ns, hashing.bytes) != (then["size"], then["mtime_ns"], then["size"])
            if changed:
                raise DataError(f"{path}: the file changed while it was being packed (size {then['size']} -> {now['size']} bytes); "
                                f"nothing was cached: pack again once it is complete")
            self.records.append({"name": names[path], "path": str(path), **then, "sha256": sha})


def parse_json(path: Path, lineno: int, raw: bytes):
    """One JSONL line as an object (None for a blank line); DataError naming file:line otherwise."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}:{lineno}: line is not valid JSON ({e})") from None


def check_text(path: Path, lineno: int, text: str) -> str:
    """`text` when it is valid Unicode (JSON allows a lone surrogate, UTF-8 does not)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON allows "\ud800"; UTF-8 does not
            raise DataError(f"{path}:{lineno}: the text holds a lone surrogate {text[e.start]!r} at character "
                            f"{e.start}, which is not valid Unicode text") from None
    return text


def parse_line(path: Path, lineno: int, raw: bytes):
    """The "text" of one pretraining line (None for a blank line); DataError naming file:line otherwise."""
    obj = parse_json(path, lineno, raw)
    if obj is None:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise DataError(f'{path}:{lineno}: expected an object with a string "text" field, got {raw[:80]!r}')
    return check_text(path, lineno, obj["text"])


def iter_documents(corpus: Corpus | Path):
    """The "text" of every document of a corpus, streamed (bad lines: DataError naming file:line)."""
    corpus = corpus if isinstance(corpus, Corpus) else Corpus.of_file(corpus)
    for text, _ in Reader(corpus):
        yield text


def batches(reader, batch_bytes: int):
    """Lists of documents of about `batch_bytes` of source each, with the source bytes they came from."""
    texts, size = [], 0
    for text, n in reader:
        texts.append(text)
        size += n
        if size >= batch_bytes:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


def read_ahead(batches, depth: int = 2):
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
