"""The user commands, on the top floor: `python -m checkpoint VERB ...` (or `python -m cli VERB ...`).

    inspect PATH                what a checkpoint holds, as JSON (model_sha256: the model's identity)
    compare RUN_A RUN_B         are two runs bit-identical: weights and every logged loss (exit 0 identical, 1 not)
    generate PATH --prompt ...  continue a prompt with the fp16 weights (KV cache; temperature, top-k, top-p, ...)
    chat PATH [--prompt ...]    a fine-tuned run's reply with the tokenizer's chat template (generate's defaults)
    serve PATH [--port 8000]    an OpenAI-compatible server (chat completions, streamed or not) over the checkpoint
                                (cli/serve.py, docs/serving.md; FastAPI and uvicorn: requirements-serve.txt)
    eval PATH --tasks ...       multiple-choice tasks (C-Eval/CMMLU layout, or the built-in arith) scored as
                                lm-evaluation-harness scores them, and --perplexity FILE (cli/evaluate.py, docs/eval.md)
    export PATH --format minimind|hf|peft --out OUT [--base NAME] [--with-base]
                                MiniMind's state dict (fp16 .pth), a Hugging Face folder with the tokenizer, or
                                a LoRA run's PEFT adapter (--with-base: the base's Hugging Face export inside)
    plot RUN [RUN ...] --out FILE.png [--keys KEY ...]
                                loss, validation loss and LR against the step (matplotlib: requirements-extra.txt);
                                --keys: other logged figures, a panel each (e.g. distill_loss top1_agreement)
    status RUN [--exit-code]    where the run is: its state, step, loss (or reward), tokens/s, last checkpoint, ETA;
                                with --exit-code, exit with the run's code (the launch scripts use it: torchrun's
                                own status does not say "resume me") and print its outcome's line last
    convert RUN                 turn checkpoints of the earlier layout (a resume.pth file) into this one, in place

PATH is a checkpoint folder (`.../checkpoints/step_00000060`) or a run folder (its newest valid
checkpoint; inspect lists every checkpoint with its validity). Every file is read verified against
the manifest, with nothing pickled run. Exit codes are common/outcome.py's: 0 success, 2 bad input
(a path that is not a checkpoint or not a run folder, a flag out of its range), 1 a damaged or
tampered checkpoint, or another I/O failure; compare: 1 when the runs differ.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from checkpoint import format, storage
from common.kernels import reproducible_kernels
from common.outcome import BadInput, command
from common.store import is_url
from run import folder


class CommandError(BadInput):
    """A command given a path or an argument it cannot use; the message says which and why."""


def inspect_checkpoint(path: Path, manifest: dict) -> dict:
    """Describe a checkpoint folder whose manifest is `manifest` (its files present; each read is verified)."""
    from model import MiniMindLM

    from weights import model_config

    metadata = storage.read_metadata(path, manifest)
    model, cfg = storage.read_tensors(path, manifest, "model."), model_config(path, manifest)
    same, sha = storage.identity_matches(manifest, "model_sha256", model, cfg.architecture())
    keys = format.keys(metadata)
    return {
        "path": str(path),
        "step": manifest["step"],
        "epoch": manifest.get("epoch"),
        "samples_seen": manifest.get("samples_seen"),
        "world_size": manifest.get("world_size"),
        "global_batch": manifest.get("global_batch"),
        "micro_batch": manifest.get("micro_batch"),
        "accum": manifest.get("accum"),
        "threads": manifest.get("threads"),
        "reduce": manifest.get("reduce"),
        "strategy": manifest.get("strategy"),
        "run_id": manifest.get("run_id"),
        "model_sha256": sha,
        "identity": manifest.get("identity", 1),
        "manifest_model_sha256_matches": same,
        "parameters": MiniMindLM(cfg).num_parameters(),
        "optimizer_state_bytes": format.tensor_bytes(metadata, "optimizer.state."),
        "ranks_with_rng_state": len({k.split(".")[1] for k in keys if k.startswith("rng.")}),
        "data_fingerprint": {k: (manifest.get("data_fingerprint") or {}).get(k) for k in (
            "source", "source_sha256", "tokenizer", "tokenizer_source", "vocab_size", "dtype", "seq_len", "num_samples", "mix")},
        "files": {name: entry["bytes"] for name, entry in manifest["files"].items()},
    }


def inspect_path(path: Path) -> dict:
    """A checkpoint folder, or a run folder: its newest valid checkpoint, with every checkpoint listed."""
    found, manifest, listing = storage.find_checkpoint(path, verify_all=True)
    if not listing:  # a checkpoint folder
        return inspect_checkpoint(found, manifest)
    return {**inspect_checkpoint(found, manifest), "checkpoints": [
        {"step": step, "path": str(f), "valid": error is None, **({"error": error} if error else {})} for step, f, error in listing]}


def _losses(run: Path) -> list[tuple[int, float]]:
    if not (run / folder.METRICS).exists():
        return []
    try:
        return [(int(m["step"]), float(m["loss"])) for m in folder.read_metrics(run)]
    except (KeyError, TypeError, ValueError) as e:
        raise CommandError(f"{run / folder.METRICS}: a line without a numeric 'step' and 'loss' ({type(e).__name__}: {e})") from None


def compare_runs(a: Path, b: Path) -> dict:
    """Two run folders side by side: the newest valid checkpoints' weights and every logged loss.
    `identical` is True only for equal model_sha256 and bit-equal losses at every step."""
    from weights import checkpoint_weights, identity

    (_, ma, ca, wa), (_, mb, cb, wb) = checkpoint_weights(a), checkpoint_weights(b)
    sha_a, sha_b = identity(wa, ca), identity(wb, cb)
    max_dw = max(((wa[k].double() - wb[k].double()).abs().max().item() for k in wa if k in wb and wa[k].shape == wb[k].shape),
                 default=float("nan"))
    la, lb = _losses(a), _losses(b)
    steps_equal = [s for s, _ in la] == [s for s, _ in lb]
    dloss = [abs(x - y) for (_, x), (_, y) in zip(la, lb)]
    return {
        "identical": sha_a == sha_b and steps_equal and la == lb,
        "model_sha256": [sha_a, sha_b],
        "step": [ma["step"], mb["step"]],
        "max_abs_weight_diff": max_dw,
        "logged_steps": [len(la), len(lb)],
        "losses_equal": steps_equal and la == lb,
        "max_abs_loss_diff": max(dloss, default=0.0),
        "first_differing_step": next((s for (s, x), (_, y) in zip(la, lb) if x != y), None),
    }


def plot(runs: list[Path], out: Path, keys: list[str] | None = None) -> int:
    """Loss (solid), validation loss (dots) and LR (below) against the optimizer step, one colour per run;
    each of `keys` (a figure metrics.jsonl logs, e.g. distill_loss) in a panel of its own between them."""
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
        raise folder.RunFolderError(f"--out {out}: unknown image extension {out.suffix or '(none)'!r}; expected one of "
                                       f"{', '.join('.' + f for f in sorted(formats))}")
    if not out.parent.is_dir():
        raise folder.RunFolderError(f"--out {out}: the folder {out.parent} does not exist")
    every = {}
    for run in runs:
        rows = folder.read_metrics(run)
        for lineno, row in enumerate(rows, 1):
            if not isinstance(row, dict) or not all(isinstance(row.get(k), (int, float)) for k in ("step", "loss", "lr")):
                raise folder.RunFolderError(f"{run / folder.METRICS}:{lineno}: a metrics line needs numeric 'step', 'loss' and 'lr'")
        every[run] = rows
        for key in keys or ():
            if not any(isinstance(r.get(key), (int, float)) for r in rows):
                raise folder.RunFolderError(f"--keys {key}: {run / folder.METRICS} logs no numeric {key!r}")
    keys = list(keys or ())
    fig, (top, *middle, bottom) = plt.subplots(2 + len(keys), 1, figsize=(8, 6 + 2 * len(keys)), sharex=True,
                                               gridspec_kw={"height_ratios": [3, *[2] * len(keys), 1]})
    for i, (run, rows) in enumerate(every.items()):
        colour, name = f"C{i}", run.name
        top.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=colour, label=f"{name} train")
        val = [r for r in rows if "val_loss" in r]
        if val:
            top.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=colour, label=f"{name} validation")
        bottom.plot([r["step"] for r in rows], [r["lr"] for r in rows], color=colour)
        for panel, key in zip(middle, keys):
            have = [r for r in rows if isinstance(r.get(key), (int, float))]
            panel.plot([r["step"] for r in have], [r[key] for r in have], color=colour)
    for panel, key in zip(middle, keys):
        panel.set_ylabel(key)
        panel.grid(alpha=0.3)
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


def generate_text(model, prompt: str, max_new_tokens: int | None = None, temperature: float | None = None, seed: int = 0, tok=None,
                  top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                  use_cache: bool = True) -> str:
    """Continue the text `prompt` with `tok` (default: bytes): BOS + prompt, then sampled ids until
    EOS or `max_new_tokens`; the decoded text, prompt included. A setting left None is
    model.generate.DEFAULTS' (chat's too)."""
    from data.tokenizer import ByteTokenizer
    from model.generate import generate_ids

    temperature, top_k, top_p, repetition_penalty = _sampling(temperature, top_k, top_p, repetition_penalty)

    tok = tok or ByteTokenizer()
    ids = generate_ids(model, tok.encode(prompt, bos=True), max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                       tok.eos, use_cache, seed)
    return tok.decode(ids[1:])


def chat_reply(model, tok, messages: list[dict], max_new_tokens: int | None = None, temperature: float | None = None, seed: int = 0,
               top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None) -> tuple[str, list[int]]:
    """The assistant's next turn after `messages`: the conversation rendered with the tokenizer's chat
    template and its generation prompt (data/chat.py), then ids generated with the KV cache until the
    tokenizer's EOS (`<|im_end|>`). Returns the reply's text (special tokens dropped) and its ids. A
    setting left None is model.generate.DEFAULTS' (generate's too)."""
    from data.chat import template_of
    from model.generate import generate_ids

    temperature, top_k, top_p, repetition_penalty = _sampling(temperature, top_k, top_p, repetition_penalty)

    prompt = tok.encode_rendered(template_of(tok).render(messages, add_generation_prompt=True))
    ids = generate_ids(model, prompt, max_new_tokens, temperature, top_k, top_p, repetition_penalty, tok.eos, True, seed)
    reply = ids[len(prompt):]
    return tok.decode(reply), reply


def _sampling(temperature, top_k, top_p, repetition_penalty) -> tuple[float, int, float, float]:
    """The settings given, each one left None taken from model.generate.DEFAULTS."""
    from model.generate import DEFAULTS

    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "repetition_penalty": repetition_penalty}
    return tuple(getattr(DEFAULTS, k) if v is None else v for k, v in given.items())


def _number(kind: type, low: float | None = None, high: float | None = None):
    """An argparse `type`: a finite `kind` within [low, high]; anything else is argparse's exit 2 naming the flag."""
    import math

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
            span = f"from {low:g} to {high:g}" if low is not None and high is not None else f"at least {low:g}" if low is not None else "finite"
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} {span}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def _sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The sampling flags of `generate` and `chat`: one set, with model.generate.DEFAULTS' defaults."""
    from model.generate import DEFAULTS

    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature, help=f"0: greedy (default {DEFAULTS.temperature:g})")
    p.add_argument("--top-k", type=int, default=DEFAULTS.top_k, help=f"sample from the k likeliest ids (0: all; default {DEFAULTS.top_k})")
    p.add_argument("--top-p", type=float, default=DEFAULTS.top_p,
                   help=f"sample from the smallest set of ids holding this probability (1: all; default {DEFAULTS.top_p:g})")
    p.add_argument("--repetition-penalty", type=float, default=DEFAULTS.repetition_penalty,
                   help=f"> 1 discourages ids already in the text (1: none; default {DEFAULTS.repetition_penalty:g})")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed: the same seed, the same text")


def chat(args) -> int:
    """`chat RUN [--prompt TEXT]`: one turn, or a conversation on the terminal."""
    from weights import load_model, load_tokenizer

    model, tok = load_model(args.path), load_tokenizer(args.path)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    def reply(text: str) -> str:
        messages.append({"role": "user", "content": text})
        try:
            answer, _ = chat_reply(model, tok, messages, args.tokens, args.temperature, args.seed, args.top_k, args.top_p,
                                   args.repetition_penalty)
        except ValueError as err:  # the conversation no longer fits the model's positions
            raise CommandError(f"chat: {err} (start a new conversation)") from None
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("inspect", help="print a checkpoint's step, geometry, model_sha256 and files as JSON")
    p.add_argument("path", type=_place)
    c = sub.add_parser("compare", help="compare two run folders: model_sha256 and every logged loss (exit 0 when identical)")
    c.add_argument("run_a", type=_place)
    c.add_argument("run_b", type=_place)
    g = sub.add_parser("generate", help="load the fp16 weights (verified, weights_only) and continue a prompt")
    g.add_argument("path", type=_place, help="a checkpoint folder or a run folder")
    g.add_argument("--prompt", default="Return the ")
    g.add_argument("--tokens", type=int, default=None, help="new tokens at most (default: up to model.seq_len positions)")
    _sampling_arguments(g)
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token (slow; for checks)")
    ch = sub.add_parser("chat", help="talk to a fine-tuned run: the tokenizer's chat template, generation until <|im_end|>")
    ch.add_argument("path", type=_place, help="a checkpoint folder or a run folder")
    ch.add_argument("--prompt", help="one user turn: print the reply and exit (default: interactive, the history kept)")
    ch.add_argument("--system", help="a system turn in front of the conversation")
    ch.add_argument("--tokens", type=int, default=None, help="new tokens per reply at most (default: up to model.seq_len positions)")
    _sampling_arguments(ch)
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the checkpoint: POST /v1/chat/completions, "
                                      "GET /v1/models (docs/serving.md)")
    sv.add_argument("path", type=_place, help="a checkpoint folder or a run folder")
    sv.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    sv.add_argument("--port", type=_number(int, 0, 65535), default=8000, help="the port (0: any free one, said on stderr; default 8000)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (401 without it)")
    sv.add_argument("--model-name", help="the model id the server reports (default: the run folder's name)")
    sv.add_argument("--slots", type=_number(int, 1), default=4, help="replies generated in turn, one token each per turn (default 4)")
    sv.add_argument("--queue", type=_number(int, 0), default=16, help="requests waiting for a slot before more get 429 (default 16)")
    ev = sub.add_parser("eval", help="score multiple-choice tasks (acc, acc_norm) and perplexity as lm-evaluation-harness does "
                                     "(docs/eval.md)")
    ev.add_argument("path", type=_place, help="a checkpoint folder or a run folder")
    ev.add_argument("--tasks", nargs="+", metavar="TASK", help="task files (.jsonl or .csv: question, A, B, C, D, answer) or "
                                                               "'arith' (built in); 'text:TASK' scores each choice's text")
    ev.add_argument("--perplexity", nargs="+", metavar="FILE", help="held-out text: a .jsonl of {\"text\"} lines or a text file")
    ev.add_argument("--limit", type=_number(int, 1), help="the first N items of each task")
    ev.add_argument("--out", type=Path, help="also write the results here, with each item's picks")
    e = sub.add_parser("export", help="write the weights for MiniMind (--format minimind) or Hugging Face (--format hf; a LoRA run's "
                                          "merged), or a LoRA run's adapters for PEFT (--format peft)")
    e.add_argument("path", type=_place, help="a checkpoint folder or a run folder (its newest valid checkpoint)")
    e.add_argument("--format", required=True, choices=("minimind", "hf", "peft"))
    e.add_argument("--out", type=Path, required=True, help="the .pth file (minimind) or folder (hf, peft) to create")
    e.add_argument("--base", metavar="NAME", help="peft: the adapter_config.json's base_model_name_or_path, as PEFT should load "
                                                  "the base (a Hub name, a path); default: --with-base's folder, else the base "
                                                  "run's path relative to the adapter folder")
    e.add_argument("--with-base", action="store_true", help="peft: write the base's Hugging Face export inside the adapter "
                                                             "folder (OUT/base), named by a relative base_model_name_or_path")
    pl = sub.add_parser("plot", help="draw loss, validation loss and LR against the step for one or more runs (matplotlib)")
    pl.add_argument("runs", type=_place, nargs="+")
    pl.add_argument("--out", type=Path, required=True, help="the PNG to write")
    pl.add_argument("--keys", nargs="+", metavar="KEY", help="other logged figures to draw, a panel each (e.g. distill_loss "
                                                             "top1_agreement ce_loss)")
    st = sub.add_parser("status", help="where the run is (JSON): state, step, the loss or the objective's figure, tokens/s, "
                                       "the last checkpoint, an ETA, who holds the folder")
    st.add_argument("run", type=_place)
    st.add_argument("--exit-code", action="store_true",
                    help="wait until no process holds the folder, then exit with the run's exit code (75: stopped, resume me)")
    st.add_argument("--launch-id", help="with --exit-code: use the status only if this launch wrote it")
    st.add_argument("--fallback", type=int, default=1,
                    help="with --exit-code: the launcher's own exit code, used when the status is not this launch's (default 1)")
    st.add_argument("--wait-s", type=_number(float, 0), default=300.0, help="with --exit-code: how long to wait for the folder's holder")
    st.add_argument("--sample", action="store_true",
                    help="with --exit-code: a run that ended with 0 first prints its model's greedy reply to log.sample_prompt")
    st.add_argument("--stopped", type=int, choices=(0, 1), default=0,
                    help="with --exit-code: 1 when the launcher passed a stop signal on; an outcome this launch never recorded is then 75")
    cv = sub.add_parser("convert", help="convert checkpoints of the earlier layout (resume.pth) into this one, in place")
    cv.add_argument("path", type=Path, help="a run folder (every old checkpoint in it) or one checkpoint folder")
    return parser


def _place(value: str):
    """A command's run or checkpoint argument: a URL as it is (s3://...; fetched by _fetch), else a Path."""
    return value if is_url(value) else Path(value)


def _fetch(place, checkpoint: bool = True):
    """A run folder or checkpoint in the store as a local copy the commands read like any folder
    (checkpoint/remote.py: fetch, every file verified as it comes down); a local path as it is."""
    if not is_url(place):
        return place
    from checkpoint import remote

    run, _, step = str(place).rstrip("/").rpartition(f"/{storage.CHECKPOINTS}/")
    if not (run and storage.NAME.match(step)):
        run, step = str(place).rstrip("/"), None
    local = remote.fetch(run, folder.fetched_dir(run), step, checkpoint)
    return local / storage.CHECKPOINTS / step if step else local


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    for name in ("path", "run_a", "run_b", "run"):  # a run folder in object storage: read from a verified local copy
        if getattr(args, name, None) is not None and not (args.verb == "convert"):
            setattr(args, name, _fetch(getattr(args, name), checkpoint=args.verb != "status" or args.sample))
    if getattr(args, "runs", None):
        args.runs = [_fetch(r, checkpoint=False) for r in args.runs]
    # Which checkpoint a command used, and a newer one skipped as damaged, go to stderr.
    log = logging.getLogger("minimind")
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    # A damaged checkpoint is a failure (exit 1), a path that holds none bad input (2): their classes say (common/outcome.py).
    if args.verb == "status":  # cli/status.py, imported by name (the submodule would shadow a function of this name)
        from .status import status as report_status

        return report_status(args)
    if args.verb == "plot":
        return plot(args.runs, args.out, args.keys)
    if args.verb == "chat":
        return chat(args)
    if args.verb == "serve":
        from .serve import serve

        return serve(args)
    if args.verb == "eval":
        from .evaluate import evaluate

        return evaluate(args)
    if args.verb == "generate":
        from weights import load_model, load_tokenizer

        try:
            print(generate_text(load_model(args.path), args.prompt, args.tokens, args.temperature, args.seed, load_tokenizer(args.path),
                                args.top_k, args.top_p, args.repetition_penalty, not args.no_cache))
        except ValueError as err:  # a request the model cannot serve (past its positions)
            raise CommandError(f"generate: {err}") from None
        return 0
    if args.verb == "export":
        from weights import export

        try:
            print(f"wrote {export(args.path, args.format, args.out, args.base, args.with_base)}")
            if args.format == "peft" and args.base is None and not args.with_base:
                print("export: base_model_name_or_path names the base run's checkpoint, which PEFT does not read; give "
                      "--with-base (its Hugging Face export inside the folder) or --base NAME (docs/lora.md)", file=sys.stderr)
        except OSError as err:
            raise OSError(err.errno, f"{err.strerror}; nothing was written", err.filename or str(args.out)) from None
        return 0
    if args.verb == "convert":
        from .convert import convert

        return convert(args.path)
    if args.verb == "inspect":
        print(json.dumps(inspect_path(args.path), indent=1))
        return 0
    result = compare_runs(args.run_a, args.run_b)
    print(json.dumps(result, indent=1))
    return 0 if result["identical"] else 1


def main(argv: list[str] | None = None) -> int:
    reproducible_kernels()  # greedy and seeded replies the same bits every time (common/kernels.py)
    return command(_run, argv)
