"""Preference pairs for DPO (docs/dpo.md): MiniMind's dpo.jsonl, rendered with the tokenizer's chat
template, the prompt split off, and pairs packed whole without cross-talk.

A line is `{"chosen": [messages], "rejected": [messages]}` (MiniMind's and TRL's implicit-prompt
form: the prompt is the longest common prefix of turns, the completions the rest) or
`{"prompt": ..., "chosen": ..., "rejected": ...}` (explicit; each a list of messages or a string:
the prompt a user turn, a completion an assistant turn).

Each side is rendered whole (prompt + completion) and tokenized as chat data is (data/chat.py);
its taught tokens are those the chat rule teaches (`data.loss_on`) from the end of the rendered
prompt with its generation prompt on (TRL's rule: what a template puts after `<bos>assistant\n`
by itself, e.g. MiniMind-3's empty `<think></think>`, is the prompt's): the completion's, never
the prompt's. The rendered prompt must be a prefix of the rendered side (a template that renders
the turns otherwise is refused, naming the line).

Packing: a pair is one piece, its chosen sequence then its rejected one, each with positions from
0 (so that neither attends to the other: the block-diagonal mask of chat data), and a fourth plane
that says which side of which pair of the row a position belongs to: 2k + 1 for the k-th pair's
chosen side, 2k + 2 for its rejected side, 0 for padding. Pairs are placed whole into rows of
seq_len (best fit, in corpus order, as conversations are; `data.pack=false`: one pair per row);
a pair longer than a row is dropped and counted. A micro-batch is rows, so a chosen side and its
rejected side are always in the same micro-batch, on any world size.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from .chat import Encoder, Packer, encode_batch, messages_of, with_system_prompt, write_row
from .sources import DataError, batches, parse_json, read_ahead

log = logging.getLogger("minimind")


def _side(value, path: Path, lineno: int, key: str, role: str) -> tuple[list[dict], list | None]:
    if isinstance(value, str):
        return messages_of([{"role": role, "content": value}], path, lineno, key)
    if not isinstance(value, list) or not value:
        raise DataError(f"{path}:{lineno}: {key} must be a non-empty list of messages (or a string), got {type(value).__name__}")
    return messages_of(value, path, lineno, key)


def parse_pair(path: Path, lineno: int, raw: bytes):
    """One JSONL line as (path, lineno, prompt, chosen completion, rejected completion, tools)."""
    obj = parse_json(path, lineno, raw)
    if obj is None:
        return None
    if not isinstance(obj, dict) or "chosen" not in obj or "rejected" not in obj:
        raise DataError(f'{path}:{lineno}: expected an object with "chosen" and "rejected" (and optionally "prompt"), '
                        f'got {raw[:80]!r}')
    chosen, tools = _side(obj["chosen"], path, lineno, "chosen", "assistant")
    rejected, tools_r = _side(obj["rejected"], path, lineno, "rejected", "assistant")
    if "prompt" in obj:
        prompt, tools_p = _side(obj["prompt"], path, lineno, "prompt", "user")
        tools = tools_p or tools or tools_r
    else:  # TRL's rule: the longest common prefix of turns is the prompt
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not prompt:
            raise DataError(f"{path}:{lineno}: chosen and rejected share no first turn: no prompt (expected the same prompt "
                            f"turns, then different completions, or an explicit \"prompt\")")
        tools = tools or tools_r
    if not chosen or not rejected:
        raise DataError(f"{path}:{lineno}: the {'chosen' if not chosen else 'rejected'} side has no turn after the prompt "
                        f"(one side is the other's prefix)")
    if chosen == rejected:
        raise DataError(f"{path}:{lineno}: chosen and rejected have identical completions (nothing to prefer)")
    for side, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[0]["role"] != "assistant":
            raise DataError(f"{path}:{lineno}: the {side} completion begins with a {turns[0]['role']} turn: it teaches no token "
                            f"(a completion is the assistant's answer to the prompt)")
    return path, lineno, prompt, chosen, rejected, tools


def _completion_mask(enc: Encoder, ids: list[int], prompt_ids: list[int], where: str, side: str) -> list[bool]:
    if ids[: len(prompt_ids)] != prompt_ids:
        raise DataError(f"{where}: the chat template renders the prompt (with its generation prompt) otherwise alone than in "
                        f"the {side} conversation (its tokens are not a prefix of it): the completion cannot be told from the prompt")
    taught = enc.taught(ids)
    return [False] * len(prompt_ids) + taught[len(prompt_ids):]


class PairPacker(Packer):
    """Whole pairs (chosen then rejected) into rows, with the side plane (module docstring)."""

    def __init__(self, seq_len: int, pad: int, pack: bool, open_rows: int = 64) -> None:
        super().__init__(seq_len, pad, pack, drop_long=True, open_rows=open_rows)
        self.stats.update(pairs=0, dropped_long=0)
        self.stats.pop("conversations")

    def add_pair(self, chosen: tuple[list[int], list[bool]], rejected: tuple[list[int], list[bool]], where: str) -> list[np.ndarray]:
        if len(chosen[0]) - 1 + len(rejected[0]) - 1 > self.seq_len:
            self.stats["dropped_long"] += 1
            return []
        pieces = []
        for side, (ids, taught) in enumerate((chosen, rejected), start=1):
            piece = self.piece(ids, taught)
            if piece is None:
                raise DataError(f"{where}: the {'chosen' if side == 1 else 'rejected'} completion teaches no token "
                                f"(data.loss_on=assistant teaches the assistant's turns: is its last turn an assistant's?)")
            pieces.append(np.concatenate([piece, np.full((1, piece.shape[1]), side, dtype=np.int64)]))
        self.stats["pairs"] += 1
        return self.place(np.concatenate(pieces, axis=1))

    def _row(self, pieces: list[np.ndarray]) -> np.ndarray:
        for k, piece in enumerate(pieces):  # the k-th pair of the row: sides 2k + 1 and 2k + 2
            piece[3] += 2 * k
        return super()._row(pieces)


def build(reader, tok, template, opts, seq_len: int, dtype, out, progress, batch_bytes: int):
    """Pack the pairs `reader` yields into rows of (input, target + 1, position, side) x seq_len
    written to `out`; returns the counts and each row's number of pairs."""
    enc = Encoder(tok, template, opts)
    packer = PairPacker(seq_len, tok.pad, opts.pack)
    pairs_per_row: list[int] = []
    index = 0

    def write(rows: list[np.ndarray]) -> None:
        for row in rows:
            write_row(row, dtype, out)
            pairs_per_row.append(int(row[3].max() + 1) // 2)

    for batch, size in read_ahead(batches(reader, batch_bytes)):
        texts, wheres = [], []
        for path, lineno, prompt, chosen, rejected, tools in batch:
            prompt = with_system_prompt(prompt, index, opts)
            index += 1
            texts += [enc.template.render(prompt, tools, add_generation_prompt=True), enc.render(prompt + chosen, tools),
                      enc.render(prompt + rejected, tools)]
            wheres.append(f"{path}:{lineno}")
        ids = encode_batch(tok, texts)
        for k, where in enumerate(wheres):
            p, c, r = ids[3 * k: 3 * k + 3]
            write(packer.add_pair((c, _completion_mask(enc, c, p, where, "chosen")), (r, _completion_mask(enc, r, p, where, "rejected")),
                                  where))
        progress.update(size)
    write(packer.finish())
    st = packer.stats
    if st["dropped_long"]:
        log.info("preference data: %d pair(s) longer than a row of seq_len=%d (both sides) dropped", st["dropped_long"], seq_len)
    if not pairs_per_row:
        raise DataError(f"{reader.corpus.label}: no pair fits a row of seq_len={seq_len} ({st['dropped_long']} dropped as longer)")
    stats = {"pairs": st["pairs"], "num_samples": len(pairs_per_row), "tokens": st["tokens"], "taught": st["taught"],
             "dropped_long": st["dropped_long"], "padding": len(pairs_per_row) * seq_len - st["tokens"],
             "max_pairs_per_row": max(pairs_per_row)}
    return stats, np.asarray(pairs_per_row, dtype=np.uint32)


def build_stdlib_preference(chat_corpus: Path, dest: Path) -> Path:
    """The built-in preference set, from the built-in chat corpus: each question with its answer
    (chosen) against the same answer's words shuffled (rejected: the same words, no longer a
    sentence; a fixed draw per line). A line whose shuffle changes nothing is left out. Written once."""
    if dest.exists():
        return dest
    import random

    from common.files import atomic_file

    lines = [json.loads(line) for line in chat_corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    with atomic_file(dest, "w", encoding="utf-8") as out:
        for k, line in enumerate(lines):
            turns = line["conversations"]
            words = turns[-1]["content"].split()
            random.Random(k).shuffle(words)
            wrong = " ".join(words)
            if wrong == " ".join(turns[-1]["content"].split()):
                continue
            out.write(json.dumps({"chosen": turns, "rejected": [*turns[:-1], {"role": "assistant", "content": wrong}]},
                                 ensure_ascii=False) + "\n")
    return dest
