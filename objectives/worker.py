"""User code (a `module:function` given as train.grpo.reward, train.agent.tools or train.agent.parser) runs in
a process of its own, one per rank, called through a socket: each call is bounded by its timeout, at which the
process is killed (a hang inside C included: nothing has to return to the interpreter) and the next call starts
another; a stop signal while a call runs kills it too (docs/rl.md, "What user code may do").

The process is this file run as a script, with the standard library only (no torch: it starts in about 50 ms),
the trainer's `sys.path` and working directory and the user's permissions. It ignores the stop signals (the
trainer decides, and kills it) and dies with the trainer (PR_SET_PDEATHSIG, and the end of its socket). A value
crosses the socket pickled, bit for bit; a tool's result crosses as the text the model reads. User code can reach
the socket, so the trainer trusts nothing on it: a reply is read against the call's deadline (a forged length
waits for bytes that never come: Late), carries the call's number (a stale or foreign one: the process is killed,
Raised), and a child the user's code forked that returns into the loop exits there without replying. A kill ends
the process group: what the user's code started goes with it.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

LOAD_TIMEOUT_S = 300.0
"""The longest a user module's import may take (its top-level code runs there)."""


class Late(Exception):
    """The call did not return within its timeout: its process was killed."""


class Raised(Exception):
    """The user's function raised (`kind`: its exception's type name, `text`: its message), or its process died."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind, self.text = kind, text


class Changed(Raised):
    """A restarted process (after a kill) could not load what the run pinned: the file changed or no longer imports."""


def described(e: BaseException) -> str:
    """`Type: message` of an exception, the user's own type for one raised in the worker."""
    return f"{e.kind}: {e.text}" if isinstance(e, Raised) else f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------- the trainer's side
class Worker:
    """This rank's process for user code: started at the first load, again at the first call after a kill
    (every module loaded so far imported again, in order)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.conn: socket.socket | None = None
        self.loaded: list[tuple[str, str, str | None]] = []  # (spec, key, the file's sha256 at the first load) by handle
        self.number = 0  # of the last message sent: its reply carries it
        self.run = 0  # counts close(): a handle of an ended run is not called

    def close(self) -> None:
        """The run ended: the process ends and what it pinned is forgotten (a next run in this interpreter, a
        notebook's or a test's, loads and pins its own code)."""
        self.kill()
        self.loaded.clear()
        self.run += 1

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, process_group=0, env=_worker_environment())
        theirs.close()
        self.conn = ours
        _send(self.conn, (0, "path", list(sys.path)))
        for handle, (spec, key, sha) in enumerate(self.loaded):
            if spec:  # imported again: the code the run pinned, or the run fails naming it
                reply = self._ask(("load", handle, spec, key), LOAD_TIMEOUT_S)
                if reply[0] != "ok" or reply[2] != sha:
                    self.kill()
                    now = reply[1] if reply[0] != "ok" else f"its sha256 is now {str(reply[2])[:16]}..., not {str(sha)[:16]}... as when the run loaded it"
                    raise Changed("FileChanged", f"{key}: {spec} changed under the run ({now}); its process was started again "
                                                 f"after a kill and runs only the code the run pinned")

    def kill(self) -> None:
        """End the process now (SIGKILL), whatever it runs; the next call starts another."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group: the user's code's children too
            except OSError:
                self.proc.kill()
            self.proc.wait()
            self.conn.close()
        self.proc = self.conn = None

    def _ask(self, message: tuple, timeout_s: float):
        if self.proc is None:
            self._start()
        self.number += 1
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            _send(self.conn, (self.number, *message))
            data = _recv(self.conn, deadline)
        except TimeoutError:
            self.kill()
            raise Late from None
        except (EOFError, OSError):  # it died (os._exit, a crash, a kill from outside), or closed its end
            try:
                code = self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                code = None
            self.kill()
            raise Raised("WorkerDied", f"the process running it ended (exit status {code})") from None
        except BaseException:  # a stop signal (run/stop.py Interrupted) while it runs: the call is abandoned
            self.kill()
            raise
        try:
            reply = _loads(data)
        except Exception as e:  # noqa: BLE001 - bytes that do not unpickle: something else wrote to the socket
            self.kill()
            raise Raised("WorkerGarbled", f"its reply did not read back ({type(e).__name__}: {e})") from None
        if not (isinstance(reply, tuple) and reply and reply[0] == self.number):
            self.kill()
            raise Raised("WorkerGarbled", "its reply was not the call's (something else wrote to the socket, or a fork replied)")
        return reply[1:]

    def load(self, spec: str, key: str) -> tuple[Remote, dict]:
        """Import a user's `module:function` in the process: (a callable that calls it there, its record: spec,
        file, sha256). BadInput naming `key` when it cannot be imported or is not a function."""
        from common.outcome import BadInput

        handle = len(self.loaded)
        try:
            if self.proc is None:
                self._start()
            self.loaded.append(("", key, None))
            reply = self._ask(("load", handle, spec, key), LOAD_TIMEOUT_S)
        except (Late, Raised) as e:
            del self.loaded[handle:]
            raise BadInput(f"{key}: {spec} does not import ({'it took longer than ' + str(LOAD_TIMEOUT_S) + ' s' if isinstance(e, Late) else described(e)})") from None
        if reply[0] == "bad":
            raise BadInput(reply[1])  # nothing to import again: its entry stays empty
        self.loaded[handle] = (spec, key, reply[2])
        return Remote(self, handle, spec, self.run), {"spec": spec, "file": reply[1], "sha256": reply[2]}


class Remote:
    """A user's function in the worker: `call(args, kwargs, timeout_s, how)`; called plainly, unbounded."""

    def __init__(self, worker: Worker, handle: int, spec: str, run: int) -> None:
        self.worker, self.handle, self.spec, self.run = worker, handle, spec, run

    def call(self, args: tuple, kwargs: dict, timeout_s: float, how: str | int = "value"):
        """Its value (`how`="value"), or for a tool (`how`: the result's length cut) ("empty",) / ("json", text) /
        ("notjson", type name). Late at the timeout (the process killed); Raised when it raised."""
        if self.run != self.worker.run:
            raise RuntimeError(f"{self.spec} was loaded by a run that has ended (objectives/worker.py Worker.close)")
        reply = self.worker._ask(("call", self.handle, how, args, kwargs), timeout_s)
        if reply[0] == "raised":
            raise Raised(reply[1], reply[2])
        return reply[1]

    def __call__(self, *args, **kwargs):
        return self.call(args, kwargs, None)


def _worker_environment() -> dict[str, str]:
    """The trainer's environment without its secrets: user code never sees the checkpoint or server key."""
    return {k: v for k, v in os.environ.items() if k not in SECRETS}


SECRETS = ("MINIMIND_CHECKPOINT_KEY", "MINIMIND_SERVE_API_KEY")
"""Environment variables the worker is started without (docs/rl.md, "What user code may do")."""

WORKER = Worker()
"""This process's (rank's) worker."""


# ---------------------------------------------------------------- the socket: length-prefixed pickles
_CROSSING = {("numpy", "dtype"), ("numpy", "ndarray"), ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
             ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"), ("builtins", "complex")}
"""The globals a reply may name: numpy's scalars and arrays; anything else could run code in the trainer (docs/rl.md)."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _CROSSING:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a value naming {module}.{name} does not cross (plain values and numpy's only)")


def _loads(data: bytes):
    """A message's value, unpickled without running code: only plain values and numpy's scalars and arrays cross."""
    return _PlainUnpickler(io.BytesIO(data)).load()


def _send(conn: socket.socket, value) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(struct.pack("!Q", len(data)) + data)


def _recv(conn: socket.socket, deadline: float | None) -> bytes:
    """One message's bytes, read by `deadline` (time.monotonic; None: waits): TimeoutError past it, EOFError at the end."""
    size = struct.unpack("!Q", _read(conn, 8, deadline))[0]
    return _read(conn, size, deadline)


def _read(conn: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-6))
        try:
            chunk = conn.recv(min(n - got, 1 << 20))
        except socket.timeout:
            raise TimeoutError from None
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------- the worker's side
def _load(spec: str, key: str):
    """rewards.load's import of a user's module:function, here: the function, or ("bad", the message)."""
    module_name, _, name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                return ("bad", f"{key}: {module_name} does not exist")
            loader = importlib.util.spec_from_file_location(f"reward_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}", path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")
            module = importlib.import_module(module_name)
    except BaseException as e:  # noqa: BLE001 - a user's module: whatever it raises, it does not import
        return ("bad", f"{key}: {module_name} does not import ({type(e).__name__}: {e})")
    fn = getattr(module, name, None)
    if not callable(fn):
        return ("bad", f"{key}: {module_name} has no function {name!r}")
    source = getattr(module, "__file__", None)
    return fn, source, hashlib.sha256(Path(source).read_bytes()).hexdigest() if source else None


def _call(fn, how, args: tuple, kwargs: dict) -> tuple:
    try:
        value = fn(*args, **kwargs)
        if how == "value":
            _loads(pickle.dumps(value))  # what cannot cross (a global beyond plain values) is the function's failure, named here
            return ("value", value)
        if not value:
            return ("value", ("empty",))
        try:
            return ("value", ("json", json.dumps(value, ensure_ascii=False)[:how]))
        except (TypeError, ValueError):
            return ("value", ("notjson", type(value).__name__))
    except BaseException as e:  # noqa: BLE001 - the user's code: whatever it raises is its result (SystemExit too)
        return ("raised", type(e).__name__, str(e))


def serve(fd: int) -> None:
    """The worker's loop: load and call messages in, replies out, until the trainer's end of the socket closes."""
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)  # the trainer decides a stop, and kills this process
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the trainer gone, this goes too
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        return
    conn, me = socket.socket(fileno=fd), os.getpid()
    functions: dict[int, object] = {}
    while True:
        try:
            number, kind, *message = pickle.loads(_recv(conn, None))
        except (EOFError, OSError):
            return
        if kind == "path":
            sys.path[:] = message[0]
            continue
        if kind == "load":
            handle, spec, key = message
            if not spec:
                continue
            got = _load(spec, key)
            if got[0] != "bad":
                functions[handle], got = got[0], ("ok", got[1], got[2])
        else:
            handle, how, args, kwargs = message
            got = _call(functions[handle], how, args, kwargs)
        if os.getpid() != me:  # a child the user's code forked, back here: only the worker replies
            os._exit(0)
        try:
            _send(conn, (number, *got))
        except OSError:  # the user's code closed the socket, or the trainer is gone
            return


if __name__ == "__main__":
    serve(int(sys.argv[1]))
