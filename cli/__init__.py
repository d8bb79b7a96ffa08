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
import importlib
import logging
from types import ModuleType

from common.kernels import reproducible_kernels
from common.outcome import command

from .arguments import Stderr, fetch

VERBS = {"inspect": "inspect", "compare": "compare", "generate": "generate", "chat": "chat", "serve": "serve", "eval": "evaluate",
         "export": "export", "plot": "plot", "status": "status", "convert": "convert"}
"""Each verb, in --help's order, and its module here: HELP (its line in --help), arguments(parser) and
run(args) -> exit code; optionally REMOTE = False (its place is never fetched from a store) and
fetch_checkpoint(args) (False: a run in the store comes down without its checkpoints)."""


def verb(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{VERBS[name]}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    for name in VERBS:
        module = verb(name)
        module.arguments(sub.add_parser(name, help=module.HELP))
    return parser


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    module = verb(args.verb)
    if getattr(module, "REMOTE", True):  # a run folder in object storage: read from a verified local copy
        checkpoint = getattr(module, "fetch_checkpoint", lambda _: True)(args)
        for name in ("path", "run_a", "run_b", "run"):
            if getattr(args, name, None) is not None:
                setattr(args, name, fetch(getattr(args, name), checkpoint=checkpoint))
        if getattr(args, "runs", None):
            args.runs = [fetch(r, checkpoint=False) for r in args.runs]
    # Which checkpoint a command used, and a newer one skipped as damaged, go to stderr.
    log = logging.getLogger("minimind")
    if not any(isinstance(h, Stderr) for h in log.handlers):
        handler = Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    # A damaged checkpoint is a failure (exit 1), a path that holds none bad input (2): their classes say (common/outcome.py).
    return module.run(args)


def main(argv: list[str] | None = None) -> int:
    reproducible_kernels()  # greedy and seeded replies the same bits every time (common/kernels.py)
    return command(_run, argv)
