"""Checkpoint I/O against the hardware's floor: save, stall, verified load and resume at 26M and 104M, and a signal to a published checkpoint."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from checkpoint import CheckpointConfig, CheckpointManager, ModelState, OptimizerState, storage
from common.files import fsync_path
from configs import load_config
from data import BatchPlan, BlockDistributedSampler, SkipBatchSampler
from model import MiniMindLM, ModelConfig
from objectives import make_optimizer
from run import folder as runfolder
from run.state import TrainState
from runtime import Runtime

from . import section
from .helpers import ROOT, SMALL, bench_meta, folder_bytes, log_quiet, shape_104m, small_model, timed_save, trained_states, vocab_6400


AIMS = {
    "async stall / sync stall": ("<=", 0.2),
    "sync save / max(best raw write, sha256 of the bytes)": ("<=", 1.15),
    "verified load / raw read + sha256": ("<=", 1.0),
    "verified read of the states in place / raw read + sha256": ("<=", 1.0),
    "async stall / copy into preallocated buffers": ("<=", 1.2),
    "step-folder bytes / tensor bytes": ("<=", 1.01),
    "resume at 90% / at 0% of an epoch": ("<=", 1.1),
}


class Synthetic(Dataset):
    """N samples computed from their index: a dataset of any size without a file."""

    def __init__(self, n: int, seq_len: int) -> None:
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        row = (torch.arange(self.seq_len + 1) * 31 + i) % 256
        return row[:-1], row[1:]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resume_rows(n: int) -> list[dict]:
    """The data side of a resume: sampler built, epoch order drawn, skip applied, first batch out."""
    plan = BatchPlan(1024, 64, 2)
    ds = Synthetic(n, 32)

    def first_batch(fraction: float) -> float:
        t0 = time.perf_counter()
        sampler = BlockDistributedSampler(n, plan, rank=1, seed=1337)
        sampler.set_epoch(3)
        skip = int(plan.steps_per_epoch(n) * fraction) * plan.accum
        loader = DataLoader(ds, batch_sampler=SkipBatchSampler(sampler, skip), generator=torch.Generator().manual_seed(0))
        next(iter(loader))
        return time.perf_counter() - t0

    rss0 = peak_rss()
    first_batch(0.0)  # warm-up (and the peak: one epoch order alive at a time)
    grew = max(0, peak_rss() - rss0)
    times: dict[float, list[float]] = {0.0: [], 0.9: []}
    for _ in range(5):  # interleaved rounds: a drift of the machine's speed falls on both alike
        for fraction in times:
            times[fraction].append(first_batch(fraction))
    at0, at90 = statistics.median(times[0.0]), statistics.median(times[0.9])
    order_bytes = n * 8
    return [{"row": f"resume latency, data side, {n / 1e6:.0f}M samples", "what": "at 90% / at 0% of an epoch", "value": at90 / at0,
             "detail": f"{at90 * 1e3:.0f} ms / {at0 * 1e3:.0f} ms; the order is one int64 tensor of {order_bytes / 2**20:.0f} MiB, "
                       f"peak RSS grew {grew / 2**20:.0f} MiB",
             "aim": "resume at 90% / at 0% of an epoch"}]


_BLOCK = 4 << 20  # the raw writes' block: large, and a multiple of every O_DIRECT alignment


def raw_write_overlapped(folder: Path, files: dict[str, bytes]) -> float:
    """Seconds to write these bytes as plain files through the page cache in 4 MiB blocks, starting
    each block's writeback as soon as it is written (sync_file_range, as our save does), then an
    fsync of each file and of the folder. No serialization, no hashing."""
    from checkpoint.files import _start_writeback

    folder.mkdir()
    os.sync()
    t0 = time.perf_counter()
    for name, data in files.items():
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(data)
        for off in range(0, len(view), _BLOCK):
            n = os.write(fd, view[off : off + _BLOCK])
            if _start_writeback is not None:
                _start_writeback(fd, off, n)
        os.fsync(fd)
        os.close(fd)
    fsync_path(folder)
    dt = time.perf_counter() - t0
    shutil.rmtree(folder)
    return dt


def raw_write_direct(folder: Path, files: dict[str, bytes]) -> float | None:
    """Seconds to write the same bytes with O_DIRECT in 4 MiB aligned blocks (no page cache), the
    last block padded and the file truncated to its size, then fsyncs. None where the filesystem
    refuses O_DIRECT (tmpfs, some overlays)."""
    import mmap

    folder.mkdir()
    buf = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT needs
    try:
        os.sync()
        t0 = time.perf_counter()
        for name, data in files.items():
            try:
                fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            except OSError:
                return None
            for off in range(0, len(data), _BLOCK):
                chunk = data[off : off + _BLOCK]
                buf[: len(chunk)] = chunk
                padded = -(-len(chunk) // 4096) * 4096
                os.write(fd, memoryview(buf)[:padded])
            os.ftruncate(fd, len(data))
            os.fsync(fd)
            os.close(fd)
        fsync_path(folder)
        return time.perf_counter() - t0
    except OSError:
        return None
    finally:
        buf.close()
        shutil.rmtree(folder, ignore_errors=True)


def drop_page_cache(files: list[Path]) -> str:
    """Evict these files from the page cache: drop_caches as root, else posix_fadvise(DONTNEED)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        return "posix_fadvise"


def raw_read_and_hash(files: list[Path]) -> float:
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb") as f:
            hashlib.sha256(f.read()).hexdigest()
    return time.perf_counter() - t0


def state_tensors(states: dict) -> list[torch.Tensor]:
    """Every tensor of the states' state_dicts, a tied tensor once (as in a snapshot)."""
    out, seen = [], set()
    for obj in states.values():
        stack = [obj.state_dict()]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                if item.data_ptr() not in seen:
                    seen.add(item.data_ptr())
                    out.append(item.detach())
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
    return out


def preallocated_copy(states: dict, buffers: list[torch.Tensor]) -> float:
    """Seconds to copy every tensor of the states into `buffers` made once beforehand (filled on the
    first call, which is not timed): the floor of a snapshot that reuses its memory, as ours does."""
    tensors = state_tensors(states)
    if not buffers:
        buffers.extend(t.clone() for t in tensors)
    t0 = time.perf_counter()
    for dst, src in zip(buffers, tensors):
        dst.copy_(src)
    return time.perf_counter() - t0


def safetensors_tensor_bytes(path: Path) -> int:
    """Bytes of the tensors a safetensors file holds (from its header)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")


def checkpoint_rows(label: str, mcfg: ModelConfig, repeat: int, work: Path, aimed: bool) -> list[dict]:
    """Our one save path (DCP with our raw-bytes writer, publish, fp16 safetensors, manifest) on the
    same state, interleaved round by round with its floors: a sync save against the raw write of the
    same bytes and their sha256, a verified load (and the states' read into place alone) against a
    raw read + sha256 of the same files (page cache dropped before each), the async stall against the
    sync one and against a copy into preallocated buffers (its parts timed one by one); the step
    folder's bytes against the bytes of the tensors it holds and against the old one-file format's."""
    import torch.distributed.checkpoint as dcp

    from checkpoint import format
    from checkpoint import states as rng

    model, opt = trained_states(mcfg)
    cfg = load_config(None, SMALL)
    cfg.model = mcfg
    meta = bench_meta(cfg)
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train": TrainState(step=1)}
    step = iter(range(1, 10_000))
    log_quiet()
    out = work / f"ckpt-{label}"
    mgr = CheckpointManager(CheckpointConfig(interval=1, keep=2), out, Runtime(), meta)
    amgr = CheckpointManager(CheckpointConfig(interval=1, keep=2, async_=True), work / f"ckpt-async-{label}", Runtime(), meta)
    times: dict[str, list[float]] = {k: [] for k in ("save", "buffered", "direct", "hash", "load", "read", "inplace", "stateread", "stall",
                                                     "sync", "copy", "dcp", "rng", "model_sd", "optim_sd", "stage")}
    buffers, cache, files = [], "", []

    def fresh_states() -> dict:
        fresh_model = MiniMindLM(mcfg)
        fresh_opt = make_optimizer(fresh_model, load_config(None).train)
        return {"model": ModelState(fresh_model), "optimizer": OptimizerState(fresh_model, fresh_opt), "train": TrainState()}

    def timed(key: str, fn):
        t0 = time.perf_counter()
        got = fn()
        times[key].append(time.perf_counter() - t0)
        return got

    for r in range(repeat):
        s, seconds = timed_save(mgr, states, step)
        times["save"].append(seconds)
        folder = out / storage.CHECKPOINTS / storage.step_dir_name(s)
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        contents = {str(p.relative_to(folder)).replace("/", "_"): p.read_bytes() for p in files}
        times["buffered"].append(raw_write_overlapped(work / f"raw-{label}-{r}", contents))
        direct = raw_write_direct(work / f"direct-{label}-{r}", contents)
        if direct is not None:
            times["direct"].append(direct)
        timed("hash", lambda: [hashlib.sha256(data).hexdigest() for data in contents.values()])  # one core
        del contents
        fresh = fresh_states()
        loader = CheckpointManager(CheckpointConfig(interval=1, keep=2, resume=str(folder)), out, Runtime(), meta)
        cache = drop_page_cache(files)
        timed("load", lambda: loader.load(fresh))
        assert fresh["train"].step == s
        drop_page_cache(files)
        times["read"].append(raw_read_and_hash(files))
        # The states alone, read into place: DCP's load through our reader into a fresh structure (made beforehand).
        manifest = storage.verify(folder)
        metadata = storage.read_metadata(folder, manifest)
        target = {name: obj.state_dict() for name, obj in fresh_states().items()}
        state_files = [p for p in files if p.parent.name == format.STATE and p.name != format.METADATA]
        drop_page_cache(files)
        timed("inplace", lambda: format.load(target, folder, manifest["files"], metadata, no_dist=True))
        drop_page_cache(files)
        times["stateread"].append(raw_read_and_hash(state_files))
        times["sync"].append(timed_save(mgr, states, step)[1])
        times["stall"].append(timed_save(amgr, states, step)[1])
        amgr.wait()
        times["copy"].append(preallocated_copy({"model": model, "optimizer": opt}, buffers))
        # The stall's parts, one by one: the RNG gather, each state_dict call, the copy into the reused buffers.
        timed("rng", lambda: amgr.comm.gather(rng.rng_blob(amgr.comm.device)))
        model_sd = timed("model_sd", states["model"].state_dict)
        optim_sd = timed("optim_sd", states["optimizer"].state_dict)
        snap = {"model": model_sd, "optimizer": optim_sd, "train": states["train"].state_dict(),
                "rng": {"0": rng.rng_blob(amgr.comm.device)}}
        timed("stage", lambda: amgr._stage(snap))
        plain = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        os.sync()
        t0 = time.perf_counter()
        dcp.save(plain, checkpoint_id=str(work / f"dcp-{label}-{r}"), no_dist=True)
        times["dcp"].append(time.perf_counter() - t0)
        shutil.rmtree(work / f"dcp-{label}-{r}", ignore_errors=True)
    amgr.drain()
    new_bytes = folder_bytes(folder)
    metadata = storage.read_metadata(folder, storage.verify(folder))
    tensors = format.tensor_bytes(metadata, "") + safetensors_tensor_bytes(folder / storage.WEIGHTS_FILE)
    old = work / f"old-{label}.pth"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "train": {"step": 1}}, old)
    old_bytes = old.stat().st_size + (folder / storage.WEIGHTS_FILE).stat().st_size + (folder / storage.MANIFEST).stat().st_size
    old.unlink()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    best_raw = min(med["buffered"], med["direct"]) if "direct" in med else med["buffered"]
    floor = max(best_raw, med["hash"])  # a verified save writes every byte and hashes every byte
    params = model.num_parameters()
    mb = new_bytes / 1e6
    direct_ms = f"{med['direct'] * 1e3:.0f} ms ({mb / med['direct']:.0f} MB/s)" if "direct" in med else "refused by this filesystem"
    rows = [
        {"row": f"checkpoint write, {label} ({params / 1e6:.1f}M params, {new_bytes / 2**20:.0f} MiB: states + fp16 safetensors + manifest)",
         "what": "sync save / max(best raw write, sha256 of the bytes)", "value": med["save"] / floor,
         "aim": "sync save / max(best raw write, sha256 of the bytes)",
         "detail": f"{med['save'] * 1e3:.0f} ms ours ({mb / med['save']:.0f} MB/s) / {floor * 1e3:.0f} ms floor; raw writes of the same "
                   f"bytes + fsyncs: buffered with writeback started per 4 MiB block {med['buffered'] * 1e3:.0f} ms "
                   f"({mb / med['buffered']:.0f} MB/s), O_DIRECT 4 MiB blocks {direct_ms}; sha256 of the bytes on one core {med['hash'] * 1e3:.0f} ms (medians of {repeat} interleaved rounds)"},
        {"row": f"checkpoint write, {label}", "what": "ours sync / bare dcp.save of the same state",
         "value": med["sync"] / med["dcp"],
         "detail": f"{med['sync'] * 1e3:.0f} ms / {med['dcp'] * 1e3:.0f} ms (ours also hashes every byte, fsyncs, writes the fp16 "
                   f"weights and the manifest, publishes atomically)"},
        {"row": f"checkpoint load, verified, {label}", "what": "verified load / raw read + sha256", "value": med["load"] / med["read"],
         "aim": "verified load / raw read + sha256",
         "detail": f"{med['load'] * 1e3:.0f} ms into a fresh model + optimizer (made beforehand; the optimizer's load "
                   f"target, the states' load_state_dict, the identity check and the fp16 file's verification included) / {med['read'] * 1e3:.0f} ms to read and hash the same files (page cache dropped with {cache} before each)"},
        {"row": f"checkpoint states read in place, verified, {label}", "what": "verified read of the states in place / raw read + sha256",
         "value": med["inplace"] / med["stateread"], "aim": "verified read of the states in place / raw read + sha256",
         "detail": f"{med['inplace'] * 1e3:.0f} ms for DCP's load through our reader into a fresh structure made beforehand / "
                   f"{med['stateread'] * 1e3:.0f} ms to read and hash the same state files (page cache dropped before each)"},
        {"row": f"stall per save, {label}, 1 process (ddp)", "what": "async stall / sync stall", "value": med["stall"] / med["sync"],
         "aim": "async stall / sync stall", "detail": f"{med['stall'] * 1e3:.1f} ms / {med['sync'] * 1e3:.1f} ms"},
        {"row": f"async stall, {label}", "what": "async stall / copy into preallocated buffers", "value": med["stall"] / med["copy"],
         "aim": "async stall / copy into preallocated buffers",
         "detail": f"{med['stall'] * 1e3:.0f} ms / {med['copy'] * 1e3:.0f} ms to copy every tensor of the same state into buffers "
                   f"allocated beforehand; the stall's parts: RNG gather {med['rng'] * 1e3:.1f} ms, model state_dict "
                   f"{med['model_sd'] * 1e3:.1f} ms, optimizer state_dict {med['optim_sd'] * 1e3:.1f} ms, copy into the reused buffers "
                   f"{med['stage'] * 1e3:.0f} ms"},
        {"row": f"step folder on disk, {label}", "what": "step-folder bytes / tensor bytes", "value": new_bytes / tensors,
         "aim": "step-folder bytes / tensor bytes",
         "detail": f"{new_bytes:,} bytes (state/ .metadata + two .distcp, fp16 safetensors, manifest) / {tensors:,} bytes of the "
                   f"tensors they hold (fp32 states + fp16 weights)"},
        {"row": f"step folder on disk, {label}", "what": "new format / old format, bytes", "value": new_bytes / old_bytes,
         "detail": f"{new_bytes / 2**20:.1f} MiB / {old_bytes / 2**20:.1f} MiB (one torch.save resume file, fp16 weights, manifest)"},
    ]
    for row in rows:
        row["aim"] = row.get("aim") if aimed else None
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work / f"ckpt-async-{label}", ignore_errors=True)
    return rows


def stop_rows(work: Path) -> list[dict]:
    """Signal to published checkpoint, the 26M shape, a real `python train.py` run stopped with
    SIGTERM, sync and async saves."""
    import signal

    found = {}
    for mode in ("false", "true"):
        out, log = work / f"stop-{mode}", work / f"stop-{mode}.log"
        args = [sys.executable, "train.py", *SMALL, f"data.tokenizer={vocab_6400(work)}", "model.seq_len=64", "train.global_batch=2",
                "train.micro_batch=1", "checkpoint.interval=0", f"checkpoint.async={mode}", "log.progress=false", f"out_dir={out}"]
        with open(log, "w") as f:
            proc = subprocess.Popen(args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        metrics = out / runfolder.METRICS
        end = time.monotonic() + 600
        while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)
        text = log.read_text()
        m = re.search(r"checkpoint published ([\d.]+)s after the signal", text)
        step = re.search(r"stopped on SIGTERM at step (\d+)", text)
        found[mode] = (float(m.group(1)) if m else float("nan"), proc.returncode, step.group(1) if step else "?")
    (sync_s, sync_code, sync_step), (async_s, async_code, async_step) = found["false"], found["true"]
    return [{"row": "stop signal to published checkpoint, 26M, 1 process", "what": "async / sync", "value": async_s / sync_s,
             "detail": f"{async_s:.2f} s async (exit {async_code}, step {async_step}) / {sync_s:.2f} s sync (exit {sync_code}, "
                       f"step {sync_step}): the rest of the step, then the save"}]


@section("checkpoint", order=10, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return [*resume_rows(10_000_000),  # first: its peak-RSS figure needs a process that has not peaked yet
                             *checkpoint_rows("26M", small_model(), 3 if q else 5, work, aimed=True),
                             *checkpoint_rows("104M", shape_104m(), 2 if q else 3, work, aimed=True),
                             *([] if q else stop_rows(work))]
