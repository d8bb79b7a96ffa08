"""Training throughput with a save every 10 steps (sync, async) against no save."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from configs import load_config

from . import section
from .helpers import ROOT, run_train


AIMS = {
    "throughput, async save every 10 / none": (">=", 0.97),
}


def throughput(rows: list[dict], skip: int, tokens_per_step: int) -> float:
    """Tokens per second over wall-clock, saves included, after `skip` warm-up steps."""
    a, b = rows[skip - 1], rows[-1]
    return (b["step"] - a["step"]) * tokens_per_step / (b["elapsed_s"] - a["elapsed_s"])


def throughput_rows(steps: int, rounds: int, work: Path) -> list[dict]:
    """Tokens/s with a save every 10 steps (sync, async) against no save. The three runs of a round
    go one after another, in an order that rotates from round to round; each ratio is taken within a
    round, and the row gives the median over rounds with the spread."""
    base = [f"train.steps={steps}", "checkpoint.keep=2"]
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    per_step = cfg.train.global_batch * cfg.model.seq_len
    modes = [("none", ["checkpoint.interval=0"]), ("sync", ["checkpoint.interval=10"]),
             ("async", ["checkpoint.interval=10", "checkpoint.async=true"])]
    ratios: dict[str, list[float]] = {"sync": [], "async": []}
    tps: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    for r in range(rounds):
        tp = {}
        for name, extra in modes[r % 3:] + modes[: r % 3]:
            rows = run_train([*base, *extra, f"out_dir={work / ('tp-' + name)}"], work / "train.log")
            tp[name] = throughput(rows, 5, per_step)
            tps[name].append(tp[name])
        for name in ratios:
            ratios[name].append(tp[name] / tp["none"])

    def spread(name: str) -> str:
        return (f"median of {rounds} rounds, each round's ratio {', '.join(f'{x:.3f}' for x in ratios[name])}; "
                f"{statistics.median(tps[name]):,.0f} / {statistics.median(tps['none']):,.0f} tok/s")

    return [
        {"row": "training throughput, tiny, save every 10 steps", "what": "async / none", "value": statistics.median(ratios["async"]),
         "detail": spread("async"), "aim": "throughput, async save every 10 / none"},
        {"row": "training throughput, tiny, save every 10 steps", "what": "sync / none", "value": statistics.median(ratios["sync"]),
         "detail": spread("sync")},
    ]


@section("throughput", order=20, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return throughput_rows(20 if q else 40, 2 if q else 4, work)
