"""Speed and memory switches that keep the arithmetic: torch.compile of each transformer block and
of the loss (`train.compile`), and activation checkpointing per block
(`train.activation_checkpointing`); docs/performance.md.

Compilation is per block, as torchtitan does it: each block's `forward` is compiled (its module
hooks, FSDP's among them, stay outside in eager code) with static shapes, and Inductor's
deterministic mode on (on CUDA only under runtime.deterministic). Every micro-batch has the same shape whatever the world size under
`dist.reduce=canonical`, so every rank runs the same kernels and the bits do not depend on the
world size; compiled kernels round differently from eager ones, so a compiled run is bit-identical
to compiled runs, not to eager ones. `CompileWatch` logs the compile's time once and warns when a
graph breaks or recompiles after the first step. Evaluation runs eagerly.

Activation checkpointing drops a block's activations after its forward and recomputes them in the
backward (torch.utils.checkpoint, non-reentrant, the RNG state preserved): the same arithmetic, so
the same bits, for less memory.
"""
from __future__ import annotations

import logging
import re
import time

import torch

log = logging.getLogger("minimind")
BACKEND = "inductor"
"""torch.compile's backend (a test swaps in Dynamo's "eager" to watch graphs without generating code)."""


def checkpointed_blocks(mode: str, n_layers: int) -> list[int]:
    """The blocks train.activation_checkpointing=`mode` recomputes: none, full (every block), or
    every_K (blocks 0, K, 2K, ...); ValueError naming the key when the mode is none of those."""
    if mode == "none":
        return []
    if mode == "full":
        return list(range(n_layers))
    if m := re.fullmatch(r"every_(\d+)", mode):
        k = int(m.group(1))
        if k >= 1:
            return list(range(0, n_layers, k))
    raise ValueError(f"train.activation_checkpointing: expected none, full or every_K (K >= 1), got {mode!r}")


def apply(model: torch.nn.Module, compile: bool, checkpointing: str, deterministic: bool = False,
          device: str = "cpu") -> "CompileWatch | None":
    """Switch on checkpointing for the blocks it names, then compile each block and the loss.
    Returns the watch of the compiled run (None when not compiled). `deterministic`: the run asked
    for torch's deterministic algorithms (runtime.deterministic); `device`: the device type."""
    for i in checkpointed_blocks(checkpointing, len(model.layers)):
        model.layers[i].checkpointed = True
    if not compile:
        return None
    deterministic_mode = deterministic or device == "cpu"
    if deterministic_mode:
        # torch.use_deterministic_algorithms also sets Inductor's deterministic mode (no benchmarking-based
        # choices: the same kernels in every process), and Dynamo restores the prior state after tracing
        # each frame: set through Inductor's config alone, the mode switches itself off after the first
        # compiled frame (seen on torch 2.13; CompileWatch checks it after every step). On the CPU it is
        # what a compiled run's exactness has always rested on (Inductor's scatter-adds and index_put
        # over several threads are otherwise unordered) and costs no tuning, so it is on whatever
        # runtime.deterministic says, warning only where that did not ask for errors; on CUDA it is on
        # only when runtime.deterministic asks: runtime.deterministic=false pays for none of it
        # (docs/performance.md).
        torch.use_deterministic_algorithms(True, warn_only=not deterministic)
    for block in model.layers:
        if hasattr(block.feed_forward, "_dispatch"):  # an MoE: the experts' token dispatch stays eager (data-dependent shapes)
            block.feed_forward._dispatch = torch.compiler.disable(block.feed_forward._dispatch)
        # Static shapes: a graph (and its kernels) for each shape, never one kernel for every shape.
        block.forward = torch.compile(block.forward, backend=BACKEND, dynamic=False)
    model.loss_fn = torch.compile(model.loss_fn, backend=BACKEND, dynamic=False)
    return CompileWatch(deterministic_mode)


class CompileWatch:
    """Dynamo's counters, read after every step (counted from the watch's creation): the first
    step's time is the compile's (logged once); a graph break is a warning, with its reasons, and so
    is a new graph after the first step (a recompile). The deterministic modes are checked too: a
    compiled frame that switched one off fails the run (its kernels would no longer be the ones
    every rank agrees on)."""

    def __init__(self, deterministic: bool = True) -> None:
        self.t0 = time.perf_counter()
        self.base, self.seen = self._counts(), None
        self.deterministic = deterministic
        """Whether the run promised the deterministic modes (checked after every step then)."""

    @staticmethod
    def _counts() -> tuple[dict[str, int], int]:
        from torch._dynamo.utils import counters

        return dict(counters["graph_break"]), int(counters["stats"].get("unique_graphs", 0))

    def _check_modes(self) -> None:
        import torch._inductor.config as inductor

        off = [name for name, on in (("torch._inductor.config.deterministic", inductor.deterministic),
                                     ("torch.use_deterministic_algorithms", torch.are_deterministic_algorithms_enabled())) if not on]
        if off:
            raise RuntimeError(f"train.compile: {' and '.join(off)} switched off after a compiled step: the kernels are no longer "
                               f"the deterministic ones this run promised")

    def after_step(self, step: int, rank_0: bool) -> None:
        if self.deterministic:
            self._check_modes()
        breaks, graphs = self._counts()
        new = {why.strip().splitlines()[0]: n - self.base[0].get(why, 0) for why, n in breaks.items() if n > self.base[0].get(why, 0)}
        chosen = {why: n for why, n in new.items() if "torch.compiler.disable" in why}  # the MoE's dispatch, eager by design
        if chosen and rank_0:
            log.info("train.compile: %d graph break(s) where the code asks for eager (an MoE's expert dispatch)", sum(chosen.values()))
        if others := {why: n for why, n in new.items() if why not in chosen}:
            log.warning("train.compile: %d graph break(s) by step %d (each splits a block's graph: slower, the same bits): %s",
                        sum(others.values()), step, "; ".join(f"{why} (x{n})" for why, n in others.items()))
        self.base = (breaks, self.base[1])
        if self.seen is None:
            self.seen = graphs
            if rank_0:
                log.info("train.compile: the first step took %.1f s (compiling %d graph(s), Inductor's deterministic mode %s)",
                         time.perf_counter() - self.t0, graphs - self.base[1], "on" if self.deterministic else "off")
            return
        if graphs != self.seen:
            log.warning("train.compile: %d new graph(s) after step %d (a recompile: another shape or mode?): it costs time, and "
                        "its kernels may round otherwise than the first ones", graphs - self.seen, step)
            self.seen = graphs
