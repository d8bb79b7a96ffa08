"""Seeds that are pure functions of their parts (docs/design.md I6): nothing to save for in-step draws.

The formula is checkpoint.rng.derive_seed (the leaf both this package and the checkpoint manager
can import); it is re-exported here for the loop."""
from __future__ import annotations

import random

import numpy as np
import torch

from checkpoint.rng import derive_seed

__all__ = ["derive_seed", "seed_all"]


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from one integer."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
