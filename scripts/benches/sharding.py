"""dist.strategy=fsdp against ddp: per-rank memory on 2 and 4 processes, and step time, save time and async stall on 2."""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from . import section
from .helpers import ROOT, SMALL, launch, step_median, vocab_6400


AIMS = {
    "async stall / sync stall": ("<=", 0.2),
    "fsdp / ddp memory, 2 processes": ("<=", 0.55),
    "fsdp / ddp memory, 4 processes": ("<=", 0.3),
}


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


@section("sharding", order=130, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return sharding_rows(work, 6 if q else 10)
