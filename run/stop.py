"""The preemption stop protocol: a signal sets a flag; the ranks agree at a step boundary.

SIGTERM (spot reclaim, torchrun's shutdown), SIGUSR1 (SLURM's pre-timeout warning) and SIGINT
only set a flag once the run is under way. The loop sums every rank's flag at each optimizer-step
boundary (run/protocol.py: `Protocol.boundary`), so that when any rank was signalled all of them save at
the same step and leave together; nobody waits on a collective that another rank already left
(docs/design.md I9).

Before that (set-up: the rendezvous, the lock wait, packing the corpus, loading a checkpoint) there
is nothing to save, and waiting for the first step could take minutes: the first signal raises
StopDuringSetup where the process is, the set-up unwinds (a half-packed cache is removed by the
packer's own cleanup), and the run ends with 75, the previous checkpoint standing.

Inside the run, a stretch that may wait long and has nothing to lose (GRPO's rollout: generation
and the user's reward, which may never return) is `interruptible()`: there too the first signal
raises (Interrupted), the stretch is abandoned, and the ranks agree to save the step before it.
"""
from __future__ import annotations

import os
import signal
import time

from contextlib import contextmanager

from common.outcome import Stopped


class StopDuringSetup(Stopped):
    """A stop signal before the run was under way (a BaseException, as KeyboardInterrupt is, so that
    no `except Exception` on the way swallows it)."""


class Interrupted(Stopped):
    """A stop signal inside an interruptible stretch (StopFlag.interruptible), raised where the main thread was."""


class StopFlag:
    """Installs the handlers; `poll()` turns True at the first signal and stays True. Until
    `under_way()` is called, the first signal raises StopDuringSetup instead.

    Under torchrun it also watches the launcher: a worker whose agent died (SIGKILLed, OOM-killed)
    would train on unsupervised and race the next launch for the checkpoint folder, so it stops
    as if signalled.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: str | None = None
        self.received_at: float | None = None
        self.setup = True  # until under_way(): a signal raises
        self.interrupt = False  # inside interruptible(): a signal raises
        self._parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        # A second signal while the stop is under way changes nothing: the save (or the unwinding
        # of the set-up) in progress goes on.
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            self.received_at = time.monotonic()
            if self.setup:
                raise StopDuringSetup(self.signal)
            if self.interrupt:
                raise Interrupted(self.signal)

    def under_way(self) -> None:
        """The run is at its first step: from here on a signal sets the flag the ranks vote on.
        A signal that came during set-up and was swallowed on the way raises now."""
        self.setup = False
        if self.signal is not None:
            raise StopDuringSetup(self.signal)

    @contextmanager
    def interruptible(self):
        """A stretch the first stop signal interrupts (Interrupted, raised where the main thread is,
        also inside a call that waits), instead of only setting the flag; one already received raises
        at once."""
        if self.poll():
            raise Interrupted(self.signal)
        self.interrupt = True
        try:
            yield
        finally:
            self.interrupt = False

    def poll(self) -> bool:
        """Has a stop been asked for? Also checks, under torchrun, whether the agent is still there."""
        if self.signal is None and self._parent is not None and os.getppid() != self._parent:
            self.signal, self.received_at = "the exit of the torchrun agent", time.monotonic()
        return self.signal is not None

    def settled(self) -> None:
        """The run's outcome is decided (its error or stop being concluded, the folder being closed):
        from here a signal only sets the flag. torchrun SIGTERMs the other ranks as soon as one rank
        exits, which may be while these ones write their last status line; raising there would
        print a traceback and change nothing."""
        self.setup = self.interrupt = False

    def restore(self) -> None:
        """Put back the handlers that were there before (for callers of train.main in-process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def ignore_stop_signals(*_: object) -> None:
    """Ignore SIGTERM/SIGUSR1/SIGINT from here on: in a DataLoader worker (the trainer stops it),
    and at the very end of a run, where Python's shutdown would otherwise restore the default
    action and a late SIGTERM from torchrun's agent (sent when another rank left first) would turn
    a clean exit code into a death by signal. SIG_IGN survives interpreter finalization."""
    for sig in StopFlag.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def exit_now(code: int) -> None:
    """Exit with `code` once everything is written and closed, skipping the interpreter's teardown,
    where the finalization of torch's C++ objects can abort a gloo worker after a clean finish
    (docs/preemption.md, "torch 2.13's pitfalls"). Stop signals are ignored from here on (see
    ignore_stop_signals): a late SIGTERM from torchrun must not turn `code` into a death by signal."""
    import logging
    import sys

    ignore_stop_signals()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
