"""The resume lab: what each piece of resume state is for, measured through the real trainer.

    python scripts/resume_lab.py [--out DIR] [--nproc N] [--steps 60] [--halt 30] [key=value ...]

A reference run of 60 steps at once; a run stopped at 30, saved, resumed to 60, which must equal
the reference bit for bit; then one resume at 30 per piece of state left out, and the distance of
each from the reference at every step from 30 to 60. Every run is train.py itself: in this process
for one process (train.main), under torchrun for more. A piece is left out by editing a copy of the
step-30 checkpoint before a normal resume (a fresh optimizer state, the data position rewound, fp16
weights, MiniMind's step rescale: the states loaded on one process, edited, and written again by the
trainer's own save path), except the LR schedule, which the lab restarts by shifting train.lr_at in
the process it launches: the trainer has no lab switches. Prints a markdown table,
writes OUT/results.json and, with matplotlib installed, OUT/distance.png.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import train  # noqa: E402
from checkpoint import CheckpointConfig, CheckpointManager, RunMeta, format, storage  # noqa: E402
from cli.convert import states_of  # noqa: E402
from data import PackedDataset, pack, resolve_source  # noqa: E402
from run import folder as runfolder  # noqa: E402
from runtime import Runtime  # noqa: E402
from weights import load_model, model_config, tokenizer_files  # noqa: E402

ABLATIONS = {
    "optimizer": "optimizer state (a fresh AdamW)",
    "data_position": "data position (order rewound to the epoch's start)",
    "fp16_weights": "fp16 weights in the resume file (MiniMind today)",
    "minimind_world_size_rule": "MiniMind's step × old // new on a fixed global batch, world size {old} → {new}",
    "lr_schedule": "LR schedule restarted from step 0",
}


@contextlib.contextmanager
def lr_restarted_at(origin: int):
    """train.lr_at as if the schedule had restarted at step `origin` (a scheduler not saved)."""
    lr_at = train.lr_at
    train.lr_at = lambda step, t: lr_at(step - origin, t)
    try:
        yield
    finally:
        train.lr_at = lr_at


def launch(nproc: int, args: list[str], log: Path, lr_origin: int = 0) -> None:
    """One run of train.py: in this process for nproc 1, else under torchrun. Raises on failure."""
    with open(log, "a") as f:
        if nproc == 1:
            with contextlib.redirect_stderr(f), contextlib.redirect_stdout(f), lr_restarted_at(lr_origin):
                code = train.main(args)
            logging.basicConfig(force=True, level=logging.WARNING)  # train's handler wrote to `f`, now closed
        else:
            entry = ["scripts/resume_lab.py", "--as-train", str(lr_origin)] if lr_origin else ["train.py"]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *entry, *args]
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"resume_lab: a run failed (exit {code}); see {log}")


def step_folder(run: Path, step: int) -> Path:
    return run / runfolder.CHECKPOINTS / storage.step_dir_name(step)


def weights_at(run: Path, step: int) -> dict[str, torch.Tensor]:
    folder = step_folder(run, step)
    return storage.read_tensors(folder, storage.verify(folder))


def edit_checkpoint(folder: Path, edit) -> Path:
    """Load a checkpoint's states on one process, change them with `edit(model, optimizer,
    train_state, manifest)`, and write them again through the trainer's own save path (every rank's
    generator states as they were), as the checkpoint of the (maybe edited) step in the same run
    folder: how the lab leaves a piece of state out before a normal resume. Returns its folder."""
    manifest = storage.verify(folder)
    states, model, opt = states_of(manifest["config"])
    meta = RunMeta(**{k: manifest.get(k) for k in RunMeta.RECORDED if k != "architecture"}, files=tokenizer_files(folder, manifest),
                   architecture=model_config(folder, manifest).architecture())
    run = folder.parent.parent
    manager = CheckpointManager(CheckpointConfig(resume=str(folder), interval=0, keep=1 << 30), run, Runtime(), meta)
    try:
        manager.load(states)
        metadata = storage.read_metadata(folder, manifest)
        ranks = sorted(k.split(".")[1] for k in format.keys(metadata) if k.startswith("rng."))
        blobs = format.load({"rng": {r: b"" for r in ranks}}, folder, manifest["files"], metadata, no_dist=True)["rng"]
        edit(model, opt, states["train"], manifest)
        shutil.rmtree(folder)  # the lab's copy: its edited states take its place
        manager.save(states["train"].step, states, background=False, rng_states=[blobs[r] for r in ranks])
    finally:
        manager.close()
    return step_folder(run, states["train"].step)


def leave_out(case: str, folder: Path, old_world: int, new_world: int, steps_per_epoch: int) -> Path:
    """Edit the copied checkpoint so that the resume misses one piece of state (the one named)."""

    def edit(model, opt, train_state, manifest: dict) -> None:
        if case == "optimizer":  # as if only the weights had been saved: AdamW's moments start at zero
            for state in opt.state.values():
                for name, value in state.items():
                    value.zero_()  # step 0, moments 0: the state a fresh AdamW makes at its first step
        elif case == "data_position":  # a loader without a skip: the epoch's order from its start
            train_state.samples_seen = 0
        elif case == "fp16_weights":  # MiniMind's resume file holds half-precision weights
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.half().float())
        elif case == "minimind_world_size_rule":
            # MiniMind rescales its step counter by old // new world size, right for its fixed per-GPU
            # batch; here the global batch is fixed, so the counter (and the data with it) goes back.
            step = train_state.step * old_world // new_world
            epoch, done = divmod(step, steps_per_epoch)
            train_state.step, train_state.epoch, train_state.samples_seen = step, epoch, done * manifest["global_batch"]

    return edit_checkpoint(folder, edit) if case != "lr_schedule" else folder


def distance(a: dict, b: dict) -> tuple[float, float]:
    """(max |Δw|, relative L2 distance ‖a − b‖ / ‖b‖) over every parameter."""
    diff = torch.cat([(a[k].double() - b[k].double()).flatten() for k in b])
    ref = torch.cat([b[k].double().flatten() for k in b])
    return diff.abs().max().item(), (diff.norm() / ref.norm()).item()


metrics = runfolder.read_metrics


def sample_accounting(halted: Path, run: Path, resumed_at: int, ref: Path) -> tuple[int, int]:
    """(samples repeated, samples skipped) over the whole run, against the reference's consumption:
    what the halted run consumed, then what the resumed run consumed after the step it resumed at."""
    got = Counter(i for m in metrics(halted) for i in m["sample_ids"])
    got += Counter(i for m in metrics(run) if m["step"] > resumed_at for i in m["sample_ids"])
    want = Counter(i for m in metrics(ref) for i in m["sample_ids"])
    return sum((got - want).values()), sum((want - got).values())


def sizes(ref: Path, steps: int) -> dict:
    """The seed's figures: file sizes, the optimizer's share, and what fp16 weights do to the logits."""
    folder = step_folder(ref, steps)
    manifest = storage.verify(folder)
    metadata = storage.read_metadata(folder, manifest)
    resume = sum(e["bytes"] for name, e in manifest["files"].items() if name.startswith(f"{format.STATE}/"))
    weights = (folder / storage.WEIGHTS_FILE).stat().st_size
    optimizer = format.tensor_bytes(metadata, "optimizer.state.")
    fp16 = load_model(folder)  # the inference path: fp16 file -> fp32 model
    fp32 = type(fp16)(fp16.cfg)
    fp32.load_state_dict(storage.read_tensors(folder, manifest))
    cfg = manifest["config"]
    bin_path, _ = pack(resolve_source(cfg["data"]["path"], Path(cfg["data"]["cache_dir"])), fp16.cfg.seq_len, Path(cfg["data"]["cache_dir"]))
    dataset = PackedDataset(bin_path, fp16.cfg.seq_len)
    batch = torch.stack([dataset[i][0] for i in range(8)])  # a fixed batch: the corpus's first 8 samples
    with torch.no_grad():
        dlogit = (fp32.eval()(batch)[0] - fp16(batch)[0]).abs().max().item()
    return {
        "weights_fp16_bytes": weights,
        "weights_fp32_bytes": format.tensor_bytes(metadata, "model."),
        "resume_bytes": resume,
        "optimizer_state_bytes": optimizer,
        "optimizer_share_of_resume": optimizer / resume,
        "resume_over_weights": resume / weights,
        "max_abs_logit_diff_fp16_vs_fp32": dlogit,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-train"]:  # a torchrun worker of the LR-schedule case: train.py, schedule shifted
        from run.stop import exit_now

        with lr_restarted_at(int(argv[1])):
            code = train.main(argv[2:])
        exit_now(code)  # as train.py's own __main__ does
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "resume_lab")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run (the world-size ablation uses nproc + 1)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--halt", type=int, default=30)
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    a = parser.parse_args(argv)
    if not 0 < a.halt < a.steps:
        parser.error("--halt must be between 0 and --steps")
    t0 = time.time()
    out = a.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log = out / "runs.log"
    # canonical reduction with a pinned thread count: resumes on another world size are exact too,
    # so every distance below is the ablation's and nothing else's.
    base = ["--config", a.config, "dist.reduce=canonical", "runtime.threads=2", f"train.steps={a.steps}",
            "log.sample_ids=true", "log.progress=false", *a.overrides]
    every_step = ["checkpoint.interval=1", f"checkpoint.keep={a.steps - a.halt + 1}"]

    def run(name: str, nproc: int, *extra: str, lr_origin: int = 0) -> Path:
        print(f"[lab] {name} ({nproc} process{'es' if nproc > 1 else ''})", file=sys.stderr, flush=True)
        launch(nproc, [*base, *extra, f"out_dir={out / name}"], log, lr_origin)
        return out / name

    ref = run("reference", a.nproc, *every_step)
    halted = run("halted", a.nproc, f"train.halt_at={a.halt}", "checkpoint.interval=0")

    def resumed_copy(name: str) -> Path:
        """The halted run's checkpoint and log, copied into a run folder of its own; returns the checkpoint."""
        dest = out / name
        (dest / runfolder.CHECKPOINTS).mkdir(parents=True)
        shutil.copytree(step_folder(halted, a.halt), step_folder(dest, a.halt))
        shutil.copy(halted / runfolder.METRICS, dest / runfolder.METRICS)
        return step_folder(dest, a.halt)

    ref_w = {s: weights_at(ref, s) for s in range(a.halt, a.steps + 1)}
    ref_loss = metrics(ref)[-1]["loss"]
    rows, curves = [], {}

    spe = int(storage.read_manifest(step_folder(halted, a.halt))["data_fingerprint"]["num_samples"]) // int(
        storage.read_manifest(step_folder(halted, a.halt))["global_batch"])

    def measure(name: str, label: str, nproc: int, case: str | None = None) -> None:
        folder = resumed_copy(name)
        if case:
            folder = leave_out(case, folder, a.nproc, nproc, spe)
        resumed_at = storage.read_manifest(folder)["step"]
        run(name, nproc, *every_step, lr_origin=a.halt if case == "lr_schedule" else 0)
        dest = out / name
        steps = sorted(s for s, _ in storage.list_checkpoints(dest / runfolder.CHECKPOINTS))
        curve = {s: distance(weights_at(dest, s), ref_w[s])[1] for s in steps if s in ref_w and s > a.halt}
        max_dw, rel = distance(weights_at(dest, a.steps), ref_w[a.steps])
        repeated, skipped = sample_accounting(halted, dest, resumed_at, ref)
        rows.append({"case": name, "label": label, "max_abs_dw": max_dw, "rel_l2": rel,
                     "final_loss_diff": metrics(dest)[-1]["loss"] - ref_loss, "samples_repeated": repeated,
                     "samples_skipped": skipped, "sha256_equal": launch_sha(dest) == launch_sha(ref)})
        curves[name] = curve
        for step, kept in storage.list_checkpoints(dest / runfolder.CHECKPOINTS):
            if step != a.steps:
                shutil.rmtree(kept)  # keep the final one; the curve is measured

    measure("exact", f"nothing left out: stop at {a.halt}, resume", a.nproc)
    new = a.nproc + 1
    measure("world_size_ours", f"world size {a.nproc} → {new}, our rule (samples_seen)", new)
    for key, label in ABLATIONS.items():
        nproc = new if key == "minimind_world_size_rule" else a.nproc
        measure(key, label.format(old=a.nproc, new=new), nproc, key)

    result = {"steps": a.steps, "halt": a.halt, "nproc": a.nproc, "rows": rows, "sizes": sizes(ref, a.steps),
              "curves": {k: {str(s): v for s, v in c.items()} for k, c in curves.items()}, "seconds": round(time.time() - t0, 1)}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    plot(result, out)
    exact = rows[0]
    if not (exact["sha256_equal"] and exact["max_abs_dw"] == 0):
        print(f"FAIL: the resumed run is not bit-identical to the reference (max abs dw {exact['max_abs_dw']:.3g})")
        return 1
    return 0


def launch_sha(run: Path) -> str:
    """model_sha256 of a run's newest valid checkpoint, from its manifest."""
    return storage.find_checkpoint(run)[1]["model_sha256"]


def table(r: dict) -> str:
    lines = [
        f"Resume lab: {r['steps']} steps at once vs stop at {r['halt']} and resume ({r['nproc']} process(es), {r['seconds']} s)",
        "",
        f"| resumed at {r['halt']} with | max abs Δw at {r['steps']} | relative L2 | final loss − reference | samples repeated | samples skipped | sha256 equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['label']} | {row['max_abs_dw']:.3g} | {row['rel_l2']:.3g} | {row['final_loss_diff']:+.3g} | "
                     f"{row['samples_repeated']} | {row['samples_skipped']} | {'yes' if row['sha256_equal'] else 'no'} |")
    s = r["sizes"]
    lines += [
        "",
        "| size | bytes |",
        "|---|---|",
        f"| weights file (fp16) | {s['weights_fp16_bytes']:,} |",
        f"| fp32 weights | {s['weights_fp32_bytes']:,} |",
        f"| the states (state/: fp32 weights, optimizer, step, RNG) | {s['resume_bytes']:,} |",
        f"| optimizer state | {s['optimizer_state_bytes']:,} ({s['optimizer_share_of_resume']:.0%} of the states) |",
        f"| states / fp16 weights | {s['resume_over_weights']:.2f}× |",
        f"| max abs Δlogit, fp16 vs fp32 weights, fixed batch of 8 | {s['max_abs_logit_diff_fp16_vs_fp32']:.3g} |",
    ]
    return "\n".join(lines)


def plot(r: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib is not installed: no plot; `pip install matplotlib` for OUT/distance.png)")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = {row["case"]: row["label"] for row in r["rows"]}
    floor = 1e-12
    for case, curve in r["curves"].items():
        steps = [int(s) for s in curve]
        values = [max(v, floor) for v in curve.values()]
        ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=labels[case] + (" (0: drawn at 1e-12)" if max(curve.values(), default=0) == 0 else ""))
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("relative L2 distance from the reference")
    ax.set_title(f"Resumed at step {r['halt']}: distance from the uninterrupted run")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "distance.png", dpi=120)
    print(f"\nplot: {out / 'distance.png'}")


if __name__ == "__main__":
    sys.exit(main())
