"""Logging: human lines on rank 0, warnings only (with the rank in front) elsewhere, through tqdm."""
from __future__ import annotations

import logging

from .setup import Runtime


class _TqdmAwareHandler(logging.StreamHandler):
    """Writes through tqdm, so a log line never lands in the middle of the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def setup_logging(rt: Runtime) -> None:
    """Human lines on rank 0; other ranks only warn, with their rank in front."""
    fmt = "%(asctime)s %(message)s" if rt.is_main else f"%(asctime)s [rank {rt.rank}] %(message)s"
    handler = _TqdmAwareHandler()
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    logging.basicConfig(handlers=[handler], level=logging.INFO if rt.is_main else logging.WARNING, force=True)


