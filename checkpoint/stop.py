"""The preemption stop protocol: a signal sets a flag; the ranks agree at a step boundary.

SIGTERM (spot reclaim, torchrun's shutdown), SIGUSR1 (SLURM's pre-timeout warning) and SIGINT
only set a flag here. The loop sums every rank's flag at each optimizer-step boundary
(`Runtime.sum`), so that when any rank was signalled all of them save at the same step and leave
together; nobody waits on a collective that another rank already left (DESIGN.md I9).
"""
from __future__ import annotations

import logging
import signal
import time

log = logging.getLogger("minimind")

EXIT_STOPPED = 75
"""Exit code of a run that stopped early on a signal after saving: "resume me" (EX_TEMPFAIL)."""


class StopFlag:
    """Installs the handlers; `requested` turns True at the first signal and stays True."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: str | None = None
        self.received_at: float | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        # A second signal while the stop is under way changes nothing: the save in progress goes on.
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            self.received_at = time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
