"""Corpora in an object store and where a cache in one is staged: `data.path=s3://...`, `data.cache_dir=s3://...`
(docs/data.md, docs/object_storage.md "Corpora and the packed cache").

A corpus in the store is named as on a disk: an object (`s3://B/corpus.jsonl.gz`), a prefix holding
`.jsonl` / `.jsonl.gz` objects (`s3://B/corpora/web`, its direct children in key order, names starting
with '.' skipped) or a glob over keys (`s3://B/corpora/*.jsonl.gz`; `*` and `?` stop at '/', `**`
crosses it). Its files are `RemoteFile`s, read by the same Reader as local files (streamed, hashed
as they are read), so the fingerprint is the one the same files give on a disk (their sha256 and
their names relative to the prefix they share). A file's identity is its size and ETag from the
listing: what a relaunch compares instead of reading the bytes (the ETag changes with the content).

The packed cache in the store (`data.cache_dir=s3://...`) is packed and fetched by data/prepare.py
(`_pack_in_store`) in the staging copy `local_cache` names; `remote_of` maps a file there back to
its URL (the precomputed tables beside the packed rows live in the store too: objectives/tables.py).
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from common.store import is_url, parse, staging_root, store_of

SUFFIXES = (".jsonl", ".jsonl.gz")


@dataclass(frozen=True)
class RemoteFile:
    """One object of a corpus in the store, with the size and ETag its listing gave."""

    bucket: str
    key: str
    size: int
    etag: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    def identity(self) -> dict:
        return {"size": self.size, "etag": self.etag}

    def open(self):
        """(a raw file of the object's bytes, the GET's identity): a GET is one version of the object."""
        raw, size, etag = store_of(self.bucket).open(self.key)
        return raw, {"size": size, "etag": etag}


def _pattern(key: str) -> re.Pattern:
    """A glob over keys as a regex: `**` any keys, `*` and `?` within one part, `[...]` a class."""
    out, i = "", 0
    while i < len(key):
        if key.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif key.startswith("**", i):
            out, i = out + ".*", i + 2
        elif key[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif key[i] == "?":
            out, i = out + "[^/]", i + 1
        elif key[i] == "[" and (j := key.find("]", i + 1)) > 0:
            out, i = out + key[i:j + 1], j + 1
        else:
            out, i = out + re.escape(key[i]), i + 1
    return re.compile(out + r"\Z")


def resolve(spec: str, what: str, error) -> tuple[str, tuple[RemoteFile, ...]]:
    """(label, files) of the corpus `spec` (an s3:// URL) names; `error(message)` (DataError) when it
    names nothing, or an object that is not .jsonl / .jsonl.gz. One HEAD or one LIST."""
    bucket, key = parse(spec, what)
    store = store_of(bucket)  # its first request names the object (a missing bucket, credentials: exit 2)
    label = f"s3://{bucket}/{key}"
    if any(c in key for c in "*?["):
        start = key[:min(key.find(c) for c in "*?[" if c in key)].rpartition("/")[0]
        pattern = _pattern(key)
        found = {k: v for k, v in store.objects(f"{start}/" if start else "").items() if pattern.match(k)}
        if not found:
            raise error(f"{what}={spec}: the pattern matches no object in the store ({store.endpoint}; expected .jsonl or .jsonl.gz objects)")
    else:
        head = store.head(key) if key else None
        if head is not None:
            found = {key: (head.size, head.etag)}
        else:
            base = f"{key}/" if key else ""
            found = {k: v for k, v in store.objects(base).items() if not k[len(base):].startswith(".")}
            if not found:
                raise error(f"{what}: corpus {spec} does not exist in the store ({store.endpoint}: no object, no prefix holding any; "
                            f"expected a JSONL object, a prefix or a glob of .jsonl / .jsonl.gz objects)")
            if deeper := sorted({k[len(base):].split("/")[0] for k in found if "/" in k[len(base):]}):
                raise error(f"s3://{bucket}/{base}{deeper[0]}/: a folder; {what}={spec} may hold only .jsonl and .jsonl.gz objects "
                            f"(move the others away)")
    files = tuple(RemoteFile(bucket, k, size, etag) for k, (size, etag) in sorted(found.items()))
    for f in files:
        if not f.key.endswith(SUFFIXES):
            raise error(f"{f}: not a .jsonl or .jsonl.gz object; {what}={spec} may hold only .jsonl and .jsonl.gz files (move the others away)")
    return label, files


def names(files: tuple[RemoteFile, ...]) -> dict:
    """Each object's name relative to the prefix they share, as data/sources.py names local files."""
    if len(files) == 1:
        return {files[0]: files[0].name}
    root = posixpath.commonpath(["/" + posixpath.dirname(f.key) for f in files])
    return {f: posixpath.relpath("/" + f.key, root) for f in files}


# ---------------------------------------------------------------------------------------- the packed cache
def local_cache(cache_dir) -> Path:
    """The local folder a cache_dir's files are in: itself, or for s3://B/P its staging copy."""
    if not is_url(cache_dir):
        return Path(cache_dir)
    bucket, prefix = parse(str(cache_dir), "data.cache_dir")
    return staging_root() / ".data" / bucket / prefix


def remote_of(local: Path) -> str | None:
    """The s3:// URL in the store whose staging copy is `local` (a packed file, or a table named beside
    it: objectives/tables.py keeps tables in the store too), or None for a path of a local cache."""
    try:
        parts = Path(local).resolve().relative_to((staging_root() / ".data").resolve()).parts
    except ValueError:
        return None
    return f"s3://{'/'.join(parts)}" if len(parts) >= 2 else None
