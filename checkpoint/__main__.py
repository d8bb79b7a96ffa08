"""`python -m checkpoint inspect PATH`: what a checkpoint holds, as JSON (reads with weights_only=True only).
`python -m checkpoint compare RUN_A RUN_B`: are two runs bit-identical (weights and every logged loss)?
`python -m checkpoint generate PATH --prompt "..."`: the fp16 weights, loaded safely, continuing a prompt
(KV cache, temperature, top-k, top-p, repetition penalty; stops at EOS or --tokens).
`python -m checkpoint export PATH --format minimind|hf --out OUT`: the weights for MiniMind (an fp16
state dict with MiniMind2's key names) or for Hugging Face (a Llama folder: config.json,
model.safetensors, generation_config.json and the run's tokenizer files).
`python -m checkpoint plot RUN [RUN ...] --out FILE.png`: training and validation loss and the LR
against the step, from each run's metrics.jsonl (needs matplotlib: requirements-extra.txt).
`python -m checkpoint status RUN`: the run's state (running, stopped at step S, finished, halted,
failed with its cause) and who holds the run folder; with --exit-code, exit with the run's code
(the launch scripts use it, since torchrun's own exit status does not say "stopped, resume me").

Exit codes: 0 success (compare: identical); 1 compare: the runs differ; 2 bad input (a path that is
not a checkpoint, a damaged or tampered one, an unreadable metrics.jsonl).

PATH is a checkpoint folder (`.../checkpoints/step_00000060`) or a run folder (its newest valid
checkpoint is inspected, and every checkpoint is listed with its validity).
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import sys
from pathlib import Path

from . import runfolder, sharded, storage


def inspect_checkpoint(folder: Path, manifest: dict) -> dict:
    """Describe a verified checkpoint folder (`manifest` is what `storage.verify` returned for it)."""
    try:
        return _describe(folder, manifest, storage.safe_load(folder / storage.RESUME_FILE))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise storage.CheckpointError(f"{folder / storage.RESUME_FILE}: not a resume file of this trainer ({type(e).__name__}: {e})") from None


def _describe(folder: Path, manifest: dict, payload: dict) -> dict:
    train = payload["train"]
    model = sharded.model_state(folder, payload)
    sha = storage.model_sha256(model)
    if payload.get("sharded"):  # shards of every rank, assembled here on one process
        from model import MiniMindLM, ModelConfig

        optimizer_bytes = sharded.optimizer_bytes(folder)
        parameters = MiniMindLM(ModelConfig(**payload["config"]["model"])).num_parameters()
    else:
        optimizer_bytes = sum(t.numel() * t.element_size() for st in payload["optimizer"]["state"].values() for t in st.values() if hasattr(t, "numel"))
        # Tied tensors share storage: count each storage once.
        parameters = sum(t.numel() for t in {t.untyped_storage().data_ptr(): t for t in model.values()}.values())
    return {
        "path": str(folder),
        "step": train["step"],
        "epoch": train["epoch"],
        "samples_seen": train["samples_seen"],
        "world_size": payload["world_size"],
        "global_batch": payload["global_batch"],
        "micro_batch": payload["micro_batch"],
        "accum": payload["accum"],
        "threads": payload.get("threads"),
        "reduce": payload.get("reduce"),
        "run_id": payload.get("run_id"),
        "model_sha256": sha,
        "manifest_model_sha256_matches": manifest.get("model_sha256") == sha,
        "parameters": parameters,
        "sharded": bool(payload.get("sharded")),
        "optimizer_state_bytes": optimizer_bytes,
        "ranks_with_rng_state": len(payload.get("rng") or []),
        "data_fingerprint": {k: payload["data_fingerprint"].get(k) for k in ("source", "source_sha256", "tokenizer", "tokenizer_source", "vocab_size", "dtype", "seq_len", "num_samples")},
        "files": {name: entry["bytes"] for name, entry in manifest["files"].items()},
    }


def inspect_path(path: Path) -> dict:
    """A checkpoint folder, or a run folder: its newest valid checkpoint, with every checkpoint listed."""
    folder, manifest, listing = storage.find_checkpoint(path, verify_all=True)
    if not listing:  # a checkpoint folder
        return inspect_checkpoint(folder, manifest)
    return {**inspect_checkpoint(folder, manifest), "checkpoints": [
        {"step": step, "path": str(folder), "valid": error is None, **({"error": error} if error else {})}
        for step, folder, error in listing]}


def _losses(run: Path) -> list[tuple[int, float]]:
    if not (run / runfolder.METRICS).exists():
        return []
    try:
        return [(int(m["step"]), float(m["loss"])) for m in runfolder.read_metrics(run)]
    except (KeyError, TypeError, ValueError) as e:
        raise storage.CheckpointError(f"{run / runfolder.METRICS}: a line without a numeric 'step' and 'loss' ({type(e).__name__}: {e})") from None


def compare_runs(a: Path, b: Path) -> dict:
    """Two run folders side by side: the newest valid checkpoints' weights and every logged loss.
    `identical` is True only for equal model_sha256 and bit-equal losses at every step."""
    ia, ib = inspect_path(a), inspect_path(b)
    wa = sharded.model_state(Path(ia["path"]), storage.safe_load(Path(ia["path"]) / storage.RESUME_FILE))
    wb = sharded.model_state(Path(ib["path"]), storage.safe_load(Path(ib["path"]) / storage.RESUME_FILE))
    max_dw = max(((wa[k].double() - wb[k].double()).abs().max().item() for k in wa if k in wb and wa[k].shape == wb[k].shape),
                 default=float("nan"))
    la, lb = _losses(a), _losses(b)
    steps_equal = [s for s, _ in la] == [s for s, _ in lb]
    dloss = [abs(x - y) for (_, x), (_, y) in zip(la, lb)]
    same_weights = ia["model_sha256"] == ib["model_sha256"]
    return {
        "identical": same_weights and steps_equal and la == lb,
        "model_sha256": [ia["model_sha256"], ib["model_sha256"]],
        "step": [ia["step"], ib["step"]],
        "max_abs_weight_diff": max_dw,
        "logged_steps": [len(la), len(lb)],
        "losses_equal": steps_equal and la == lb,
        "max_abs_loss_diff": max(dloss, default=0.0),
        "first_differing_step": next((s for (s, x), (_, y) in zip(la, lb) if x != y), None),
    }


def status(args: argparse.Namespace) -> int:
    """Print the run's status record; with --exit-code, the exit code a scheduler should see."""
    if not args.run.is_dir() and not args.exit_code:
        raise runfolder.RunFolderError(f"{args.run}: not a run folder")
    stopped = args.stopped  # the launcher passed a stop signal on: an outcome never recorded is a stop
    fallback = 75 if stopped else args.fallback if args.fallback in (0, 1, 2) else 1  # a death by signal is a failure (1)
    if not args.run.is_dir():  # the run never got as far as its folder
        print(f"status: {args.run} does not exist yet; exit {fallback}", file=sys.stderr)
        return fallback
    # Wait for this launch's workers that outlived their torchrun (finishing a save); another run
    # that holds the folder (this launch waited for it and was stopped) is not waited for.
    holder = runfolder.read_holder(args.run)
    ours = not args.launch_id or not holder or holder.get("launch_id") == args.launch_id
    if args.exit_code and ours and not runfolder.wait_until_free(args.run, args.wait_s):
        # Workers that outlived their torchrun are still saving: their outcome is not known yet.
        print(f"status: {args.run} is still held by {runfolder.describe_holder(runfolder.read_holder(args.run))} "
              f"after {args.wait_s:g} s", file=sys.stderr)
        return 75 if stopped else args.fallback or 1
    record = runfolder.read_status(args.run)
    held = not runfolder.wait_until_free(args.run, 0)
    print(json.dumps({**(record or {"state": None}), "held_by": runfolder.read_holder(args.run) if held else None}, indent=1))
    if not args.exit_code:
        return 0
    if record is None or (args.launch_id and record.get("launch_id") != args.launch_id):
        print(f"status: {args.run} has no status from this launch; exit {fallback} from the launcher's code {args.fallback}", file=sys.stderr)
        return fallback
    if record["state"] == "running":  # the holder is gone without a word: killed
        print(f"status: the run in {args.run} died without recording an outcome (killed?)", file=sys.stderr)
        return 75 if stopped else fallback or 1
    code = record.get("exit_code")
    return code if code in (0, 1, 2, 75) else 1


def plot(runs: list[Path], out: Path) -> int:
    """Loss (solid), validation loss (dots) and LR (below) against the optimizer step, one colour per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: plot needs matplotlib: pip install -r requirements-extra.txt", file=sys.stderr)
        return 2
    formats = set(plt.gcf().canvas.get_supported_filetypes())
    plt.close("all")
    if out.suffix.lstrip(".").lower() not in formats:
        raise runfolder.RunFolderError(f"--out {out}: unknown image extension {out.suffix or '(none)'!r}; expected one of "
                                       f"{', '.join('.' + f for f in sorted(formats))}")
    if not out.parent.is_dir():
        raise runfolder.RunFolderError(f"--out {out}: the folder {out.parent} does not exist")
    every = {}
    for run in runs:
        rows = runfolder.read_metrics(run)
        for lineno, row in enumerate(rows, 1):
            if not isinstance(row, dict) or not all(isinstance(row.get(k), (int, float)) for k in ("step", "loss", "lr")):
                raise runfolder.RunFolderError(f"{run / runfolder.METRICS}:{lineno}: a metrics line needs numeric 'step', 'loss' and 'lr'")
        every[run] = rows
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for i, (run, rows) in enumerate(every.items()):
        colour, name = f"C{i}", run.name
        top.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=colour, label=f"{name} train")
        val = [r for r in rows if "val_loss" in r]
        if val:
            top.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=colour, label=f"{name} validation")
        bottom.plot([r["step"] for r in rows], [r["lr"] for r in rows], color=colour)
    top.set_ylabel("loss (nats/token)")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_ylabel("LR")
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")
    return 0


class _Stderr(logging.StreamHandler):
    """A handler that writes to whatever sys.stderr is when a line is logged."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _) -> None:
        pass


def chat(args) -> int:
    """`python -m checkpoint chat RUN [--prompt TEXT]`: one turn, or a conversation on the terminal."""
    from data.sources import DataError
    from inference import chat_reply, load_model, load_tokenizer

    model, tok = load_model(args.path), load_tokenizer(args.path)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    def reply(text: str) -> str:
        messages.append({"role": "user", "content": text})
        try:
            answer, _ = chat_reply(model, tok, messages, args.tokens, args.temperature, args.seed, args.top_k, args.top_p,
                                   args.repetition_penalty)
        except DataError as err:  # no chat template, or one that raises
            raise storage.CheckpointError(f"chat: {err}") from None
        except ValueError as err:  # the conversation no longer fits the model's positions
            raise storage.CheckpointError(f"chat: {err} (start a new conversation)") from None
        messages.append({"role": "assistant", "content": answer})
        return answer

    if args.prompt is not None:
        print(reply(args.prompt))
        return 0
    print("(an empty line or end of input ends the conversation)", file=sys.stderr)
    while True:
        try:
            text = input("you> ")
        except EOFError:
            return 0
        if not text.strip():
            return 0
        print(f"model> {reply(text)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("inspect", help="print a checkpoint's step, geometry, model_sha256 and files as JSON")
    p.add_argument("path", type=Path)
    c = sub.add_parser("compare", help="compare two run folders: model_sha256 and every logged loss (exit 0 when identical)")
    c.add_argument("run_a", type=Path)
    c.add_argument("run_b", type=Path)
    g = sub.add_parser("generate", help="load the fp16 weights (verified, weights_only) and continue a prompt")
    g.add_argument("path", type=Path, help="a checkpoint folder or a run folder")
    g.add_argument("--prompt", default="Return the ")
    g.add_argument("--tokens", type=int, default=None, help="new tokens at most (default: up to model.seq_len positions)")
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest ids (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of ids holding this probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages ids already in the text")
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token (slow; for checks)")
    g.add_argument("--seed", type=int, default=0)
    ch = sub.add_parser("chat", help="talk to a fine-tuned run: the tokenizer's chat template, generation until <|im_end|>")
    ch.add_argument("path", type=Path, help="a checkpoint folder or a run folder")
    ch.add_argument("--prompt", help="one user turn: print the reply and exit (default: interactive, the history kept)")
    ch.add_argument("--system", help="a system turn in front of the conversation")
    ch.add_argument("--tokens", type=int, default=None, help="new tokens per reply at most (default: up to model.seq_len positions)")
    ch.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    ch.add_argument("--top-k", type=int, default=0)
    ch.add_argument("--top-p", type=float, default=1.0)
    ch.add_argument("--repetition-penalty", type=float, default=1.0)
    ch.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("export", help="write the weights for MiniMind (--format minimind) or Hugging Face (--format hf)")
    e.add_argument("path", type=Path, help="a checkpoint folder or a run folder (its newest valid checkpoint)")
    e.add_argument("--format", required=True, choices=("minimind", "hf"))
    e.add_argument("--out", type=Path, required=True, help="the .pth file (minimind) or folder (hf) to create")
    pl = sub.add_parser("plot", help="draw loss, validation loss and LR against the step for one or more runs (matplotlib)")
    pl.add_argument("runs", type=Path, nargs="+")
    pl.add_argument("--out", type=Path, required=True, help="the PNG to write")
    st = sub.add_parser("status", help="print the run's state (status.json) and who holds the run folder")
    st.add_argument("run", type=Path)
    st.add_argument("--exit-code", action="store_true",
                    help="wait until no process holds the folder, then exit with the run's exit code (75: stopped, resume me)")
    st.add_argument("--launch-id", help="with --exit-code: use the status only if this launch wrote it")
    st.add_argument("--fallback", type=int, default=1, help="with --exit-code: the code when the status is not this launch's (default 1)")
    st.add_argument("--wait-s", type=float, default=300.0, help="with --exit-code: how long to wait for the folder's holder")
    st.add_argument("--stopped", type=int, choices=(0, 1), default=0,
                    help="with --exit-code: 1 when the launcher passed a stop signal on; an outcome this launch never recorded is then 75")
    args = parser.parse_args(argv)
    # Which checkpoint a command used, and a newer one skipped as damaged, go to stderr.
    log = logging.getLogger("minimind")
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    try:
        if args.verb == "status":
            return status(args)
        if args.verb == "plot":
            return plot(args.runs, args.out)
        if args.verb == "generate":
            from inference import generate, load_model, load_tokenizer

            try:
                print(generate(load_model(args.path), args.prompt, args.tokens, args.temperature, args.seed, load_tokenizer(args.path),
                               args.top_k, args.top_p, args.repetition_penalty, not args.no_cache))
            except ValueError as err:  # a request the model cannot serve (past its positions)
                raise storage.CheckpointError(f"generate: {err}") from None
            return 0
        if args.verb == "chat":
            return chat(args)
        if args.verb == "export":
            from model.formats import WeightsError
            from weights import export

            try:
                out = export(args.path, args.format, args.out)
            except WeightsError as err:
                raise storage.CheckpointError(str(err)) from None
            except OSError as err:
                name = errno.errorcode.get(err.errno or 0, "")
                print(f"error: {err.filename or args.out}: {err.strerror}{f' ({name})' if name else ''}; nothing was written", file=sys.stderr)
                return 1
            print(f"wrote {out}")
            return 0
        if args.verb == "inspect":
            print(json.dumps(inspect_path(args.path), indent=1))
            return 0
        result = compare_runs(args.run_a, args.run_b)
        print(json.dumps(result, indent=1))
        return 0 if result["identical"] else 1
    except (storage.CheckpointError, runfolder.RunFolderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
