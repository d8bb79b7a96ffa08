"""Seeds that are pure functions of their parts (docs/design.md I6): nothing to save for in-step draws."""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def generators_apart():
    """Draw inside without touching the caller's global generators: python's, numpy's and torch's
    (CPU and every CUDA device) are restored on the way out (torch.random.fork_rng keeps torch's alone)."""
    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)
