"""A checkpoint's files, written and read with their sha256 taken as the bytes go by: the writer
that hashes what torch.save (or anything) writes, a file written and fsynced with its manifest entry,
and a file read once, whole, and returned only when the manifest vouches for its bytes."""
from __future__ import annotations

import collections
import concurrent.futures
import errno
import fcntl
import hashlib
import mmap
import os
import stat
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.serialization import config as serialization_config

from common.files import fsync_path
from common.outcome import Failed
from common.store import RemotePath


class CheckpointError(Failed):
    """A checkpoint that cannot be used; the message names the folder or file and what failed.
    The one class of "this checkpoint is unusable": every error a damaged, truncated, forged or
    linked step folder raises while it is found, verified or loaded is one (a run falls back to
    the previous checkpoint, a tool exits 1). storage.CheckpointMismatch, a sound checkpoint that
    does not fit this run's settings, derives from it and is bad input instead."""


class FileError(CheckpointError):
    """A file of a checkpoint that cannot be used (unlisted, damaged, refused, a link)."""


def no_follow(path, flags: int) -> int:
    """An `opener` for open(): the file itself, never what a symbolic link in its place points to."""
    return os.open(path, flags | os.O_NOFOLLOW)


def refuse_links(folder: Path, name: str = "") -> None:
    """`folder` and every part of `name` below it (a path relative to it) is no symbolic link:
    nothing of a checkpoint is ever followed through a link (read, verified or deleted)."""
    path = Path(folder)
    for part in ("", *Path(name).parts):
        path = path / part if part else path
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                raise FileError(f"{path}: a symbolic link; nothing in a checkpoint is followed through links (refused)")
        except FileNotFoundError:
            return  # the caller reports what is missing


_OVERLAP = 1 << 20  # buffers from this size on are hashed in a second thread while they are written
_helper = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-io")  # hashing and fsync, beside the writer


def _writeback_starter():
    """sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE) where the C library has it (Linux):
    starts writing a range of a file to disk without waiting, so the final fsync has little left."""
    import ctypes

    try:
        # The process's own C library (no ldconfig subprocess at import, as ctypes.util.find_library starts).
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        return lambda fd, offset, n: fn(fd, offset, n, 2)
    except (OSError, AttributeError):
        return None


_start_writeback = _writeback_starter()


class HashingWriter:
    """File-like wrapper that hashes and counts bytes as `torch.save` writes them (nothing is read back).

    A large buffer (a tensor's storage) is hashed in a helper thread while this thread writes it:
    sha256 and the write both release the GIL, so the two overlap on two cores; the next buffer
    waits for the hash, so the digest is over the bytes in file order. The first OSError is kept:
    torch's zip writer replaces it with "unexpected pos", and the caller re-raises the real one
    ("No space left on device", with the path)."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, b) -> int:
        view = memoryview(b)
        self.size += view.nbytes
        hashing = _helper.submit(self.sha.update, view) if view.nbytes >= _OVERLAP else None
        if hashing is None:
            self.sha.update(view)
        try:
            written = self.f.write(view)
            if hashing is not None and _start_writeback is not None:
                # this buffer goes to disk while the next ones are hashed and written
                self.f.flush()
                _start_writeback(self.f.fileno(), self.size - view.nbytes, view.nbytes)
            return written
        except OSError as e:
            self.error = self.error or e
            raise
        finally:
            if hashing is not None:
                hashing.result()

    def flush(self) -> None:
        self.f.flush()


STAGE_BLOCK = 8 << 20
"""The block a StreamWriter stages, hashes and writes at once (a multiple of every O_DIRECT alignment)."""
_IN_FLIGHT = 2  # staged blocks of one file being written while the next one is filled and hashed
_writes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-write")  # the writes of staged blocks
_free_blocks: list = []  # page-aligned staging blocks, reused across files and saves
_blocks_lock = threading.Lock()


def _pwrite(fd: int, view: memoryview, offset: int) -> int:
    """os.pwrite, the one place a StreamWriter's bytes reach the file (tests put a full disk here)."""
    return os.pwrite(fd, view, offset)


def _take_block() -> mmap.mmap:
    with _blocks_lock:
        return _free_blocks.pop() if _free_blocks else mmap.mmap(-1, STAGE_BLOCK)  # page-aligned, as O_DIRECT needs


def _give_block(block: mmap.mmap) -> None:
    with _blocks_lock:
        _free_blocks.append(block)


class StreamWriter:
    """Writes a new file from buffers given in order (`write`), each byte hashed in the same pass
    as its write; `close()` fsyncs and returns the file's manifest entry.

    The bytes are copied into page-aligned staging blocks of STAGE_BLOCK bytes (reused across
    saves); each full block is hashed in this thread, then written by a helper thread at its offset
    while the next block is filled and hashed (sha256, numpy's copy and pwrite release the GIL).
    From the first full block on, the file takes O_DIRECT where the filesystem does (the page
    cache is bypassed: a checkpoint's bytes are not read again by this process, and on many disks
    the page cache, not the device, is the bottleneck; docs/design.md "One save path"); a
    filesystem that refuses it (tmpfs) is written through the page cache with writeback started
    per block. The last, partial block is written through the page cache. Every error is an
    OSError naming the file (a full disk: "No space left on device", the path)."""

    def __init__(self, path: Path) -> None:
        self.path, self.sha, self.size = Path(path), hashlib.sha256(), 0
        self.fd = self._call(os.open, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self.direct: bool | None = None  # decided at the first full block
        self.tried_direct = False
        self.block: mmap.mmap | None = None
        self.fill = 0
        self.pending: list[tuple[Future, mmap.mmap | None]] = []

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            raise OSError(e.errno, e.strerror or str(e), str(self.path)) from None

    def tell(self) -> int:
        """The offset the next byte written lands at."""
        return self.size + self.fill

    def write(self, buffer) -> None:
        view = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)
        pos = 0
        while pos < view.size:
            if self.block is None:
                self.block, self.fill = _take_block(), 0
            n = min(STAGE_BLOCK - self.fill, view.size - pos)
            np.copyto(np.frombuffer(self.block, dtype=np.uint8, count=n, offset=self.fill), view[pos:pos + n])
            self.fill += n
            pos += n
            if self.fill == STAGE_BLOCK:
                self._flush()

    def _flush(self) -> None:
        block, n, offset = self.block, self.fill, self.size
        self.block, self.fill = None, 0
        data = memoryview(block)[:n]
        self.sha.update(data)
        self.size += n
        if self.direct is None:
            self.direct = self.tried_direct = n == STAGE_BLOCK and self._set_direct(True)
        if n < STAGE_BLOCK and self.direct:  # the tail, not a whole block: through the page cache, once the blocks are written
            while self.pending:
                self._wait_oldest()
            self.direct = self._set_direct(False)
        self.pending.append((_writes.submit(self._write_at, data, offset), block))
        while len(self.pending) > _IN_FLIGHT:
            self._wait_oldest()

    def _set_direct(self, on: bool) -> bool:
        if not hasattr(os, "O_DIRECT"):
            return False
        try:
            flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
            return on
        except OSError:  # the filesystem refuses O_DIRECT
            return False

    def _write_at(self, data: memoryview, offset: int) -> None:
        done, retried = 0, False
        while done < data.nbytes:
            try:
                n = _pwrite(self.fd, data[done:], offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and self.tried_direct and not retried:  # O_DIRECT taken at fcntl, refused at the write
                    self.direct, retried = self._set_direct(False), True
                    continue
                raise OSError(e.errno, e.strerror or str(e), str(self.path)) from None
            if n == 0:
                raise OSError(errno.EIO, "write returned 0", str(self.path))
            done += n
        if not self.direct and _start_writeback is not None:
            _start_writeback(self.fd, offset, data.nbytes)

    def _wait_oldest(self) -> None:
        fut, block = self.pending.pop(0)
        try:
            fut.result()
        finally:
            _give_block(block)  # written (or failed): its buffer is free

    def close(self, sync: bool = True) -> dict:
        """Write the rest, wait for every block, fsync (unless the caller does), close; the file's manifest entry."""
        try:
            if self.block is not None:
                self._flush()
            while self.pending:
                self._wait_oldest()
            if sync:
                self._call(os.fsync, self.fd)
        finally:
            self.abort()
        return {"bytes": self.size, "sha256": self.sha.hexdigest()}

    def abort(self) -> None:
        """Close the file after a failure (the blocks in flight finished first: their buffers are reused)."""
        for fut, block in self.pending:
            concurrent.futures.wait([fut])
            _give_block(block)
        self.pending = []
        if self.block is not None:
            _give_block(self.block)
            self.block = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_uploads = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckpt-upload")  # the parts of uploads, several at once
_UPLOAD_IN_FLIGHT = 4  # parts of one file being uploaded while the next block is filled and hashed


class UploadWriter(StreamWriter):
    """A StreamWriter whose file is an object in the store (common/store.py): the same staging
    blocks, each hashed in this thread, each uploaded as a part of a multipart upload by a helper
    thread with its own SHA-256 (the store refuses a part whose bytes do not match) while the next
    block is filled; `close()` completes the upload and returns the same manifest entry (our sha256
    of the whole, in the same pass). A file smaller than one block is one PUT carrying the sha256 of
    the whole. Until completed an upload is invisible; one left by a killed save is aborted at the
    next start (checkpoint/remote.py)."""

    def __init__(self, path: RemotePath) -> None:
        self.path, self.sha, self.size = path, hashlib.sha256(), 0
        self.store, self.key = path.store, path.key
        self.fd, self.direct, self.tried_direct = -1, False, False
        self.block: mmap.mmap | None = None
        self.fill = 0
        self.pending: list[tuple[Future, mmap.mmap | None]] = []
        self.upload_id: str | None = None
        self.parts: list[dict] = []
        self.small: bytes | None = None

    def _flush(self) -> None:
        block, n = self.block, self.fill
        self.block, self.fill = None, 0
        data = memoryview(block)[:n]
        self.sha.update(data)  # the whole file's sha256, in the same pass as its upload
        self.size += n
        if self.upload_id is None and n < STAGE_BLOCK:  # the whole file is less than a block: one PUT at close
            self.small = bytes(data)
            _give_block(block)
            return
        if self.upload_id is None:
            self.upload_id = self.store.begin(self.key)
        number = len(self.parts) + len(self.pending) + 1
        self.pending.append((_uploads.submit(self.store.part, self.key, self.upload_id, number, data), block))
        while len(self.pending) > _UPLOAD_IN_FLIGHT:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        fut, block = self.pending.pop(0)
        try:
            self.parts.append(fut.result())
        finally:
            _give_block(block)

    def close(self, sync: bool = True) -> dict:
        try:
            if self.block is not None:
                self._flush()
            while self.pending:
                self._wait_oldest()
            if self.upload_id is not None:
                self.store.complete(self.key, self.upload_id, self.parts)
                self.upload_id = None
            else:
                self.store.put(self.key, self.small or b"", sha256=self.sha.hexdigest())
        finally:
            self.abort()
        return {"bytes": self.size, "sha256": self.sha.hexdigest()}

    def abort(self) -> None:
        for fut, block in self.pending:
            concurrent.futures.wait([fut])
            _give_block(block)
        self.pending = []
        if self.block is not None:
            _give_block(self.block)
            self.block = None
        if self.upload_id is not None:
            upload, self.upload_id = self.upload_id, None
            try:
                self.store.abort(self.key, upload)
            except Exception:  # noqa: BLE001 - the next start aborts what is left (checkpoint/remote.py)
                pass


def writer_for(path) -> StreamWriter:
    """The writer of a new file at `path`: a local file (StreamWriter) or an object in the store (UploadWriter)."""
    return UploadWriter(path) if isinstance(path, RemotePath) else StreamWriter(path)


class RangeReader:
    """An object in the store read front to back as a file (`readinto`, `read`), in ranged GETs of
    one staging block each, retried on its own (common/store.py); up to AHEAD of the next ranges are
    being fetched while this one is consumed (a GET's latency hidden behind the others, as a
    multipart download keeps several parts in flight)."""

    AHEAD = 4

    def __init__(self, path: RemotePath, size: int) -> None:
        self.store, self.key, self.size = path.store, path.key, size
        self.pos, self.buf, self.start = 0, memoryview(b""), 0
        self.ahead: collections.deque[tuple[int, Future]] = collections.deque()
        self.next = 0  # where the next range requested starts

    def _request(self) -> None:
        while len(self.ahead) < self.AHEAD and self.next < self.size:
            n = min(STAGE_BLOCK, self.size - self.next)
            self.ahead.append((self.next, _uploads.submit(self.store.get_range, self.key, self.next, n)))
            self.next += n

    def _fill(self) -> bool:
        if self.pos >= self.size:
            return False
        if self.ahead and self.ahead[0][0] != self.pos:  # not where the ranges in flight start: from here instead
            self.close()
        if not self.ahead:
            self.next = self.pos
        self._request()
        start, fut = self.ahead.popleft()
        self.buf, self.start = memoryview(fut.result()), start  # sliced without copies below
        self._request()
        return True

    def readinto(self, view) -> int:
        view = memoryview(view).cast("B")
        done = 0
        while done < view.nbytes:
            offset = self.pos - self.start
            if not 0 <= offset < len(self.buf):
                if not self._fill():
                    break
                offset = 0
            n = min(view.nbytes - done, len(self.buf) - offset)
            view[done:done + n] = self.buf[offset:offset + n]
            done += n
            self.pos += n
        return done

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        out = bytearray(n)
        got = self.readinto(out)
        return bytes(out[:got])

    def close(self) -> None:
        concurrent.futures.wait([fut for _, fut in self.ahead])
        self.ahead.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_read(folder, name: str, error=None):
    """(a raw reader with readinto/read, its size) of the file `name` of `folder`: a local file
    opened without following a link, or an object in the store (its size from a HEAD); `error`
    (FileError by default) naming it when it cannot be opened."""
    error = error or FileError
    path = folder / name
    if isinstance(path, RemotePath):
        head = path.store.head(path.key)
        if head is None:
            raise error(f"{path}: missing (listed in the manifest)")
        return RangeReader(path, head.size), head.size
    refuse_links(folder, name)
    try:
        f = open(path, "rb", buffering=0, opener=no_follow)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    return f, os.fstat(f.fileno()).st_size


def write_stream(path: Path, buffers, sync: bool = True) -> dict:
    """Write `buffers` (an iterable of bytes-like objects) in order as the new file `path` with a
    StreamWriter: hashed in the same pass, fsynced unless `sync` is False (the caller fsyncs it);
    returns its manifest entry {bytes, sha256}."""
    w = writer_for(path)
    try:
        for b in buffers:
            w.write(b)
    except BaseException:
        w.abort()
        raise
    return w.close(sync)


def _fsync_named(path: Path) -> None:
    try:
        fsync_path(path)
    except OSError as e:  # e.g. a full disk that only shows at writeback
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


class HashingReader:
    """Reads a file front to back into buffers given to it (`readinto`: a tensor's own bytes), hashing
    every byte as it goes by, each byte read once. A large block is hashed in a helper thread while
    the next one is read (sha256 and read() both release the GIL); the blocks are hashed in file
    order. A file that ends early is a FileError naming it."""

    BLOCK = 8 << 20

    def __init__(self, f, path: Path) -> None:
        self.f, self.path, self.sha, self.size = f, path, hashlib.sha256(), 0
        self._pending: Future | None = None

    def _hash(self, view: memoryview) -> None:
        if self._pending is not None:
            self._pending.result()  # the blocks before it first: the digest is over the bytes in file order
            self._pending = None
        if view.nbytes >= _OVERLAP:
            self._pending = _helper.submit(self.sha.update, view)
        else:
            self.sha.update(view)

    def readinto(self, buffer) -> None:
        """Fill `buffer` (anything with a writable buffer) whole from the file's next bytes."""
        view = memoryview(buffer).cast("B")
        for start in range(0, view.nbytes, self.BLOCK):
            part = view[start:start + self.BLOCK]
            got = 0
            while got < part.nbytes:
                n = self.f.readinto(part[got:])
                if not n:
                    raise FileError(f"{self.path}: ends at byte {self.size + got}, before the bytes its metadata lists (truncated)")
                got += n
            self.size += got
            self._hash(part)

    def skip(self, n: int) -> None:
        """Read and hash the next `n` bytes without keeping them (items this rank does not load)."""
        while n > 0:
            block = bytearray(min(n, self.BLOCK))  # a fresh buffer: the previous one may still be being hashed
            self.readinto(block)
            n -= len(block)

    def rest(self) -> None:
        """Read and hash to the end of the file."""
        while block := self.f.read(self.BLOCK):
            self.size += len(block)
            self._hash(memoryview(block))

    def hexdigest(self) -> str:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        return self.sha.hexdigest()


def write_file(path: Path, obj: Any, fsyncs: list[Future] | None = None) -> dict:
    """Write one file of a checkpoint (raw bytes, or a generator of buffers written in order, with a
    StreamWriter; or an object through torch.save),
    hashing it on the way. Its fsync is started in a helper thread and appended to `fsyncs` (the caller waits for all of them before the manifest), or
    done here when `fsyncs` is None."""
    if isinstance(obj, (bytes, bytearray, memoryview, types.GeneratorType)):
        entry = write_stream(path, [obj] if not isinstance(obj, types.GeneratorType) else obj, sync=fsyncs is None)
        if fsyncs is not None and not isinstance(path, RemotePath):
            fsyncs.append(_helper.submit(_fsync_named, path))
        return entry
    w = None
    try:
        f = open(path, "wb")
        try:
            w = HashingWriter(f)
            # torch's zip writer computes a CRC32 of every record (about 0.5 GB/s here); the
            # manifest's sha256 covers every byte already, and torch.load does not check it.
            with serialization_config.patch({"save.compute_crc32": False}):
                torch.save(obj, w)
            f.flush()
        except BaseException:
            f.close()
            raise
        if fsyncs is None:
            fsync_close(f)
        else:
            fsyncs.append(_helper.submit(fsync_close, f))
    except Exception as e:
        if w is not None and w.error is not None and w.error is not e:
            real = w.error
            raise OSError(real.errno, real.strerror or str(real), str(path)) from e
        if isinstance(e, OSError) and not e.filename:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise
    return {"bytes": w.size, "sha256": w.sha.hexdigest()}


def fsync_close(f) -> None:
    try:
        os.fsync(f.fileno())
    except OSError as e:  # e.g. a full disk that only shows at writeback
        raise OSError(e.errno, e.strerror or str(e), f.name) from None
    finally:
        f.close()


def verified_bytes(folder: Path, name: str, entries: dict[str, dict]) -> bytes:
    """The bytes of `folder/name` (a path relative to the step folder), read once, whole, and
    returned only when the manifest lists it with this size and sha256."""
    folder = folder if isinstance(folder, RemotePath) else Path(folder)
    entry, path = entries.get(name), folder / name
    if entry is None:
        raise FileError(f"{path}: not listed in the manifest; only what the manifest vouches for is read")
    f, _ = open_read(folder, name)  # a link put there since is not followed either
    try:
        with f:
            data = f.read()
    except OSError as e:
        raise FileError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(data) != entry["bytes"]:
        raise FileError(f"{path}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
    sha = hashlib.sha256(data).hexdigest()
    if sha != entry["sha256"]:
        raise FileError(f"{path}: sha256 {sha[:12]}... does not match the manifest's {entry['sha256'][:12]}... (corrupted)")
    return data
