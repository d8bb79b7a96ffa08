"""Our loop beside MiniMind's own trainer, unmodified, on the same corpus, shape and batch."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from configs import load_config
from model import MiniMindLM

from . import section
from .helpers import MINIMIND_TOKENIZER, ROOT, SMALL, UPSTREAM, launch, mixed_corpus, small_model, vocab_6400


AIMS = {
    "ours / MiniMind's trainer, time per step": ("<=", 1.05),
    "spread of ours / MiniMind's time per step over the rounds": ("<=", 0.05),
    "ours / MiniMind's trainer, loss-carrying tokens per second": (">=", 2.0),
    "ours compiled / MiniMind's default trainer, loss-carrying tokens per second": (">=", 3.0),
    "model FLOPs utilisation, compiled": (">=", 0.5),
}


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


@section("peer", order=40, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return peer_rows(work, 3 if q else 5, 8 if q else 25, 2 if q else 3)
