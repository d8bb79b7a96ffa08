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
        self._names: dict | bool | None = None  # the module's own keys -> DCP's while they agree; False: DCP's every time

    def _trainable(self) -> set[str]:
        return {name for name, p in self.model.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self._names is False:
            state = get_model_state_dict(self.model)
        else:
            own = self.model.state_dict()
            state = _renamed(own, self._names)
            if state is None:  # DCP's names, and whether its dict is the module's own renamed: then reused while the keys stay
                state = get_model_state_dict(self.model)
                self._names = _names_if_same(own, state) or False
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
        self._names: tuple | bool | None = None  # (the groups' parameters by id, their names) while they agree; False: DCP's

    def state_dict(self) -> dict:
        # An Adam without state (a save before its first step: a stop inside the GRPO family's first
        # rollout publishes step 0) is saved as it stands, unstepped: its state made as Adam's first
        # step makes it before the update (step 0, both moments zero), which that step then takes
        # from where a fresh Adam would. DCP's own way, a step with zero gradients, counts a step:
        # the resumed run's first update would be Adam's second (its bias corrections), not its first.
        # Any other optimizer without state gets DCP's way. A load makes its target with load_target.
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not self.optimizer.state and isinstance(self.optimizer, torch.optim.Adam):
            _fresh_adam_state(self.optimizer, torch.zeros_like)
        ids = tuple(id(p) for g in self.optimizer.param_groups for p in g["params"])
        if self.optimizer.state and self._names and self._names[0] == ids:
            return _by_name(self.optimizer.state_dict(), self._names[1])
        state = get_optimizer_state_dict(self.model, self.optimizer)
        if self._names is not False:
            names = [name for g in state.get("param_groups", ()) for name in g["params"]]
            ok = len(names) == len(ids) and _same(_by_name(self.optimizer.state_dict(), names), state)
            self._names = (ids, names) if ok else False
        return state

    def load_target(self) -> dict:
        """The structure a load fills. A fresh Adam or AdamW gets its state made as its first step
        would make it (the same entries, shapes, dtypes and devices: `Adam._init_group`'s), left
        uninitialised: the load overwrites every byte of it (each tensor's chunks cover it exactly
        once, checked before the read; a load that fails leaves no run training on it). DCP's own
        way, a step with zero gradients, allocates and zeroes the gradients and both moments and
        computes a step: about a third of a 26M resume (docs/bench.md). Any other optimizer, or
        one with state, is DCP's way. `target_is_new`: the target is memory made for the load (the
        manager reads into it; `discard_target` drops it when the load fails its checks), not the
        optimizer's live state (which the manager never reads into)."""
        opt = self.optimizer
        self.target_is_new = not opt.state and isinstance(opt, torch.optim.Adam)  # AdamW is an Adam
        if self.target_is_new:
            _fresh_adam_state(opt, torch.empty_like)
        return self.state_dict()

    def discard_target(self) -> None:
        """A load that failed its checks leaves the optimizer as it was: the state load_target made goes."""
        if getattr(self, "target_is_new", False):
            self.optimizer.state.clear()
            self.target_is_new = False

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


def _fresh_adam_state(opt: torch.optim.Adam, like) -> None:
    """Every trained parameter's state made as `Adam._init_group` makes it before a first step (the same
    entries, shapes, dtypes, devices and a step of 0), its moments `like(p)`: zeros (Adam's own, a save
    of an unstepped optimizer) or left uninitialised (a load's target, which the load overwrites)."""
    from torch.optim.optimizer import _get_scalar_dtype

    for group in opt.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            on_device = group.get("capturable") or group.get("fused")
            step = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device) if on_device
                    else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
            state = {"step": step, "exp_avg": like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": like(p, memory_format=torch.preserve_format)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = like(p, memory_format=torch.preserve_format)
            opt.state[p] = state


# DCP's get_model_state_dict and get_optimizer_state_dict walk the modules and map every name at
# each call (about 7 ms each at the 26M shape, the larger part of an async save's stall besides the
# copy: docs/bench.md). Where their dict is the module's or optimizer's own with other names (DDP,
# one process, a compiled module: no DTensor), the names are taken once from DCP and reused while
# the keys (a module's) or the parameters (an optimizer's) stay the same; anything else is DCP's
# every time.

def _same(a, b) -> bool:
    """The same entries: keys in the same order, each tensor the same memory and view, each other value equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (type(a) is type(b) is torch.Tensor and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device)
    return type(a) is type(b) and a == b


def _names_if_same(own: dict, dcp: dict) -> dict | None:
    """The module's key -> DCP's key, when DCP's dict is the module's own renamed in order; else None."""
    if len(own) != len(dcp):
        return None
    names = dict(zip(own, dcp))
    return names if _same(_renamed(own, names), dcp) else None


def _renamed(own: dict, names: dict | None) -> dict | None:
    """`own` under DCP's names, or None when `names` is not for these keys (the module changed)."""
    if names is None or len(own) != len(names) or any(k not in names for k in own):
        return None
    return {names[k]: v for k, v in own.items()}


def _by_name(raw: dict, names: list[str]) -> dict:
    """torch's optimizer state dict (parameters by index) with each index replaced by its name."""
    return {"state": {names[i]: v for i, v in raw["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
                             for g in raw["param_groups"]]}


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
