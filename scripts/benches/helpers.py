"""What more than one section uses: launching train.py, reading its metrics, the shapes, the tokenizer and corpora, timed saves."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import train
from checkpoint import CheckpointManager, RunMeta
from configs import load_config, to_dict
from data import resolve_source
from model import MiniMindLM, ModelConfig
from objectives import make_optimizer
from run import folder as runfolder

from . import ROOT

MINIMIND_TOKENIZER = ROOT.parent / "shared" / "minimind" / "tokenizer.json"
UPSTREAM = ROOT.parent / "shared" / "minimind" / "upstream"
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


def small_model() -> ModelConfig:
    """The 26M shape (SMALL) with MiniMind's 6,400-id vocabulary."""
    cfg = load_config(None, SMALL).model
    cfg.vocab_size = 6400
    return cfg


def shape_104m() -> ModelConfig:
    """MiniMind2's 104M shape (dim 768, 16 layers, 8 heads, 2 KV heads, FFN 2048) with its 6,400-id
    vocabulary: about 4x the 26M rows' model."""
    cfg = small_model()
    cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim = 768, 16, 8, 2, 2048
    return cfg
