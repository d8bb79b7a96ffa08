"""Distributed set-up (setup.py), the torch 2.13 restart-store workaround (elastic.py), logging
(logs.py), the two gradient reductions (reduce.py), FSDP2 sharding and its reductions (sharding.py)
and derived seeds (seeding.py)."""
from .elastic import agree_on_attempt, attempt_store
from .logs import setup_logging
from . import sharding
from .reduce import CanonicalReduce, DDPReduce
from .seeding import derive_seed, seed_all
from .setup import DTYPES, DistConfig, Runtime, RuntimeConfig, SetupError, autocast, default_threads, setup, teardown

__all__ = [
    "CanonicalReduce", "DDPReduce", "DistConfig", "Runtime", "RuntimeConfig", "SetupError", "agree_on_attempt",
    "attempt_store", "default_threads", "derive_seed", "seed_all", "setup", "setup_logging", "sharding", "teardown",
]
