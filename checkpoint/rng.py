"""Per-process RNG state as tensors and ints, so that `torch.load(weights_only=True)` reads it back.

In-step randomness is derived from (seed, epoch, step, micro-batch) and needs no saving
(docs/design.md I6); the global generators are saved and restored anyway, per rank, so that code a user
adds to the loop that draws from them also resumes exactly.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def capture(device: torch.device) -> dict:
    """This process's python, numpy, torch CPU (and CUDA device) generator states."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }
    return state


def restore(state: dict, device: torch.device) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["gauss"]))
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of `parts`, e.g. (seed, epoch, step, micro_batch): the
    project's one seed formula (docs/design.md I6; runtime.seeding re-exports it for the loop)."""
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_fresh(*parts: int) -> None:
    """Seed this process's generators from `derive_seed(*parts)`: for a rank that a checkpoint has
    no state for (the world grew)."""
    seed = derive_seed(*parts)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
