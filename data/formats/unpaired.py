"""data.format=unpaired: KTO's examples ({"prompt", "completion", "label"}), each packed with its mismatched KL sequence.

A line is `{"prompt": ..., "completion": ..., "label": true|false}` (TRL's unpaired preference form): the prompt a
list of messages or a string (a user turn), the completion a list of messages beginning with the assistant's or a
string (an assistant turn), the label whether the completion is desirable. Each is rendered and its taught tokens
chosen as a preference side's are (data/preference.py: the completion's, from the end of the rendered prompt with
its generation prompt on).

KTO estimates its KL term from mismatched pairs: TRL rotates the completions by one within each device batch of the
dataset in order; here, so that the pairs are a function of the corpus alone (the same on any world size or batch),
line k's KL sequence is its prompt with line k + 1's completion (the last line's: with the first line's). An example
is one piece, its sequence then its KL sequence, each with positions from 0, with two more planes: the side (2k + 1
the row's k-th example, 2k + 2 its KL sequence, 0 padding) and the label (1 desirable, 2 undesirable, 0 padding).
Pieces are placed whole as pairs are (best fit, in corpus order); one longer than a row is dropped and counted.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from ..chat import Encoder, Packer, encode_batch, messages_of, with_system_prompt, write_row
from ..dataset import PreferenceDataset, pairs_path
from ..preference import _completion_mask
from ..sources import DataError, batches, parse_json, read_ahead
from . import DataFormat, register

log = logging.getLogger("minimind")
DESIRABLE, UNDESIRABLE = 1, 2


def _turns(value, path: Path, lineno: int, key: str, role: str):
    if isinstance(value, str):
        return messages_of([{"role": role, "content": value}], path, lineno, key)
    if not isinstance(value, list) or not value:
        raise DataError(f"{path}:{lineno}: {key} must be a non-empty list of messages (or a string), got {type(value).__name__}")
    return messages_of(value, path, lineno, key)


def parse_example(path: Path, lineno: int, raw: bytes):
    """One JSONL line as (path, lineno, prompt, completion, label, tools); DataError naming file:line and the key."""
    obj = parse_json(path, lineno, raw)
    if obj is None:
        return None
    if not isinstance(obj, dict) or not {"prompt", "completion", "label"} <= set(obj):
        raise DataError(f'{path}:{lineno}: expected an object with "prompt", "completion" and "label", got {raw[:80]!r}')
    if not isinstance(obj["label"], bool):
        raise DataError(f"{path}:{lineno}: label must be true (desirable) or false (undesirable), got {obj['label']!r}")
    prompt, tools = _turns(obj["prompt"], path, lineno, "prompt", "user")
    completion, tools_c = _turns(obj["completion"], path, lineno, "completion", "assistant")
    if completion[0]["role"] != "assistant":
        raise DataError(f"{path}:{lineno}: the completion begins with a {completion[0]['role']} turn: it teaches no token "
                        f"(a completion is the assistant's answer to the prompt)")
    return path, lineno, prompt, completion, obj["label"], tools or tools_c


class ExamplePacker(Packer):
    """Whole examples (the sequence, then its KL sequence) into rows, with the side and label planes."""

    def __init__(self, seq_len: int, pad: int, pack: bool, open_rows: int = 64) -> None:
        super().__init__(seq_len, pad, pack, drop_long=True, open_rows=open_rows)
        self.stats.update(completions=0, desirable=0, undesirable=0, dropped_long=0)
        self.stats.pop("conversations")

    def add_example(self, seq, kl, label: bool, where: str) -> list[np.ndarray]:
        if len(seq[0]) - 1 + len(kl[0]) - 1 > self.seq_len:
            self.stats["dropped_long"] += 1
            return []
        pieces = []
        for side, (ids, taught) in enumerate((seq, kl), start=1):
            piece = self.piece(ids, taught)
            if piece is None:
                what = "completion" if side == 1 else "next line's completion (its KL sequence)"
                raise DataError(f"{where}: the {what} teaches no token (data.loss_on=assistant teaches the assistant's turns)")
            planes = np.empty((2, piece.shape[1]), dtype=np.int64)
            planes[0], planes[1] = side, DESIRABLE if label else UNDESIRABLE
            pieces.append(np.concatenate([piece, planes]))
        self.stats["completions"] += 1
        self.stats["desirable" if label else "undesirable"] += 1
        return self.place(np.concatenate(pieces, axis=1))

    def _row(self, pieces: list[np.ndarray]) -> np.ndarray:
        for k, piece in enumerate(pieces):  # the k-th example of the row: sides 2k + 1 and 2k + 2
            piece[3] += 2 * k
        return super()._row(pieces)


def build(reader, tok, template, opts, seq_len: int, dtype, out, progress, batch_bytes: int):
    """Pack the examples `reader` yields, each with its KL sequence (line k + 1's completion; the module docstring),
    into rows of (input, target + 1, position, side, label) x seq_len written to `out`."""
    enc = Encoder(tok, template, opts)
    packer = ExamplePacker(seq_len, tok.pad, opts.pack)
    per_row: list[int] = []
    first, held, index = None, None, 0

    def write(rows: list[np.ndarray]) -> None:
        for row in rows:
            write_row(row, dtype, out)
            per_row.append(int(row[3].max() + 1) // 2)

    def emit(example, other) -> None:  # `example` with `other`'s completion as its KL sequence
        nonlocal index
        path, lineno, prompt, completion, label, tools = example
        prompt = with_system_prompt(prompt, index, opts)
        index += 1
        where = f"{path}:{lineno}"
        p, c, k = encode_batch(tok, [enc.template.render(prompt, tools, add_generation_prompt=True), enc.render(prompt + completion, tools),
                                     enc.render(prompt + other[3], tools)])
        write(packer.add_example((c, _completion_mask(enc, c, p, where, "completion")), (k, _completion_mask(enc, k, p, where, "KL")),
                                 label, where))

    for batch, size in read_ahead(batches(reader, batch_bytes)):
        for example in batch:
            if first is None:
                first = example
            if held is not None:
                emit(held, example)
            held = example
        progress.update(size)
    if held is None:
        raise DataError(f"{reader.corpus.label}: the corpus is empty (no {{\"prompt\", \"completion\", \"label\"}} lines)")
    emit(held, first)
    write(packer.finish())
    st = packer.stats
    if st["dropped_long"]:
        log.info("unpaired data: %d example(s) longer than a row of seq_len=%d (with its KL sequence) dropped", st["dropped_long"], seq_len)
    if not per_row:
        raise DataError(f"{reader.corpus.label}: no example fits a row of seq_len={seq_len} ({st['dropped_long']} dropped as longer)")
    stats = {"completions": st["completions"], "desirable": st["desirable"], "undesirable": st["undesirable"], "num_samples": len(per_row),
             "tokens": st["tokens"], "taught": st["taught"], "dropped_long": st["dropped_long"],
             "padding": len(per_row) * seq_len - st["tokens"], "max_examples_per_row": max(per_row)}
    return stats, np.asarray(per_row, dtype=np.uint32), None


class UnpairedDataset(PreferenceDataset):
    """Rows of packed examples: (input ids, targets with -100 where nothing is taught, positions, sides, labels), each
    of seq_len; `pairs(indices)` counts the examples of those rows (what packing stored), `max_pairs` the most a row holds."""

    ROW_PLANES = 5

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        x, y, pos, side, label = torch.from_numpy(self._rows()[self.start + index].astype(np.int64)).view(5, self.seq_len)
        return x, y - 1 - 99 * (y == 0), pos, side, label


def build_stdlib_unpaired(preference: Path, dest: Path) -> Path:
    """The built-in unpaired set, from the built-in preference pairs (data/preference.py): pair k's prompt with its
    chosen answer (desirable) when k is even, with its rejected one, the answer's words shuffled (undesirable), when
    k is odd: each prompt once, next to another's (its KL sequence is a mismatched pair). Written once."""
    if dest.exists():
        return dest
    from common.files import atomic_file

    with atomic_file(dest, "w", encoding="utf-8") as out:
        lines = [line for line in preference.read_text(encoding="utf-8").splitlines() if line.strip()]
        for k, line in enumerate(lines):
            pair, label = json.loads(line), k % 2 == 0
            completion = pair["chosen" if label else "rejected"][-1:]
            out.write(json.dumps({"prompt": pair["chosen"][:-1], "completion": completion, "label": label}, ensure_ascii=False) + "\n")
    return dest


def _stdlib(cache_dir: Path) -> Path:
    from ..prepare import build_stdlib_chat
    from ..preference import build_stdlib_preference

    pairs = build_stdlib_preference(build_stdlib_chat(cache_dir / "stdlib_chat.jsonl"), cache_dir / "stdlib_preference.jsonl")
    return build_stdlib_unpaired(pairs, cache_dir / "stdlib_unpaired.jsonl")


register(DataFormat(name="unpaired", chat=True, planes=5, parse=parse_example, build=build, side=pairs_path, dataset=UnpairedDataset,
                    builtins={"stdlib-unpaired": _stdlib}, unit="completions"))
