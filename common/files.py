"""One way to write a file that must survive a crash or a power loss: a temporary file in the same
folder, fsynced, given an ordinary mode, renamed over the final name, then the folder fsynced. A
reader sees the old file or the new one, never a part (docs/design.md I8). Every file the project
writes goes through here: the status, the metrics after a resume, the config copy, packed corpora,
tokenizer files, exports. (Checkpoint folders are published by checkpoint/storage.py, which fsyncs
each file and the folder the same way and renames the folder.)
"""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Make a file's data, or a folder's entries (a rename, a new file), durable; the file may have
    been written through another descriptor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_prefix(path: Path) -> str:
    """The start of the temporary names of `path` written on this host, whatever the process."""
    return f".{path.name}.tmp-{socket.gethostname()}-"


def tmp_name(path: Path) -> Path:
    """The temporary name a write of `path` uses on this host in this process: hidden, beside it."""
    return path.with_name(f"{tmp_prefix(path)}{os.getpid()}")


def ordinary_mode() -> int:
    """0666 less the umask: the mode `open()` gives a new file (a temporary file may be 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextmanager
def atomic_file(path: Path, mode: str = "wb", encoding: str | None = None) -> Iterator:
    """`with atomic_file(path) as f: f.write(...)`: on a clean exit the bytes are on disk under
    `path`; on an exception nothing changed there and the temporary file is gone."""
    path = Path(path)
    tmp = tmp_name(path)
    f = open(tmp, mode, encoding=encoding)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        os.fchmod(f.fileno(), ordinary_mode())
        f.close()
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: Path, data: bytes | str) -> Path:
    """Replace `path` with `data` (str is written as UTF-8), durably and atomically."""
    with atomic_file(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def durable_tree(folder: Path) -> None:
    """fsync every file and folder under `folder` (itself included) and give the files ordinary
    modes: what a folder written in a temporary place needs before it is renamed into view."""
    for root, _, names in os.walk(folder):
        for name in names:
            fsync_path(Path(root) / name)
            os.chmod(Path(root) / name, ordinary_mode())
        fsync_path(Path(root))
