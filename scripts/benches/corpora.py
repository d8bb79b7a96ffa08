"""The epoch order's memory and first batch at 90%, and a launch on a large packed corpus against a tiny one."""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from data import BatchPlan, BlockDistributedSampler, SkipBatchSampler, resolve_source

from . import section
from .helpers import ROOT


AIMS = {
    "launch on a packed 2 GB corpus / on a tiny one": ("<=", 1.5),
    "bytes read at launch / corpus size": ("<=", 0.01),
    "bijective order memory, MiB": ("<=", 1.0),
    "bijective first batch at 90%, ms": ("<=", 10.0),
}


def order_rows() -> list[dict]:
    """The epoch order's memory and the time to the first batch at 90% of an epoch (sampler built,
    order made, first micro-batch's indices out): bijective at 10M and 1B samples, randperm at 10M."""
    import tracemalloc

    plan = BatchPlan(1024, 64, 2)

    def first_batch(kind: str, n: int) -> tuple[float, int]:
        tracemalloc.start()
        t0 = time.perf_counter()
        sampler = BlockDistributedSampler(n, plan, rank=1, seed=1337, order=kind)
        sampler.set_epoch(3)
        skip = int(plan.steps_per_epoch(n) * 0.9) * plan.accum
        next(iter(SkipBatchSampler(sampler, skip)))
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        held = sampler.order().perm.nbytes if kind == "randperm" else peak  # torch's tensor memory is not traced
        return seconds, max(held, peak)

    got = {}
    for kind, n in (("randperm", 10_000_000), ("bijective", 10_000_000), ("bijective", 1_000_000_000)):
        runs = [first_batch(kind, n) for _ in range(5)]
        got[(kind, n)] = (statistics.median(r[0] for r in runs), max(r[1] for r in runs))
    rp_t, rp_m = got[("randperm", 10_000_000)]
    rows = []
    for n in (10_000_000, 1_000_000_000):
        t, m = got[("bijective", n)]
        rows += [
            {"row": f"epoch order, bijective, {n / 1e6:.0f}M samples", "what": "bijective order memory, MiB", "value": m / 2**20,
             "aim": "bijective order memory, MiB",
             "detail": f"{m / 1024:.1f} KiB at most while making the order and the first batch (tracemalloc) / randperm at 10M: "
                       f"{rp_m / 2**20:.0f} MiB (ratio {m / rp_m:.1e})"},
            {"row": f"epoch order, bijective, {n / 1e6:.0f}M samples", "what": "bijective first batch at 90%, ms", "value": t * 1e3,
             "aim": "bijective first batch at 90%, ms",
             "detail": f"{t * 1e3:.2f} ms / randperm at 10M: {rp_t * 1e3:.0f} ms (ratio {t / rp_t:.1e}); median of 5"},
        ]
    return rows


def _launch(args: list[str], log: Path) -> tuple[float, int]:
    """A one-step `python train.py` (1 process) in a child: (seconds from start to exit, bytes it read
    from storage: ru_inblock, which counts read() calls and memmap page faults that miss the page cache)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    t0 = time.perf_counter()
    with open(log, "a") as f:
        code = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml", "log.progress=false", "train.steps=1",
                               "checkpoint.interval=0", *args], cwd=ROOT, stdout=f, stderr=f).returncode
    seconds = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"bench: a launch failed, see {log}")
    return seconds, (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - before) * 512


def launch_rows(work: Path, gigabytes: float, rounds: int) -> list[dict]:
    """A launch on an already packed corpus of `gigabytes` GB (the packed file; the byte tokenizer
    doubles the JSONL's size) against one on a tiny corpus: seconds from start to exit of a
    one-step run, and the bytes the launch read from storage with the corpus evicted from the page
    cache first (posix_fadvise; torch's own files stay cached, as on any second launch)."""
    big, tiny = work / "launch-big.jsonl", work / "launch-tiny.jsonl"
    pool = list(open(resolve_source("stdlib", ROOT / "data" / "cache").files[0], "rb"))
    chunk = b"".join(pool)
    with open(big, "wb") as f:
        while f.tell() < gigabytes * 1e9 / 2:
            f.write(chunk)
    tiny.write_bytes(b"".join(pool[:4000]))
    cache, log = work / "launch-cache", work / "launch.log"
    for src in (big, tiny):  # packed once, ahead (python -m data.prepare)
        subprocess.run([sys.executable, "-m", "data.prepare", str(src), "--seq-len", "128", "--cache-dir", str(cache)],
                       cwd=ROOT, check=True, capture_output=True)
    packed = next(cache.glob("launch-big-*.bin"))
    packed_bytes = packed.stat().st_size
    corpus_bytes = packed_bytes + big.stat().st_size
    times: dict[str, list[float]] = {"big": [], "tiny": []}
    reads: dict[str, list[int]] = {"big": [], "tiny": []}
    for r in range(rounds):
        for name, src in (("tiny", tiny), ("big", big)):
            drop_files = [p for p in cache.glob(f"launch-{name}-*")] + [src]
            for path in drop_files:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            seconds, nbytes = _launch([f"data.path={src}", f"data.cache_dir={cache}", f"out_dir={work / ('launch-' + name)}",
                                       "checkpoint.resume=never"], log)
            shutil.rmtree(work / f"launch-{name}", ignore_errors=True)
            times[name].append(seconds)
            reads[name].append(nbytes)
    tb, tt = statistics.median(times["big"]), statistics.median(times["tiny"])
    rb = statistics.median(reads["big"])
    for path in (big, tiny):
        path.unlink()
    shutil.rmtree(cache, ignore_errors=True)
    return [
        {"row": f"launch on an already packed {packed_bytes / 1e9:.1f} GB corpus, 1 process, one step",
         "what": "seconds to exit, big / tiny corpus", "value": tb / tt, "aim": "launch on a packed 2 GB corpus / on a tiny one",
         "detail": f"{tb:.2f} s / {tt:.2f} s (median of {rounds}; start to exit: imports, stat of the source, model, one step, a save)"},
        {"row": f"launch on an already packed {packed_bytes / 1e9:.1f} GB corpus, 1 process, one step",
         "what": "bytes read at launch / corpus size", "value": rb / corpus_bytes, "aim": "bytes read at launch / corpus size",
         "detail": f"{rb / 1e6:.1f} MB read from storage (tiny corpus: {statistics.median(reads['tiny']) / 1e6:.1f} MB) / "
                   f"{corpus_bytes / 1e9:.2f} GB (the JSONL and its packed file), both evicted from the page cache before each launch"},
    ]


@section("corpora", order=100, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return [*order_rows(), *launch_rows(work, 0.2 if q else 2.0, 3)]
