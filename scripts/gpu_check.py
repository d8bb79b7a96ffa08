"""The GPU check behind scripts/gpu_check.sh: exact resume on CUDA (eager, FSDP, compiled, one and two
processes), the time per step beside MiniMind's own trainer at its shape, the deterministic mode's
kernels and their cost, no host read inside a step, MFU at the 104M shape, save stalls.

Uses only what a GPU image has (torch with CUDA, numpy, pyyaml, tqdm, tokenizers); MiniMind's
trainer also needs `datasets`, which a GPU image may lack: it is installed from a folder of wheels
next to the checkout when one is there (MINIMIND_WHEELS, or .whl/), else the peer rows say they were
skipped. MiniMind's code is read from ../shared/minimind/upstream (or MINIMIND_UPSTREAM) and run,
unmodified, from a scratch copy. Prints one markdown table and writes gpu_check.json into $OUT (or
runs/gpu_check). `--cpu-dry-run` runs the same plan, shrunk, on the CPU: it checks the script, not
the GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Dense bf16 tensor-core peak, TFLOP/s, by the name the driver reports (GPU_PEAK_TFLOPS overrides).
PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0, "4090": 165.2}
AIMS = {
    "ours deterministic / MiniMind default, eager": 1.00, "ours deterministic / MiniMind default, compiled": 1.00,
    "ours non-deterministic / MiniMind default, eager": 0.90, "ours non-deterministic / MiniMind default, compiled": 0.90,
}
"""Time per step, ours / MiniMind's trainer at the same shape and batch (issue: at most these); MFU_AIM below."""
MFU_AIM = 0.25
"""MFU at MiniMind2's 104M shape, compiled, bit-exact: at least this fraction of the dense bf16 datasheet figure."""
STALL_AIM = 0.2
"""async stall / sync stall, the aim scripts/bench.py sets on the CPU."""


def minimind_shape(dim: int, layers: int) -> list[str]:
    """MiniMind's trainer at --hidden_size dim --num_hidden_layers layers, as our keys: its defaults are 8
    heads, 4 KV heads, an FFN of ceil(dim pi / 64) * 64 (1664 at 512), q/k norms, eps 1e-6, theta 1e6
    (configs/minimind3_small.yaml gives the last three)."""
    return [f"model.dim={dim}", f"model.n_layers={layers}", "model.n_heads=8", "model.n_kv_heads=4",
            f"model.hidden_dim={math.ceil(dim * math.pi / 64) * 64}"]


def launch(nproc: int, args: list[str], log: Path, timeout: int = 300, env: dict | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py", *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\nTIMEOUT after {timeout}s\n{e.stdout or ''}{e.stderr or ''}\n")
        return 124, ""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    return proc.returncode, proc.stderr


def final(run: Path) -> tuple[str | None, list[float]]:
    from cli.inspect import inspect_path
    from run import folder

    try:
        sha = inspect_path(run)["model_sha256"]
    except Exception:  # noqa: BLE001 - reported as a failed row
        sha = None
    losses = [m["loss"] for m in folder.read_metrics(run)] if (run / folder.METRICS).exists() else []
    return sha, losses


def halt_resume(work: Path, name: str, args: list[str], steps: int, first: int, then: int, what: str) -> dict:
    """`steps` at once on `then` processes against `steps // 2` on `first` and the rest on `then`."""
    ref, run, log = work / f"ref-{name}", work / f"run-{name}", work / f"launches-{name}.log"
    t0 = time.time()
    codes = [launch(then, [*args, f"train.steps={steps}", f"out_dir={ref}"], log)[0],
             launch(first, [*args, f"train.steps={steps}", f"train.halt_at={steps // 2}", f"out_dir={run}"], log)[0],
             launch(then, [*args, f"train.steps={steps}", f"out_dir={run}"], log)[0]]
    (sa, la), (sb, lb) = final(ref), final(run)
    ok = codes == [0, 0, 0] and sa is not None and sa == sb and la == lb and len(la) == steps
    return {"check": f"{what}: {steps} steps on {then} vs {steps // 2} on {first} + {steps // 2} on {then}",
            "result": "bit-identical" if ok else f"DIFFERENT (exit codes {codes})",
            "detail": f"sha256 {str(sa)[:12]}… vs {str(sb)[:12]}…, {len(lb)} losses equal: {la == lb}",
            "ok": ok, "seconds": round(time.time() - t0, 1)}


def exactness_plans(base: list[str], steps: int, device: str) -> list[tuple]:
    """Every exact-resume row as (name, args, steps, first, then, what), to be run side by side."""
    plans = []
    gpus = torch.cuda.device_count() if device == "cuda" else 2
    for dtype in ("float32", "bfloat16"):
        for nproc in (1, 2):
            # nccl refuses two ranks on one GPU: two processes sharing it talk over gloo, with CUDA tensors.
            backend = "nccl" if device == "cuda" and nproc <= gpus else "gloo"
            plans.append((f"{dtype}-{nproc}", [*base, f"train.dtype={dtype}", f"dist.backend={backend}"], steps, nproc, nproc,
                          f"{dtype} ({backend}, {nproc} process{'es' * (nproc > 1)})"))
    # dist.reduce=canonical halted on 2 and resumed on 3 against 1: the world-size promise, on the GPU
    three = "nccl" if device == "cuda" and gpus >= 3 else "gloo"
    plans.append(("canonical-2-3", [*base, "train.dtype=bfloat16", "dist.reduce=canonical", f"dist.backend={three}",
                                    "train.global_batch=12", "train.micro_batch=2"], steps, 2, 3,
                  f"bfloat16, dist.reduce=canonical, 2 then 3 processes ({three}) against 3 throughout"))
    fsdp = [*base, "dist.strategy=fsdp", "train.dtype=bfloat16", "checkpoint.interval=0"]
    plans.append(("fsdp-1-1", [*fsdp, f"dist.backend={'nccl' if device == 'cuda' else 'gloo'}"], steps, 1, 1,
                  "fsdp, bfloat16, dist.reduce=ddp"))
    two = "nccl" if device == "cuda" and gpus >= 2 else "gloo"
    plans.append(("fsdp-canonical-2-1", [*fsdp, "dist.reduce=canonical", f"dist.backend={two}"], steps, 2, 1,
                  f"fsdp, bfloat16, dist.reduce=canonical, 2 then 1 ({two} on 2)"))
    compiled = [*base, "train.compile=true", "dist.reduce=canonical", "train.dtype=float32", "checkpoint.interval=0"]
    moe = ["model.moe.experts=4", "model.moe.top_k=1", "model.qk_norm=true", "dist.strategy=fsdp"]
    plans.append(("compiled-2-1", [*compiled, f"dist.backend={two}"], max(steps // 3, 8), 2, 1,
                  f"compiled, float32, dist.reduce=canonical ({two} on 2)"))
    plans.append(("compiled-moe-fsdp", [*compiled, *moe, f"dist.backend={'nccl' if device == 'cuda' else 'gloo'}"],
                  max(steps // 3, 8), 1, 1, "compiled MoE (4 experts, top-1) under fsdp, float32, canonical"))
    return plans


def exactness(work: Path, base: list[str], steps: int, device: str, parallel: int) -> list[dict]:
    """The exact-resume rows, `parallel` at a time (their timings are not reported: they share the GPU)."""
    plans = exactness_plans(base, steps, device)
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        rows = list(pool.map(lambda p: halt_resume(work, *p), plans))
    with open(work / "launches.log", "a") as out:
        for name, *_ in plans:
            out.write((work / f"launches-{name}.log").read_text())
    return rows


def flops_per_token(cfg) -> float:
    """6 N (matmul parameters, the tied output head included) + 12 L T d (attention scores and values)."""
    d, L, T = cfg.dim, cfg.n_layers, cfg.seq_len
    kv = cfg.n_kv_heads * cfg.head_size
    per_layer = d * cfg.n_heads * cfg.head_size * 2 + d * kv * 2 + 3 * d * cfg.ffn_dim
    n = L * per_layer + cfg.vocab_size * d
    return 6 * n + 12 * L * T * cfg.n_heads * cfg.head_size


def peak_tflops(device: str) -> tuple[str, float]:
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return name, float(os.environ.get("GPU_PEAK_TFLOPS", 0)) or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)


# --------------------------------------------------------------------------- beside MiniMind's trainer
def upstream() -> Path | None:
    """MiniMind's code at the shared commit (its trainer, model, dataset and tokenizer), or None."""
    for p in (os.environ.get("MINIMIND_UPSTREAM"), ROOT.parent / "shared" / "minimind" / "upstream", ROOT / ".gpu" / "upstream"):
        if p and (Path(p) / "trainer" / "train_pretrain.py").is_file() and (Path(p) / "model" / "tokenizer.json").is_file():
            return Path(p)
    return None


def peer_env(work: Path) -> tuple[dict | None, str]:
    """The environment MiniMind's trainer runs in: this python, plus `datasets` from a folder of wheels
    when this python lacks it. (None, why) when it cannot run."""
    probe = [sys.executable, "-c", "import datasets, transformers"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return {}, "datasets and transformers from this python"
    for folder in (os.environ.get("MINIMIND_WHEELS"), ROOT / ".whl", ROOT.parent / "wheels"):
        if folder and any(Path(folder).glob("datasets-*.whl")):
            site = work / "peer-site"
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                   "--target", str(site), *map(str, Path(folder).glob("*.whl"))], capture_output=True, text=True)
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
            if proc.returncode == 0 and subprocess.run(probe, capture_output=True, env={**os.environ, **env}).returncode == 0:
                return env, f"datasets from the wheels in {folder}"
            return None, f"the wheels in {folder} did not install or import: {proc.stderr.strip()[-300:]}"
    return None, "this python has no `datasets` (MiniMind's trainer imports it) and no folder of wheels was found"


def peer_corpus(path: Path, lines: int, chars: int) -> Path:
    """A MiniMind-format JSONL of `lines` documents of at least `chars` characters each (the standard
    library's docstrings, joined in order): every document fills MiniMind's row, so both trainers
    compute every position of every row."""
    from data.prepare import _stdlib_docstrings

    docs = (doc for _, _, doc in _stdlib_docstrings())
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            text = ""
            while len(text) < chars:
                text += next(docs) + "\n\n"
            f.write(json.dumps({"text": text}) + "\n")
    return path


def minimind_time(scratch: Path, corpus: Path, shape: dict, compiled: bool, steps: int, warm: int, env: dict,
                  device: str, log: Path) -> float:
    """Seconds per step of MiniMind's train_pretrain.py, unmodified: the time between its log lines at
    steps `warm` and `steps` (each line reads the loss: a device sync) over the steps between."""
    cmd = [sys.executable, "train_pretrain.py", "--data_path", str(corpus), "--hidden_size", str(shape["dim"]),
           "--num_hidden_layers", str(shape["layers"]), "--max_seq_len", str(shape["seq_len"]), "--batch_size", str(shape["batch"]),
           "--accumulation_steps", "1", "--epochs", "1", "--num_workers", "4", "--log_interval", str(warm),
           "--save_interval", "1000000", "--save_dir", str(scratch / "out"), "--use_compile", str(int(compiled)),
           "--device", "cuda:0" if device == "cuda" else "cpu", "--dtype", "bfloat16"]
    seen: dict[int, float] = {}
    proc = subprocess.Popen(cmd, cwd=scratch / "trainer", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    out = []
    for line in proc.stdout:
        out.append(line)
        if m := re.search(r"\((\d+)/(\d+)\), loss", line):
            seen[int(m.group(1))] = time.perf_counter()
    proc.wait()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{''.join(out[-60:])}\n")
    if proc.returncode != 0 or warm not in seen or steps not in seen:
        raise RuntimeError(f"MiniMind's trainer exited {proc.returncode} (log lines at {sorted(seen)}): {''.join(out[-5:])}")
    return (seen[steps] - seen[warm]) / (steps - warm)


def ours_args(corpus: Path, tokenizer: Path, shape: list[str], batch: int, seq_len: int, compiled: bool, deterministic: bool,
              steps: int, warm: int, out: Path, device: str) -> list[str]:
    return ["--config", "configs/minimind3_small.yaml", *shape, f"model.seq_len={seq_len}", f"data.path={corpus}",
            f"data.tokenizer={tokenizer}", f"data.cache_dir={out.parent / 'peer-cache'}", f"train.global_batch={batch}",
            f"train.micro_batch={batch}", f"train.steps={steps}", f"log.every={warm}", "checkpoint.interval=0", "log.progress=false",
            f"train.dtype={'bfloat16' if device == 'cuda' else 'float32'}", f"train.compile={str(compiled).lower()}",
            f"runtime.deterministic={str(deterministic).lower()}", f"runtime.device={device}", f"out_dir={out}"]


def ours_time(args: list[str], out: Path, steps: int, warm: int, log: Path) -> float:
    """Seconds per step of train.py: the wall time between its lines of steps `warm` and `steps` (both
    log steps, where the lines are written and the device read) over the steps between."""
    from run import folder

    shutil.rmtree(out, ignore_errors=True)
    code, err = launch(1, args, log)
    if code != 0:
        raise RuntimeError(f"train.py exited {code}: {err[-400:]}")
    at = {m["step"]: m["elapsed_s"] for m in folder.read_metrics(out)}
    return (at[steps] - at[warm]) / (steps - warm)


def peer(work: Path, device: str, dry: bool) -> list[dict]:
    """Ours beside MiniMind's train_pretrain.py at its shape, same corpus, tokenizer and batch, eager
    and compiled, ours in both deterministic modes: time per step, tokens/s, MFU and the ratios."""
    from configs import load_config

    up = upstream()
    if up is None:
        return [{"check": "beside MiniMind's trainer", "result": "SKIPPED", "ok": None,
                 "detail": "MiniMind's code is not at ../shared/minimind/upstream, .gpu/upstream or MINIMIND_UPSTREAM"}]
    env, how = peer_env(work)
    if env is None:
        return [{"check": "beside MiniMind's trainer", "result": "SKIPPED", "ok": None, "detail": how}]
    dim, layers, seq_len, batch, steps, warm = (64, 2, 64, 4, 12, 4) if dry else (512, 8, 512, 32, 100, 20)
    shape = minimind_shape(dim, layers)
    scratch = work / "minimind"
    shutil.copytree(up, scratch)
    tokenizer = scratch / "model" / "tokenizer.json"
    corpus = peer_corpus(work / "peer.jsonl", batch * steps, 6 * seq_len)
    log = work / "peer.log"
    times: dict[str, float] = {}
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        times[f"minimind {mode}"] = minimind_time(scratch, corpus, {"dim": dim, "layers": layers, "seq_len": seq_len, "batch": batch},
                                                  compiled, steps, warm, env, device, log)
        for det in (True, False):
            out = work / f"ours-{mode}-{det}"
            times[f"ours {'deterministic' if det else 'non-deterministic'} {mode}"] = ours_time(
                ours_args(corpus, tokenizer, shape, batch, seq_len, compiled, det, steps, warm, out, device), out, steps, warm, log)
    cfg = load_config(ROOT / "configs" / "minimind3_small.yaml", [*shape, f"model.seq_len={seq_len}", f"data.tokenizer={tokenizer}"]).model
    name, peak = peak_tflops(device)
    per_token = flops_per_token(cfg)
    rows = []
    for key, t in times.items():
        tps = batch * seq_len / t
        mfu = tps * per_token / (peak * 1e12) if peak else float("nan")
        rows.append({"check": f"time per step, {key}, MiniMind's shape (dim {dim}, {layers} layers, 8 heads, 4 KV), batch {batch} x {seq_len}",
                     "result": f"{t * 1e3:.1f} ms", "ok": None, "seconds_per_step": t, "tokens_per_s": tps, "mfu": mfu,
                     "detail": f"{tps:,.0f} tokens/s, MFU {mfu:.1%} ({per_token / 1e6:.0f}M FLOP/token, {peak} TFLOP/s {name})"})
    for who in ("deterministic", "non-deterministic"):
        for mode in ("eager", "compiled"):
            ratio = times[f"ours {who} {mode}"] / times[f"minimind {mode}"]
            aim = AIMS[f"ours {who} / MiniMind default, {mode}"]
            rows.append({"check": f"ours {who} / MiniMind default, {mode}, time per step", "result": f"{ratio:.3f}",
                         "ok": None if dry else ratio <= aim, "ratio": ratio,
                         "detail": f"aim <= {aim:.2f}{' (a report in the dry run: its shape is shrunk)' if dry else ''}; "
                                   f"steps {warm} to {steps}, MiniMind's trainer unmodified ({how})"})
    return rows


def mfu_104m(work: Path, device: str, dry: bool) -> list[dict]:
    """MFU at MiniMind2's 104M shape (dim 768, 16 layers), compiled, runtime.deterministic=true, batch 32 x 512."""
    from configs import load_config
    from run import folder

    dim, layers, seq_len, batch, steps, warm = (64, 2, 64, 4, 12, 4) if dry else (768, 16, 512, 32, 60, 20)
    out = work / "mfu-104m"
    tok = upstream()
    args = ["--config", "configs/minimind2_small.yaml", f"model.dim={dim}", f"model.n_layers={layers}", f"model.seq_len={seq_len}",
            f"train.global_batch={batch}", f"train.micro_batch={batch}", f"train.steps={steps}", f"log.every={warm}",
            "checkpoint.interval=0", "log.progress=false", "train.compile=true", "runtime.deterministic=true",
            f"train.dtype={'bfloat16' if device == 'cuda' else 'float32'}", f"runtime.device={device}", f"out_dir={out}",
            *([f"data.tokenizer={tok / 'model' / 'tokenizer.json'}"] if tok else [])]
    code, err = launch(1, args, work / "launches.log")
    if code != 0:
        return [{"check": "MFU at the 104M shape", "result": f"FAILED (exit {code})", "detail": err[-300:], "ok": False}]
    at = {m["step"]: m["elapsed_s"] for m in folder.read_metrics(out)}
    t = (at[steps] - at[warm]) / (steps - warm)
    cfg = load_config(ROOT / "configs" / "minimind2_small.yaml", [f"model.dim={dim}", f"model.n_layers={layers}", f"model.seq_len={seq_len}",
                                                                  *(args[-1:] if tok else [])]).model
    name, peak = peak_tflops(device)
    mfu = batch * seq_len / t * flops_per_token(cfg) / (peak * 1e12) if peak else float("nan")
    return [{"check": f"MFU, MiniMind2's shape (dim {dim}, {layers} layers), compiled, runtime.deterministic=true, batch {batch} x {seq_len}",
             "result": f"{mfu:.1%}", "ok": None if dry or not peak else mfu >= MFU_AIM, "mfu": mfu, "seconds_per_step": t,
             "detail": f"aim >= {MFU_AIM:.0%} of {peak} TFLOP/s ({name}); {t * 1e3:.1f} ms per step, "
                       f"{flops_per_token(cfg) / 1e6:.0f}M FLOP/token"}]


# --------------------------------------------------------------------------- the deterministic mode's kernels
PROFILE_CHILD = "--child-profile"


def profile_child(out: Path, dry: bool) -> None:
    """In this process: our model at MiniMind's shape, one training step (forward, backward, AdamW) on a
    random batch, profiled in three modes: non-deterministic, deterministic as the trainer sets it,
    and deterministic with torch's fill of new tensors left on. Writes each mode's time per step and
    CUDA time per kernel name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from configs import load_config
    from model import MiniMindLM
    from objectives import make_optimizer

    device = torch.device("cpu" if dry else "cuda")
    dim, layers, seq_len, batch = (64, 2, 64, 4) if dry else (512, 8, 512, 32)
    shape = minimind_shape(dim, layers)
    up = upstream()
    cfg = load_config(ROOT / "configs" / "minimind3_small.yaml",
                      [*shape, f"model.seq_len={seq_len}", *([f"data.tokenizer={up / 'model' / 'tokenizer.json'}"] if up else [])])
    torch.manual_seed(0)
    model = MiniMindLM(cfg.model).to(device)
    opt = make_optimizer(model, cfg.train)
    x = torch.randint(0, cfg.model.vocab_size, (batch, seq_len), device=device)
    y = torch.randint(0, cfg.model.vocab_size, (batch, seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step() -> None:
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    result = {}
    for mode, det, fill in (("non-deterministic", False, True), ("deterministic (the trainer's)", True, False),
                            ("deterministic, new tensors filled (torch's default)", True, True)):
        torch.use_deterministic_algorithms(det)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        for _ in range(5):
            step()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        sync()
        per_step = (time.perf_counter() - t0) / 10
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(3):
                step()
            sync()
        kernels = {}
        for e in prof.key_averages():
            if device.type == "cuda":  # the kernels themselves (an operator's entry sums its kernels' time again)
                us = getattr(e, "self_device_time_total", None)
                us = e.self_cuda_time_total if us is None else us
                if e.device_type != DeviceType.CUDA:
                    continue
            else:
                us = e.self_cpu_time_total
            if us:
                kernels[e.key] = {"us": us / 3, "count": e.count / 3}
        result[mode] = {"seconds_per_step": per_step, "kernels": kernels}
    out.write_text(json.dumps(result))


def deterministic_cost(work: Path, device: str, dry: bool) -> list[dict]:
    """What runtime.deterministic changes: each mode's time per step of one eager step at MiniMind's
    shape, and the kernels whose time differs most between the non-deterministic mode and each other."""
    out = work / "profile.json"
    proc = subprocess.run([sys.executable, __file__, PROFILE_CHILD, str(out), *(["--cpu-dry-run"] if dry else [])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return [{"check": "the deterministic mode's kernels", "result": "FAILED", "ok": False, "detail": proc.stderr[-400:]}]
    found = json.loads(out.read_text())
    base = found["non-deterministic"]
    rows = []
    for mode, got in found.items():
        diff = sorted(((k, got["kernels"].get(k, {"us": 0})["us"] - base["kernels"].get(k, {"us": 0})["us"],
                        got["kernels"].get(k, {"count": 0})["count"], base["kernels"].get(k, {"count": 0})["count"])
                       for k in set(got["kernels"]) | set(base["kernels"])), key=lambda d: -abs(d[1]))[:6]
        rows.append({"check": f"one eager step at MiniMind's shape, {mode}", "result": f"{got['seconds_per_step'] * 1e3:.1f} ms",
                     "ok": None, "seconds_per_step": got["seconds_per_step"],
                     "detail": "" if mode == "non-deterministic" else "kernel time against non-deterministic: " + "; ".join(
                         f"{k[:70]} {d / 1e3:+.2f} ms ({n:.0f} vs {m:.0f} calls)" for k, d, n, m in diff),
                     "kernels": got["kernels"]})
    return rows


# --------------------------------------------------------------------------- no host read inside a step
SYNC_CHILD = "--child-sync"


def sync_child(report: Path, args: list[str]) -> None:
    """train.main(args) in this process with CUDA's sync debug mode warning at every synchronizing call;
    each call's Python stack is kept and sorted: inside a step of the loop (a failure of the promise,
    unless under a log step's write of the lines, a checkpoint's save or a validation) or outside."""
    import ast
    import traceback
    import warnings

    import train

    loop = next(n for n in ast.walk(ast.parse((ROOT / "train.py").read_text())) if isinstance(n, ast.FunctionDef) and n.name == "loop")
    body = next(n for n in ast.walk(loop) if isinstance(n, ast.For))
    lines = range(body.lineno, body.end_lineno + 1)
    found = {"in_step": [], "allowed": 0, "outside": 0}

    def allowed(f: traceback.FrameSummary) -> bool:  # a log step's write of the lines, a checkpoint, an evaluation
        return (f.filename.endswith("metrics.py") and f.name == "flush") or f"{os.sep}checkpoint{os.sep}" in f.filename \
            or f.name in ("validation", "evaluate")

    def seen(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        in_loop = [f for f in stack if f.filename.endswith("train.py") and f.name == "loop" and f.lineno in lines]
        if not in_loop:
            found["outside"] += 1
        elif any(allowed(f) for f in stack):
            found["allowed"] += 1
        else:
            found["in_step"].append("".join(traceback.format_list(stack[-8:])))

    warnings.showwarning = seen
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    code = train.main(args)
    torch.cuda.set_sync_debug_mode(0)
    report.write_text(json.dumps({"code": code, **found}))


def host_reads(work: Path, base: list[str], device: str) -> list[dict]:
    """A run of 40 steps (lines every 10) under CUDA's sync debug mode: no synchronizing call inside a
    step but a log step's read of the lines (run/metrics.py)."""
    if device != "cuda":
        return [{"check": "no host read inside a step (torch.cuda.set_sync_debug_mode)", "result": "SKIPPED", "ok": None,
                 "detail": "CUDA only (tests/test_host_reads.py proves it on the CPU with a counting double)"}]
    report = work / "sync.json"
    rows = []
    for det in ("true", "false"):
        args = [*base, "train.steps=40", "log.every=10", "checkpoint.interval=0", "train.dtype=bfloat16", f"runtime.deterministic={det}",
                f"out_dir={work / f'sync-{det}'}"]
        proc = subprocess.run([sys.executable, __file__, SYNC_CHILD, str(report), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            rows.append({"check": "no host read inside a step", "result": "FAILED", "ok": False, "detail": proc.stderr[-400:]})
            continue
        got = json.loads(report.read_text())
        ok = got["code"] == 0 and not got["in_step"]
        rows.append({"check": f"no host read inside a step, runtime.deterministic={det} (torch.cuda.set_sync_debug_mode)",
                     "result": "none" if ok else f"{len(got['in_step'])} in steps", "ok": ok,
                     "detail": f"{got['allowed']} at the 4 log steps' reads and the final save, {got['outside']} in set-up; "
                               + (got["in_step"][0].replace("\n", " ")[-600:] if got["in_step"] else "exit 0")})
    return rows


def stalls(work: Path, base: list[str], steps: int, aimed: bool) -> list[dict]:
    """Sync against async save stall; `aimed`: the aim applies (MiniMind2-small's shape, not the
    dry run's shrunk model, whose save is mostly fixed costs)."""
    found = {}
    for mode in ("false", "true"):
        out = work / f"stall-{mode}"
        code, err = launch(1, [*base, "train.dtype=bfloat16", "runtime.deterministic=false", f"train.steps={steps}",
                               "checkpoint.interval=2", f"checkpoint.async={mode}", f"out_dir={out}"], work / "launches.log")
        if code != 0:
            return [{"check": "save stall", "result": f"FAILED (exit {code})", "detail": "see launches.log", "ok": False}]
        pattern = r"snapshot taken in ([\d.]+)s" if mode == "true" else r"saved \S+: step \d+, ([\d.]+)s"
        found[mode] = statistics.median(float(x) for x in re.findall(pattern, err)[1:] or re.findall(pattern, err))
    ratio = found["true"] / found["false"]
    aim = f"aim <= {STALL_AIM}" if aimed else f"a report: the aim <= {STALL_AIM} is for the MiniMind2-small shape, shrunk in the dry run"
    return [{"check": "save stall at a step boundary, MiniMind2-small shape", "result": f"async {found['true'] * 1e3:.0f} ms vs sync {found['false'] * 1e3:.0f} ms",
             "detail": f"ratio {ratio:.3f} ({aim})", "ok": ratio <= STALL_AIM if aimed else None, "ratio": ratio}]


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == PROFILE_CHILD:
        profile_child(Path(sys.argv[2]), "--cpu-dry-run" in sys.argv)
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == SYNC_CHILD:
        sync_child(Path(sys.argv[2]), sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same plan, shrunk, on the CPU (checks the script)")
    parser.add_argument("--only", nargs="*", default=None, help="groups to run: exactness, determinism, sync, peer, mfu, stalls")
    a = parser.parse_args()
    device = "cpu" if a.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --cpu-dry-run to check the script on a CPU", file=sys.stderr)
        return 2
    out_dir = Path(os.environ.get("OUT") or ROOT / "runs" / "gpu_check")
    work = ROOT / "runs" / "gpu_check_work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    t0 = time.time()
    common = ["--config", "configs/tiny.yaml", "log.progress=false", "checkpoint.interval=0", f"runtime.device={device}"]
    small = ["--config", "configs/minimind2_small.yaml", "log.progress=false", f"runtime.device={device}"]
    if a.cpu_dry_run:
        shrink = ["model.dim=32", "model.n_layers=2", "model.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.warmup_steps=2"]
        common += shrink
        small += shrink
    want = set(a.only or ("exactness", "determinism", "sync", "peer", "mfu", "stalls"))
    rows: list[dict] = []
    timed = {}

    def info() -> dict:
        return {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cuda": torch.version.cuda,
                "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)",
                "gpus": torch.cuda.device_count() if device == "cuda" else 0, "seconds": round(time.time() - t0, 1), "groups_s": timed}

    def group(name: str, fn, *args) -> None:
        if name in want:
            s = time.time()
            try:
                rows.extend(fn(*args))
            except Exception as e:  # noqa: BLE001 - one group's failure is its row; the others still run
                rows.append({"check": name, "result": "FAILED", "ok": False, "detail": f"{type(e).__name__}: {str(e)[-500:]}"})
            timed[name] = round(time.time() - s, 1)
            print(f"gpu_check: {name} done in {timed[name]} s", file=sys.stderr, flush=True)
            (out_dir / "gpu_check.json").write_text(json.dumps({"info": info(), "rows": rows}, indent=1))  # kept if a later group overruns

    # The timed groups first, each with the GPU to itself; then the exact-resume rows side by side (none of their figures is timed).
    group("determinism", deterministic_cost, work, device, a.cpu_dry_run)
    group("sync", host_reads, work, common, device)
    group("peer", peer, work, device, a.cpu_dry_run)
    group("mfu", mfu_104m, work, device, a.cpu_dry_run)
    group("stalls", stalls, work, small, 8, not a.cpu_dry_run)
    group("exactness", exactness, work, [*common, "runtime.deterministic=true"], 8 if a.cpu_dry_run else 20, device, 2 if a.cpu_dry_run else 9)
    info = info()
    print(f"GPU check {info['date']}: {info['device']} x{info['gpus']}, torch {info['torch']} (CUDA {info['cuda']}), {info['seconds']} s\n")
    print("| check | result | detail |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {r['result']} | {r.get('detail', '')} |")
    (out_dir / "gpu_check.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    for name in ("launches.log", "peer.log"):
        if (work / name).exists():
            shutil.copy(work / name, out_dir / name)
    # Every verdict is computed from the row's measured values against its aim; report rows (ok None) have none.
    return 0 if all(r["ok"] for r in rows if r["ok"] is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
