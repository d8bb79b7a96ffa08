"""train.py for live recovery's tests (tests/test_ft.py), with the faults a test injects into one group
at a chosen step. The trainer has no such switch.

    FT_STEP_S=0.2         every step takes at least this long (a relaunched group's start-up is then a few steps)
    FT_KILL=WHERE:STEP    SIGKILL this process at step STEP (or the first after it): WHERE is quorum (before asking for the step's quorum),
                          gather (after computing its share, before the gather), send (a peer asked it for a heal:
                          it dies while sending) or recv (it dies while receiving a heal)
    FT_HANG=STEP          SIGSTOP this process before the gather of step STEP (a hung group; the test kills it)
    FT_CORRUPT_HEAL=1     a healed group's received weights get one value changed before they are loaded
    FT_GATE=STEP:PATH,..  wait before the quorum of step STEP until PATH exists (a test lets a new group start up first)
    FT_ONCE=PATH          FT_KILL fires only in the first process that creates PATH (of several armed alike)

Each group says `ft_train: in the run` once its Manager is up (from then on the quorum waits for it).
"""
import os
import runpy
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import run.live  # noqa: E402
import runtime.ft  # noqa: E402

KILL = os.environ.get("FT_KILL", "")
WHERE, AT = (KILL.split(":")[0], int(KILL.split(":")[1])) if KILL else ("", -1)
HANG = int(os.environ.get("FT_HANG", "-1"))
STEP_S = float(os.environ.get("FT_STEP_S", "0"))
GATES = [(int(g.split(":", 1)[0]), Path(g.split(":", 1)[1])) for g in os.environ.get("FT_GATE", "").split(",") if g]
ONCE = os.environ.get("FT_ONCE")


def die(why: str) -> None:
    if ONCE:
        try:
            os.close(os.open(ONCE, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    print(f"ft_train: SIGKILL {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


_quorum = runtime.ft.Membership.quorum


def quorum(self, step):
    if WHERE == "quorum" and step >= AT:
        die(f"before the quorum of step {step}")
    if STEP_S:
        time.sleep(STEP_S)
    while any(step >= at and not gate.exists() for at, gate in GATES):
        time.sleep(0.05)
    return _quorum(self, step)


runtime.ft.Membership.quorum = quorum
_init = runtime.ft.Membership.__init__


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    print("ft_train: in the run", flush=True)


runtime.ft.Membership.__init__ = init
_gather = runtime.ft.Membership.gather


def gather(self, rows):
    step = self.manager.current_step()
    if WHERE == "gather" and step >= AT:
        die(f"before the gather of step {step}")
    if step == HANG:
        print(f"ft_train: SIGSTOP before the gather of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return _gather(self, rows)


runtime.ft.Membership.gather = gather
_state_dict = run.live.Live.state_dict


def state_dict(self):
    if WHERE == "send" and self.run.train_state.step >= AT:
        die(f"while sending a heal at step {self.run.train_state.step}")
    return _state_dict(self)


run.live.Live.state_dict = state_dict
_make = runtime.ft._safe_transport


def safe_transport(timeout):
    transport = _make(timeout)
    load = type(transport)._load_from_address

    def partial_load(address, timeout):
        if WHERE == "recv":
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                f.read(1024)  # the transfer under way
                die("while receiving a heal")
        return load(address, timeout)

    transport._load_from_address = partial_load
    return transport


runtime.ft._safe_transport = safe_transport
if os.environ.get("FT_CORRUPT_HEAL"):
    _load = run.live.Live.load_state_dict

    def corrupted(self, payload):
        name, tensor = next(iter(payload["states"]["model"].items()))
        tensor.view(-1)[0] += 1e-3  # one value changed in transit
        print(f"ft_train: changed one value of {name} in the heal", flush=True)
        return _load(self, payload)

    run.live.Live.load_state_dict = corrupted

sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
