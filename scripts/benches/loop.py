"""Our loop against a minimal PyTorch loop on the same model and batches, and canonical against ddp reductions on 2 processes."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import train
from configs import load_config
from data import BatchPlan, BlockDistributedSampler, PackedDataset, SkipBatchSampler, pack, resolve_source
from model import MiniMindLM
from objectives import make_optimizer

from . import section
from .helpers import ROOT, launch, run_train, step_median


AIMS = {
    "our loop / minimal loop (speed)": (">=", 0.95),
    "canonical / ddp step time, 2 processes": ("<=", 1.3),
}


def minimal_loop(cfg, steps: int, parts: set[str]) -> list[float]:
    """A plain PyTorch loop on the same model, batches and threads as train.py's: each step's
    seconds. `parts` adds the loop's own pieces one by one (the profile of the difference): "seed"
    (the per-micro-batch fork_rng + derive_seed draw), "loader" (our sampler and SkipBatchSampler
    instead of a shuffled DataLoader), "item" (the step's loss as a float)."""
    from common.seeds import derive_seed

    cache = Path(cfg.data.cache_dir)
    bin_path, _ = pack(resolve_source(cfg.data.path, cache), cfg.model.seq_len, cache)
    ds = PackedDataset(bin_path, cfg.model.seq_len)
    torch.manual_seed(cfg.seed)
    model = MiniMindLM(cfg.model)
    opt = make_optimizer(model, cfg.train)
    plan = BatchPlan(cfg.train.global_batch, cfg.train.micro_batch, 1)
    if "loader" in parts:
        sampler = BlockDistributedSampler(len(ds), plan, 0, cfg.seed)
        loader = iter(DataLoader(ds, batch_sampler=SkipBatchSampler(sampler, 0), generator=torch.Generator().manual_seed(cfg.seed)))
    else:
        loader = iter(DataLoader(ds, batch_size=cfg.train.micro_batch, shuffle=True, drop_last=True))
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        total = 0.0
        for j in range(plan.accum):
            x, y = next(loader)
            if "seed" in parts:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(derive_seed(cfg.seed, 0, s, j))
                    loss = model(x, y)[1] / plan.accum
            else:
                loss = model(x, y)[1] / plan.accum
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if "item" in parts:
            float(total)
        times.append(time.perf_counter() - t0)
    return times


def loop_rows(steps: int, rounds: int, work: Path) -> list[dict]:
    """Our loop (train.py, 1 process: the whole step, from one step's start to the next one's:
    metrics line, stop check, boundary and all) against a minimal loop of the same model, batches
    and threads, interleaved round by round; and the minimal loop with our pieces added one at a
    time, to say where the difference goes."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    torch.set_num_threads(train.runtime.default_threads(cfg.runtime, "ddp", 1))
    ours, minimal, pieces = [], [], {"seed": [], "loader": [], "item": []}
    for r in range(rounds):
        rows = run_train([f"train.steps={steps}", "checkpoint.interval=0", f"out_dir={work / 'loop-ours'}"], work / "train.log")
        ours.append((rows[-1]["elapsed_s"] - rows[2]["elapsed_s"]) / (len(rows) - 3))
        minimal.append(statistics.median(minimal_loop(cfg, steps, set())[3:]))
        for part in pieces:
            pieces[part].append(statistics.median(minimal_loop(cfg, steps, {part})[3:]))
    med = statistics.median
    ratios = [m / o for m, o in zip(minimal, ours)]
    detail = (f"{med(ours) * 1e3:.1f} ms ours (elapsed per step, everything), {med(minimal) * 1e3:.1f} ms minimal; each of our "
              f"pieces added to the minimal loop alone: " + ", ".join(f"{k} +{(med(v) - med(minimal)) * 1e3:.1f} ms" for k, v in pieces.items())
              + f"; the rest (metrics line, stop check, boundary, objective) {(med(ours) - med(minimal) - sum(med(v) - med(minimal) for v in pieces.values())) * 1e3:.1f} ms; "
              f"median of {rounds} interleaved rounds ({', '.join(f'{x:.3f}' for x in ratios)})")
    return [{"row": "step time, tiny, 1 process", "what": "our loop / minimal loop (speed)", "value": med(ratios), "detail": detail,
             "aim": "our loop / minimal loop (speed)"}]


def reduce_rows(steps: int, work: Path) -> list[dict]:
    """canonical vs ddp on 2 processes under torchrun: median step time from metrics."""
    med = {}
    for mode in ("ddp", "canonical"):
        out = work / f"reduce-{mode}"
        launch(["--config", "configs/tiny.yaml", f"train.steps={steps}", f"dist.reduce={mode}", "checkpoint.interval=0",
                "log.progress=false", f"out_dir={out}"], work / "torchrun.log", nproc=2)
        med[mode] = step_median(out, 3)
    return [{"row": "step time, tiny, 2 processes", "what": "canonical / ddp", "value": med["canonical"] / med["ddp"],
             "detail": f"{med['canonical'] * 1e3:.0f} ms / {med['ddp'] * 1e3:.0f} ms", "aim": "canonical / ddp step time, 2 processes"}]


@section("loop", order=30, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return [*loop_rows(15 if q else 30, 2 if q else 4, work), *reduce_rows(15 if q else 30, work)]
