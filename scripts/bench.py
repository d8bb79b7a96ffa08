"""Where we stand: checkpoint I/O against the hardware's floor, throughput with saves, the loop
against a minimal one and against MiniMind's own trainer, compile and activation checkpointing,
MoE, LoRA, DPO, GRPO, resume cost, data preparation, sharding.

    python scripts/bench.py [--quick] [--only SECTION ...] [--json PATH]

One run, one table; each row is a ratio against a baseline measured beside it in the same run (the
hardware's floor, a minimal loop of our own, or a peer run unmodified). Timings live here and in
docs/bench.json (written whole by this script; with --only, those sections' rows replace theirs and
the file's "sections" says when and how each was run again), never in a test. The peer rows need MiniMind's
trainer's requirements (transformers, datasets: requirements-bench.txt), installed here when
missing, never by scripts/train.sh.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import re
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

from common.kernels import reproducible_kernels  # noqa: E402

# Before the first matmul: every section, and every process it starts (MiniMind's trainer too), runs
# MKL's branch of the trainer's default (its reproducible one unless MKL_CBWR is set), so a row's two
# sides share their arithmetic and --only SECTION runs as the whole bench does; the JSON records it.
reproducible_kernels()

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import train  # noqa: E402
from checkpoint import CheckpointConfig, CheckpointManager, ModelState, OptimizerState, RunMeta, storage  # noqa: E402
from common.files import fsync_path  # noqa: E402
from configs import load_config, to_dict  # noqa: E402
from data import BatchPlan, BlockDistributedSampler, PackedDataset, SkipBatchSampler, pack, resolve_source  # noqa: E402
from model import MiniMindLM, ModelConfig  # noqa: E402
from objectives import make_optimizer  # noqa: E402
from run import folder as runfolder  # noqa: E402
from run.state import TrainState  # noqa: E402
from runtime import Runtime  # noqa: E402

MINIMIND_TOKENIZER = ROOT.parent / "shared" / "minimind" / "tokenizer.json"
UPSTREAM = ROOT.parent / "shared" / "minimind" / "upstream"
AIMS = {
    "store save / raw multipart put": ("<=", 1.15),
    "store resume / raw get + sha256": ("<=", 1.1),
    "async stall, store / local": ("<=", 1.2),
    "packing / batch encoder alone, MiniMind's tokenizer": (">=", 0.8),
    "peak RSS packing 400 MB / 200 MB": ("<=", 1.1),
    "generation, KV cache / recompute": (">=", 1.0),
    "async stall / sync stall": ("<=", 0.2),
    "sync save / max(best raw write, sha256 of the bytes)": ("<=", 1.15),
    "verified load / raw read + sha256": ("<=", 1.0),
    "verified read of the states in place / raw read + sha256": ("<=", 1.0),
    "async stall / copy into preallocated buffers": ("<=", 1.2),
    "step-folder bytes / tensor bytes": ("<=", 1.01),
    "throughput, async save every 10 / none": (">=", 0.97),
    "resume at 90% / at 0% of an epoch": ("<=", 1.1),
    "our loop / minimal loop (speed)": (">=", 0.95),
    "canonical / ddp step time, 2 processes": ("<=", 1.3),
    "launch on a packed 2 GB corpus / on a tiny one": ("<=", 1.5),
    "bytes read at launch / corpus size": ("<=", 0.01),
    "bijective order memory, MiB": ("<=", 1.0),
    "mixed loader / single-source loader, step time": ("<=", 1.02),
    "mix resume at 90% / at 0%": ("<=", 1.1),
    "mix order memory, MiB": ("<=", 1.0),
    "bijective first batch at 90%, ms": ("<=", 10.0),
    "packed: real tokens / tokens computed": (">=", 0.9),
    "taught tokens per token computed, packed / padded": (">=", 1.5),
    "fsdp / ddp memory, 2 processes": ("<=", 0.55),
    "fsdp / ddp memory, 4 processes": ("<=", 0.3),
    "ours / MiniMind's trainer, time per step": ("<=", 1.05),
    "spread of ours / MiniMind's time per step over the rounds": ("<=", 0.05),
    "ours / MiniMind's trainer, loss-carrying tokens per second": (">=", 2.0),
    "ours compiled / MiniMind's default trainer, loss-carrying tokens per second": (">=", 3.0),
    "model FLOPs utilisation, compiled": (">=", 0.5),
    "compiled / eager tokens per second": (">=", 1.1),
    "activation checkpointing / none, peak RSS": ("<=", 0.7),
    "DPO, precomputed / live reference, step time": ("<=", 0.6),
    "served stream / generate_ids tokens per second": (">=", 0.9),
    "distill, top-32 precomputed / live teacher, step time": ("<=", 0.6),
}
SMALL = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.hidden_dim=1664", "model.qk_norm=true",
         "model.norm_eps=1e-6", "model.seq_len=256"]
"""MiniMind's trainer's shape at --hidden_size 512 --num_hidden_layers 8 (its config's defaults: 8 heads,
4 KV heads, FFN ceil(512 pi / 64) * 64 = 1664, q/k norms, eps 1e-6): the peer rows' and the 26M rows' model."""


def log_quiet() -> None:
    logging.getLogger("minimind").setLevel(logging.WARNING)


def launch(args: list[str], log: Path, nproc: int = 0, timeout: int = 3600, env: dict | None = None) -> tuple[float, str]:
    """train.py in a child (python, or torchrun with nproc): (seconds from start to exit, its log);
    a failure stops the bench with the log's tail."""
    cmd = [sys.executable, "train.py", *args] if not nproc else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - t0
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stderr}\n")
    if proc.returncode != 0:
        raise SystemExit(f"bench: a training run failed (exit {proc.returncode}), see {log}:\n{proc.stderr[-3000:]}")
    return seconds, proc.stderr


def step_median(out: Path, skip: int = 2) -> float:
    rows = runfolder.read_metrics(out)[skip:]
    return statistics.median(r["step_s"] for r in rows)


_RSS_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
sys.argv = ["train.py", *sys.argv[2:]]
import train
code = train.main(sys.argv[1:])
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(f"VmHWM {hwm * 1024}", flush=True)
sys.exit(code)
"""


def run_rss(args: list[str], work: Path) -> tuple[int, str]:
    """train.main in a fresh child; (its peak RSS in bytes, VmHWM, its log)."""
    proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(ROOT), *args], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench: a training run failed:\n{proc.stderr[-3000:]}")
    return int(re.search(r"VmHWM (\d+)", proc.stdout).group(1)), proc.stderr


def run_train(args: list[str], log: Path, config: str = "configs/tiny.yaml") -> list[dict]:
    """train.main in this process (1 process); returns its metrics lines."""
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("out_dir=")))
    shutil.rmtree(out, ignore_errors=True)
    with open(log, "a") as f, contextlib.redirect_stderr(f), contextlib.redirect_stdout(f):
        code = train.main(["--config", str(ROOT / config), "log.progress=false", *args])
    logging.basicConfig(force=True, level=logging.WARNING)
    if code != 0:
        raise SystemExit(f"bench: a training run failed, see {log}")
    return runfolder.read_metrics(out)


def trained_states(mcfg: ModelConfig, tokens: int = 16) -> tuple[MiniMindLM, torch.optim.Optimizer]:
    """A model and an AdamW with its state populated by one step on a small batch."""
    torch.manual_seed(0)
    model = MiniMindLM(mcfg)
    opt = make_optimizer(model, load_config(None).train)
    x = torch.randint(0, 256, (1, min(tokens, mcfg.seq_len)))
    model(x, x)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def bench_meta(cfg) -> RunMeta:
    return RunMeta(world_size=1, global_batch=1, micro_batch=1, accum=1, threads=torch.get_num_threads(), reduce="ddp",
                   config=to_dict(cfg), run_id="bench")


def timed_save(mgr: CheckpointManager, states: dict, step) -> tuple[int, float]:
    """One save at the next step number: (step, seconds until save() returned)."""
    s = next(step)
    states["train"].step = s
    os.sync()  # no other measurement's writeback runs into this one
    t0 = time.perf_counter()
    mgr.save(s, states)
    return s, time.perf_counter() - t0


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    batches = [texts for texts, _ in sources.batches(sources.Reader(prepare.resolve_source(str(source), cache)), 4 << 20)]
    t0 = time.perf_counter()
    n = sum(len(e) for texts in batches for e in tok.tok.encode_batch_fast(texts, add_special_tokens=False))
else:  # json: parsing every line, the floor of any packer
    n = sum(len(texts) for texts, _ in sources.batches(sources.Reader(prepare.resolve_source(str(source), cache)), 4 << 20))
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


def throughput(rows: list[dict], skip: int, tokens_per_step: int) -> float:
    """Tokens per second over wall-clock, saves included, after `skip` warm-up steps."""
    a, b = rows[skip - 1], rows[-1]
    return (b["step"] - a["step"]) * tokens_per_step / (b["elapsed_s"] - a["elapsed_s"])



def shape_104m() -> ModelConfig:
    """MiniMind2's 104M shape (dim 768, 16 layers, 8 heads, 2 KV heads, FFN 2048) with its 6,400-id
    vocabulary: about 4x the 26M rows' model."""
    cfg = small_model()
    cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim = 768, 16, 8, 2, 2048
    return cfg


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


def sft_rows(work: Path, conversations: int, steps: int) -> list[dict]:
    """Packed against padded chat rows (data.pack) at seq_len 512 with MiniMind's tokenizer: the
    share of computed positions that are real tokens and that teach, and the step time per taught
    token training the tiny model's shape on each (1 process)."""
    from data import tokenizer as tokenizers
    from data.chat import ChatOptions
    from data.dataset import ChatDataset

    tok_path = vocab_6400(work)
    source = work / "sft.jsonl"
    chat_corpus(source, conversations, tok_path)
    tok = tokenizers.load(str(tok_path))
    got = {}
    for packed in (True, False):
        bin_path, meta = pack(source, 512, work / "sft-cache", tok, chat=ChatOptions(pack=packed))
        computed = meta["num_samples"] * 512
        rows = run_train([f"data.path={source}", "data.format=chat", f"data.pack={str(packed).lower()}", f"data.tokenizer={tok_path}",
                          f"data.cache_dir={work / 'sft-cache'}", "model.seq_len=512", "train.global_batch=16", "train.micro_batch=4",
                          f"train.steps={steps}", "checkpoint.interval=0", "log.sample_ids=true", f"out_dir={work / 'sft-run'}"],
                         work / "train.log")
        ds = ChatDataset(bin_path, 512, dtype=meta["dtype"])
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


def sharding_rows(work: Path, steps: int) -> list[dict]:
    """dist.strategy=fsdp against ddp: per-rank bytes of parameters, gradients and AdamW state of the
    26M shape on 2 and 4 processes (the largest rank's), and on 2 processes the step time, the save
    time and the async stall of train.py (the 26M shape)."""
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
    big = [*SMALL, f"data.tokenizer={vocab_6400(work)}", "model.seq_len=128", "train.global_batch=8", "train.micro_batch=2",
           f"train.steps={steps}", "checkpoint.interval=4", "log.progress=false", "dist.reduce=ddp"]
    for strategy, mode in (("ddp", "false"), ("fsdp", "false"), ("fsdp", "true")):
        out = work / f"shard-{strategy}-{mode}"
        _, err = launch(["--config", "configs/tiny.yaml", *big, f"dist.strategy={strategy}", f"checkpoint.async={mode}", f"out_dir={out}"],
                        work / "shard.log", nproc=2)
        # a sync save's stall is its whole time; an async one's, until its snapshot is taken (the last save of a run is sync)
        pattern = r"snapshot taken in ([\d.]+)s" if mode == "true" else r"saved \S+: step \d+, ([\d.]+)s"
        saves = [float(x) for x in re.findall(pattern, err)]
        timing[(strategy, mode)] = (step_median(out), statistics.median(saves), len(saves))
        shutil.rmtree(out, ignore_errors=True)
    (sd, vd, nd), (sf, vf, nf), (_, va, na) = timing[("ddp", "false")], timing[("fsdp", "false")], timing[("fsdp", "true")]
    rows += [
        {"row": "step time, 26M shape, 2 processes (gloo, CPU)", "what": "fsdp / ddp", "value": sf / sd,
         "detail": f"{sf * 1e3:.0f} ms / {sd * 1e3:.0f} ms (median of {steps - 2} steps)"},
        {"row": "checkpoint save, 26M shape, 2 processes", "what": "fsdp / ddp (the same DCP path)", "value": vf / vd,
         "detail": f"{vf:.2f} s / {vd:.2f} s (medians of {nf} and {nd} saves, as the runs log them)"},
        {"row": "stall per save, 26M shape, 2 processes under fsdp", "what": "async stall / sync stall", "value": va / vf,
         "aim": "async stall / sync stall",
         "detail": f"{va:.3f} s until the snapshot is taken / {vf:.2f} s (medians of {na} and {nf} saves)"},
    ]
    return rows


def generation_rows(new_tokens: int = 256) -> list[dict]:
    """Tokens per second generating `new_tokens` greedily after a 4-token prompt, with the KV cache
    against recomputing the whole sequence per token (model/generate.py generate_ids), tiny and 26M
    shapes (random weights, seq_len 512; EOS ignored)."""
    from model.generate import generate_ids

    rows = []
    tiny = load_config(ROOT / "configs" / "tiny.yaml").model
    shapes = {"tiny": ModelConfig(dim=tiny.dim, n_layers=tiny.n_layers, n_heads=tiny.n_heads, n_kv_heads=tiny.n_kv_heads, seq_len=512),
              "26M": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, hidden_dim=1664, qk_norm=True, vocab_size=6400,
                                 seq_len=512)}
    for label, mcfg in shapes.items():
        torch.manual_seed(0)
        model = MiniMindLM(mcfg).eval()
        seconds, tokens = {}, {}
        for cached in (True, False):
            t0 = time.perf_counter()
            tokens[cached] = generate_ids(model, [1, 2, 3, 4], new_tokens, temperature=0.0, eos=None, use_cache=cached)
            seconds[cached] = time.perf_counter() - t0
        same = tokens[True] == tokens[False]
        rows.append({"row": f"generation, {label}, {new_tokens} new tokens, 1 process", "what": "KV cache / recompute (tokens/s)",
                     "value": seconds[False] / seconds[True],
                     "detail": f"{new_tokens / seconds[True]:.0f} tok/s cached / {new_tokens / seconds[False]:.0f} tok/s recomputed; "
                               f"greedy tokens {'identical' if same else 'DIFFER'}", "aim": "generation, KV cache / recompute"})
    return rows


def ensure_bench_requirements() -> None:
    """MiniMind's trainer needs transformers and datasets (requirements-bench.txt): installed here
    when missing, never by scripts/train.sh."""
    try:
        import datasets  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r",
                        str(ROOT / "requirements-bench.txt")], check=True)


def peer_corpus(work: Path, lines: int) -> Path:
    """The first `lines` lines of a mixed Chinese/English corpus (bench's mixed_corpus), one file per length."""
    whole = work / "peer-whole.jsonl"
    if not whole.exists():
        mixed_corpus(whole, 4, vocab_6400(work), seed=1)
    out = work / f"peer-{lines}.jsonl"
    with open(whole, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        for _ in range(lines):
            dst.write(src.readline())
    return out


def mkl_default_env() -> dict:
    """This process's environment without MKL_CBWR: a child's MKL on its default branch (unless the
    child sets one itself, as train.py does)."""
    return {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}


def minimind_run(scratch: Path, corpus: Path, work: Path, compile_: bool, mkl_default: bool = False) -> float:
    """MiniMind's train_pretrain.py, unmodified, from the scratch copy: one epoch over `corpus`
    (so its step count is the corpus's lines / 8); seconds from start to exit. MKL on the bench's
    branch (the trainer's reproducible one), or with `mkl_default` on MKL's default, as its users run it."""
    out = work / "mm-out"
    cmd = [sys.executable, "train_pretrain.py", "--data_path", str(corpus), "--hidden_size", "512", "--num_hidden_layers", "8",
           "--max_seq_len", "256", "--batch_size", "8", "--accumulation_steps", "1", "--epochs", "1", "--num_workers", "1",
           "--device", "cpu", "--log_interval", "100000", "--save_interval", "100000", "--save_dir", str(out),
           "--use_compile", "1" if compile_ else "0"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=scratch / "trainer", capture_output=True, text=True, timeout=3600,
                          env={**(mkl_default_env() if mkl_default else os.environ), "HF_DATASETS_OFFLINE": "1",
                               "TOKENIZERS_PARALLELISM": "false"})
    seconds = time.perf_counter() - t0
    with open(work / "minimind.log", "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\n")
    if proc.returncode != 0:
        raise SystemExit(f"bench: MiniMind's trainer failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds


def ours_run(corpus: Path, steps: int, work: Path, compile_: bool) -> float:
    """train.py on the same corpus, shape and batch (8 rows of 256), one process; seconds to exit."""
    out = work / "ours-peer"
    shutil.rmtree(out, ignore_errors=True)
    seconds, _ = launch(["--config", "configs/tiny.yaml", *SMALL, f"data.path={corpus}", f"data.tokenizer={MINIMIND_TOKENIZER}",
                         f"data.cache_dir={work / 'peer-cache'}", "train.global_batch=8", "train.micro_batch=8", f"train.steps={steps}",
                         "train.warmup_steps=2", "checkpoint.interval=0", "log.progress=false", f"train.compile={str(compile_).lower()}",
                         f"out_dir={out}"], work / "peer.log")
    return seconds


def matmul_peak(n: int = 2048, repeats: int = 8) -> float:
    """This CPU's fp32 matmul peak in FLOP/s: the best of `repeats` n x n x n products (2 n^3 each)
    at the threads a training process gets (torch's default, as the runs here use)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def matmul_peak_mkl_default() -> float:
    """matmul_peak in a child whose MKL runs its default branch (MKL reads MKL_CBWR once, at its
    first call: this process's is the bench's)."""
    import inspect

    code = f"import math, time, torch\n{inspect.getsource(matmul_peak)}\nprint(matmul_peak())"  # not `import bench`: it sets MKL_CBWR
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=mkl_default_env())
    if proc.returncode != 0:
        raise SystemExit(f"bench: the matmul peak on MKL's default branch failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.split()[-1])


def peer_rows(work: Path, short: int, long: int, rounds: int) -> list[dict]:
    """Our loop beside MiniMind's own trainer, unmodified (its files at the shared commit, copied to
    a scratch folder, as it writes beside itself): the same width and depth, batch 8 x 256, CPU, one
    process, the same JSONL corpus and MiniMind's tokenizer. Time per step from the difference of
    two run lengths (`short` and `long` steps), so start-up, data set-up and the final save cancel,
    in `rounds` rounds that interleave MiniMind's default (eager) trainer, ours eager and ours
    compiled (its cache filled before the first round): each ratio is the median of its rounds'
    ratios, their spread (max - min) printed. The model FLOPs utilisation is 6 x parameters x
    positions computed per second over this CPU's fp32 matmul peak measured in the same run. Then
    where a difference comes from: each model's forward and backward alone on the same batch, and
    MiniMind's data loader alone (it tokenizes in the loop)."""
    if not MINIMIND_TOKENIZER.is_file() or not (UPSTREAM / "trainer" / "train_pretrain.py").is_file():
        return []
    ensure_bench_requirements()
    scratch = work / "minimind"
    shutil.copytree(UPSTREAM, scratch)
    (scratch / "model" / "tokenizer.json").write_bytes(MINIMIND_TOKENIZER.read_bytes())  # its init_model reads ../model
    small, big = peer_corpus(work, 8 * short), peer_corpus(work, 8 * long)
    ours_run(big, 2, work, False)  # pack both corpora ahead: the runs below read the cache
    ours_run(small, 2, work, False)
    ours_run(small, 3, work, True)  # fill the compile cache: every compiled run below reads it
    per: dict[str, list[float]] = {"mm": [], "ours": [], "ours_c": [], "mm_d": []}
    for _ in range(rounds):
        mm = [minimind_run(scratch, c, work, False) for c in (small, big)]
        us = [ours_run(c, n, work, False) for c, n in ((small, short), (big, long))]
        uc = [ours_run(c, n, work, True) for c, n in ((small, short), (big, long))]
        md = [minimind_run(scratch, c, work, False, mkl_default=True) for c in (small, big)]
        for key, t in (("mm", mm), ("ours", us), ("ours_c", uc), ("mm_d", md)):
            per[key].append((t[1] - t[0]) / (long - short))
    # MiniMind pads each document to 256: the positions that carry a loss, over the long corpus
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MINIMIND_TOKENIZER))
    texts = [json.loads(line)["text"] for line in open(big, encoding="utf-8")]
    carried = statistics.mean(min(len(e.ids) + 2, 256) - 1 for e in tok.encode_batch(texts, add_special_tokens=False))
    step = {k: statistics.median(v) for k, v in per.items()}
    by_round = {k: [u / m for u, m in zip(per[k], per["mm"])] for k in ("ours", "ours_c")}
    by_round["vs_default"] = [u / m for u, m in zip(per["ours"], per["mm_d"])]
    ratio = {k: statistics.median(v) for k, v in by_round.items()}
    spread = {k: max(v) - min(v) for k, v in by_round.items()}
    tps = {"ours": 8 * 256 / step["ours"], "ours_c": 8 * 256 / step["ours_c"], "mm": 8 * carried / step["mm"]}
    torch.manual_seed(0)
    params = sum(p.numel() for p in MiniMindLM(small_model()).parameters())  # the tied head counted once
    peak, peak_default = matmul_peak(), matmul_peak_mkl_default()
    best = max(peak, peak_default)  # the hardware's: MFU over the fastest product this CPU computes, whatever branch
    mfu = {k: 6 * params * 8 * 256 / step[k] / best for k in step}  # every position is computed, padded or not
    mkl = os.environ.get("MKL_CBWR", "MKL's default")
    why = peer_breakdown(scratch, big)
    rounds_of = {k: ", ".join(f"{x:.3f}" for x in v) for k, v in by_round.items()}
    return [
        {"row": "training step, MiniMind's shape (hidden 512, 8 layers, 8 heads, 4 KV, FFN 1664), batch 8 x 256, CPU, 1 process",
         "what": "ours / MiniMind's trainer, time per step", "value": ratio["ours"], "aim": "ours / MiniMind's trainer, time per step",
         "detail": f"{step['ours']:.2f} s / {step['mm']:.2f} s (medians; each round a {short}- and a {long}-step run of each, "
                   f"start-up cancelled; both with MKL_CBWR={mkl}, the trainer's default); the {rounds} rounds' ratios "
                   f"{rounds_of['ours']}; {why}"},
        {"row": "training step, MiniMind's shape, batch 8 x 256", "what": "ours / MiniMind's trainer on MKL's default branch (as its "
         "users run it), time per step", "value": ratio["vs_default"],
         "detail": f"{step['ours']:.2f} s / {step['mm_d']:.2f} s (MiniMind's trainer without MKL_CBWR; on the trainer's "
                   f"reproducible branch {step['mm']:.2f} s); the {rounds} rounds' ratios {rounds_of['vs_default']}: the price of "
                   f"the same bits every run, paid in MKL's large fp32 products"},
        {"row": "fp32 matmul peak, 2048^3, this CPU", "what": "MKL's default branch / the trainer's reproducible branch, FLOP/s",
         "value": peak_default / peak,
         "detail": f"{peak_default / 1e9:.0f} GFLOP/s (a child without MKL_CBWR) / {peak / 1e9:.0f} GFLOP/s (MKL_CBWR={mkl}), "
                   f"{torch.get_num_threads()} threads, best of 8 products each"},
        {"row": "training step, MiniMind's shape, batch 8 x 256", "what": "spread of ours / MiniMind's time per step over the rounds",
         "value": spread["ours"], "aim": "spread of ours / MiniMind's time per step over the rounds",
         "detail": f"max - min of {rounds} rounds' ratios ({rounds_of['ours']}), runs of {short} and {long} steps"},
        {"row": "training step, MiniMind's shape, batch 8 x 256", "what": "ours / MiniMind's trainer, loss-carrying tokens per second",
         "value": tps["ours"] / tps["mm"], "aim": "ours / MiniMind's trainer, loss-carrying tokens per second",
         "detail": f"{tps['ours']:,.0f} / {tps['mm']:,.0f} tok/s, both eager: we pack (256 of 256 positions carry a loss), MiniMind "
                   f"pads each document to the row ({carried:.0f} of 256 on this corpus)"},
        {"row": "training step, MiniMind's shape, batch 8 x 256", "what": "ours compiled / MiniMind's default trainer, loss-carrying "
         "tokens per second", "value": tps["ours_c"] / tps["mm"],
         "aim": "ours compiled / MiniMind's default trainer, loss-carrying tokens per second",
         "detail": f"{tps['ours_c']:,.0f} / {tps['mm']:,.0f} tok/s: train.compile=true (warm cache) against MiniMind's trainer with "
                   f"its default --use_compile 0 (both with MKL_CBWR={mkl}); the {rounds} rounds' step ratios {rounds_of['ours_c']}"},
        {"row": "model FLOPs utilisation, MiniMind's shape, batch 8 x 256, CPU, 1 process", "what": "model FLOPs utilisation, eager",
         "value": mfu["ours"],
         "detail": f"6 x {params / 1e6:.1f}M parameters x {8 * 256 / step['ours']:,.0f} positions/s / {best / 1e9:.0f} GFLOP/s "
                   f"(this CPU's best fp32 2048^3 matmul on either MKL branch, {torch.get_num_threads()} threads, measured in this "
                   f"run; the reproducible branch's own {peak / 1e9:.0f}); MiniMind's trainer {mfu['mm']:.3f} on the same branch as "
                   f"ours, {mfu['mm_d']:.3f} on MKL's default (it computes every padded position "
                   f"too); attention's score products not counted"},
        {"row": "model FLOPs utilisation, MiniMind's shape, batch 8 x 256, CPU, 1 process", "what": "model FLOPs utilisation, compiled",
         "value": mfu["ours_c"], "aim": "model FLOPs utilisation, compiled",
         "detail": f"6 x {params / 1e6:.1f}M parameters x {8 * 256 / step['ours_c']:,.0f} positions/s / {best / 1e9:.0f} GFLOP/s "
                   f"(train.compile=true, warm cache)"},
    ]


def peer_breakdown(scratch: Path, corpus: Path, rounds: int = 5) -> str:
    """Each model's forward + backward + AdamW step alone on the same batch (8 x 256, random ids),
    and MiniMind's DataLoader alone over its dataset (tokenizing each document as it is read)."""
    import importlib.util

    sys.path.insert(0, str(scratch))
    try:
        spec = importlib.util.spec_from_file_location("mm_model", scratch / "model" / "model_minimind.py")
        mm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mm)
        spec = importlib.util.spec_from_file_location("mm_data", scratch / "dataset" / "lm_dataset.py")
        mmd = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mmd)
        from transformers import AutoTokenizer

        torch.manual_seed(0)
        theirs = mm.MiniMindForCausalLM(mm.MiniMindConfig(hidden_size=512, num_hidden_layers=8))
        cfg = load_config(None, SMALL)
        cfg.model.vocab_size = 6400
        ours = MiniMindLM(cfg.model)
        x = torch.randint(0, 6400, (8, 256))

        def step(model, fn):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
            return statistics.median(times[1:])

        t_ours = step(ours, lambda: ours(x, x)[1])
        t_theirs = step(theirs, lambda: theirs(x, labels=x).loss)
        tok = AutoTokenizer.from_pretrained(str(scratch / "model"))
        ds = mmd.PretrainDataset(str(corpus), tok, max_length=256)
        loader = iter(DataLoader(ds, batch_size=8, num_workers=0))
        t0 = time.perf_counter()
        n = 0
        for _ in range(min(20, len(ds) // 8)):
            next(loader)
            n += 1
        t_data = (time.perf_counter() - t0) / max(n, 1)
    finally:
        sys.path.remove(str(scratch))
    return (f"where it goes, measured alone on the same batch: forward + backward + AdamW step {t_ours:.2f} s ours (SDPA attention) "
            f"/ {t_theirs:.2f} s MiniMind's model; MiniMind's data loader {t_data * 1e3:.0f} ms a batch (tokenizing in the loop; "
            f"with --num_workers 1 it overlaps the step), ours reads packed ids")


def compile_rows(work: Path, short: int, long: int) -> list[dict]:
    """train.compile at the 26M shape on CPU: tokens/s compiled / eager (per step from two run
    lengths, the compile cache warm), and the first step's time with a cold cache (the compile)."""
    tok = vocab_6400(work)
    base = ["--config", "configs/tiny.yaml", *SMALL, f"data.tokenizer={tok}", "train.global_batch=8", "train.micro_batch=8",
            "checkpoint.interval=0", "log.progress=false", "train.warmup_steps=2", f"data.cache_dir={work / 'c-cache'}"]
    cold = work / "inductor-cold"
    _, err = launch([*base, "train.steps=2", "train.compile=true", f"out_dir={work / 'c-cold'}"], work / "compile.log",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(cold)})
    first = float(re.search(r"the first step took ([\d.]+) s", err).group(1))
    per = {}
    for compiled in (False, True):
        env = {"TORCHINDUCTOR_CACHE_DIR": str(cold)}
        t = [launch([*base, f"train.steps={n}", f"train.compile={str(compiled).lower()}", f"out_dir={work / f'c-{compiled}-{n}'}"],
                    work / "compile.log", env=env)[0] for n in (short, long)]
        per[compiled] = (t[1] - t[0]) / (long - short)
    _, err = launch([*base, "train.steps=2", "train.compile=true", f"out_dir={work / 'c-warm'}"], work / "compile.log",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(cold)})
    warm = float(re.search(r"the first step took ([\d.]+) s", err).group(1))
    shutil.rmtree(cold, ignore_errors=True)
    return [
        {"row": "train.compile, 26M shape (MiniMind's), batch 8 x 256, CPU, 1 process", "what": "compiled / eager tokens per second",
         "value": per[False] / per[True], "aim": "compiled / eager tokens per second",
         "detail": f"{per[True]:.2f} s / {per[False]:.2f} s per step (from {short}- and {long}-step runs, the compile cache warm)"},
        {"row": "train.compile, 26M shape, the first step", "what": "cold cache / warm cache, seconds", "value": first / warm,
         "detail": f"{first:.1f} s with an empty TORCHINDUCTOR_CACHE_DIR (the compile) / {warm:.1f} s reading it"},
    ]


def checkpointing_rows(work: Path, steps: int) -> list[dict]:
    """train.activation_checkpointing=full against none at the 26M shape, batch 8 x 256: the
    process's peak RSS and the step time (fresh processes)."""
    tok = vocab_6400(work)
    base = ["--config", "configs/tiny.yaml", *SMALL, f"data.tokenizer={tok}", "train.global_batch=8", "train.micro_batch=8",
            f"train.steps={steps}", "checkpoint.interval=0", "log.progress=false", f"data.cache_dir={work / 'c-cache'}"]
    got = {}
    for mode in ("none", "full"):
        out = work / f"ac-{mode}"
        rss, _ = run_rss([*base, f"train.activation_checkpointing={mode}", f"out_dir={out}"], work)
        got[mode] = (rss, step_median(out, 1))
    (rn, tn), (rf, tf) = got["none"], got["full"]
    return [
        {"row": "activation checkpointing, 26M shape, batch 8 x 256, CPU", "what": "activation checkpointing / none, peak RSS",
         "value": rf / rn, "aim": "activation checkpointing / none, peak RSS",
         "detail": f"{rf / 2**20:.0f} MiB / {rn / 2**20:.0f} MiB (the whole process's peak: weights, AdamW, activations)"},
        {"row": "activation checkpointing, 26M shape, batch 8 x 256, CPU", "what": "full / none, step time", "value": tf / tn,
         "detail": f"{tf:.2f} s / {tn:.2f} s (each block's forward runs again in the backward)"},
    ]


def models_rows(work: Path, steps: int) -> list[dict]:
    """MiniMind-3's MoE against a dense model with the same active parameters (4 experts, top-1,
    each expert the dense FFN's width), and minimind3_small against minimind2_small: step time and
    tokens per second at batch 8 x 256, 1 process."""
    tok = vocab_6400(work)
    common = [f"data.tokenizer={tok}", "train.global_batch=8", "train.micro_batch=8", f"train.steps={steps}", "checkpoint.interval=0",
              "log.progress=false", "model.seq_len=256", f"data.cache_dir={work / 'c-cache'}"]
    t = {}
    for name, args in (("dense", ["--config", "configs/tiny.yaml", *SMALL]),
                       ("moe", ["--config", "configs/tiny.yaml", *SMALL, "model.moe.experts=4", "model.moe.top_k=1"]),
                       ("minimind2_small", ["--config", "configs/minimind2_small.yaml"]),
                       ("minimind3_small", ["--config", "configs/minimind3_small.yaml"])):
        out = work / f"m-{name}"
        launch([*args, *common, f"out_dir={out}"], work / "models.log")
        t[name] = step_median(out, 2)
    return [
        {"row": "MoE (4 experts, top-1) vs dense, the same active parameters, 26M shape, batch 8 x 256", "what": "MoE / dense, step time",
         "value": t["moe"] / t["dense"], "detail": f"{t['moe']:.2f} s / {t['dense']:.2f} s (the router, the experts' token dispatch, "
                                                   f"and four experts' weights for one's arithmetic)"},
        {"row": "configs/minimind3_small.yaml vs configs/minimind2_small.yaml, batch 8 x 256", "what": "tokens per second, 3 / 2",
         "value": t["minimind2_small"] / t["minimind3_small"],
         "detail": f"{8 * 256 / t['minimind3_small']:,.0f} / {8 * 256 / t['minimind2_small']:,.0f} tok/s"},
    ]


def lora_rows(work: Path) -> list[dict]:
    """A LoRA checkpoint (rank 16 on MiniMind's square linears) against a full fine-tune's of the
    same 26M model: the step folder's bytes and the save's time as the runs log them."""
    tok = vocab_6400(work)
    base = ["--config", "configs/tiny.yaml", *SMALL, f"data.tokenizer={tok}", "model.seq_len=128", "train.global_batch=4",
            "train.micro_batch=4", "train.steps=6", "checkpoint.interval=2", "log.progress=false", f"data.cache_dir={work / 'c-cache'}"]
    got = {}
    for name, extra in (("full", []), ("lora", ["train.lora.rank=16"])):
        out = work / f"lora-{name}"
        _, err = launch([*base, *extra, f"out_dir={out}"], work / "lora.log")
        saves = [float(x) for x in re.findall(r"saved \S+: step \d+, ([\d.]+)s", err)]
        got[name] = (folder_bytes(out / storage.CHECKPOINTS / storage.step_dir_name(6)), statistics.median(saves))
    (bf, sf), (bl, sl) = got["full"], got["lora"]
    return [{"row": "checkpoint of a LoRA run (rank 16, q_proj + o_proj) vs a full fine-tune, 26M shape", "what": "LoRA / full, bytes",
             "value": bl / bf, "detail": f"{bl / 2**20:.2f} MiB / {bf / 2**20:.1f} MiB per step folder (the base is pinned by its hash)"},
            {"row": "checkpoint of a LoRA run vs a full fine-tune, 26M shape", "what": "LoRA / full, save time", "value": sl / sf,
             "detail": f"{sl:.2f} s / {sf:.2f} s (medians of 3 saves)"}]


def dpo_rows(work: Path, steps: int) -> list[dict]:
    """DPO on the built-in pairs at the tiny shape (seq_len 512, 1 process): step time with the
    precomputed reference against a live one; and packed pairs against one padded pair per row:
    taught tokens per computed position (data.pack)."""
    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-preference", "data.format=preference", "train.objective=dpo",
            "model.seq_len=512", "train.global_batch=8", "train.micro_batch=4", f"train.steps={steps}", "checkpoint.interval=0",
            "log.progress=false", "data.num_samples=400", f"data.cache_dir={work / 'dpo-cache'}"]
    t, taught = {}, {}
    for name, extra in (("precompute", []), ("live", ["train.dpo.precompute=false"])):
        out = work / f"dpo-{name}"
        launch([*base, *extra, f"out_dir={out}"], work / "dpo.log")
        t[name] = step_median(out, 2)
    from data import tokenizer as tokenizers
    from data.chat import ChatOptions

    source = resolve_source("stdlib-preference", work / "dpo-cache")
    for packed in (True, False):
        _, meta = pack(source, 512, work / "dpo-cache", tokenizers.ByteTokenizer(), chat=ChatOptions(pack=packed, kind="preference"))
        taught[packed] = meta["taught"] / (meta["num_samples"] * 512)
    return [{"row": "DPO, tiny shape at seq_len 512, batch 8 rows, 1 process", "what": "DPO, precomputed / live reference, step time",
             "value": t["precompute"] / t["live"], "aim": "DPO, precomputed / live reference, step time",
             "detail": f"{t['precompute'] * 1e3:.0f} ms / {t['live'] * 1e3:.0f} ms (the live reference: one more forward per row)"},
            {"row": "DPO rows, the built-in pairs at seq_len 512", "what": "taught tokens per computed position, packed / padded pairs",
             "value": taught[True] / taught[False], "detail": f"{taught[True]:.3f} packed / {taught[False]:.3f} one pair per row"}]


def grpo_rows(work: Path, steps: int) -> list[dict]:
    """GRPO on the built-in sums at the tiny shape: a group's rollout with the KV cache against
    recomputing the sequence per token; the share of a step spent generating; 2 processes / 1."""
    from model.generate import generate_group

    cfg = load_config(ROOT / "configs" / "tiny.yaml").model
    torch.manual_seed(0)
    model = MiniMindLM(cfg).eval()
    prompt = list(range(1, 41))
    gens = lambda: [torch.Generator().manual_seed(k) for k in range(6)]  # noqa: E731
    t = {}
    for cached in (True, False):
        t0 = time.perf_counter()
        out = generate_group(model, prompt, gens(), 64, use_cache=cached)
        t[cached] = time.perf_counter() - t0
        t[(cached, "ids")] = out
    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-arith", "data.format=prompts", "train.objective=grpo",
            "train.global_batch=24", "train.micro_batch=6", "train.grpo.max_new_tokens=16", f"train.steps={steps}",
            "checkpoint.interval=0", "log.progress=false", "dist.reduce=canonical", f"data.cache_dir={work / 'grpo-cache'}"]
    step = {}
    for n in (1, 2):
        out = work / f"grpo-{n}"
        launch([*base, f"out_dir={out}"], work / "grpo.log", nproc=n if n > 1 else 0)
        rows = runfolder.read_metrics(out)[1:]
        step[n] = (statistics.median(r["step_s"] for r in rows), statistics.median(r["rollout_s"] / r["step_s"] for r in rows))
    return [
        {"row": "GRPO rollout, tiny shape, a group of 6 x 64 new tokens after 40", "what": "KV cache / recompute (tokens/s)",
         "value": t[False] / t[True], "detail": f"{6 * 64 / t[True]:.0f} / {6 * 64 / t[False]:.0f} tok/s; the same ids: "
                                                 f"{'yes' if torch.equal(t[(True, 'ids')], t[(False, 'ids')]) else 'NO'}"},
        {"row": "GRPO step, tiny shape, 4 prompts x 6 completions of 16 tokens, 1 process", "what": "generation / step time",
         "value": step[1][1], "detail": f"median of {steps - 1} steps of {step[1][0]:.2f} s"},
        {"row": "GRPO step, tiny shape, 4 prompts x 6 completions", "what": "step time, 2 processes / 1", "value": step[2][0] / step[1][0],
         "detail": f"{step[2][0]:.2f} s / {step[1][0]:.2f} s (each rank generates its own groups)"},
    ]


def grpo_family_rows(work: Path, steps: int) -> list[dict]:
    """TRL's GRPO family (issue 45): a variant's step time against CISPO's (the default) on 2 processes,
    where its global-batch figures are gathered."""
    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-arith", "data.format=prompts", "train.objective=grpo",
            "train.global_batch=24", "train.micro_batch=6", "train.grpo.max_new_tokens=16", f"train.steps={steps}",
            "checkpoint.interval=0", "log.progress=false", "dist.reduce=canonical", f"data.cache_dir={work / 'family-cache'}"]
    variants = {"cispo": [], "dapo": ["train.grpo.loss=dapo", "train.grpo.scale_rewards=batch", "train.grpo.mask_truncated=true"],
                "gspo": ["train.grpo.loss=grpo", "train.grpo.importance_sampling=sequence"]}
    step = {}
    for name, extra in variants.items():
        out = work / f"family-{name}"
        launch([*base, *extra, f"out_dir={out}"], work / "family.log", nproc=2)
        step[name] = statistics.median(r["step_s"] for r in runfolder.read_metrics(out)[1:])
    return [
        {"row": "GRPO family, tiny shape, 4 prompts x 6 completions of 16 tokens, 2 processes", "what": "dapo + batch std + mask_truncated / cispo step time",
         "value": step["dapo"] / step["cispo"], "detail": f"{step['dapo']:.2f} s / {step['cispo']:.2f} s (median of {steps - 1} steps; "
                                                          "the global token count and rewards gathered once a rollout)"},
        {"row": "GRPO family, tiny shape, 4 prompts x 6 completions of 16 tokens, 2 processes", "what": "GSPO (sequence-level grpo) / cispo step time",
         "value": step["gspo"] / step["cispo"], "detail": f"{step['gspo']:.2f} s / {step['cispo']:.2f} s (median of {steps - 1} steps)"},
    ]


def ppo_rows(work: Path, steps: int) -> list[dict]:
    """PPO's step against GRPO's at the same completions and updates a rollout (1 process); the critic's bytes per rank."""
    from model.critic import Critic

    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-arith", "data.format=prompts", "train.global_batch=24",
            "train.micro_batch=6", "train.grpo.max_new_tokens=16", f"train.steps={steps}", "checkpoint.interval=0", "log.progress=false",
            "dist.reduce=canonical", f"data.cache_dir={work / 'ppo-cache'}"]
    runs = {"grpo": ["train.objective=grpo", "train.grpo.updates_per_rollout=2"],
            "ppo": ["train.objective=ppo", "train.ppo.updates_per_rollout=2", "train.ppo.early_stop_kl=1e9"]}
    step = {}
    for name, extra in runs.items():
        out = work / f"ppo-{name}"
        launch([*base, *extra, f"out_dir={out}"], work / "ppo.log", nproc=0)
        step[name] = statistics.median(r["step_s"] for r in runfolder.read_metrics(out)[1:])
    cfg = load_config(ROOT / "configs" / "tiny.yaml").model
    critic = Critic(cfg)
    n = sum(p.numel() for p in critic.parameters())
    policy = sum(p.numel() for p in MiniMindLM(cfg).parameters())
    return [
        {"row": "PPO / GRPO (cispo) step, tiny shape, 4 prompts x 6 completions of 16 tokens, 2 updates a rollout, 1 process",
         "what": "step time", "value": step["ppo"] / step["grpo"],
         "detail": f"{step['ppo']:.2f} s / {step['grpo']:.2f} s (median of {steps - 1} steps: the critic's forwards and backward, "
                   "its optimizer step, the early stop's forward)"},
        {"row": "PPO critic, tiny shape (model/critic.py: the policy's body and a value head)", "what": "critic bytes per rank / policy's",
         "value": 3 * n / policy, "detail": f"{3 * n * 4 / 2**20:.2f} MiB: fp32 weights and AdamW's two moments, replicated on every rank, "
                                            f"against the policy's {policy * 4 / 2**20:.2f} MiB of fp32 weights"},
    ]


def agent_rows(work: Path, steps: int) -> list[dict]:
    """Agentic RL (data.format=agent, objectives/agent.py) at the agent recipe's shape over the seeded init, 1 process:
    the share of a step spent in the episodes (generated one at a time, batch 1 per turn, a KV cache each) and the
    model's ids those episodes generate per second."""
    out = work / "agent-1"
    launch(["--config", "configs/agent_tiny.yaml", "model.init_from=", "train.grpo.max_new_tokens=32", f"train.steps={steps}",
            "checkpoint.interval=0", "log.progress=false", "log.every=1", "dist.reduce=canonical", f"data.cache_dir={work / 'agent-cache'}",
            f"out_dir={out}"], work / "agent.log")
    rows = runfolder.read_metrics(out)[1:]
    share = statistics.median(r["rollout_s"] / r["step_s"] for r in rows)
    tok_s = statistics.median(r["completion_length"] * 24 / r["rollout_s"] for r in rows)
    step_s = statistics.median(r["step_s"] for r in rows)
    turns = statistics.mean(r["agent/turns"] for r in rows)
    return [
        {"row": "Agent step, tiny shape, 4 prompts x 6 episodes of up to 3 turns x 32 new tokens, 1 process",
         "what": "episodes / step time", "value": share, "detail": f"median of {len(rows)} steps of {step_s:.2f} s, "
                                                                    f"{turns:.2f} turns per episode (seeded init)"},
        {"row": "Agent episodes, tiny shape, batch 1 per turn with a KV cache", "what": "model ids generated per second",
         "value": tok_s, "detail": f"median over {len(rows)} rollouts (GRPO's group of 6: see the GRPO rows)"},
    ]


def ensure_serve_requirements() -> None:
    """`serve` needs FastAPI and uvicorn (requirements-serve.txt): installed here when missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r",
                        str(ROOT / "requirements-serve.txt")], check=True)


def serve_rows(work: Path, new_tokens: int, clients: int = 8) -> list[dict]:
    """`python -m checkpoint serve` over a 2-step tiny run at seq_len 512 (its weights barely trained, so
    replies run long), one thread in the server and in this process: one streamed request's tokens per
    second against generate_ids' on the same prompt and seed (the same ids); `clients` concurrent streamed
    requests: total tokens per second and the time to the first token; and eval's items per second on
    the built-in task (objectives/benchmark.py)."""
    import threading

    import httpx

    from model.generate import generate_ids
    from objectives.benchmark import evaluate_tasks, read_tasks
    from weights import load_model, load_tokenizer

    ensure_serve_requirements()
    out = work / "serve-run"
    launch(["--config", "configs/tiny.yaml", "data.path=stdlib-chat", "data.format=chat", "model.seq_len=512", "train.steps=2",
            "checkpoint.interval=0", "log.progress=false", f"data.cache_dir={work / 'serve-cache'}", f"out_dir={out}"],
           work / "serve.log")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "checkpoint", "serve", str(out), "--port", "0", "--slots", str(clients)],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
    threads = torch.get_num_threads()
    try:
        said = ""
        while not (found := re.search(r":(\d+)/v1", said)):
            line = proc.stderr.readline()
            if not line:
                raise SystemExit(f"bench: serve ended (exit {proc.wait()}) before it listened:\n{said[-3000:]}")
            said += line
        port = int(found.group(1))
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        for _ in range(600):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        messages = [{"role": "user", "content": "What does os.path.join do?"}]

        def stream(seed: int, http: httpx.Client) -> tuple[float, float, int]:
            """(seconds to the first token, seconds in all, completion tokens) of one streamed request."""
            body = {"messages": messages, "temperature": 0.9, "seed": seed, "max_tokens": new_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0, first, tokens = time.perf_counter(), None, 0
            with http.stream("POST", url, json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - t0
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return first or float("nan"), time.perf_counter() - t0, tokens

        model, tok = load_model(out), load_tokenizer(out)
        from data.chat import template_of

        prompt = tok.encode_rendered(template_of(tok).render(messages, add_generation_prompt=True))
        torch.set_num_threads(1)
        # the seed whose reply is longest among the first 10 (the same ids in both, so the longer the fairer)
        seed = max(range(10), key=lambda k: (len(generate_ids(model, prompt, new_tokens, 0.9, 0, 0.9, 1.1, tok.eos, True, k)), -k))
        gen = []
        for _ in range(3):
            t0 = time.perf_counter()
            ids = generate_ids(model, prompt, new_tokens, 0.9, 0, 0.9, 1.1, tok.eos, True, seed)
            gen.append(time.perf_counter() - t0)
        n = len(ids) - len(prompt)
        with httpx.Client(timeout=600) as http:
            stream(seed, http)  # warm-up
            single = [stream(seed, http) for _ in range(3)]
        assert n == single[0][2], f"the server generated {single[0][2]} tokens, generate_ids {n}: not the same reply"
        served_s, gen_s = statistics.median(s for _, s, _ in single), statistics.median(gen)
        results: list = [None] * clients

        def client(i: int) -> None:
            with httpx.Client(timeout=600) as http:
                results[i] = stream(100 + i, http)

        workers = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
        firsts = sorted(f for f, _, _ in results)
        total = sum(t for _, _, t in results)
        p95 = firsts[min(len(firsts) - 1, math.ceil(0.95 * len(firsts)) - 1)]
        tasks = read_tasks("arith")
        t0 = time.perf_counter()
        evaluate_tasks(load_model(out, fp32=True), tok, tasks)
        eval_s, eval_threads = time.perf_counter() - t0, torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
        proc.terminate()
        proc.wait(timeout=60)
    items = len(tasks[0].items)
    return [
        {"row": f"serve, tiny shape at seq_len 512, one streamed request of {n} tokens, 1 thread", "what":
         "served stream / generate_ids tokens per second", "value": gen_s / served_s, "aim": "served stream / generate_ids tokens per second",
         "detail": f"{n / served_s:.0f} tok/s through HTTP (SSE, the openai chunk format) / {n / gen_s:.0f} tok/s in process "
                   f"(medians of 3; the same ids)"},
        {"row": f"serve, {clients} concurrent streamed requests of up to {new_tokens} tokens, --slots {clients}, 1 thread",
         "what": "total tokens per second", "value": total / wall,
         "detail": f"{total} tokens in {wall:.2f} s; time to the first token p50 {statistics.median(firsts) * 1e3:.0f} ms, "
                   f"p95 {p95 * 1e3:.0f} ms (one token per reply per turn)"},
        {"row": f"eval, the built-in arith task ({items} items x 4 choices), tiny shape", "what": "items per second",
         "value": items / eval_s, "detail": f"{items} items in {eval_s:.2f} s ({eval_threads} thread{'s' if eval_threads > 1 else ''}; one forward "
                                                     f"of the 4 choices per item)"},
    ]


def distill_rows(work: Path, steps: int) -> list[dict]:
    """Distillation on the built-in chats at the tiny shape (seq_len 256, batch 16 rows, 1 process):
    step time with a live teacher of twice the student's width against next-token training of the
    student alone, and their peak RSS; the teacher's top 32 precomputed against the live teacher;
    the table's bytes per taught position; under fsdp the teacher's bytes per rank (it is
    replicated) against the student's shard."""
    import numpy as np

    from objectives.tables import TableFiles, read_verified

    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-chat", "data.format=chat", "model.seq_len=256", "train.global_batch=16",
            "train.micro_batch=4", f"train.steps={steps}", "checkpoint.interval=0", "log.progress=false",
            f"data.cache_dir={work / 'distill-cache'}"]
    wide = ["model.dim=256", "model.n_heads=8", "model.n_kv_heads=4"]  # the default's heads of 32 at twice the width
    launch([*base, *wide, "train.steps=1", f"out_dir={work / 'distill-teacher'}"], work / "distill.log")
    distill = ["train.objective=distill", f"train.distill.teacher={work / 'distill-teacher'}"]
    t, rss = {}, {}
    for name, extra in (("student", []), ("live", distill), ("top32", [*distill, "train.distill.top_k=32"])):
        out = work / f"distill-{name}"
        rss[name], _ = run_rss([*base, *extra, f"out_dir={out}"], work)
        t[name] = step_median(out, 2)
    (table,) = (p for p in (work / "distill-cache").rglob("*.teacher-*-K32-*") if p.is_dir())
    empty = {"logits": np.zeros((0, 32), np.float32), "ids": np.zeros((0, 32), np.uint16)}
    positions = sum(len(item["ids"]) for item in read_verified(TableFiles(table), empty, str(table))[0].values())
    size = sum(p.stat().st_size for p in table.iterdir())
    teacher, student = (load_config(ROOT / "configs" / "tiny.yaml", [*base[2:], *w]).model for w in (wide, []))
    tb, sb = (MiniMindLM(c).num_parameters() * 4 for c in (teacher, student))
    return [{"row": "distillation, tiny shape at seq_len 256, batch 16 chat rows, 1 process, a live teacher of 2x width (dim 256)",
             "what": "distill (live teacher) / next-token, step time", "value": t["live"] / t["student"],
             "detail": f"{t['live'] * 1e3:.0f} ms / {t['student'] * 1e3:.0f} ms (the teacher: one forward per row, no graph)"},
            {"row": "distillation, the same runs", "what": "distill (live teacher) / next-token, peak RSS", "value": rss["live"] / rss["student"],
             "detail": f"{rss['live'] / 2**20:.0f} MiB / {rss['student'] / 2**20:.0f} MiB (VmHWM of the whole process)"},
            {"row": "distillation, the teacher's top 32 precomputed before training", "what": "distill, top-32 precomputed / live teacher, step time",
             "value": t["top32"] / t["live"], "aim": "distill, top-32 precomputed / live teacher, step time",
             "detail": f"{t['top32'] * 1e3:.0f} ms / {t['live'] * 1e3:.0f} ms"},
            {"row": "distillation's top-32 table", "what": "bytes per taught position", "value": size / positions,
             "detail": f"{size / 2**20:.2f} MiB for {positions:,} taught positions (32 fp32 logits + 32 uint16 ids each)"},
            {"row": "distillation under fsdp, 2 processes (from the parameter counts)", "what": "teacher bytes per rank / student's shard",
             "value": tb / (sb / 2), "detail": f"{tb / 2**20:.2f} MiB (replicated: every rank holds the whole fp32 teacher) / "
                                                f"{sb / 2 / 2**20:.2f} MiB (half the student's fp32 parameters)"}]


def store_rows(work: Path, repeat: int) -> list[dict]:
    """A run folder in object storage (docs/object_storage.md), against SeaweedFS on loopback (the
    tests' server, tests/seaweed.py: `weed mini` on 127.0.0.1, its data on this disk), the 26M and
    104M shapes, interleaved round by round with their floors: a sync save to the store against a raw
    multipart put of the same bytes (boto3's own upload_fileobj, 8 MiB parts, the files at once, 4
    parts of each in flight: our part size and concurrency); a verified resume from the store against
    a raw get (download_fileobj, the same parts and concurrency) + sha256 of the same objects; the
    async stall with an s3 out_dir against the local one. Then a fresh node's seconds from launch to
    its first step against a warm node's, and the bytes it fetched (counted by a proxy in front of the
    server) against the step folder's."""
    import concurrent.futures
    import io

    sys.path.insert(0, str(ROOT / "tests"))
    import seaweed
    from boto3.s3.transfer import TransferConfig

    from checkpoint.remote import RemoteStore
    from common.store import RemotePath, store_of

    server = seaweed.Seaweed(work / "seaweed").start()
    saved_env = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    rows: list[dict] = []
    try:
        client = server.client()
        transfer = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=4, use_threads=True)
        log_quiet()
        for label, mcfg in (("26M", small_model()), ("104M", shape_104m())):
            model, opt = trained_states(mcfg)
            cfg = load_config(None, SMALL)
            cfg.model = mcfg
            meta = bench_meta(cfg)
            states = {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train": TrainState(step=1)}
            step = iter(range(1, 10_000))
            url = f"s3://{seaweed.BUCKET}/bench-{label}"
            mgr = CheckpointManager(CheckpointConfig(interval=1, keep=2), url, Runtime(), meta)
            s3_async = CheckpointManager(CheckpointConfig(interval=1, keep=2, async_=True), f"{url}-async", Runtime(), meta)
            local_async = CheckpointManager(CheckpointConfig(interval=1, keep=2, async_=True), work / f"store-local-async-{label}", Runtime(), meta)
            mgr.load({})
            s3_async.load({})
            times: dict[str, list[float]] = {k: [] for k in ("save", "put", "load", "get", "s3_stall", "local_stall")}
            nbytes = 0
            for r in range(repeat):
                s, seconds = timed_save(mgr, states, step)
                times["save"].append(seconds)
                remote = RemoteStore(RemotePath(url))
                folder = remote.root / storage.step_dir_name(s)
                body = remote.read_manifest(folder)
                where = remote.files(folder, body)
                contents = {name: store_of(seaweed.BUCKET).get((where / name).key)[0] for name in body["files"]}
                nbytes = sum(len(v) for v in contents.values())
                with concurrent.futures.ThreadPoolExecutor(len(contents)) as pool:
                    t0 = time.perf_counter()
                    list(pool.map(lambda kv: client.upload_fileobj(io.BytesIO(kv[1]), seaweed.BUCKET, f"bench-raw-{label}/{kv[0]}",
                                                                    Config=transfer), contents.items()))
                    times["put"].append(time.perf_counter() - t0)
                del contents
                fresh_model = MiniMindLM(mcfg)
                fresh = {"model": ModelState(fresh_model), "optimizer": OptimizerState(fresh_model, make_optimizer(fresh_model, cfg.train)),
                         "train": TrainState()}
                loader = CheckpointManager(CheckpointConfig(interval=1, keep=2), url, Runtime(), meta)
                t0 = time.perf_counter()
                assert loader.load(fresh).step == s
                times["load"].append(time.perf_counter() - t0)
                loader.close()

                def get_and_hash(name: str) -> str:
                    buf = io.BytesIO()
                    client.download_fileobj(seaweed.BUCKET, f"bench-raw-{label}/{name}", buf, Config=transfer)
                    return hashlib.sha256(buf.getbuffer()).hexdigest()

                with concurrent.futures.ThreadPoolExecutor(len(body["files"])) as pool:
                    t0 = time.perf_counter()
                    list(pool.map(get_and_hash, body["files"]))
                    times["get"].append(time.perf_counter() - t0)
                times["s3_stall"].append(timed_save(s3_async, states, step)[1])
                s3_async.wait()
                times["local_stall"].append(timed_save(local_async, states, step)[1])
                local_async.wait()
            for m in (mgr, s3_async, local_async):
                m.close()
            t = {k: statistics.median(v) for k, v in times.items()}
            rows += [
                {"row": f"sync save to the store, {label}, SeaweedFS on loopback", "what": "store save / raw multipart put of the same bytes",
                 "value": t["save"] / t["put"], "aim": "store save / raw multipart put",
                 "detail": f"{t['save']:.2f} s / {t['put']:.2f} s for {nbytes / 2**20:.0f} MiB (boto3 upload_fileobj, 8 MiB parts, "
                           f"the files at once, 4 parts each in flight); median of {repeat}"},
                {"row": f"verified resume from the store, {label}, SeaweedFS on loopback", "what": "store resume / raw get + sha256",
                 "value": t["load"] / t["get"], "aim": "store resume / raw get + sha256",
                 "detail": f"{t['load']:.2f} s (discovery, every byte read and hashed, DCP's load, the identity) / {t['get']:.2f} s "
                           f"(boto3 download_fileobj, the same parts and concurrency, then sha256); median of {repeat}"},
                {"row": f"async stall, {label}, s3 out_dir vs local", "what": "async stall, store / local",
                 "value": t["s3_stall"] / t["local_stall"], "aim": "async stall, store / local",
                 "detail": f"{t['s3_stall'] * 1e3:.0f} ms / {t['local_stall'] * 1e3:.0f} ms until save() returned; median of {repeat}"},
            ]
            del model, opt, states
        rows += fresh_node_rows(work, server)
    finally:
        server.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rows


def fresh_node_rows(work: Path, server) -> list[dict]:
    """A resume on a node that never saw the run (an empty staging folder and data cache) against
    one on the node that ran it, through a proxy that counts the bytes the store sent: seconds from
    the launch to the first step's metrics line, and the bytes fetched against the step folder's."""
    import seaweed

    from checkpoint.remote import RemoteStore
    from common.store import RemotePath

    tok = vocab_6400(work)
    args = [sys.executable, "train.py", *SMALL, f"data.tokenizer={tok}", "model.seq_len=64", "train.global_batch=2",
            "train.micro_batch=1", "log.progress=false", "checkpoint.interval=0"]
    url = f"s3://{seaweed.BUCKET}/bench-fresh"
    first = subprocess.run([*args, "train.steps=2", f"data.cache_dir={work / 'warm-cache'}", f"out_dir={url}"], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "MINIMIND_STAGING_DIR": str(work / "warm-staging")})
    assert first.returncode == 0, first.stderr[-2000:]
    got: dict[str, tuple[float, int]] = {}
    proxy = seaweed.FaultProxy(server, lambda method, path, n: None)  # forwards everything, counting the bytes sent back
    try:
        # the warm node resumes step 2 on its own disk's cache and staging; the fresh one then resumes step 3 with neither
        for name, cache, staging, steps in (("warm", "warm-cache", "warm-staging", 3), ("fresh", "fresh-cache", "fresh-staging", 4)):
            before, out = proxy.sent, work / f"{name}.log"
            t0 = time.perf_counter()
            proc = subprocess.Popen([*args, f"train.steps={steps}", f"data.cache_dir={work / cache}", f"out_dir={url}"], cwd=ROOT,
                                    stdout=open(out, "w"), stderr=subprocess.STDOUT,
                                    env={**os.environ, "MINIMIND_STAGING_DIR": str(work / staging), "AWS_ENDPOINT_URL": proxy.endpoint})
            metrics = work / staging / seaweed.BUCKET / "bench-fresh" / runfolder.METRICS
            while (not metrics.exists() or len(metrics.read_text().splitlines()) < steps) and proc.poll() is None:
                time.sleep(0.02)  # the staged log holds the steps before (from the store), then the first step's line
            got[name] = (time.perf_counter() - t0, proxy.sent - before)
            proc.wait(timeout=600)
            assert proc.returncode == 0, out.read_text()[-2000:]
    finally:
        proxy.close()
    remote = RemoteStore(RemotePath(url))
    steps = remote.list_steps()
    body = remote.read_manifest(steps[-1][1]) if steps else {"files": {}}
    step_bytes = sum(e["bytes"] for e in body["files"].values())
    (tw, bw), (tf, bf) = got["warm"], got["fresh"]
    return [{"row": "a fresh node's launch to its first step, 26M, 1 process, SeaweedFS on loopback", "what": "fresh node / warm node, seconds",
             "value": tf / tw, "detail": f"{tf:.1f} s / {tw:.1f} s from the launch to the first step's line (both read the checkpoint "
                                         f"from the store; the fresh one packs its corpus again: data.cache_dir is local)"},
            {"row": "a fresh node's bytes from the store, 26M", "what": "bytes fetched / the step folder's bytes", "value": bf / step_bytes,
             "detail": f"{bf / 2**20:.1f} MiB / {step_bytes / 2**20:.1f} MiB (the warm node fetched {bw / 2**20:.1f} MiB)"}]


SECTIONS = ("checkpoint", "throughput", "loop", "peer", "compile", "models", "lora", "dpo", "grpo", "corpora", "packing", "sft",
            "sharding", "generation", "serve", "distill", "mix", "grpo_family", "ppo", "agent", "store")


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


def small_model() -> ModelConfig:
    """The 26M shape (SMALL) with MiniMind's 6,400-id vocabulary."""
    cfg = load_config(None, SMALL).model
    cfg.vocab_size = 6400
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, rounds and steps")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here (docs/bench.json is a full run's, whole; with "
                                                  "--only, the sections run replace theirs in an existing file: reruns says when)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    parser.add_argument("--corpus-mb", type=int, default=200, help="size of the packing rows' generated corpus (and twice it)")
    a = parser.parse_args(argv)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=ROOT / "runs" if (ROOT / "runs").exists() else None))
    q = a.quick
    wanted = set(a.only or SECTIONS)
    sections = {
        "checkpoint": lambda: [*resume_rows(10_000_000),  # first: its peak-RSS figure needs a process that has not peaked yet
                               *checkpoint_rows("26M", small_model(), 3 if q else 5, work, aimed=True),
                               *checkpoint_rows("104M", shape_104m(), 2 if q else 3, work, aimed=True),
                               *([] if q else stop_rows(work))],
        "throughput": lambda: throughput_rows(20 if q else 40, 2 if q else 4, work),
        "loop": lambda: [*loop_rows(15 if q else 30, 2 if q else 4, work), *reduce_rows(15 if q else 30, work)],
        "peer": lambda: peer_rows(work, 3 if q else 5, 8 if q else 25, 2 if q else 3),
        "compile": lambda: [*compile_rows(work, 3 if q else 5, 8 if q else 25), *checkpointing_rows(work, 3 if q else 5)],
        "models": lambda: models_rows(work, 4 if q else 6),
        "lora": lambda: lora_rows(work),
        "dpo": lambda: dpo_rows(work, 6 if q else 12),
        "grpo": lambda: grpo_rows(work, 4 if q else 8),
        "corpora": lambda: [*order_rows(), *launch_rows(work, 0.2 if q else 2.0, 3)],
        "packing": lambda: packing_rows(work, 50 if q else a.corpus_mb),
        "sft": lambda: sft_rows(work, 1000 if q else 4000, 6 if q else 12),
        "sharding": lambda: sharding_rows(work, 6 if q else 10),
        "generation": lambda: generation_rows(64 if q else 256),
        "serve": lambda: serve_rows(work, 128 if q else 256),
        "distill": lambda: distill_rows(work, 6 if q else 12),
        "mix": lambda: mix_rows(work, 20 if q else 40, 3 if q else 5),
        "grpo_family": lambda: grpo_family_rows(work, 4 if q else 8),
        "ppo": lambda: ppo_rows(work, 4 if q else 8),
        "agent": lambda: agent_rows(work, 4 if q else 8),
        "store": lambda: store_rows(work, 2 if q else 3),
    }
    rows: list[dict] = []
    try:
        for name in SECTIONS:
            if name in wanted:
                t1 = time.time()
                got = sections[name]()
                for row in got:
                    row["section"] = name
                rows += got
                print(f"[bench] {name}: {len(got)} rows, {time.time() - t1:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(rows, a, t0)


def report(rows: list[dict], a: argparse.Namespace, t0: float) -> int:
    for row in rows:
        aim = AIMS.get(row.get("aim") or "")
        row["aim"] = f"{aim[0]} {aim[1]}" if aim else ""
        row["meets_aim"] = (row["value"] <= aim[1] if aim[0] == "<=" else row["value"] >= aim[1]) if aim else None
    print(f"bench ({' '.join(a.only) if a.only else ('quick' if a.quick else 'full')}, {time.time() - t0:.0f} s, torch {torch.__version__}, "
          f"{os.cpu_count()} cores)\n")
    print("| measured | ratio | value | aim | figures |")
    print("|---|---|---|---|---|")
    for row in rows:
        mark = "" if row["meets_aim"] is None else (" ✓" if row["meets_aim"] else " ✗")
        print(f"| {row['row']} | {row['what']} | {row['value']:.3f} | {row['aim']}{mark} | {row['detail']} |")
    if a.json:
        run = {"command": " ".join(["python", "scripts/bench.py", *(argv_of(a))]), "quick": a.quick, "only": a.only,
               "seconds": round(time.time() - t0), "torch": torch.__version__, "cores": os.cpu_count(),
               "mkl_cbwr": os.environ.get("MKL_CBWR", "(MKL's default)"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        if a.only and a.json.exists():  # some sections again: their rows replace theirs, the others' stay, each run said
            old = json.loads(a.json.read_text())
            kept = [r for r in old["rows"] if r.get("section") not in a.only]
            rows = sorted(kept + rows, key=lambda r: SECTIONS.index(r["section"]) if r.get("section") in SECTIONS else len(SECTIONS))
            reruns = {**old.get("reruns", {}), **{name: {k: run[k] for k in ("command", "seconds", "date", "torch", "cores", "mkl_cbwr")}
                                                  for name in a.only}}
            run = {**{k: v for k, v in old.items() if k not in ("rows", "aims_missed", "reruns")}, "reruns": reruns}
        run["aims_missed"] = [r["what"] for r in rows if r["meets_aim"] is False]
        a.json.write_text(json.dumps({**run, "rows": rows}, indent=1) + "\n")
    return 0


def argv_of(a: argparse.Namespace) -> list[str]:
    return sys.argv[1:]


if __name__ == "__main__":
    sys.exit(main())
