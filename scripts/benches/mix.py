"""data.mix's loader against a single source, and its resume and memory at 10M samples a source."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from . import section
from .helpers import run_train


AIMS = {
    "mixed loader / single-source loader, step time": ("<=", 1.02),
    "mix resume at 90% / at 0%": ("<=", 1.1),
    "mix order memory, MiB": ("<=", 1.0),
}


def mix_rows(work: Path, steps: int, repeats: int) -> list[dict]:
    """data.mix (data/mix.py): a small model's step (tiny.yaml at dim 64, 2 layers, 64 tokens) with a two-source mix of the built-in corpus (the
    same file under two names, weights 1:1, so only the loader and the per-source figures differ)
    against the same run on the corpus alone, median step time after 5 warm-up steps, runs
    alternated; a 3-source mix's first global batch after a resume at 90% of each source's epoch
    against one at 0% (the counts read from the checkpoint's state, each source's order made,
    randperm and bijective); and what the mix's order holds at 10M samples a source (bijective)."""
    import tracemalloc

    from data.mix import MixOrder

    base = ["train.steps=" + str(steps), "checkpoint.interval=0", "train.global_batch=32", "train.micro_batch=8", "runtime.threads=1",
            "model.dim=64", "model.n_layers=2", "model.seq_len=64"]
    mixed = "data.mix=[{path: stdlib, weight: 1, name: a}, {path: stdlib, weight: 1, name: b}]"
    times: dict[str, list[float]] = {"mix": [], "single": []}
    for _ in range(repeats):
        for name, extra in (("single", []), ("mix", [mixed])):
            rows = run_train([*base, *extra, f"out_dir={work / ('mix-' + name)}"], work / "mix.log")
            times[name].append(statistics.median(r["step_s"] for r in rows[5:]))
    tm, ts = statistics.median(times["mix"]), statistics.median(times["single"])
    n, g = 10_000_000, 1024

    def first_batch(kind: str, at: float) -> tuple[float, int]:
        order = MixOrder(["a", "b", "c"], [n, n, n], [5.0, 3.0, 2.0], seed=1337, kind=kind, global_batch=g)
        step = int(at * n / g)  # a's share is half: at 90% of its epoch and beyond c's
        counts = [int(step * g * w / 10) for w in (5, 3, 2)]
        saved = {"step": step, "counts": dict(zip("abc", counts)), "base_step": 0, "base": dict.fromkeys("abc", 0),
                 "weights": {"a": 0.5, "b": 0.3, "c": 0.2}}
        tracemalloc.start()
        t0 = time.perf_counter()
        order.resume(saved, set(), {}, {})
        order.step_samples(step)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        held = sum(o.perm.nbytes for _, o in order._orders.values() if hasattr(o, "perm"))  # torch's memory is not traced
        return seconds, max(peak, held)

    got = {(kind, at): [first_batch(kind, at) for _ in range(repeats)] for kind in ("randperm", "bijective") for at in (0.0, 0.9)}
    t = {k: statistics.median(r[0] for r in v) for k, v in got.items()}
    m = {k: max(r[1] for r in v) for k, v in got.items()}
    return [
        {"row": "data.mix, 2 sources, tiny.yaml at dim 64, 2 layers, 64 tokens, 1 process", "what": "mixed loader / single-source loader, step time", "value": tm / ts,
         "aim": "mixed loader / single-source loader, step time",
         "detail": f"{tm * 1e3:.1f} ms / {ts * 1e3:.1f} ms a step (median after 5 warm-up steps of {steps}, median of {repeats} "
                   f"alternated runs each; the mix adds each row's loss for loss/<name>)"},
        *({"row": f"data.mix, 3 sources of 10M samples, {kind}", "what": f"mix resume at 90% / at 0%, {kind}",
           "value": t[(kind, 0.9)] / t[(kind, 0.0)], "aim": "mix resume at 90% / at 0%",
           "detail": f"{t[(kind, 0.9)] * 1e3:.1f} ms / {t[(kind, 0.0)] * 1e3:.1f} ms to the first global batch of {g} "
                     f"(counts from the state, no replay); median of {repeats}"} for kind in ("randperm", "bijective")),
        {"row": "data.mix, 3 sources of 10M samples, bijective", "what": "mix order memory, MiB", "value": m[("bijective", 0.9)] / 2**20,
         "aim": "mix order memory, MiB",
         "detail": f"{m[('bijective', 0.9)] / 1024:.1f} KiB at most while resuming at 90% and making a batch (tracemalloc) / randperm: "
                   f"{m[('randperm', 0.9)] / 2**20:.0f} MiB"},
    ]


@section("mix", order=170, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return mix_rows(work, 20 if q else 40, 3 if q else 5)
