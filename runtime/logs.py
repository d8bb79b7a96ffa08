"""Logging: human lines on rank 0, warnings only (with the rank in front) elsewhere, through tqdm."""
from __future__ import annotations

import logging

from .setup import Runtime


class _TqdmAwareHandler(logging.StreamHandler):
    """Writes through tqdm, so a log line never lands in the middle of the progress bar; the line and
    its newline in one write (see say)."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record) + "\n", file=self.stream, end="")
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def setup_logging(rt: Runtime) -> None:
    """Human lines on rank 0; other ranks only warn, with their rank in front."""
    fmt = "%(asctime)s %(message)s" if rt.is_main else f"%(asctime)s [rank {rt.rank}] %(message)s"
    handler = _TqdmAwareHandler()
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    logging.basicConfig(handlers=[handler], level=logging.INFO if rt.is_main else logging.WARNING, force=True)




PEER_GRACE_S = 5.0
"""How long a rank other than 0 waits before it says a refusal that every rank may have reached alike."""


def say_refusal(message: str) -> None:
    """One line for a refusal each rank reaches on its own before the ranks talk (a config error),
    said once: by global rank 0 at once; by another rank (its rank in front) only after
    PEER_GRACE_S, by when torchrun, seeing rank 0 leave, has stopped it if rank 0 refused the same.
    A refusal of that rank alone (a file missing on its node) is still said."""
    import os
    import sys
    import time

    rank = int(os.environ.get("RANK", "0") or 0)
    if rank:
        time.sleep(PEER_GRACE_S)
    say(f"[rank {rank}] {message}" if rank else message)


def say(line: str) -> None:
    """One line to stderr in one write: the ranks of a torchrun share its stderr, and Python's is
    unbuffered when it is a pipe, so print's text and newline (two writes) of two ranks interleave
    into one line and another rank's line loses its own (a CI run of the GRPO timeout test)."""
    import sys

    sys.stderr.write(line + "\n")
    sys.stderr.flush()
