"""The GPU check behind scripts/gpu_check.sh: exact resume on CUDA (eager, FSDP, compiled), throughput
and MFU eager and compiled, save stalls.

Uses only what the GPU machine has (torch with CUDA, numpy, pyyaml, tqdm); prints one
markdown table and writes gpu_check.json into $OUT (or runs/gpu_check). `--cpu-dry-run` runs the
same plan, shrunk, on the CPU: it checks the script, not the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Dense bf16 tensor-core peak, TFLOP/s, by the name the driver reports (GPU_PEAK_TFLOPS overrides).
PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0, "4090": 165.2}


def launch(nproc: int, args: list[str], log: Path, timeout: int = 300) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py", *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log.write_text(f"{' '.join(cmd)}\nTIMEOUT after {timeout}s\n{e.stdout or ''}{e.stderr or ''}")
        return 124, ""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    return proc.returncode, proc.stderr


def final(run: Path) -> tuple[str | None, list[float]]:
    from cli import inspect_path
    from run import folder

    try:
        sha = inspect_path(run)["model_sha256"]
    except Exception:  # noqa: BLE001 - reported as a failed row
        sha = None
    losses = [m["loss"] for m in folder.read_metrics(run)] if (run / folder.METRICS).exists() else []
    return sha, losses


def halt_resume(work: Path, name: str, args: list[str], steps: int, first: int, then: int, what: str) -> dict:
    """`steps` at once on `then` processes against `steps // 2` on `first` and the rest on `then`."""
    ref, run = work / f"ref-{name}", work / f"run-{name}"
    t0 = time.time()
    codes = [launch(then, [*args, f"train.steps={steps}", f"out_dir={ref}"], work / "launches.log")[0],
             launch(first, [*args, f"train.steps={steps}", f"train.halt_at={steps // 2}", f"out_dir={run}"], work / "launches.log")[0],
             launch(then, [*args, f"train.steps={steps}", f"out_dir={run}"], work / "launches.log")[0]]
    (sa, la), (sb, lb) = final(ref), final(run)
    ok = codes == [0, 0, 0] and sa is not None and sa == sb and la == lb and len(la) == steps
    return {"check": f"{what}: {steps} steps on {then} vs {steps // 2} on {first} + {steps // 2} on {then}",
            "result": "bit-identical" if ok else f"DIFFERENT (exit codes {codes})",
            "detail": f"sha256 {str(sa)[:12]}… vs {str(sb)[:12]}…, {len(lb)} losses equal: {la == lb}",
            "ok": ok, "seconds": round(time.time() - t0, 1)}


def exactness(work: Path, base: list[str], steps: int, device: str) -> list[dict]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        for nproc in (1, 2):
            # nccl refuses two ranks on one GPU: two processes sharing it talk over gloo, with CUDA tensors.
            backend = "nccl" if device == "cuda" and nproc <= torch.cuda.device_count() else "gloo"
            rows.append(halt_resume(work, f"{dtype}-{nproc}", [*base, f"train.dtype={dtype}", f"dist.backend={backend}"],
                                    steps, nproc, nproc, f"{dtype} ({backend})"))
    return rows


def fsdp_exactness(work: Path, base: list[str], steps: int, device: str) -> list[dict]:
    """dist.strategy=fsdp in bfloat16 (FSDP's mixed precision): halted at half and resumed on the same
    GPU count with FSDP's own reduce-scatter; and, where two GPUs (or the dry run's two CPU processes)
    are present, halted on 2 and resumed on 1 under dist.reduce=canonical against the 1-GPU run."""
    rows = []
    gpus = torch.cuda.device_count() if device == "cuda" else 2
    backend = "nccl" if device == "cuda" else "gloo"
    args = [*base, "dist.strategy=fsdp", "train.dtype=bfloat16", f"dist.backend={backend}", "checkpoint.interval=0"]
    plans = [("ddp", 1, 1)] + ([("canonical", 2, 1)] if gpus >= 2 else [])
    return [halt_resume(work, f"fsdp-{reduce}-{first}-{then}", [*args, f"dist.reduce={reduce}"], steps, first, then,
                        f"fsdp, bfloat16, dist.reduce={reduce} ({backend})") for reduce, first, then in plans]


def compiled_exactness(work: Path, base: list[str], steps: int, device: str) -> list[dict]:
    """train.compile=true under dist.reduce=canonical in float32: halted on 2 processes (two GPUs, or
    two processes sharing one over gloo) and resumed on 1, against the 1-process compiled run; and the
    MoE shape under FSDP, compiled, halted and resumed on one process."""
    two = "nccl" if device == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    args = [*base, "train.compile=true", "dist.reduce=canonical", "train.dtype=float32", "checkpoint.interval=0"]
    moe = ["model.moe.experts=4", "model.moe.top_k=1", "model.qk_norm=true", "dist.strategy=fsdp"]
    return [halt_resume(work, "compiled-2-1", [*args, f"dist.backend={two}"], steps, 2, 1,
                        f"compiled, float32, dist.reduce=canonical ({two} on 2)"),
            halt_resume(work, "compiled-moe-fsdp", [*args, *moe, f"dist.backend={'nccl' if device == 'cuda' else 'gloo'}"], steps, 1, 1,
                        "compiled MoE (4 experts, top-1) under fsdp, float32, canonical")]


STALL_AIM = 0.2
"""async stall / sync stall, the aim scripts/bench.py sets on the CPU."""


def flops_per_token(cfg) -> float:
    """6 N (matmul parameters, the tied output head included) + 12 L T d (attention scores and values)."""
    d, L, T = cfg.dim, cfg.n_layers, cfg.seq_len
    kv = cfg.n_kv_heads * cfg.head_size
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * cfg.ffn_dim
    n = L * per_layer + cfg.vocab_size * d
    return 6 * n + 12 * L * T * d


def throughput(work: Path, base: list[str], steps: int, device: str) -> list[dict]:
    """Tokens/s and MFU of the MiniMind2-small shape in bf16 on one process, eager and compiled (a
    report: no aim, so no verdict; the compiled/eager ratio is the row bench.py aims at on the CPU)."""
    from configs import load_config
    from run import folder

    cfg = load_config(ROOT / "configs" / "minimind2_small.yaml", [a for a in base if a.startswith("model.")]).model
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak = float(os.environ.get("GPU_PEAK_TFLOPS", 0)) or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    rows, found = [], {}
    for mode in ("false", "true"):
        out = work / f"throughput-compile-{mode}"
        code, _ = launch(1, [*base, "train.dtype=bfloat16", "runtime.deterministic=false", f"train.steps={steps}",
                             f"train.compile={mode}", "checkpoint.interval=0", f"out_dir={out}"], work / "launches.log")
        if code != 0:
            return [{"check": f"throughput, compile={mode}", "result": f"FAILED (exit {code})", "detail": "see launches.log", "ok": False}]
        tps = found[mode] = statistics.median(r["tokens_per_s"] for r in folder.read_metrics(out)[3:])
        achieved = tps * flops_per_token(cfg)
        mfu = achieved / (peak * 1e12) if peak else float("nan")
        rows.append({"check": f"MiniMind2-small shape, bf16, 1 process, {'compiled' if mode == 'true' else 'eager'}, {name}",
                     "result": f"{tps:,.0f} tokens/s",
                     "detail": f"{achieved / 1e12:.1f} TFLOP/s = MFU {mfu:.1%} of {peak} TFLOP/s (bf16 dense)" if peak
                     else f"{achieved / 1e12:.2f} TFLOP/s (peak unknown: set GPU_PEAK_TFLOPS)",
                     "ok": None, "tokens_per_s": tps, "mfu": mfu})
    rows.append({"check": "compiled / eager tokens per second", "result": f"{found['true'] / found['false']:.2f}",
                 "detail": "steps 4 on (the first compiles)", "ok": None, "ratio": found["true"] / found["false"]})
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same plan, shrunk, on the CPU (checks the script)")
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
    t0 = time.time()
    common = ["--config", "configs/tiny.yaml", "log.progress=false", "checkpoint.interval=0", f"runtime.device={device}"]
    small = ["--config", "configs/minimind2_small.yaml", "log.progress=false", f"runtime.device={device}"]
    if a.cpu_dry_run:
        shrink = ["model.dim=32", "model.n_layers=2", "model.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.warmup_steps=2"]
        common += shrink
        small += shrink
    rows = exactness(work, [*common, "runtime.deterministic=true"], 8 if a.cpu_dry_run else 60, device)
    rows += fsdp_exactness(work, [*common, "runtime.deterministic=true"], 8 if a.cpu_dry_run else 40, device)
    rows += compiled_exactness(work, [*common, "runtime.deterministic=true"], 8 if a.cpu_dry_run else 20, device)
    rows += throughput(work, small, 8 if a.cpu_dry_run else 40, device)
    rows += stalls(work, small, 8 if a.cpu_dry_run else 20, aimed=not a.cpu_dry_run)
    info = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)",
            "gpus": torch.cuda.device_count() if device == "cuda" else 0, "seconds": round(time.time() - t0, 1)}
    print(f"GPU check {info['date']}: {info['device']} x{info['gpus']}, torch {info['torch']} (CUDA {info['cuda']}), {info['seconds']} s\n")
    print("| check | result | detail |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {r['result']} | {r['detail']} |")
    (out_dir / "gpu_check.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    shutil.copy(work / "launches.log", out_dir / "launches.log")
    # Every verdict is computed from the row's measured values against its aim; report rows (ok None) have none.
    return 0 if all(r["ok"] for r in rows if r["ok"] is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
