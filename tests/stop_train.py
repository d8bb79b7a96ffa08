"""train.py stopped by a SIGTERM to itself at one named point of a rollout's life (tests/test_stops.py):
STOP_AT names the point, STOP_STEP the logged step (1-based) whose rollout or update it is in, STOP_RANK
the rank that is signalled (default 0). Run as a script (`python tests/stop_train.py ...` or behind
torchrun) it is train.py with the stop armed; `armed(point, step)` arms it around an in-process
`train.main`. The trainer has no such switch: the points are its own functions, wrapped.

    tool     inside a tool call of that step's rollout (an agent): the signal comes from another thread
             0.1 s into the call, while the trainer waits for the tool (the tests' tools take longer)
    turn     between two turns of an episode: its tool results are in, its next turn not generated
    reward   inside the rollout's rewards, as a reward is called
    rollout  the step's rollout complete and agreed, before its first update's forward
    update   after the step's optimizer step, before its boundary's vote (between two updates of a rollout)

The first three are inside the rollout (abandoned: the checkpoint is the step before it); the last two
set the flag the ranks vote on at the step's boundary (the checkpoint is that step). `FIRED` (and, for a
script, the file STOP_FIRED names) records where the signal was sent and, for `tool`, whether a tool
call was still running when it arrived.
"""
from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POINTS = ("tool", "turn", "reward", "rollout", "update")
FIRED: list[str] = []


def _fire(where: str) -> None:
    FIRED.append(where)
    if os.environ.get("STOP_FIRED"):
        Path(os.environ["STOP_FIRED"]).write_text(where)
    os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def armed(point: str, step: int, rank: int = 0):
    """The stop armed at `point` of step `step` (1-based) on rank `rank`, for the `with` block."""
    if point not in POINTS:
        raise ValueError(f"STOP_AT: one of {', '.join(POINTS)}, got {point!r}")
    sys.path.insert(0, str(ROOT))
    from objectives import grpo, rewards, tools
    from objectives.agent import Agent

    here = int(os.environ.get("RANK", "0")) == rank
    now, done, inside = [0], [False], [False]

    def due() -> bool:
        if here and not done[0] and now[0] == step:
            done[0] = True
            return True
        return False

    patches: list[tuple[object, str, object]] = []

    def wrap(owner, name: str, make) -> None:
        original = getattr(owner, name)
        patches.append((owner, name, original))
        setattr(owner, name, make(original))

    def begin_step(original):
        def f(self, indices, s=0):
            now[0] = s + 1
            return original(self, indices, s)
        return f

    wrap(grpo.GRPO, "begin_step", begin_step)
    if point == "tool":
        def run(original):
            def f(self, call):
                if not due():
                    return original(self, call)
                inside[0] = True
                threading.Timer(0.1, lambda: _fire("tool" if inside[0] else "tool (the call had returned)")).start()
                try:
                    return original(self, call)
                finally:
                    inside[0] = False
            return f
        wrap(tools.Toolbox, "run", run)
    elif point == "turn":
        def observation(original):
            def f(self, *args, **kwargs):
                if due():
                    _fire("turn")
                return original(self, *args, **kwargs)
            return f
        wrap(Agent, "observation", observation)
    elif point == "reward":
        def score(original):
            def f(*args, **kwargs):
                if due():
                    _fire("reward")
                return original(*args, **kwargs)
            return f
        wrap(rewards, "score", score)
    elif point == "rollout":
        def prepare(original):
            def f(self, *args, **kwargs):
                out = original(self, *args, **kwargs)
                if out is None and self.rollout_at == self.step and due():
                    _fire("rollout")
                return out
            return f
        for cls in (grpo.GRPO, *_subclasses(grpo.GRPO)):
            if "prepare" in vars(cls):
                wrap(cls, "prepare", prepare)
    else:
        def step_metrics(original):
            def f(self, rt):
                if due():
                    _fire("update")
                return original(self, rt)
            return f
        for cls in (grpo.GRPO, *_subclasses(grpo.GRPO)):
            if "step_metrics" in vars(cls):
                wrap(cls, "step_metrics", step_metrics)
    try:
        yield
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def _subclasses(cls) -> list:
    import objectives.ppo  # noqa: F401 - PPO's prepare and step_metrics wrap GRPO's

    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.argv[0] = str(ROOT / "train.py")
    with armed(os.environ["STOP_AT"], int(os.environ["STOP_STEP"]), int(os.environ.get("STOP_RANK", "0"))):
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
