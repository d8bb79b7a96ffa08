"""Benchmarks scored as EleutherAI's lm-evaluation-harness scores them (docs/eval.md): multiple-choice
tasks in C-Eval / CMMLU's layout by the log-likelihood of each choice (acc, acc_norm), perplexity over a
held-out text file, on one process or split across a run's ranks with the results gathered in item order.

A task file (JSONL or CSV) has a `question`, the choices in columns `A`, `B`, ... and the `answer`'s
letter (CMMLU's `Question` and `Answer` too). Each choice is one request (context, continuation):

    letters (default; lm-eval's ceval-valid and cmmlu tasks):
        context       "{question.strip()}\\nA. {A}\\nB. {B}\\nC. {C}\\nD. {D}\\n答案："
        continuations " A", " B", " C", " D"
    text: (a spec `text:FILE`; arc or hellaswag's way, where acc_norm matters):
        context       "Question: {question.strip()}\\nAnswer:"
        continuations " {A}", " {B}", ...

A request is tokenized as the harness's causal models do: the context's trailing spaces move to the
continuation, the continuation's ids are those of context + continuation past the context's own ids,
no BOS is added (the tokenizer's `encode`), and ids past model.seq_len + 1 are cut from the left. Its
log-likelihood is the fp32 sum of the continuation's log-softmax; `acc` takes the likeliest choice,
`acc_norm` the likeliest per character of the choice (the harness's `len(choice)`: letters for the
letters style, the choice's text for text), `acc_bytes` per UTF-8 byte. Nothing here draws from a
random generator or changes a model's state: training runs it at eval.interval (docs/design.md I15).
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common.outcome import BadInput
from data.prompts import arith_sums

LETTERS = "ABCDEFGHIJ"
STYLES = ("letters", "text")
BUILTIN = ("arith",)
"""The built-in task: the first 100 sums of the built-in arithmetic prompts (data/prompts.py), four
choices each (the sum and three other numbers 0-18, a fixed draw)."""


class TaskError(BadInput):
    """A task or text file that cannot be scored; the message names the file and line (exit 2)."""


@dataclass(frozen=True)
class Item:
    """One question: its text, its choices' texts (A, B, ...), the right one's index, where it was read."""

    question: str
    choices: tuple[str, ...]
    answer: int
    where: str


@dataclass(frozen=True)
class Task:
    """A named list of items and how they are asked (STYLES)."""

    name: str
    style: str
    items: tuple[Item, ...]
    source: str


def builtin_arith(n: int = 100) -> tuple[Item, ...]:
    """The built-in task's items (BUILTIN)."""
    rnd = random.Random(1)
    items = []
    for k, (a, b) in enumerate(arith_sums(n)):
        total = a + b
        others = rnd.sample([v for v in range(19) if v != total], 3)
        place = rnd.randrange(4)
        choices = [*others[:place], total, *others[place:]]
        items.append(Item(f"What is {a} + {b}?", tuple(str(c) for c in choices), place, f"arith:{k + 1}"))
    return tuple(items)


def _rows(path: Path):
    """(line number, row as a dict) of a JSONL or CSV file; TaskError naming file:line for what does not parse."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TaskError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 ({e})") from None
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines(keepends=True))
        try:
            start = 2
            for row in reader:
                if None in row:  # more fields than the header names
                    raise TaskError(f"{path}:{start}: {len(row[None])} more field(s) than the header's {len(reader.fieldnames)}")
                yield start, row
                start = reader.line_num + 1
        except csv.Error as e:
            raise TaskError(f"{path}:{reader.line_num}: not CSV ({e})") from None
        return
    if path.suffix.lower() not in (".jsonl", ".json"):
        raise TaskError(f"{path}: expected a .jsonl or .csv file in C-Eval's layout (question, A, B, C, D, answer)")
    yield from _json_lines(path, text, "question, A, B, ..., answer")


def _json_lines(path: Path, text: str, expected: str):
    """(line number, object) of each non-empty line of a JSONL file; a line that is not a JSON object is
    a TaskError naming file:line and `expected`."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{lineno}: expected an object with {expected}")
        yield lineno, row


def _text(row: dict, key: str, where: str) -> str:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TaskError(f"{where}: column {key!r} must be text, got {type(value).__name__}")
    return str(value)


def read_items(path: Path) -> tuple[Item, ...]:
    """A task file's items; TaskError naming file:line for a missing column, a value that is not text, or
    an answer that is not one of the choices' letters. The first row's letters are every row's."""
    items, letters, header = [], None, path.suffix.lower() == ".csv"
    for lineno, row in _rows(path):
        where = f"{path}:{lineno}"
        q = next((k for k in ("question", "Question") if k in row), None)
        a = next((k for k in ("answer", "Answer") if k in row), None)
        if letters is None:  # A, B, ... as far as the first row goes
            letters = ""
            while len(letters) < len(LETTERS) and LETTERS[len(letters)] in row:
                letters += LETTERS[len(letters)]
            letters = letters if len(letters) >= 2 else "AB"
        missing = ([] if q else ["question"]) + [c for c in letters if c not in row] + ([] if a else ["answer"])
        if missing:  # a CSV file's columns are its header's
            raise TaskError(f"{path}:{1 if header else lineno}: no column {', '.join(repr(m) for m in missing)} (C-Eval's "
                            f"layout: question, {', '.join(letters)}, answer)")
        answer = _text(row, a, where).strip()
        if answer not in letters:
            raise TaskError(f"{where}: answer {answer!r} is not one of the choices {', '.join(letters)}")
        choices = tuple(_text(row, c, where) for c in letters)
        if "" in choices:
            raise TaskError(f"{where}: choice {letters[choices.index('')]!r} is empty")
        items.append(Item(_text(row, q, where), choices, letters.index(answer), where))
    if not items:
        raise TaskError(f"{path}: no items")
    return tuple(items)


def read_task(spec: str) -> Task:
    """The task a spec names: `arith` (built in) or a file, either prefixed `text:` for the text style."""
    style, _, rest = spec.partition(":") if spec.startswith("text:") else ("letters", "", spec)
    if rest in BUILTIN:
        return Task(rest if style == "letters" else f"{rest}_text", style, builtin_arith(), f"built-in {rest}")
    path = Path(rest)
    if not path.is_file():
        raise TaskError(f"task {spec!r}: not a file, nor a built-in task ({', '.join(BUILTIN)})")
    name = path.stem if style == "letters" else f"{path.stem}_text"
    return Task(name, style, read_items(path), str(path))


def read_tasks(specs: list[str] | str) -> list[Task]:
    """Each spec's task (a string: comma-separated specs); two tasks of one name are an error."""
    if isinstance(specs, str):
        specs = [s.strip() for s in specs.split(",") if s.strip()]
    tasks = [read_task(s) for s in specs]
    names = [t.name for t in tasks]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TaskError(f"tasks {', '.join(twice)}: named twice (a task is named by its file's stem)")
    return tasks


def write_items(items: tuple[Item, ...], path: Path) -> None:
    """Items as a JSONL task file in C-Eval's layout (the built-in task for the harness: docs/eval.md)."""
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            row = {"question": item.question, **dict(zip(LETTERS, item.choices)), "answer": LETTERS[item.answer]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def requests(item: Item, style: str) -> tuple[str, list[str], list[str]]:
    """(context, continuations, the texts whose length acc_norm divides by), as the harness's task would build them."""
    if style == "letters":
        letters = LETTERS[:len(item.choices)]
        context = item.question.strip() + "".join(f"\n{k}. {c}" for k, c in zip(letters, item.choices)) + "\n答案："
        return context, [f" {k}" for k in letters], list(letters)
    return f"Question: {item.question.strip()}\nAnswer:", [f" {c}" for c in item.choices], list(item.choices)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's causal split: trailing spaces of the context go to the continuation; the
    continuation's ids are the whole text's past the context's own."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def loglikelihoods(model, pairs: list[tuple[list[int], list[int]]], autocast=None) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each continuation after its context, one forward for all of them
    (rows padded on the right, which a causal model does not see): the fp32 sum of the continuation's
    log-softmax, and whether each of its ids is the argmax. Ids past model.seq_len + 1 are cut from the left."""
    limit = model.cfg.seq_len
    rows = [(ctx + cont)[-(limit + 1):][:-1] for ctx, cont in pairs]
    x = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for r, row in enumerate(rows):
        x[r, :len(row)] = torch.tensor(row)
    with torch.no_grad(), autocast or contextlib.nullcontext():
        logits, _ = model(x.to(model.tok_embeddings.weight.device))
    logp = F.log_softmax(logits.float(), dim=-1).cpu()
    out = []
    for r, (row, (_, cont)) in enumerate(zip(rows, pairs)):
        piece, target = logp[r, len(row) - len(cont): len(row)], torch.tensor(cont)
        out.append((float(piece.gather(1, target[:, None]).sum()), bool((piece.argmax(-1) == target).all())))
    return out


def choose(lls: list[float], texts: list[str]) -> dict:
    """The harness's picks from the choices' log-likelihoods: `pred` (argmax), `pred_norm` (per
    character, len(text)), `pred_bytes` (per UTF-8 byte); ties go to the first, as numpy's argmax."""
    def argmax(values):
        return max(range(len(values)), key=lambda i: (values[i], -i))

    return {"pred": argmax(lls), "pred_norm": argmax([ll / len(t) for ll, t in zip(lls, texts)]),
            "pred_bytes": argmax([ll / len(t.encode("utf-8")) for ll, t in zip(lls, texts)])}


def score_item(model, tok, item: Item, style: str, autocast=None) -> dict:
    """One item's log-likelihoods and picks (choose)."""
    context, continuations, texts = requests(item, style)
    got = loglikelihoods(model, [encode_pair(tok, context, c) for c in continuations], autocast)
    lls = [ll for ll, _ in got]
    return {"lls": lls, **choose(lls, texts), "answer": item.answer}


def evaluate_tasks(model, tok, tasks: list[Task], rank: int = 0, world_size: int = 1, all_gather=None, sharded: bool = False,
                   autocast=None) -> dict:
    """Every task's items scored, split across ranks (item k of all the tasks' items, in order, on
    rank k mod world_size; under `sharded`, every rank runs as many forwards, a rank with fewer items
    repeating its first and dropping it, since each forward gathers shards), gathered and put back in
    item order: per task and overall, the count of items, acc, acc_norm and acc_bytes (means over
    items in item order) and each item's picks. The model is put in eval mode and back; the global
    generators are forked around it, so nothing of training's changes (docs/design.md I15)."""
    flat = [(t, item) for t in tasks for item in t.items]
    mine = list(range(rank, len(flat), world_size))
    rounds = -(-len(flat) // world_size) if sharded else len(mine)
    device = model.tok_embeddings.weight.device
    cuda = [device.index or 0] if device.type == "cuda" else []
    was_training, got = model.training, []
    model.eval()  # no dropout, and the generators forked: nothing of training's is drawn (docs/design.md I15)
    try:
        with torch.random.fork_rng(devices=cuda), torch.compiler.set_stance("force_eager"):
            for r in range(rounds):
                k = mine[r] if r < len(mine) else (mine[0] if mine else 0)
                scored = score_item(model, tok, flat[k][1], flat[k][0].style, autocast)
                if r < len(mine):
                    got.append((k, scored))
    finally:
        model.train(was_training)
    parts = all_gather(got) if all_gather else [got]
    every = [s for _, s in sorted((pair for part in parts for pair in part), key=lambda p: p[0])]
    results, at = {"tasks": {}}, 0
    for t in tasks:
        scored, at = every[at: at + len(t.items)], at + len(t.items)
        results["tasks"][t.name] = {"items": len(scored), **_means(scored), "style": t.style, "source": t.source,
                                    "picks": [{k: s[k] for k in ("pred", "pred_norm", "answer")} for s in scored]}
    results["overall"] = {"items": len(every), **_means(every)}
    return results


def _means(scored: list[dict]) -> dict:
    n = len(scored)
    return {name: sum(float(s[key] == s["answer"]) for s in scored) / n if n else float("nan")
            for name, key in (("acc", "pred"), ("acc_norm", "pred_norm"), ("acc_bytes", "pred_bytes"))}


def read_documents(path: Path) -> list[str]:
    """A held-out text file's documents: each line's "text" of a JSONL file (MiniMind's pretraining
    layout), else the whole file as one document."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TaskError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 ({e})") from None
    if path.suffix.lower() != ".jsonl":
        docs = [text] if text.strip() else []
    else:
        docs = []
        for lineno, row in _json_lines(path, text, 'a "text" string'):
            if not isinstance(row.get("text"), str):
                raise TaskError(f'{path}:{lineno}: expected an object with a "text" string')
            docs.append(row["text"])
    if not docs:
        raise TaskError(f"{path}: no text")
    return docs


def rolling_windows(ids: list[int], prefix: int, length: int) -> list[tuple[list[int], list[int]]]:
    """The harness's rolling windows (get_rolling_token_windows with one token of context, made disjoint):
    (context, predicted ids) covering every id once, `length` at a time; the first after `prefix` (BOS),
    a full one after the id before it, the last, shorter one after as many ids before it as fill the window."""
    out, done = [], min(length, len(ids))
    if ids:
        out.append(([prefix], ids[:done]))
    while done < len(ids):
        n = min(len(ids) - done, length)
        end = done + n
        window = ids[end - length - 1: end - 1]
        out.append((window[: len(window) - (n - 1)], ids[end - n: end]))
        done = end
    return out


def perplexity(model, tok, docs: list[str], batch: int = 8) -> dict:
    """Perplexity of `docs` as the harness's loglikelihood_rolling tasks measure it: each document's
    ids (no BOS) in rolling windows of model.seq_len after BOS; per token, per byte, per word, and bits per byte."""
    windows = [w for doc in docs for w in rolling_windows(tok.encode(doc), tok.bos, model.cfg.seq_len)]
    total = 0.0
    for i in range(0, len(windows), batch):
        for ll, _ in loglikelihoods(model, windows[i: i + batch]):
            total += ll
    tokens = sum(len(p) for _, p in windows)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    words = sum(len(re.split(r"\s+", d)) for d in docs)
    return {"documents": len(docs), "tokens": tokens, "bytes": nbytes, "loglikelihood": total,
            "token_perplexity": math.exp(-total / tokens), "byte_perplexity": math.exp(-total / nbytes),
            "word_perplexity": math.exp(-total / words), "bits_per_byte": -total / nbytes / math.log(2)}


class TaskScores:
    """eval.tasks during training: the tasks read once at set-up, scored at eval.interval on every
    rank (evaluate_tasks), logged as eval/<task>/acc and eval/<task>/acc_norm."""

    def __init__(self, specs: str, tok) -> None:
        self.tasks, self.tok = read_tasks(specs), tok

    def __call__(self, model, rt, autocast, sharded: bool) -> dict:
        if not self.tasks:
            return {}
        got = evaluate_tasks(model, self.tok, self.tasks, rt.rank, rt.world_size, rt.all_gather, sharded, autocast)
        return {f"eval/{name}/{m}": r[m] for name, r in got["tasks"].items() for m in ("acc", "acc_norm")}
