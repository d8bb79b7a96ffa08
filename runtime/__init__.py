"""How this process takes part in the run: distributed set-up and its collectives (setup.py), the
launch's board on the c10d store (board.py), torch 2.13's restart-store workaround (elastic.py),
logging (logs.py), the gradient reductions (reduce.py), FSDP2 sharding with its reductions
(sharding.py), and the speed switches that keep the arithmetic: compile and activation
checkpointing (speed.py); live recovery's replica groups on torchft's Lighthouse, with the canonical sum across
them (ft.py) and the Lighthouse itself (`python -m runtime.lighthouse`, lighthouse.py)."""
from . import sharding, speed
from .board import Board, Heartbeat, Stalled, wait_for
from .elastic import agree_on_attempt, attempt_store
from .logs import setup_logging
from .reduce import CanonicalReduce, DDPReduce, make_reducer
from .setup import DTYPES, DistConfig, Runtime, RuntimeConfig, SetupError, autocast, default_threads, setup, teardown

__all__ = [
    "Board", "CanonicalReduce", "DDPReduce", "DTYPES", "DistConfig", "Heartbeat", "Runtime", "RuntimeConfig", "SetupError",
    "Stalled", "agree_on_attempt", "attempt_store", "autocast", "default_threads", "make_reducer", "setup", "setup_logging",
    "sharding", "speed", "teardown", "wait_for",
]
