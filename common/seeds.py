"""Seeds that are pure functions of their parts (docs/design.md I6): nothing to save for in-step draws."""
from __future__ import annotations

import hashlib
import random


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of `parts`, e.g. (seed, epoch, step, micro_batch): the
    project's one seed formula (docs/design.md I6)."""
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from one integer."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
