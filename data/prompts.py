"""Prompts for reinforcement learning (docs/rl.md): MiniMind's rlaif.jsonl and verifiable tasks,
rendered with the tokenizer's chat template and its generation prompt.

A line is `{"conversations": [messages]}` (MiniMind's rlaif.jsonl: the last assistant turn empty,
dropped) or `{"prompt": ..., "answer": ..., ...}` (the prompt a string, a user turn, or a list of
messages; the other keys are the line's fields, given to the reward function). A prompt must have a
user turn. Each prompt is one row of model.seq_len ids (the rendered prompt with the generation
prompt, padded with the pad id); packing writes beside the rows each prompt's length (a .npy) and
its fields with the user's last turn and where the line is (a .fields.jsonl), for the rewards.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from common.files import atomic_file

from .chat import encode_batch, messages_of
from .sources import DataError, batches, parse_json, read_ahead


def parse_prompt(path: Path, lineno: int, raw: bytes):
    """One JSONL line as (messages, tools, fields); DataError naming file:line."""
    obj = parse_json(path, lineno, raw)
    if obj is None:
        return None
    if not isinstance(obj, dict) or not ("conversations" in obj or "prompt" in obj):
        raise DataError(f'{path}:{lineno}: expected an object with "conversations" (MiniMind\'s rlaif.jsonl) or "prompt", '
                        f'got {raw[:80]!r}')
    fields = {k: v for k, v in obj.items() if k not in ("conversations", "prompt")}
    if "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f'{path}:{lineno}: "conversations" must be a non-empty list of turns')
        if isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant" and not turns[-1].get("content"):
            turns = turns[:-1]  # rlaif.jsonl: the answer to generate is the empty last turn
        messages, tools = messages_of(turns, path, lineno, "conversations")
    else:
        value = obj["prompt"]
        if isinstance(value, str):
            value = [{"role": "user", "content": value}]
        if not isinstance(value, list) or not value:
            raise DataError(f'{path}:{lineno}: "prompt" must be a string or a non-empty list of messages')
        messages, tools = messages_of(value, path, lineno, "prompt")
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise DataError(f"{path}:{lineno}: the prompt has no user turn (roles: {', '.join(m['role'] for m in messages)})")
    if messages[-1]["role"] == "assistant":
        raise DataError(f"{path}:{lineno}: the prompt ends with an assistant turn that is not empty: nothing is left to generate")
    return messages, tools, {**fields, "prompt": users[-1]["content"], "line": f"{path}:{lineno}"}


def fields_path(bin_path: Path) -> Path:
    """A packed prompt file's fields, one JSON line per prompt."""
    return bin_path.with_name(bin_path.stem + ".fields.jsonl")


def build(reader, tok, template, opts, seq_len: int, dtype, out, progress, batch_bytes: int):
    """Write each prompt as a row of seq_len ids; returns the counts, each prompt's length and its
    fields (data/prepare.py writes them beside the rows, before the fingerprint)."""
    lengths: list[int] = []
    fields_tmp = []
    dropped = 0
    for batch, size in read_ahead(batches(reader, batch_bytes)):
        texts = [template.render(m, tools, add_generation_prompt=True) for m, tools, _ in batch]
        for (_, _, fields), ids in zip(batch, encode_batch(tok, texts)):
            if len(ids) >= seq_len:
                dropped += 1
                continue
            row = np.full(seq_len, tok.pad, dtype=np.int64)
            row[: len(ids)] = ids
            row.astype(dtype).tofile(out)
            lengths.append(len(ids))
            fields_tmp.append(fields)
        progress.update(size)
    if not lengths:
        raise DataError(f"{reader.corpus.label}: no prompt fits model.seq_len={seq_len} ({dropped} longer)")
    if dropped:
        import logging

        logging.getLogger("minimind").info("prompts: %d longer than model.seq_len=%d dropped", dropped, seq_len)
    stats = {"prompts": len(lengths), "num_samples": len(lengths), "tokens": int(sum(lengths)), "dropped_long": dropped,
             "max_prompt": max(lengths)}
    return stats, np.asarray(lengths, dtype=np.uint32), fields_tmp


def write_fields(path: Path, fields: list[dict]) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        for item in fields:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")


def arith_sums(n: int = 2000, seed: int = 0) -> list[tuple[int, int]]:
    """The built-in task's sums, (a, b) with operands 0 to 9, a fixed draw: the prompts of
    build_stdlib_arith and the items of the built-in multiple-choice task (objectives/benchmark.py)."""
    rnd = random.Random(seed)
    return [(rnd.randint(0, 9), rnd.randint(0, 9)) for _ in range(n)]


def build_stdlib_arith(dest: Path, n: int = 2000, seed: int = 0) -> Path:
    """The built-in verifiable task: small sums, "What is 3 + 4?" with the answer "7" (arith_sums).
    Written once."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest, "w", encoding="utf-8") as out:
        for a, b in arith_sums(n, seed):
            out.write(json.dumps({"prompt": f"What is {a} + {b}? Answer with the number.", "answer": str(a + b)}) + "\n")
    return dest
