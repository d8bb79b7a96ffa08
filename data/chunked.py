"""The packed rows of a cache in the store, read a chunk at a time as the run reads them
(docs/object_storage.md, "Corpora and the packed cache").

The packed file is one object in the store; the cache's record (`<stem>.json`, its `cache_files`)
names its size, its sha256, a chunk size and each chunk's sha256 (`describe`, when the cache is put
there). A node's staging copy is a sparse file of the packed file's size, with that record beside it
(`stage`); before a row is read (data/dataset.py, data/repack.py), each chunk it touches is made
good (`Lazy.ensure`): the staging copy's own bytes when they hash to the record's (a chunk this node
fetched or packed before), else one ranged GET, hashed, and written into the staging copy only when
its sha256 is the record's; otherwise `ChunkDamaged`, naming the object and the chunk (exit 1): no
row of it is trained on. A relaunch at step k so reads the chunks of the rows it trains, not the
corpus. The staging copy holds at most the packed file's bytes (the chunks fetched so far).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.files import atomic_file, atomic_write
from common.outcome import Failed
from common.store import RemotePath

CHUNK_BYTES = int(os.environ.get("MINIMIND_CACHE_CHUNK_BYTES", str(1 << 20)))
"""The chunk size of a packed file put in the store (recorded with it: a reader takes the record's)."""
FETCHES = 8
"""Chunks of one micro-batch fetched at once (`Lazy.ensure_many`)."""


class ChunkDamaged(Failed):
    """A chunk of a packed file in the store whose bytes are not the ones its record names: exit 1 (met in a
    DataLoader worker, said in its own line as any worker's error: run/protocol.py from_worker)."""


def record_path(path: Path) -> Path:
    """Where the chunk record of a staging copy lies: beside it, hidden."""
    return path.with_name(f".{path.name}.chunks.json")


def describe(path: Path, chunk_bytes: int | None = None) -> dict:
    """The record of the local file `path` for the store, in one pass: its bytes, its sha256, the
    chunk size (default CHUNK_BYTES) and each chunk's sha256."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    whole, chunks = hashlib.sha256(), []
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            whole.update(block)
            chunks.append(hashlib.sha256(block).hexdigest())
    return {"sha256": whole.hexdigest(), "bytes": os.path.getsize(path), "chunk_bytes": chunk_bytes, "chunks": chunks}


def stage(path: Path, url: str, entry: dict) -> None:
    """Make `path` the staging copy of the packed file at `url` whose record is `entry`: the record
    beside it first, then the file kept when it has the record's size (its chunks are checked as
    they are read), else a sparse file of that size (nothing of it fetched yet)."""
    atomic_write(record_path(path), json.dumps({"url": url, **{k: entry[k] for k in ("bytes", "sha256", "chunk_bytes", "chunks")}}))
    if not path.is_file() or path.stat().st_size != entry["bytes"]:
        with atomic_file(path, "wb") as f:
            f.truncate(entry["bytes"])


def staged(path: Path) -> bool:
    """Is `path` a staging copy read a chunk at a time (not a file this node packed)?"""
    return record_path(path).exists()


def forget(path: Path) -> None:
    """`path` is no staging copy any more (a file packed here over it: whole): its record goes."""
    record_path(path).unlink(missing_ok=True)


def discard(path: Path) -> None:
    """Remove the staging copy `path` and its record: its unfetched chunks are holes, which nothing
    could fill once the cache's record is gone from the store."""
    if staged(path):
        path.unlink(missing_ok=True)
        forget(path)


class Lazy:
    """A staging copy read a chunk at a time: `ensure(offset, n)` before bytes [offset, offset + n)
    of it are read. The chunks this process has checked are remembered; another process (a rank, a
    DataLoader worker) checks its own, writing the same verified bytes when it fetches."""

    def __init__(self, path: Path, record: dict) -> None:
        self.path, self.url, self.size = Path(path), record["url"], record["bytes"]
        self.chunk, self.hashes = record["chunk_bytes"], record["chunks"]
        self.ok: set[int] = set()
        self._lock = threading.Lock()
        # The file as opened now: chunks are checked and written through this descriptor, so a file packed over
        # the path later (another run of this node) is never what this one's reads are checked against.
        self.fd = os.open(self.path, os.O_RDWR)

    def __del__(self) -> None:
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None

    @classmethod
    def open(cls, path: Path) -> Lazy | None:
        """The lazy reader of the staging copy `path`, or None for a local cache's file (read as it is)."""
        try:
            return cls(path, json.loads(record_path(Path(path)).read_text()))
        except FileNotFoundError:
            return None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "ok": set(), "_lock": None, "fd": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.fd = os.open(self.path, os.O_RDWR)

    def chunks(self, offset: int, n: int) -> range:
        return range(offset // self.chunk, (offset + max(n, 1) - 1) // self.chunk + 1)

    def ensure(self, offset: int, n: int) -> None:
        self.ensure_many([(offset, n)])

    def ensure_many(self, spans) -> None:
        """Make good every chunk that the (offset, n) `spans` touch, the missing ones fetched at once."""
        todo = sorted({c for offset, n in spans for c in self.chunks(offset, n)} - self.ok)
        if len(todo) > 1:
            with ThreadPoolExecutor(min(FETCHES, len(todo)), thread_name_prefix="chunks") as pool:
                list(pool.map(self._make_good, todo))
        elif todo:
            self._make_good(todo[0])

    def _make_good(self, i: int) -> None:
        start = i * self.chunk
        n, want = min(self.chunk, self.size - start), self.hashes[i]
        if hashlib.sha256(os.pread(self.fd, n, start)).hexdigest() != want:  # not here yet (a hole), or not these bytes
            where = RemotePath(self.url)
            data = where.store.get_range(where.key, start, n)
            got = hashlib.sha256(data).hexdigest()
            if got != want:
                raise ChunkDamaged(f"{self.url}: bytes {start}-{start + n - 1} (chunk {i} of {len(self.hashes)}) hash to "
                                   f"{got[:16]}..., not the {want[:16]}... the cache's record names: the packed cache in the "
                                   f"store is damaged; no row of it is trained on (delete its record "
                                   f"{self.url.rsplit('.', 1)[0]}.json to have the corpus packed again)")
            os.pwrite(self.fd, data, start)
        with self._lock:
            self.ok.add(i)


def mapped(path: Path) -> tuple[Lazy | None, mmap.mmap]:
    """The packed file at `path` mapped for reading, with its lazy reader when it is a staging copy (else
    None): both on one open of the file, so the rows read are the bytes the reader checks and fills."""
    lazy = Lazy.open(Path(path))
    if lazy is not None:
        return lazy, mmap.mmap(lazy.fd, 0, access=mmap.ACCESS_READ)
    with open(path, "rb") as f:
        return None, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
