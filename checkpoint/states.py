"""The states a checkpoint holds besides the run's own small ones: a module's weights and its
optimizer, named by parameter (so that any strategy and world size reads them), and each rank's
generator states as tensors and ints (so that `torch.load(weights_only=True)` reads them back).

In-step randomness is derived from (seed, epoch, step, micro-batch) and needs no saving
(docs/design.md I6); the global generators are saved and restored anyway, per rank, so that code a
user adds to the loop that draws from them also resumes exactly.
"""
from __future__ import annotations

import io
import random

import numpy as np
import torch

from common.seeds import derive_seed


class ModelState:
    """A module's weights as a state dict of plain tensors (DDP, one process) or DTensors (FSDP),
    under the module's own parameter names: the same keys whatever the strategy (docs/sharding.md).
    `trainable_only`: the parameters that train and nothing else (a LoRA run's adapters: its frozen
    base is referenced by its hash, never written; docs/lora.md)."""

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False) -> None:
        self.model, self.trainable_only = model, trainable_only

    def _trainable(self) -> set[str]:
        return {name for name, p in self.model.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model)
        if self.trainable_only:
            keep = self._trainable()
            state = {k: v for k, v in state.items() if k in keep}
        return state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.trainable_only and set(state) != self._trainable():
            raise KeyError(f"the checkpoint's trained parameters are not this model's: missing {sorted(self._trainable() - set(state))}, "
                           f"unexpected {sorted(set(state) - self._trainable())}")
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not self.trainable_only))


class OptimizerState:
    """An optimizer's state keyed by parameter name (not by position), for any strategy and world size."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        # A fresh optimizer (a resume's) gets its state made by one step with zero gradients and a
        # zero learning rate, which leaves every weight as it was; the load then replaces it.
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


def capture(device: torch.device) -> dict:
    """This process's python, numpy, torch CPU (and CUDA device) generator states."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore(state: dict, device: torch.device) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["gauss"]))
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def rng_blob(device: torch.device) -> bytes:
    """`capture`, serialized: one rank's states as one item of the checkpoint (rank 0 writes every rank's)."""
    buf = io.BytesIO()
    torch.save(capture(device), buf)
    return buf.getvalue()


def restore_blob(blob: bytes, device: torch.device) -> None:
    restore(torch.load(io.BytesIO(blob), weights_only=True), device)


def seed_fresh(*parts: int) -> None:
    """Seed this process's generators from `derive_seed(*parts)`: for a rank that a checkpoint has
    no state for (the world grew)."""
    seed = derive_seed(*parts)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
