"""Object storage: a run folder at `s3://BUCKET/PREFIX` (docs/object_storage.md).

An S3 store has no rename and no lock; what it has (AWS S3 since 2020/2024, SeaweedFS, MinIO) is strong
read-after-write consistency and conditional writes: `If-None-Match: *` creates an object only if none
is there, `If-Match: <etag>` replaces it only if it is still the one read. Everything a run folder
needs is built on those two (checkpoint/remote.py publishes with them, the lease below is one).

This module is the one client of the store: the URL (`s3://BUCKET/PREFIX`; anything else with a
scheme is refused by name), the connection from the standard AWS variables (AWS_ENDPOINT_URL,
AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE: botocore reads them, nothing here
prints one), every request retried with backoff on a connection error, throttling or a 5xx (bounded,
each retry logged), then a `StoreError` naming the endpoint and the object (exit 1); credentials the
store refuses or a bucket it lacks are `StoreRefused` naming the endpoint and the variable (exit 2).
`RemotePath` is a location in the store that the file-level code (checkpoint/files.py) writes with
multipart uploads and reads with ranged GETs. It imports nothing of this repository but common/.
"""
from __future__ import annotations

import base64
import datetime
import email.utils
import hashlib
import io
import json
import logging
import os
import random
import re
import socket
import threading
import time
from dataclasses import dataclass

from common.outcome import BadInput, Failed

log = logging.getLogger("minimind")
for _name in ("botocore", "boto3", "urllib3", "s3transfer"):  # their INFO lines ("Found credentials in ...") are not the run's
    logging.getLogger(_name).setLevel(logging.WARNING)
SCHEME = "s3://"
_ANY_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
ATTEMPTS = int(os.environ.get("MINIMIND_S3_ATTEMPTS", "6"))
"""Tries of one request before it is a failure (connection errors, throttling, 5xx): 0.2 s doubling, at most 5 s apart."""
LEASE_TTL_S = float(os.environ.get("MINIMIND_LEASE_TTL_S", "30"))
"""A lease not renewed for this long (by the store's own clock) may be taken over."""
PART = 8 << 20
"""A multipart upload's part: checkpoint/files.py's staging block."""
_CREDENTIALS = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"


class StoreError(Failed):
    """A request that failed after its retries (the store down, a timeout): names the endpoint and the object. Exit 1."""


class StoreRefused(BadInput):
    """The store refuses this run's settings (credentials, a missing bucket, a URL that is no run folder). Exit 2."""


class Conflict(Failed):
    """A conditional write refused (412): another writer created or replaced the object first."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def is_url(value) -> bool:
    """Is `value` a URL (any scheme; an unknown one is refused by `parse`) rather than a local path?"""
    return isinstance(value, (str, RemotePath)) and bool(_ANY_SCHEME.match(str(value)))


def parse(url: str, what: str = "out_dir") -> tuple[str, str]:
    """(bucket, prefix without slashes at its ends) of `s3://BUCKET/PREFIX`; StoreRefused naming `what` otherwise."""
    m = _ANY_SCHEME.match(url)
    if not m or m.group(1).lower() != "s3":
        raise StoreRefused(f"{what}={url}: unknown scheme {m.group(1) + '://' if m else ''!r}; a run folder is a local path "
                           f"or s3://BUCKET/PREFIX (docs/object_storage.md)")
    rest = url[m.end():]
    bucket, _, prefix = rest.partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket or ""):
        raise StoreRefused(f"{what}={url}: no bucket (expected s3://BUCKET/PREFIX, BUCKET 3-63 lower-case letters, digits, dots, hyphens)")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise StoreRefused(f"{what}={url}: the prefix has an empty, '.' or '..' part")
    return bucket, prefix


class RemotePath:
    """A location in the store, `s3://BUCKET/KEY`, used where the file-level code takes a Path:
    `/` appends a part, `name` and `parent` as a Path's; mkdir is nothing (a store has no folders).
    It pickles as its URL (ranks send each other locations); the client is made per process."""

    def __init__(self, url: str) -> None:
        self.bucket, self.key = parse(str(url), "a location")
        self.url = f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    def __truediv__(self, part) -> RemotePath:
        part = str(part).strip("/")
        return RemotePath(f"{self.url}/{part}" if part else self.url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __reduce__(self):
        return RemotePath, (self.url,)

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(f"{SCHEME}{self.bucket}/{self.key.rpartition('/')[0]}")

    @property
    def store(self) -> Store:
        return store_of(self.bucket)

    def mkdir(self, *args, **kwargs) -> None:
        pass


def location(value):
    """A RemotePath for a URL, else a local Path (what a manifest's folder or a candidate's string names)."""
    from pathlib import Path

    return value if isinstance(value, RemotePath) else RemotePath(value) if is_url(value) else Path(value)


_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed", "InternalError",
                "ServiceUnavailable", "TooManyRequests", "503", "500", "502", "504",
                "BadDigest", "XAmzContentSHA256Mismatch"}  # bytes damaged on their way, refused by the store: sent again from ours


def _b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


@dataclass
class Head:
    size: int
    etag: str
    age_s: float
    """Seconds since the object was last written, by the store's clock (its Date less its Last-Modified)."""


class Store:
    """One bucket at one endpoint, with this process's client (made at first use: botocore reads
    the AWS variables). Every method is one request (or a listing's pages), retried as the module
    docstring says; a conditional write refused is a Conflict."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self._client = self._signed = None
        self._lock = threading.Lock()
        self.bytes_read: dict[str, int] = {}
        """Bytes of each object's body this process has read (GET, ranged GET, streamed): the client's
        own count, what a test and a relaunch's log say was fetched."""
        self.lease: Lease | None = None
        """The lease this process holds on a run folder in this bucket (run/folder.py), checked before a publish."""

    @property
    def client(self):
        """The client of every request but one (its payload unsigned: see `_make`)."""
        with self._lock:
            if self._client is None:
                self._client = self._make(sign_payload=False)
            return self._client

    @property
    def signed(self):
        """The client of the request whose body carries no SHA-256 of its own (CompleteMultipartUpload's
        list of parts): its signature hashes the body, so bytes damaged on their way are refused
        (XAmzContentSHA256Mismatch, retried) as an upload's are against its checksum."""
        with self._lock:
            if self._signed is None:
                self._signed = self._make(sign_payload=True)
            return self._signed

    @staticmethod
    def _make(sign_payload: bool):
        import boto3
        from botocore.config import Config

        session = boto3.session.Session()
        region = session.region_name or "us-east-1"
        # Our own retries (logged, bounded); botocore's CRC on every upload off: we send SHA-256 ourselves.
        # Every object and part we upload carries its SHA-256 (x-amz-checksum-sha256, a signed header the store
        # checks the bytes against: `put`, `part`), so the signature need not hash those bodies a second time
        # (payload_signing_enabled off: what botocore itself does over https for a body with a checksum; over
        # http it would hash every byte again). A body without a checksum of its own goes by `signed`.
        config = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=60,
                        max_pool_connections=32, s3={"addressing_style": "path", "payload_signing_enabled": sign_payload},
                        request_checksum_calculation="when_required", response_checksum_validation="when_required")
        return session.client("s3", region_name=region, config=config)

    @property
    def endpoint(self) -> str:
        try:
            return self.client.meta.endpoint_url
        except Exception:  # noqa: BLE001 - only a name for a message
            return os.environ.get("AWS_ENDPOINT_URL", "the default S3 endpoint")

    def url(self, key: str) -> str:
        return f"{SCHEME}{self.bucket}/{key}"

    # ------------------------------------------------------------------ the one retry loop
    def call(self, op: str, key: str, fn, *args, conflict_ok: bool = False, missing_ok: bool = False, **kwargs):
        """`fn(*args, **kwargs)` (a client method), retried on what may pass; returns its answer, or
        None for a missing object when `missing_ok`. A 412 raises Conflict; credentials or a missing
        bucket, StoreRefused; anything else after the retries, StoreError."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

        delay = 0.2
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return fn(*args, **kwargs)
            except ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status == 412 or code == "PreconditionFailed":
                    raise Conflict(f"{self.url(key)}: {op} refused (412): it was created or replaced by another writer", key) from None
                if missing_ok and (status == 404 or code in ("NoSuchKey", "404", "NotFound", "NoSuchUpload")):
                    return None
                if code in ("NoSuchBucket",) or (status == 404 and op == "check"):
                    raise StoreRefused(f"{self.endpoint}: bucket {self.bucket!r} does not exist (create it, or fix the URL)") from None
                if status == 403 or code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
                    raise StoreRefused(f"{self.endpoint}: {op} {self.url(key)} refused ({code or status}): check {_CREDENTIALS} "
                                       f"for this endpoint and bucket") from None
                if code not in _RETRY_CODES and status < 500 and status != 429:
                    raise StoreError(f"{self.endpoint}: {op} {self.url(key)} failed: {code or status} "
                                     f"{e.response.get('Error', {}).get('Message', '')}".rstrip()) from None
                cause = f"{code or status} {e.response.get('Error', {}).get('Message', '')}".strip()
            except (NoCredentialsError, PartialCredentialsError):
                raise StoreRefused(f"{self.endpoint}: no credentials for {self.url(key)}: set {_CREDENTIALS}") from None
            except (BotoCoreError, OSError) as e:
                cause = f"{type(e).__name__}: {e}"
            if attempt == ATTEMPTS:
                raise StoreError(f"{self.endpoint}: {op} {self.url(key)} failed after {ATTEMPTS} attempts: {cause}")
            wait = min(delay, 5.0) * (0.5 + random.random() / 2)
            log.warning("%s: %s %s: %s; retry %d of %d in %.1f s", self.endpoint, op, self.url(key), cause, attempt, ATTEMPTS - 1, wait)
            time.sleep(wait)
            delay *= 2
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ objects
    def check(self) -> None:
        """The bucket is there and the credentials work (one HEAD); StoreRefused naming the endpoint otherwise."""
        self.call("check", "", self.client.head_bucket, Bucket=self.bucket)

    def probe_conditional_writes(self, prefix: str) -> None:
        """The store enforces conditional writes: a probe object under `prefix` created, then created
        again create-only and replaced with a wrong etag, both of which must be refused (then deleted).
        A store that ignores them is refused by name (StoreRefused), not trusted."""
        key = f"{prefix}/.probe-{os.getpid()}-{random.getrandbits(32):08x}".lstrip("/")
        self.put(key, b"probe", create=True)
        try:
            for how, kwargs in (("If-None-Match: *", {"create": True}), ("If-Match", {"if_match": '"0123456789abcdef0123456789abcdef"'})):
                try:
                    self.put(key, b"again", **kwargs)
                except Conflict:
                    continue
                raise StoreRefused(f"{self.endpoint}: the store ignored {how} (a conditional write): a run folder needs conditional "
                                   f"writes and strong consistency (AWS S3, SeaweedFS, MinIO; docs/object_storage.md); refused")
        finally:
            self.delete(key)

    def put(self, key: str, data: bytes, create: bool = False, if_match: str | None = None, sha256: str | None = None) -> str:
        """Write the object `key`; `create`: only if none is there (If-None-Match: *); `if_match`: only
        if it is still that etag. The store checks the bytes against their SHA-256 (`sha256`, hex, where
        the caller has it; else taken here). Its etag."""
        data = bytes(data)
        kwargs = {"IfNoneMatch": "*"} if create else {"IfMatch": if_match} if if_match else {}
        kwargs["ChecksumSHA256"] = _b64(sha256 or hashlib.sha256(data).hexdigest())
        return self.call("PUT", key, self.client.put_object, Bucket=self.bucket, Key=key, Body=data, **kwargs)["ETag"]

    def count(self, key: str, n: int) -> None:
        with self._lock:
            self.bytes_read[key] = self.bytes_read.get(key, 0) + n

    def get(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, etag) of `key`, or None when there is none."""
        def read():
            r = self.client.get_object(Bucket=self.bucket, Key=key)
            return r["Body"].read(), r["ETag"]
        got = self.call("GET", key, read, missing_ok=True)
        if got is not None:
            self.count(key, len(got[0]))
        return got

    def get_range(self, key: str, start: int, n: int) -> bytes:
        def read():
            return self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")["Body"].read()
        data = self.call("GET", key, read)
        self.count(key, len(data))
        if len(data) != n:
            raise StoreError(f"{self.endpoint}: GET {self.url(key)} bytes {start}-{start + n - 1}: {len(data)} bytes came back")
        return data

    def head(self, key: str) -> Head | None:
        r = self.call("HEAD", key, self.client.head_object, Bucket=self.bucket, Key=key, missing_ok=True)
        if r is None:
            return None
        now = email.utils.parsedate_to_datetime(r["ResponseMetadata"]["HTTPHeaders"]["date"])  # the store's clock, not ours
        modified = r["LastModified"]
        if now.tzinfo is None:
            now = now.replace(tzinfo=datetime.timezone.utc)
        if modified.tzinfo is None:
            modified = modified.replace(tzinfo=datetime.timezone.utc)
        return Head(r["ContentLength"], r["ETag"], (now - modified).total_seconds())

    def list(self, prefix: str) -> dict[str, int]:
        """Every object under `prefix` (a folder: ends with '/'), key -> size."""
        out, token = {}, None
        while True:
            kwargs = {"ContinuationToken": token} if token else {}
            r = self.call("LIST", prefix, self.client.list_objects_v2, Bucket=self.bucket, Prefix=prefix, **kwargs)
            out.update({o["Key"]: o["Size"] for o in r.get("Contents", [])})
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    def objects(self, prefix: str) -> dict[str, tuple[int, str]]:
        """Every object under `prefix` (a folder: ends with '/'; or a start of keys), key -> (size, etag)."""
        out, token = {}, None
        while True:
            kwargs = {"ContinuationToken": token} if token else {}
            r = self.call("LIST", prefix, self.client.list_objects_v2, Bucket=self.bucket, Prefix=prefix, **kwargs)
            out.update({o["Key"]: (o["Size"], o["ETag"]) for o in r.get("Contents", [])})
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    def open(self, key: str) -> tuple[io.RawIOBase, int, str]:
        """A streamed read of `key` (one GET, retried until its answer starts): (a raw file of its
        bytes, its size, its etag). A failure while the body streams is a StoreError naming the object."""
        r = self.call("GET", key, self.client.get_object, Bucket=self.bucket, Key=key)
        return _Body(self, key, r["Body"]), r["ContentLength"], r["ETag"]

    def upload(self, key: str, path, sha256: str) -> None:
        """The local file `path` as the object `key`: one PUT under a part's size, else a multipart
        upload of PART-sized parts; the store checks each part's (or the whole's) SHA-256, and the
        whole's bytes as read must hash to `sha256` (its record) before the object is made: a file
        changed on this disk since it was hashed is refused (StoreError naming it), never uploaded."""
        size = os.path.getsize(path)
        whole = hashlib.sha256()
        with open(path, "rb") as f:
            if size <= PART:
                data = f.read()
                whole.update(data)
                self._same(path, key, whole, sha256)
                self.put(key, data, sha256=sha256)
                return
            upload_id = self.begin(key)
            try:
                parts, number = [], 1
                while block := f.read(PART):
                    whole.update(block)
                    parts.append(self.part(key, upload_id, number, memoryview(block)))
                    number += 1
                self._same(path, key, whole, sha256)
                self.complete(key, upload_id, parts)
            except BaseException:
                self.abort(key, upload_id)
                raise

    def _same(self, path, key: str, whole, sha256: str) -> None:
        if whole.hexdigest() != sha256:
            raise StoreError(f"{path}: its bytes hash to {whole.hexdigest()[:16]}..., not the {sha256[:16]}... recorded for "
                             f"{self.url(key)}: the file changed since it was hashed; not uploaded")

    def download(self, key: str, dest, sha256: str) -> str | None:
        """The object `key` into the local file `dest` (atomically), hashed as it comes down: kept only
        when its sha256 is `sha256` (None), else nothing is kept and the mismatch is said (a string)."""
        from common.files import atomic_file

        raw, _, _ = self.open(key)
        h = hashlib.sha256()
        try:
            with atomic_file(dest, "wb") as out:
                try:
                    while block := raw.read(PART):
                        h.update(block)
                        out.write(block)
                finally:
                    raw.close()
                if h.hexdigest() != sha256:
                    raise _Mismatch
        except _Mismatch:
            return f"{self.url(key)}: its bytes hash to {h.hexdigest()[:16]}..., not the {sha256[:16]}... its record names"
        return None

    def delete(self, key: str, if_match: str | None = None) -> None:
        self.call("DELETE", key, self.client.delete_object, Bucket=self.bucket, Key=key, **({"IfMatch": if_match} if if_match else {}),
                  missing_ok=True)

    # ------------------------------------------------------------------ multipart
    def begin(self, key: str) -> str:
        return self.call("CREATE-MULTIPART", key, self.client.create_multipart_upload, Bucket=self.bucket, Key=key,
                         ChecksumAlgorithm="SHA256")["UploadId"]

    def part(self, key: str, upload_id: str, number: int, data: memoryview) -> dict:
        """Upload part `number`; its SHA-256 goes with it (the store refuses bytes that do not match)."""
        sha = _b64(hashlib.sha256(data).hexdigest())
        r = self.call("UPLOAD-PART", key, self.client.upload_part, Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                      Body=bytes(data), ChecksumSHA256=sha)
        return {"PartNumber": number, "ETag": r["ETag"], "ChecksumSHA256": sha}

    def complete(self, key: str, upload_id: str, parts: list[dict]) -> str:
        """The upload made the object `key` of `parts` (their list sent by `signed`: its body bound to the request)."""
        return self.call("COMPLETE-MULTIPART", key, self.signed.complete_multipart_upload, Bucket=self.bucket, Key=key,
                         UploadId=upload_id, MultipartUpload={"Parts": parts})["ETag"]

    def abort(self, key: str, upload_id: str) -> None:
        self.call("ABORT-MULTIPART", key, self.client.abort_multipart_upload, Bucket=self.bucket, Key=key, UploadId=upload_id,
                  missing_ok=True)

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload under `prefix` not completed nor aborted."""
        r = self.call("LIST-MULTIPART", prefix, self.client.list_multipart_uploads, Bucket=self.bucket, Prefix=prefix)
        return [(u["Key"], u["UploadId"]) for u in r.get("Uploads", [])]


class _Mismatch(Exception):
    """A download whose bytes are not the ones named (nothing kept)."""


class _Body(io.RawIOBase):
    """A GET's streamed body as a raw file, counted in the store's bytes_read; its errors named."""

    def __init__(self, store: Store, key: str, body) -> None:
        self.store, self.key, self.body = store, key, body

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        try:
            data = self.body.read(len(b))
        except Exception as e:  # noqa: BLE001 - a connection cut while the body streams
            raise StoreError(f"{self.store.endpoint}: GET {self.store.url(self.key)} failed while reading: {type(e).__name__}: {e}") from None
        b[:len(data)] = data
        self.store.count(self.key, len(data))
        return len(data)

    def close(self) -> None:
        self.body.close()
        super().close()


def staging_root():
    """The local staging folder (MINIMIND_STAGING_DIR, default ~/.cache/minimind/staging): the bounded
    cache of what lives in the store (run folders, the packed corpora), which a fresh node does not need."""
    from pathlib import Path

    return Path(os.environ.get("MINIMIND_STAGING_DIR") or Path.home() / ".cache" / "minimind" / "staging")


_stores: dict[str, Store] = {}
_stores_lock = threading.Lock()


def store_of(bucket: str) -> Store:
    """This process's Store of `bucket` (one client per process, shared by its threads)."""
    with _stores_lock:
        return _stores.setdefault(bucket, Store(bucket))


def _own_clients_after_fork() -> None:
    """A forked child (a DataLoader worker reading a cache in the store) makes its own clients: the
    parent's connections are the parent's."""
    global _stores_lock
    _stores.clear()
    _stores_lock = threading.Lock()


os.register_at_fork(after_in_child=_own_clients_after_fork)


# ---------------------------------------------------------------------------------------- the lease
def holder_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "launch_id": os.environ.get("MINIMIND_LAUNCH_ID"),
            "since": round(time.time(), 3)}


def describe_holder(info: dict) -> str:
    if not info:
        return "another process (its lease holds no name)"
    since = time.strftime("%H:%M:%S", time.localtime(info.get("since", 0)))
    launch = f", launch {info['launch_id']}" if info.get("launch_id") else ""
    return f"pid {info.get('pid')} on host {info.get('host')}{launch} since {since}"


class Lease:
    """One writer per run folder across machines: the object `key`, created create-only with its
    holder, renewed by compare-and-swap every ttl/3 in a thread, taken over only once the store's
    clock says it was last written more than `ttl_s` ago (logged, naming the previous holder), and
    deleted (if still ours) at release. A renewal refused means another writer took it over: `lost`
    names it, and a publish checks `check()` first."""

    def __init__(self, store: Store, key: str, ttl_s: float = LEASE_TTL_S) -> None:
        self.store, self.key, self.ttl_s = store, key, ttl_s
        self.etag: str | None = None
        self.record = holder_record()
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed = time.monotonic()

    def holder(self) -> tuple[dict, Head | None]:
        got, head = self.store.get(self.key), self.store.head(self.key)
        try:
            info = json.loads(got[0]) if got else {}
        except ValueError:
            info = {}
        return (info if isinstance(info, dict) else {}), head

    def acquire(self, timeout_s: float, poll_s: float = 0.5) -> Lease:
        """Take the lease, waiting up to `timeout_s` for a live holder; StoreRefused naming it after that."""
        end, announced = time.monotonic() + timeout_s, None
        body = (json.dumps({**self.record, "ttl_s": self.ttl_s}) + "\n").encode()
        while True:
            try:
                self.etag = self.store.put(self.key, body, create=True)
                break
            except Conflict:
                pass
            info, head = self.holder()
            if head is None:
                continue  # released between the two requests: try again at once
            if head.age_s > max(self.ttl_s, float(info.get("ttl_s") or 0)) + 1:  # the store's clock, 1 s resolution
                try:
                    self.etag = self.store.put(self.key, body, if_match=head.etag)
                except Conflict:
                    continue  # renewed, released or taken by another at that moment
                log.warning("took over the lease %s of %s: not renewed for %.0f s (ttl %g s)", self.store.url(self.key),
                            describe_holder(info), head.age_s, self.ttl_s)
                break
            who = describe_holder(info)
            if time.monotonic() >= end:
                raise StoreRefused(f"{self.store.url(self.key).rsplit('/', 1)[0]} is held by {who} (its lease was renewed "
                                   f"{head.age_s:.0f} s ago): another run is using this folder (waited {timeout_s:g} s, "
                                   f"checkpoint.lock_timeout_s); stop it or use another out_dir")
            if who != announced:
                log.warning("%s is held by %s; waiting up to %g s for it to finish or its lease to expire",
                            self.store.url(self.key).rsplit("/", 1)[0], who, timeout_s)
                announced = who
            time.sleep(poll_s)
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._renew_loop, name="lease", daemon=True)
        self._thread.start()
        self.store.lease = self
        return self

    def _renew_loop(self) -> None:
        body = (json.dumps({**self.record, "ttl_s": self.ttl_s}) + "\n").encode()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.etag = self.store.put(self.key, body, if_match=self.etag)
                self._renewed = time.monotonic()
            except Conflict:
                info, _ = self.holder()
                self.lost = f"the lease {self.store.url(self.key)} was taken over by {describe_holder(info)}"
                log.error("%s; this run publishes nothing more", self.lost)
                return
            except (StoreError, StoreRefused) as e:
                log.warning("renewing the lease %s: %s", self.store.url(self.key), e)

    def check(self) -> None:
        """Raise Conflict when the lease is lost, or not renewed within its ttl (a writer that cannot
        renew may already have been taken over: it publishes nothing)."""
        if self.lost:
            raise Conflict(self.lost, self.key)
        if time.monotonic() - self._renewed > self.ttl_s:
            raise Conflict(f"the lease {self.store.url(self.key)} was not renewed for {time.monotonic() - self._renewed:.0f} s "
                           f"(ttl {self.ttl_s:g} s): another run may hold the folder now", self.key)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.store.lease is self:
            self.store.lease = None
        if self.etag and not self.lost:
            try:
                self.store.delete(self.key, if_match=self.etag)
            except (Conflict, StoreError, StoreRefused) as e:
                log.warning("releasing the lease %s: %s (it expires by itself)", self.store.url(self.key), e)
        self.etag = None
