"""`python -m checkpoint eval RUN --tasks ... [--perplexity FILE ...]`: benchmark scores of a checkpoint
as lm-evaluation-harness computes them (objectives/benchmark.py; docs/eval.md): a line per task on
stderr, the results as JSON on stdout (and in --out with each item's picks)."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from .arguments import number, place

HELP = "score multiple-choice tasks (acc, acc_norm) and perplexity as lm-evaluation-harness does (docs/eval.md)"


def arguments(p) -> None:
    p.add_argument("path", type=place, help="a checkpoint folder or a run folder")
    p.add_argument("--tasks", nargs="+", metavar="TASK", help="task files (.jsonl or .csv: question, A, B, C, D, answer) or "
                                                              "'arith' (built in); 'text:TASK' scores each choice's text")
    p.add_argument("--perplexity", nargs="+", metavar="FILE", help="held-out text: a .jsonl of {\"text\"} lines or a text file")
    p.add_argument("--limit", type=number(int, 1), help="the first N items of each task")
    p.add_argument("--out", type=Path, help="also write the results here, with each item's picks")


def run(args) -> int:
    """Read every task and text file first (a bad one exits 2 naming file:line before the model loads),
    then score them with the checkpoint's fp32 weights (those the Hugging Face export holds)."""
    from checkpoint import storage
    from objectives.benchmark import evaluate_tasks, perplexity, read_documents, read_tasks
    from weights import load_model, load_tokenizer

    from .arguments import CommandError

    if not args.tasks and not args.perplexity:
        raise CommandError("eval: nothing to do; give --tasks (a task file, or arith) and/or --perplexity FILE")
    if args.limit is not None and args.limit < 1:
        raise CommandError(f"--limit must be >= 1, got {args.limit}")
    tasks = read_tasks(args.tasks or [])
    if args.limit:
        tasks = [dataclasses.replace(t, items=t.items[:args.limit]) for t in tasks]
    texts = [(Path(p), read_documents(Path(p))) for p in args.perplexity or []]
    folder, manifest, _ = storage.find_checkpoint(args.path)
    model, tok = load_model(folder, fp32=True), load_tokenizer(folder)
    t0 = time.perf_counter()
    results = evaluate_tasks(model, tok, tasks) if tasks else {"tasks": {}, "overall": {"items": 0}}
    seconds = time.perf_counter() - t0
    for name, r in results["tasks"].items():
        print(f"{name}: acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}  ({r['items']} items, {r['style']}, {r['source']})",
              file=sys.stderr)
    if len(results["tasks"]) > 1:
        o = results["overall"]
        print(f"overall: acc {o['acc']:.4f}  acc_norm {o['acc_norm']:.4f}  ({o['items']} items)", file=sys.stderr)
    results["perplexity"] = {}
    for path, docs in texts:
        p = results["perplexity"][str(path)] = perplexity(model, tok, docs)
        print(f"{path}: perplexity {p['token_perplexity']:.3f} per token, {p['byte_perplexity']:.4f} per byte, "
              f"{p['bits_per_byte']:.4f} bits per byte ({p['documents']} documents, {p['tokens']} tokens)", file=sys.stderr)
    results = {"checkpoint": str(folder), "step": manifest["step"], **results, "seconds": round(seconds, 3),
               "items_per_s": round(results["overall"]["items"] / seconds, 2) if seconds and results["overall"]["items"] else None}
    if args.out:
        try:
            Path(args.out).write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(args.out)) from None
    for r in results["tasks"].values():
        r.pop("picks")
    print(json.dumps(results, indent=1, ensure_ascii=False))
    return 0
