"""Where we stand: checkpoint stalls, throughput with saves, resume cost, reduction modes, loop overhead.

    python scripts/bench.py [--quick] [--json PATH]

One run, one table; each row is a ratio against a baseline measured beside it in the same run.
Timings live here and in docs/bench.json (written whole by this script), never in a test.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import train  # noqa: E402
from checkpoint import CheckpointConfig, CheckpointManager, RunMeta, runfolder  # noqa: E402
from checkpoint.files import fsync_path  # noqa: E402
from configs import load_config, to_dict  # noqa: E402
from data import BatchPlan, BlockDistributedSampler, PackedDataset, SkipBatchSampler, pack, resolve_source  # noqa: E402
from model import MiniMindLM, ModelConfig  # noqa: E402
from runtime import Runtime  # noqa: E402

MINIMIND_TOKENIZER = ROOT.parent / "shared" / "minimind" / "tokenizer.json"
AIMS = {
    "packing / batch encoder alone, MiniMind's tokenizer": (">=", 0.8),
    "peak RSS packing 400 MB / 200 MB": ("<=", 1.1),
    "generation, KV cache / recompute": (">=", 1.0),
    "async stall / sync stall": ("<=", 0.2),
    "sync save / max(best raw write, sha256 of the bytes)": ("<=", 1.15),
    "verified load / raw read + sha256": ("<=", 1.3),
    "async stall / copy into preallocated buffers": ("<=", 1.5),
    "throughput, async save every 10 / none": (">=", 0.97),
    "resume at 90% / at 0% of an epoch": ("<=", 1.1),
    "bytes read at a 2-process resume / resume file size": ("<=", 1.1),
    "our loop / minimal loop (speed)": (">=", 0.95),
    "canonical / ddp step time, 2 processes": ("<=", 1.3),
    "launch on a packed 2 GB corpus / on a tiny one": ("<=", 1.5),
    "bytes read at launch / corpus size": ("<=", 0.01),
    "bijective order memory, MiB": ("<=", 1.0),
    "bijective first batch at 90%, ms": ("<=", 10.0),
    "packed: real tokens / tokens computed": (">=", 0.9),
    "taught tokens per token computed, packed / padded": (">=", 1.5),
    "fsdp / ddp memory, 2 processes": ("<=", 0.55),
    "fsdp / ddp memory, 4 processes": ("<=", 0.3),
}


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def trained_states(mcfg: ModelConfig, tokens: int = 16) -> tuple[MiniMindLM, torch.optim.Optimizer]:
    """A model and an AdamW with its state populated by one step on a small batch."""
    torch.manual_seed(0)
    model = MiniMindLM(mcfg)
    opt = train.make_optimizer(model, load_config(None).train)
    x = torch.randint(0, 256, (1, min(tokens, mcfg.seq_len)))
    model(x, x)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


_BLOCK = 4 << 20  # the raw writes' block: large, and a multiple of every O_DIRECT alignment


def raw_write_overlapped(folder: Path, files: dict[str, bytes]) -> float:
    """Seconds to write these bytes as plain files through the page cache in 4 MiB blocks, starting
    each block's writeback as soon as it is written (sync_file_range, as our save does), then an
    fsync of each file and of the folder. No serialization, no hashing."""
    from checkpoint.files import _start_writeback

    folder.mkdir()
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


def stall_rows(label: str, mcfg: ModelConfig, repeat: int, work: Path) -> tuple[list[dict], dict]:
    """Stall of one save at a step boundary, five ways, on the same state."""
    model, opt = trained_states(mcfg)
    rt = Runtime()
    tok = [f"data.tokenizer={vocab_6400(work)}"] if mcfg.vocab_size == 6400 else []  # the vocabulary follows the tokenizer
    cfg = load_config(None, [*(f"model.{k}={v}" for k, v in to_dict(mcfg).items() if k not in ("vocab_size", "init_from")), *tok])
    meta = RunMeta(1, 1, 1, 1, torch.get_num_threads(), "ddp", to_dict(cfg), {}, "bench")
    states = {"model": model, "optimizer": opt, "train": train.TrainState(step=1)}
    results: dict[str, float] = {}
    step = iter(range(1, 10_000))
    quiet = logging.getLogger("minimind")
    quiet.setLevel(logging.WARNING)

    def ours(async_: bool) -> float:
        out = work / f"ours-{label}-{async_}"
        mgr = CheckpointManager(CheckpointConfig(interval=1, keep=2, async_=async_), out, rt, meta)
        stalls, totals = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            stalls.append(timed_save(mgr, states, step)[1])
            mgr.wait()  # the background part, outside the stall
            totals.append(time.perf_counter() - t0)
        mgr.drain()
        results[f"ours {'async' if async_ else 'sync'} total"] = statistics.median(totals)
        shutil.rmtree(out)
        return statistics.median(stalls)

    results["sync"] = ours(False)
    results["async"] = ours(True)
    io_rows = io_floor_rows(label, mgr_factory=lambda out, async_: CheckpointManager(
        CheckpointConfig(interval=1, keep=2, async_=async_), out, rt, meta), states=states, repeat=repeat, work=work,
        step=step, model_cfg=mcfg)
    payload = {"model": model.state_dict(), "optimizer": opt.state_dict(), "train": states["train"].state_dict()}
    path = work / "bare.pth"
    results["torch.save"] = median_time(lambda: torch.save(payload, path), repeat)
    resume_bytes = path.stat().st_size
    path.unlink()
    dcp_state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    n = iter(range(10_000))
    results["dcp.save"] = median_time(lambda: dcp.save(dcp_state, checkpoint_id=str(work / f"dcp-{label}-{next(n)}")), repeat)
    futures = []
    results["dcp.async_save"] = median_time(
        lambda: futures.append(dcp.async_save(dcp_state, checkpoint_id=str(work / f"dcpa-{label}-{next(n)}"))), repeat)
    for f in futures:
        f.result()
    params = model.num_parameters()
    rows = [
        {"row": f"stall per save, {label} ({params / 1e6:.1f}M params)", "what": "ours async / ours sync",
         "value": results["async"] / results["sync"], "detail": f"{results['async'] * 1e3:.1f} ms / {results['sync'] * 1e3:.1f} ms",
         "aim": "async stall / sync stall"},
        {"row": f"stall per save, {label}", "what": "ours sync / bare torch.save",
         "value": results["sync"] / results["torch.save"], "detail": f"{results['sync'] * 1e3:.1f} ms / {results['torch.save'] * 1e3:.1f} ms (ours also hashes, fsyncs, writes fp16 weights + manifest)"},
        {"row": f"stall per save, {label}", "what": "DCP save / ours sync",
         "value": results["dcp.save"] / results["sync"], "detail": f"{results['dcp.save'] * 1e3:.1f} ms / {results['sync'] * 1e3:.1f} ms"},
        {"row": f"stall per save, {label}", "what": "DCP async_save / ours async",
         "value": results["dcp.async_save"] / results["async"], "detail": f"{results['dcp.async_save'] * 1e3:.1f} ms / {results['async'] * 1e3:.1f} ms"},
    ]
    return rows + io_rows, {"resume_bytes": resume_bytes, "sync_seconds": results["sync"], "sync_total": results["ours sync total"]}


def timed_save(mgr: CheckpointManager, states: dict, step) -> tuple[int, float]:
    """One save at the next step number: (step, seconds until save() returned)."""
    s = next(step)
    states["train"].step = s
    t0 = time.perf_counter()
    mgr.save(s, states)
    return s, time.perf_counter() - t0


def io_floor_rows(label: str, mgr_factory, states: dict, repeat: int, work: Path, step, model_cfg: ModelConfig) -> list[dict]:
    """Our checkpoint I/O against the hardware's floor, side by side and interleaved round by round:
    a sync save against a raw write of the same bytes, a verified load against a raw read + sha256
    of the same files (page cache dropped before each), the async stall against a memory copy."""
    out = work / f"floor-{label}"
    mgr = mgr_factory(out, False)
    save_t, buffered_t, direct_t, hash_t, load_t, read_t, stall_t, copy_t = [], [], [], [], [], [], [], []
    cache, buffers = "", []
    for r in range(repeat):
        s, seconds = timed_save(mgr, states, step)
        save_t.append(seconds)
        folder = out / runfolder.CHECKPOINTS / f"step_{s:08d}"
        files = sorted(p for p in folder.iterdir())
        contents = {p.name: p.read_bytes() for p in files}
        buffered_t.append(raw_write_overlapped(work / f"raw-{label}-{r}", contents))
        direct = raw_write_direct(work / f"direct-{label}-{r}", contents)
        if direct is not None:
            direct_t.append(direct)
        t0 = time.perf_counter()
        for data in contents.values():  # one core, as our save hashes in one helper thread
            hashlib.sha256(data).hexdigest()
        hash_t.append(time.perf_counter() - t0)
        # load: a fresh model and optimizer, as a resuming process has
        model = MiniMindLM(model_cfg)
        fresh = {"model": model, "optimizer": train.make_optimizer(model, load_config(None).train), "train": train.TrainState()}
        loader = mgr_factory(out, False)
        loader.cfg.resume = str(folder)
        cache = drop_page_cache(files)
        t0 = time.perf_counter()
        loader.load(fresh)
        load_t.append(time.perf_counter() - t0)
        assert fresh["train"].step == s
        drop_page_cache(files)
        read_t.append(raw_read_and_hash(files))
        copy_t.append(preallocated_copy(states, buffers))
    nbytes = sum(p.stat().st_size for p in files)
    amgr = mgr_factory(work / f"floor-async-{label}", True)
    for _ in range(repeat):
        stall_t.append(timed_save(amgr, states, step)[1])
        amgr.wait()
    amgr.drain()
    med = statistics.median
    aimed = label != "tiny"  # the aims are the 26M config's; a 14 MiB checkpoint is mostly fixed costs
    best_raw = min(med(buffered_t), med(direct_t)) if direct_t else med(buffered_t)
    floor = max(best_raw, med(hash_t))  # a verified save writes every byte and hashes every byte
    direct_ms = f"{med(direct_t) * 1e3:.0f} ms" if direct_t else "refused by this filesystem"
    rows = [
        {"row": f"checkpoint write, {label} ({nbytes / 2**20:.0f} MiB: resume + fp16 weights + manifest)",
         "what": "sync save / max(best raw write, sha256 of the bytes)", "value": med(save_t) / floor,
         "aim": "sync save / max(best raw write, sha256 of the bytes)",
         "detail": f"{med(save_t) * 1e3:.0f} ms ours / {floor * 1e3:.0f} ms floor; raw writes of the same bytes + fsyncs: buffered "
                   f"with writeback started per 4 MiB block {med(buffered_t) * 1e3:.0f} ms, O_DIRECT 4 MiB blocks {direct_ms}; "
                   f"sha256 of the bytes on one core {med(hash_t) * 1e3:.0f} ms (medians of {len(save_t)} interleaved rounds)"},
        {"row": f"checkpoint load, verified, {label}", "what": "verified load / raw read + sha256", "value": med(load_t) / med(read_t),
         "aim": "verified load / raw read + sha256",
         "detail": f"{med(load_t) * 1e3:.0f} ms into model + optimizer / {med(read_t) * 1e3:.0f} ms to read and hash the same files (page cache dropped with {cache} before each)"},
        {"row": f"async stall, {label}", "what": "async stall / copy into preallocated buffers", "value": med(stall_t) / med(copy_t),
         "aim": "async stall / copy into preallocated buffers",
         "detail": f"{med(stall_t) * 1e3:.0f} ms / {med(copy_t) * 1e3:.0f} ms to copy every tensor of the same state into buffers allocated beforehand"},
    ]
    for row in rows:
        row["aim"] = row["aim"] if aimed else None
    return rows


def stop_rows(work: Path) -> list[dict]:
    """Signal to published checkpoint, 26M config (MiniMind2-small's shape with a 6,400-token
    vocabulary), a real `python train.py` run stopped with SIGTERM, sync and async saves."""
    import re
    import signal

    found = {}
    for mode in ("false", "true"):
        out, log = work / f"stop-{mode}", work / f"stop-{mode}.log"
        args = [sys.executable, "train.py", "--config", "configs/minimind2_small.yaml", f"data.tokenizer={vocab_6400(work)}",
                "model.seq_len=64", "train.global_batch=2", "train.micro_batch=1", "train.dtype=float32",
                "runtime.deterministic=false", "checkpoint.interval=0", f"checkpoint.async={mode}", "log.progress=false",
                f"out_dir={out}"]
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


def vocab_6400(work: Path) -> Path:
    """MiniMind's tokenizer (6,400 ids), or, where it is absent, one of 6,400 ids trained here."""
    if MINIMIND_TOKENIZER.is_file():
        return MINIMIND_TOKENIZER
    from data.tokenizer import train_bpe

    out = work / "tokenizer-6400"
    if not (out / "tokenizer.json").exists():
        train_bpe([resolve_source("stdlib", ROOT / "data" / "cache")], 6400, out)
    return out / "tokenizer.json"


def mixed_corpus(path: Path, megabytes: int, tok_path: Path, seed: int = 0) -> None:
    """A MiniMind-format JSONL of `megabytes` MB, lines alternating at random between Chinese and English:
    English lines are the standard library's docstrings; Chinese lines are runs of the tokenizer's own
    CJK vocabulary entries with Chinese punctuation (no Chinese corpus can be downloaded here)."""
    import random
    import re

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    cjk = [w for w in (tok.decode([i]) for i in range(tok.get_vocab_size())) if re.fullmatch(r"[\u4e00-\u9fff]+", w)]
    english = [json.loads(line)["text"] for line in open(resolve_source("stdlib", ROOT / "data" / "cache").files[0], encoding="utf-8")]
    rng = random.Random(seed)
    chinese = ["".join(rng.choice(cjk) + (rng.choice("，。、；：！？") if rng.random() < 0.12 else "")
                       for _ in range(rng.randint(20, 400))) for _ in range(20_000)]
    pool = [json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in chinese + english]
    pool = [line.encode() for line in pool]
    weights = [1.0] * len(chinese) + [len(chinese) / len(english)] * len(english)  # half the lines each way
    written, limit = 0, megabytes * 1_000_000
    with open(path, "wb") as f:
        while written < limit:
            chunk = b"".join(rng.choices(pool, weights, k=4096))
            f.write(chunk)
            written += len(chunk)


_PACK_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from data import pack, prepare, sources
from data import tokenizer as tokenizers
mode, source, cache = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
tok = tokenizers.load(sys.argv[5])
t0 = time.perf_counter()
if mode == "pack":
    _, meta = pack(prepare.resolve_source(str(source), cache), 512, cache, tok)
    n = meta["num_tokens"]
elif mode == "encoder":  # the ceiling: the batch encoder alone, on the same batches held in memory
    batches = [texts for texts, _ in prepare.batches(sources.Reader(prepare.resolve_source(str(source), cache)), 4 << 20)]
    t0 = time.perf_counter()
    n = sum(len(e) for texts in batches for e in tok.tok.encode_batch_fast(texts, add_special_tokens=False))
else:  # json: parsing every line, the floor of any packer
    n = sum(len(texts) for texts, _ in prepare.batches(sources.Reader(prepare.resolve_source(str(source), cache)), 4 << 20))
seconds = time.perf_counter() - t0
# VmHWM: this process image's peak RSS (ru_maxrss would carry the forking parent's peak over)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "n": n, "rss": hwm * 1024}))
"""


def split_corpus(source: Path, folder: Path, parts: int, megabytes: int | None = None) -> Path:
    """The first `megabytes` (all, for None) of `source` in `parts` files of whole lines, in a folder."""
    folder.mkdir(parents=True)
    limit = (megabytes * 1_000_000 if megabytes else source.stat().st_size) // parts
    with open(source, "rb") as src:
        for i in range(parts):
            with open(folder / f"part-{i:03d}.jsonl", "wb") as dst:
                dst.write(src.read(limit))
                dst.write(src.readline())
    return folder


def _pack_child(mode: str, source: Path, cache: Path, tok: str) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", _PACK_CHILD, str(ROOT), mode, str(source), str(cache), tok],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    if out.returncode != 0:
        raise SystemExit(f"bench: packing child ({mode}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def packing_rows(work: Path, megabytes: int) -> list[dict]:
    """Corpus preparation at scale, each figure from a fresh process: packing with MiniMind's
    tokenizer against its batch encoder alone on the same text in memory; peak RSS of packing a
    corpus and one twice its size; the byte tokenizer's packing against parsing the JSON alone."""
    tok = vocab_6400(work)
    whole = work / f"mixed-{2 * megabytes}.jsonl"
    mixed_corpus(whole, 2 * megabytes, tok)
    small, big = split_corpus(whole, work / f"mixed-{megabytes}", 4, megabytes), split_corpus(whole, work / f"mixed-{2 * megabytes}", 8)
    whole.unlink()
    mb = sum(p.stat().st_size for p in small.iterdir()) / 1e6
    ours = _pack_child("pack", small, work / "pc", str(tok))
    ceiling = _pack_child("encoder", small, work / "pc", str(tok))
    twice = _pack_child("pack", big, work / "pc", str(tok))
    by_bytes = _pack_child("pack", small, work / "pc", "bytes")
    parse = _pack_child("json", small, work / "pc", "bytes")
    shutil.rmtree(work / "pc", ignore_errors=True)
    name = "MiniMind's tokenizer" if tok == MINIMIND_TOKENIZER else "a 6,400-id tokenizer trained here"
    return [
        {"row": f"packing {mb:.0f} MB of mixed Chinese/English JSONL in 4 files, {name}", "what": "packing / batch encoder alone",
         "value": ceiling["seconds"] / ours["seconds"],
         "detail": f"{mb / ours['seconds']:.1f} MB/s packed (parse, encode, write, fsync) / {mb / ceiling['seconds']:.1f} MB/s "
                   f"encoder alone on the text in memory; {ours['n'] / 1e6:.0f}M tokens",
         "aim": "packing / batch encoder alone, MiniMind's tokenizer"},
        {"row": f"peak RSS of packing, {2 * megabytes} MB vs {megabytes} MB corpus", "what": "RSS ratio",
         "value": twice["rss"] / ours["rss"],
         "detail": f"{twice['rss'] / 2**20:.0f} MiB / {ours['rss'] / 2**20:.0f} MiB (whole process)", "aim": "peak RSS packing 400 MB / 200 MB"},
        {"row": f"packing {mb:.0f} MB with the byte tokenizer", "what": "packing / JSON parsing alone",
         "value": parse["seconds"] / by_bytes["seconds"],
         "detail": f"{mb / by_bytes['seconds']:.0f} MB/s packed / {mb / parse['seconds']:.0f} MB/s parsing the JSON lines"},
    ]


def generation_rows(new_tokens: int = 256) -> list[dict]:
    """Tokens per second generating `new_tokens` greedily after a 4-token prompt, with the KV cache
    against recomputing the whole sequence per token (inference.generate_ids), tiny and 26M shapes
    (random weights, seq_len 512 so that every position is covered; EOS ignored)."""
    from inference import generate_ids

    rows = []
    tiny = load_config(ROOT / "configs" / "tiny.yaml").model
    shapes = {"tiny": ModelConfig(dim=tiny.dim, n_layers=tiny.n_layers, n_heads=tiny.n_heads, n_kv_heads=tiny.n_kv_heads, seq_len=512),
              "26M": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=2, vocab_size=6400, seq_len=512)}
    for label, mcfg in shapes.items():
        torch.manual_seed(0)
        model = MiniMindLM(mcfg).eval()
        prompt = [1, 2, 3, 4]
        seconds, tokens = {}, {}
        for cached in (True, False):
            t0 = time.perf_counter()
            tokens[cached] = generate_ids(model, prompt, new_tokens, temperature=0.0, eos=None, use_cache=cached)
            seconds[cached] = time.perf_counter() - t0
        same = tokens[True] == tokens[False]
        rows.append({"row": f"generation, {label}, {new_tokens} new tokens, 1 process", "what": "KV cache / recompute (tokens/s)",
                     "value": seconds[False] / seconds[True],
                     "detail": f"{new_tokens / seconds[True]:.0f} tok/s cached / {new_tokens / seconds[False]:.0f} tok/s recomputed; "
                               f"greedy tokens {'identical' if same else 'DIFFER'}",
                     "aim": "generation, KV cache / recompute"})
    return rows


def run_train(args: list[str], log: Path) -> list[dict]:
    """train.main in this process (1 process); returns its metrics lines."""
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("out_dir=")))
    shutil.rmtree(out, ignore_errors=True)
    with open(log, "a") as f, contextlib.redirect_stderr(f), contextlib.redirect_stdout(f):
        code = train.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "log.progress=false", *args])
    logging.basicConfig(force=True, level=logging.WARNING)
    if code != 0:
        raise SystemExit(f"bench: a training run failed, see {log}")
    return runfolder.read_metrics(out)


def throughput(rows: list[dict], skip: int, tokens_per_step: int) -> float:
    """Tokens per second over wall-clock, saves included, after `skip` warm-up steps."""
    a, b = rows[skip - 1], rows[-1]
    return (b["step"] - a["step"]) * tokens_per_step / (b["elapsed_s"] - a["elapsed_s"])


def throughput_rows(steps: int, rounds: int, work: Path) -> list[dict]:
    """Tokens/s with a save every 10 steps (sync, async) against no save. The three runs of a round
    go one after another, in an order that rotates from round to round; each ratio is taken within a
    round, and the row gives the median over rounds with the spread, so that a cost shows as a
    ratio below 1 in every round and noise as a spread around 1."""
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
         "detail": spread("async"), "aim": "throughput, async save every 10 / none", "rounds": ratios["async"]},
        {"row": "training throughput, tiny, save every 10 steps", "what": "sync / none", "value": statistics.median(ratios["sync"]),
         "detail": spread("sync"), "rounds": ratios["sync"]},
    ]


def resume_read_rows(work: Path) -> list[dict]:
    """What a resume reads: a 2-process launch resumes a tiny run; the bytes every rank read from
    files during the load (read() calls, page cache or not: what a shared filesystem would serve),
    from the load's own log line, against the resume file's size."""
    out = work / "read-once"
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
            "--config", "configs/tiny.yaml", "log.progress=false", "train.steps=4", f"out_dir={out}"]
    for halt in (2, 3):
        proc = subprocess.run([*base, f"train.halt_at={halt}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"bench: the resume launch failed:\n{proc.stderr[-3000:]}")
    import re

    m = re.search(r"([\d.]+) MiB read from files by (\d+) rank\(s\) for a ([\d.]+) MiB resume file", proc.stderr)
    if not m:
        raise SystemExit(f"bench: no load line in the resume's log:\n{proc.stderr[-3000:]}")
    read, ranks, size = float(m.group(1)), int(m.group(2)), float(m.group(3))
    return [{"row": "resume, tiny, 2 processes on one node", "what": "bytes read at a 2-process resume / resume file size",
             "value": read / size, "aim": "bytes read at a 2-process resume / resume file size",
             "detail": f"{read:.1f} MiB read from files by {ranks} ranks during the load / a {size:.1f} MiB resume file "
                       f"(rank 0 reads and verifies it once; the other rank deserializes the bytes rank 0 broadcasts)"}]


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
    at0 = statistics.median(first_batch(0.0) for _ in range(3))
    at90 = statistics.median(first_batch(0.9) for _ in range(3))
    order_bytes = n * 8
    return [{"row": f"resume latency, data side, {n / 1e6:.0f}M samples", "what": "at 90% / at 0% of an epoch", "value": at90 / at0,
             "detail": f"{at90 * 1e3:.0f} ms / {at0 * 1e3:.0f} ms; the order is one int64 tensor of {order_bytes / 2**20:.0f} MiB, "
                       f"peak RSS grew {grew / 2**20:.0f} MiB",
             "aim": "resume at 90% / at 0% of an epoch"}]


def reduce_rows(steps: int, work: Path) -> list[dict]:
    """canonical vs ddp on 2 processes under torchrun: median step time from metrics."""
    med = {}
    for mode in ("ddp", "canonical"):
        out = work / f"reduce-{mode}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
               "--config", "configs/tiny.yaml", f"train.steps={steps}", f"dist.reduce={mode}", "checkpoint.interval=0",
               "log.progress=false", f"out_dir={out}"]
        with open(work / "torchrun.log", "a") as f:
            if subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"bench: torchrun failed, see {work / 'torchrun.log'}")
        rows = runfolder.read_metrics(out)[3:]
        med[mode] = statistics.median(r["step_s"] for r in rows)
    return [{"row": "step time, tiny, 2 processes", "what": "canonical / ddp", "value": med["canonical"] / med["ddp"],
             "detail": f"{med['canonical'] * 1e3:.0f} ms / {med['ddp'] * 1e3:.0f} ms", "aim": "canonical / ddp step time, 2 processes"}]


def loop_rows(steps: int, work: Path) -> list[dict]:
    """Our loop against a minimal plain-PyTorch loop on the same model, batch and threads (1 process)."""
    ours = run_train([f"train.steps={steps}", "checkpoint.interval=0", f"out_dir={work / 'loop-ours'}"], work / "train.log")
    ours_step = statistics.median(r["step_s"] for r in ours[3:])
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    torch.set_num_threads(train.runtime.default_threads(cfg.runtime, "ddp", 1))
    cache = Path(cfg.data.cache_dir)
    bin_path, _ = pack(resolve_source(cfg.data.path, cache), cfg.model.seq_len, cache)
    ds = PackedDataset(bin_path, cfg.model.seq_len)
    torch.manual_seed(cfg.seed)
    model = MiniMindLM(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), weight_decay=cfg.train.weight_decay)
    accum = cfg.train.global_batch // cfg.train.micro_batch
    loader = iter(DataLoader(ds, batch_size=cfg.train.micro_batch, shuffle=True, drop_last=True))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(accum):
            x, y = next(loader)
            (model(x, y)[1] / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    minimal = statistics.median(times[3:])
    return [{"row": "step time, tiny, 1 process", "what": "our loop / minimal loop (speed)", "value": minimal / ours_step,
             "detail": f"{ours_step * 1e3:.0f} ms ours, {minimal * 1e3:.0f} ms minimal", "aim": "our loop / minimal loop (speed)"}]


def chat_corpus(path: Path, n: int, tok_path: Path, seed: int = 0) -> None:
    """`n` MiniMind-like conversations: a user turn and an assistant turn (a third of them with a
    system turn, a fifth with a second exchange), each turn Chinese (runs of the tokenizer's CJK
    vocabulary) or English (standard-library docstrings), answers longer than questions."""
    import random
    import re

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    cjk = [w for w in (tok.decode([i]) for i in range(tok.get_vocab_size())) if re.fullmatch(r"[\u4e00-\u9fff]+", w)]
    english = [json.loads(line)["text"] for line in open(resolve_source("stdlib", ROOT / "data" / "cache").files[0], encoding="utf-8")]
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        if rng.random() < 0.5:
            return "".join(rng.choice(cjk) + ("，。"[rng.random() < 0.5] if rng.random() < 0.1 else "") for _ in range(rng.randint(lo, hi)))
        return rng.choice(english)[: rng.randint(lo, hi) * 3]

    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            turns = [{"role": "system", "content": text(5, 30)}] if rng.random() < 0.33 else []
            for _ in range(2 if rng.random() < 0.2 else 1):
                turns += [{"role": "user", "content": text(5, 60)}, {"role": "assistant", "content": text(20, 300)}]
            f.write(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")


def sft_rows(work: Path, conversations: int, steps: int) -> list[dict]:
    """Packed against padded chat rows (data.pack) at seq_len 512 with MiniMind's tokenizer: the
    share of computed positions that are real tokens and that teach, and the step time per taught
    token training the tiny model's shape on each (1 process)."""
    from data.chat import ChatOptions
    from data.dataset import ChatDataset

    tok_path = vocab_6400(work)
    source = work / "sft.jsonl"
    chat_corpus(source, conversations, tok_path)
    from data import tokenizer as tokenizers

    tok = tokenizers.load(str(tok_path))
    got = {}
    for packed in (True, False):
        bin_path, meta = pack(source, 512, work / "sft-cache", tok, chat=ChatOptions(pack=packed))
        computed = meta["num_samples"] * 512
        rows = run_train([f"data.path={source}", "data.format=chat", f"data.pack={str(packed).lower()}", f"data.tokenizer={tok_path}",
                          f"data.cache_dir={work / 'sft-cache'}", "model.seq_len=512", "train.global_batch=16", "train.micro_batch=4",
                          f"train.steps={steps}", "checkpoint.interval=0", "log.sample_ids=true", f"out_dir={work / 'sft-run'}"],
                         work / "train.log")
        ds = ChatDataset(bin_path, 512, dtype=meta["dtype"])  # the rows the run trained on: the same cache
        per_taught = statistics.median(r["step_s"] / ds.taught(r["sample_ids"]) for r in rows[2:])
        got[packed] = {"real": meta["tokens"] / computed, "taught": meta["taught"] / computed, "rows": meta["num_samples"],
                       "per_taught": per_taught}
    p, q = got[True], got[False]
    return [
        {"row": f"chat rows, {conversations} MiniMind-like conversations, seq_len 512", "what": "packed: real tokens / tokens computed",
         "value": p["real"], "aim": "packed: real tokens / tokens computed",
         "detail": f"packed {p['real']:.3f} in {p['rows']} rows; padded {q['real']:.3f} in {q['rows']} rows"},
        {"row": f"chat rows, {conversations} MiniMind-like conversations, seq_len 512", "what": "taught tokens per token computed, packed / padded",
         "value": p["taught"] / q["taught"], "aim": "taught tokens per token computed, packed / padded",
         "detail": f"packed {p['taught']:.3f}, padded {q['taught']:.3f} taught tokens per position computed"},
        {"row": "chat step time per taught token, tiny shape at seq_len 512, 1 process", "what": "packed / padded",
         "value": p["per_taught"] / q["per_taught"],
         "detail": f"{p['per_taught'] * 1e6:.1f} us / {q['per_taught'] * 1e6:.1f} us per taught token (median of {steps - 2} steps)"},
    ]


_SHARD_CHILD = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
from model import MiniMindLM, ModelConfig
from runtime import sharding
dist.init_process_group("gloo")
torch.manual_seed(0)
cfg = ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=2, vocab_size=6400, seq_len=64)
out = {}
for strategy in ("ddp", "fsdp"):
    model = MiniMindLM(cfg)
    net = model
    if strategy == "fsdp":
        sharding.shard(model, "float32", True)
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, 64))
    _, loss = net(x, x)
    loss.backward()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    grads = sum(local(p.grad).numel() * 4 for p in model.parameters() if p.grad is not None)
    opt.step()
    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    state = sum(local(v).numel() * local(v).element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    out[strategy] = {"params": params, "grads": grads, "optimizer": state}
per_rank = [None] * dist.get_world_size()
dist.all_gather_object(per_rank, out)
if dist.get_rank() == 0:
    print(json.dumps(per_rank))
dist.destroy_process_group()
"""


def sharding_rows(work: Path, steps: int) -> list[dict]:
    """dist.strategy=fsdp against ddp: per-rank bytes of parameters, gradients and AdamW state of the
    26M shape on 2 and 4 processes (the largest rank's, counted from the tensors each rank holds),
    and on 2 processes the step time and the checkpoint save time of train.py (a 25M model on bytes)."""
    rows = []
    for n in (2, 4):
        child = work / "shard_child.py"
        child.write_text(_SHARD_CHILD)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(child),
                               str(ROOT)], cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"bench: the sharding child failed:\n{proc.stderr[-3000:]}")
        per_rank = json.loads(proc.stdout.strip().splitlines()[-1])
        total = {k: max(sum(r[k].values()) for r in per_rank) for k in ("ddp", "fsdp")}
        parts = {k: max(r["fsdp"][k] for r in per_rank) / 2**20 for k in ("params", "grads", "optimizer")}
        rows.append({"row": f"per-rank bytes of parameters + gradients + AdamW state, 26M shape, {n} processes",
                     "what": "fsdp / ddp", "value": total["fsdp"] / total["ddp"], "aim": f"fsdp / ddp memory, {n} processes",
                     "detail": f"{total['fsdp'] / 2**20:.0f} MiB / {total['ddp'] / 2**20:.0f} MiB on the largest rank "
                               f"(fsdp: {parts['params']:.0f} + {parts['grads']:.0f} + {parts['optimizer']:.0f} MiB)"})
    timing = {}
    big = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=2", "model.seq_len=128", "train.global_batch=8",
           "train.micro_batch=2", f"train.steps={steps}", "checkpoint.interval=4", "log.progress=false", "dist.reduce=ddp"]
    import re

    for strategy, mode in (("ddp", "false"), ("fsdp", "false"), ("fsdp", "true")):
        out = work / f"shard-{strategy}-{mode}"
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                               "--config", "configs/tiny.yaml", *big, f"dist.strategy={strategy}", f"checkpoint.async={mode}",
                               f"out_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"bench: the {strategy} run failed:\n{proc.stderr[-3000:]}")
        metrics = runfolder.read_metrics(out)
        # a sync save's stall is its whole time; an async one's, until the shards are staged (the last save of a run is sync)
        pattern = r"shards staged in ([\d.]+)s" if mode == "true" else r"saved \S+: step \d+, ([\d.]+)s"
        saves = [float(x) for x in re.findall(pattern, proc.stderr)]
        timing[(strategy, mode)] = (statistics.median(m["step_s"] for m in metrics[2:]), statistics.median(saves), len(saves))
        shutil.rmtree(out, ignore_errors=True)
    (sd, vd, nd), (sf, vf, nf), (_, va, na) = timing[("ddp", "false")], timing[("fsdp", "false")], timing[("fsdp", "true")]
    rows += [
        {"row": "step time, 25M model, 2 processes (gloo, CPU)", "what": "fsdp / ddp", "value": sf / sd,
         "detail": f"{sf * 1e3:.0f} ms / {sd * 1e3:.0f} ms (median of {steps - 2} steps)"},
        {"row": "checkpoint save, 25M model, 2 processes", "what": "sharded (DCP) / ddp", "value": vf / vd,
         "detail": f"{vf:.2f} s / {vd:.2f} s (medians of {nf} and {nd} saves, as the runs log them)"},
        {"row": "stall per sharded save, 25M model, 2 processes", "what": "async stall / sync stall", "value": va / vf,
         "aim": "async stall / sync stall",
         "detail": f"{va:.3f} s until the shards are staged (and the full model gathered for the fp16 file) / {vf:.2f} s "
                   f"(medians of {na} and {nf} saves)"},
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps, no 26M rows (about 2 minutes here)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here (docs/bench.json is a full run's, whole)")
    parser.add_argument("--only", choices=("packing", "generation", "throughput", "corpora", "sft", "sharding"), help="run only these rows")
    parser.add_argument("--corpus-mb", type=int, default=200, help="size of the packing rows' generated corpus (and twice it)")
    a = parser.parse_args(argv)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=ROOT / "runs" if (ROOT / "runs").exists() else None))
    # DCP's save wants a process group; a single-rank gloo one on a free port.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29_500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows: list[dict] = []
    try:
        if a.only:
            rows += {"packing": lambda: packing_rows(work, a.corpus_mb), "generation": generation_rows,
                     "throughput": lambda: throughput_rows(20 if a.quick else 40, 2 if a.quick else 4, work),
                     "corpora": lambda: [*order_rows(), *launch_rows(work, 0.2 if a.quick else 2.0, 3)],
                     "sft": lambda: sft_rows(work, 1000 if a.quick else 4000, 6 if a.quick else 12),
                     "sharding": lambda: sharding_rows(work, 6 if a.quick else 10)}[a.only]()
            return report(rows, a, t0)
        rows += resume_rows(10_000_000)  # first: its peak-RSS figure needs a process that has not peaked yet
        repeat = 3 if a.quick else 5
        tiny = load_config(ROOT / "configs" / "tiny.yaml").model
        r, _ = stall_rows("tiny", tiny, repeat, work)
        rows += r
        if not a.quick:
            big = ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=2, vocab_size=6400, seq_len=512)
            r, _ = stall_rows("26M", big, repeat, work)
            rows += r
            rows += stop_rows(work)
        rows += resume_read_rows(work)
        rows += throughput_rows(20 if a.quick else 40, 2 if a.quick else 4, work)
        rows += loop_rows(15 if a.quick else 30, work)
        dist.destroy_process_group()
        rows += reduce_rows(15 if a.quick else 30, work)
        rows += packing_rows(work, 50 if a.quick else a.corpus_mb)
        rows += order_rows()
        rows += launch_rows(work, 0.2 if a.quick else 2.0, 3)
        rows += sft_rows(work, 1000 if a.quick else 4000, 6 if a.quick else 12)
        rows += sharding_rows(work, 6 if a.quick else 10)
        rows += generation_rows(64 if a.quick else 256)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    return report(rows, a, t0)


def report(rows: list[dict], a: argparse.Namespace, t0: float) -> int:
    for row in rows:
        aim = AIMS.get(row.get("aim") or "")
        row["aim"] = f"{aim[0]} {aim[1]}" if aim else ""
        row["meets_aim"] = (row["value"] <= aim[1] if aim[0] == "<=" else row["value"] >= aim[1]) if aim else None
    print(f"bench ({a.only or ('quick' if a.quick else 'full')}, {time.time() - t0:.0f} s, torch {torch.__version__}, {os.cpu_count()} cores)\n")
    print("| measured | ratio | value | aim | figures |")
    print("|---|---|---|---|---|")
    for row in rows:
        mark = "" if row["meets_aim"] is None else (" ✓" if row["meets_aim"] else " ✗")
        print(f"| {row['row']} | {row['what']} | {row['value']:.3f} | {row['aim']}{mark} | {row['detail']} |")
    if a.json:
        run = {"command": " ".join(["python", "scripts/bench.py", *sys.argv[1:]]), "quick": a.quick, "only": a.only,
               "seconds": round(time.time() - t0), "torch": torch.__version__, "cores": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "aims_missed": [r["what"] for r in rows if r["meets_aim"] is False]}
        a.json.write_text(json.dumps({**run, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
