"""Chat data for supervised fine-tuning (docs/sft.md): conversations rendered with the tokenizer's
own chat template, the assistant-only loss mask, and packing without cross-talk.

A line is `{"conversations": [{"role": ..., "content": ...}, ...]}` (MiniMind's SFT files): roles
system, user, assistant, tool; an assistant turn may carry `reasoning_content` and `tool_calls` (a
JSON string or a list); the system turn may carry `tools` (a JSON string or a list), passed to the
template as `tools`.

Rendering is Hugging Face's (docs/design.md I18): the `chat_template` of the tokenizer's
`tokenizer_config.json`, run by Jinja2 in an immutable sandbox with what templates use (`tojson`
that does not escape HTML, `raise_exception`, `strftime_now`, `namespace`, loop controls), given
`messages`, `tools`, `add_generation_prompt` and the special tokens' texts. The text is tokenized
with the special tokens recognized.

Which tokens teach (MiniMind's rule): for every assistant turn, from the token after
`<bos>assistant\\n` through the closing `<eos>` and the newline after it, found as token sequences
in the ids; every other target is ignored (`data.loss_on=assistant`). `data.loss_on=all` teaches
every token of the conversation.

Packing: each conversation becomes (input, target, position) triples - the ids but the last, the
ids but the first (-100 where not taught), positions 0, 1, ... - and whole conversations are placed
into rows of `seq_len` (best fit among the rows still open, in corpus order: deterministic), the
rest of a row padded. Positions restart at 0 for every conversation; the model derives a
block-diagonal causal mask from them, so no conversation attends to another in the same row.
`data.pack=false` puts one conversation per row instead, padded (MiniMind's layout).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.seeds import derive_seed

from .tokenizer import CHATML
from .sources import DataError, batches, check_text, parse_json, read_ahead

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a knowledgeable AI. Answer accurately and concisely.",
    "You are a small but useful language model.",
    "你是一个乐于助人的AI助手。",
    "你是一个知识丰富的AI，请尽力给出准确的回答。",
)
"""What `data.system_prompt_ratio` adds in front of a conversation without a system turn."""
SYSTEM_STREAM = 7  # the derive_seed stream of the system-prompt draw: (seed, this, conversation index)


class TemplateError(DataError):
    """A template that does not compile or raises while rendering."""


def compile_template(source: str, where: str):
    """`source` compiled as transformers compiles chat templates (sandboxed Jinja2)."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise TemplateError(f"{where}: the chat template does not compile ({e})") from None


@dataclass
class Template:
    """A tokenizer's chat template with the special tokens' texts it is rendered with."""

    source: str
    where: str
    specials: dict
    """bos_token, eos_token, pad_token (and unk_token when the config names one): their texts."""

    def __post_init__(self) -> None:
        self.compiled = compile_template(self.source, self.where)

    def render(self, messages: list[dict], tools=None, add_generation_prompt: bool = False, **extra) -> str:
        """The template's text; `extra`: more variables for it (a server's `chat_template_kwargs`, e.g. MiniMind's
        `open_thinking`), never in place of the ones above."""
        import jinja2

        try:
            return self.compiled.render(**{**extra, **self.specials}, messages=messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"the chat template of {self.where} raised: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TemplateError(f"the chat template of {self.where} failed: {type(e).__name__}: {e}") from None


def template_of(tok) -> Template:
    """The tokenizer's chat template: its tokenizer_config.json's `chat_template`, or ChatML for the
    byte tokenizer. A tokenizer file without one is an error naming its config."""
    if not hasattr(tok, "config"):
        return Template(CHATML, "the byte tokenizer", dict(tok.special_texts))
    source = tok.config.get("chat_template")
    where = str(Path(tok.source).with_name("tokenizer_config.json"))
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source.strip():
        raise DataError(f"{where}: no chat_template; data.format=chat renders conversations with the tokenizer's own "
                        f"template (add one, e.g. ChatML, or train a tokenizer here: it writes one)")
    return Template(source, where, dict(tok.special_texts))


def _json_or_list(value, path, lineno, what):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: {what} is a string that is not JSON ({e})") from None
    if not isinstance(value, list):
        raise DataError(f"{path}:{lineno}: {what} must be a list (or a JSON string of one), got {type(value).__name__}")
    return value


def parse_conversation(path: Path, lineno: int, raw: bytes):
    """One JSONL line as (messages, tools), checked; DataError naming file:line (and the role or key)."""
    obj = parse_json(path, lineno, raw)
    if obj is None:
        return None
    turns = obj.get("conversations") if isinstance(obj, dict) else None
    if not isinstance(turns, list) or not turns:
        raise DataError(f'{path}:{lineno}: expected an object with a non-empty "conversations" list, got {raw[:80]!r}')
    return messages_of(turns, path, lineno, "conversations")


def messages_of(turns: list, path: Path, lineno: int, what: str) -> tuple[list[dict], list | None]:
    """A list of turns as (messages, tools), each turn checked; DataError naming file:line and `what`[k]."""
    messages, tools = [], None
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{path}:{lineno}: {what}[{k}] is not an object")
        role = turn.get("role")
        if role not in ROLES:
            raise DataError(f"{path}:{lineno}: {what}[{k}] has role {role!r}; expected one of {', '.join(ROLES)}")
        content = turn.get("content")
        if not isinstance(content, str):
            raise DataError(f"{path}:{lineno}: {what}[{k}] ({role}): content must be a string, got "
                            f"{type(content).__name__}")
        message = {"role": role, "content": check_text(path, lineno, content)}
        if role == "assistant":
            if turn.get("reasoning_content") is not None:
                if not isinstance(turn["reasoning_content"], str):
                    raise DataError(f"{path}:{lineno}: {what}[{k}] (assistant): reasoning_content must be a string")
                message["reasoning_content"] = check_text(path, lineno, turn["reasoning_content"])
            if turn.get("tool_calls"):
                message["tool_calls"] = _json_or_list(turn["tool_calls"], path, lineno, f"{what}[{k}].tool_calls")
        if role == "system" and turn.get("tools"):
            tools = _json_or_list(turn["tools"], path, lineno, f"{what}[{k}].tools")
        messages.append(message)
    return messages, tools


@dataclass(frozen=True)
class ChatOptions:
    """What decides a chat corpus's packed rows besides the tokenizer and seq_len."""

    loss_on: str = "assistant"
    pack: bool = True
    drop_long: bool = False
    system_prompt_ratio: float = 0.0
    seed: int = 0
    kind: str = "chat"
    """chat (conversations) or preference (pairs, data/preference.py)."""

    def key(self) -> dict:
        """The options in the cache key and fingerprint (the seed only when it is used)."""
        out = {"format": self.kind, "loss_on": self.loss_on, "pack": self.pack, "drop_long": self.drop_long}
        if self.system_prompt_ratio:
            out.update(system_prompt_ratio=self.system_prompt_ratio, seed=self.seed)
        return out


def with_system_prompt(messages: list[dict], index: int, opts: ChatOptions) -> list[dict]:
    """MiniMind's augmentation as a pure function of (seed, conversation index): a system prompt in
    front of `system_prompt_ratio` of the conversations that have none."""
    if not opts.system_prompt_ratio or messages[0]["role"] == "system":
        return messages
    rnd = random.Random(derive_seed(opts.seed, SYSTEM_STREAM, index))
    if rnd.random() >= opts.system_prompt_ratio:
        return messages
    return [{"role": "system", "content": rnd.choice(SYSTEM_PROMPTS)}, *messages]


def find(ids: list[int], pattern: list[int], start: int) -> int:
    """The first index >= start where `pattern` occurs in `ids`, or -1."""
    n = len(pattern)
    first = pattern[0]
    i = start
    while True:
        try:
            i = ids.index(first, i)
        except ValueError:
            return -1
        if ids[i:i + n] == pattern:
            return i
        i += 1


def assistant_mask(ids: list[int], opener: list[int], closer: list[int]) -> list[bool]:
    """MiniMind's rule: True from after each `opener` (<bos>assistant\\n) through the end of the
    following `closer` (<eos>\\n), or to the end when the turn is not closed (a truncated one)."""
    mask = [False] * len(ids)
    i = 0
    while (at := find(ids, opener, i)) >= 0:
        start = at + len(opener)
        end = find(ids, closer, start)
        stop = len(ids) if end < 0 else end + len(closer)
        mask[start:stop] = [True] * (stop - start)
        i = stop
    return mask


class Encoder:
    """Conversations -> (ids, taught) with a tokenizer and its template."""

    def __init__(self, tok, template: Template, opts: ChatOptions) -> None:
        self.tok, self.template, self.opts = tok, template, opts
        self.opener = tok.encode_rendered(f"{template.specials['bos_token']}assistant\n")
        self.closer = tok.encode_rendered(f"{template.specials['eos_token']}\n")

    def render(self, messages: list[dict], tools=None) -> str:
        return self.template.render(messages, tools)

    def encode(self, messages: list[dict], tools=None) -> tuple[list[int], list[bool]]:
        ids = self.tok.encode_rendered(self.render(messages, tools))
        return ids, self.taught(ids)

    def taught(self, ids: list[int]) -> list[bool]:
        return [True] * len(ids) if self.opts.loss_on == "all" else assistant_mask(ids, self.opener, self.closer)


def labels_of(ids: list[int], taught: list[bool]) -> list[int]:
    """Hugging Face's labels: aligned with input_ids (the model shifts), -100 where a token does not teach."""
    return [i if t else IGNORE for i, t in zip(ids, taught)]


class Packer:
    """Whole conversations into rows of `seq_len` (input, target, position) triples.

    Best fit among at most `open_rows` rows still open, in corpus order; the fullest row is closed
    when a new one must open past that. Deterministic, and a conversation is never split."""

    def __init__(self, seq_len: int, pad: int, pack: bool, drop_long: bool, open_rows: int = 64) -> None:
        self.seq_len, self.pad, self.pack, self.drop_long, self.open_rows = seq_len, pad, pack, drop_long, open_rows
        self.open: list[list] = []  # [used, [(x, y, pos) arrays ...]]
        self.stats = {"conversations": 0, "truncated": 0, "dropped_long": 0, "untaught": 0, "rows": 0, "tokens": 0, "taught": 0}

    def add(self, ids: list[int], taught: list[bool]) -> list[np.ndarray]:
        """Place one conversation; returns the rows this closed (each (3, seq_len) int64)."""
        if len(ids) - 1 > self.seq_len:
            if self.drop_long:
                self.stats["dropped_long"] += 1
                return []
            self.stats["truncated"] += 1
            ids, taught = ids[: self.seq_len + 1], taught[: self.seq_len + 1]
        piece = self.piece(ids, taught)
        if piece is None:
            self.stats["untaught"] += 1
            return []
        self.stats["conversations"] += 1
        return self.place(piece)

    def piece(self, ids: list[int], taught: list[bool]) -> np.ndarray | None:
        """(input, target, position) planes of one sequence, counted; None when nothing in it teaches."""
        x = np.asarray(ids[:-1], dtype=np.int64)
        y = np.where(np.asarray(taught[1:], dtype=bool), np.asarray(ids[1:], dtype=np.int64), IGNORE)
        if len(x) == 0 or not (y != IGNORE).any():
            return None
        self.stats["tokens"] += len(x)
        self.stats["taught"] += int((y != IGNORE).sum())
        return np.stack([x, y, np.arange(len(x), dtype=np.int64)])

    def place(self, piece: np.ndarray) -> list[np.ndarray]:
        """Put a piece (planes x length) in a row: the tightest open fit, else a new row; returns the rows this closed."""
        n = piece.shape[1]
        if not self.pack:
            return [self._row([piece])]
        fits = [r for r in self.open if self.seq_len - r[0] >= n]
        if fits:
            row = min(fits, key=lambda r: self.seq_len - r[0])  # the tightest fit; the first of equals
            row[0] += n
            row[1].append(piece)
            return []
        closed = []
        if len(self.open) >= self.open_rows:
            fullest = max(self.open, key=lambda r: r[0])
            self.open.remove(fullest)
            closed.append(self._row(fullest[1]))
        self.open.append([n, [piece]])
        return closed

    def finish(self) -> list[np.ndarray]:
        rows = [self._row(r[1]) for r in self.open]
        self.open = []
        return rows

    def _row(self, pieces: list[np.ndarray]) -> np.ndarray:
        row = np.concatenate(pieces, axis=1)
        pad = self.seq_len - row.shape[1]
        if pad:  # padding: no target, and each pad position its own one-token segment (position 0); further planes 0
            fill = [[self.pad] * pad, [IGNORE] * pad, [0] * pad] + [[0] * pad] * (row.shape[0] - 3)
            row = np.concatenate([row, np.array(fill, dtype=np.int64)], axis=1)
        self.stats["rows"] += 1
        return row


def marked_text(tok, ids: list[int], taught: list[bool]) -> str:
    """The rendered text with the taught spans in [[ ]]: what `inspect --text` prints."""
    out, span, inside = [], [], None
    for i, t in zip(ids, taught):
        if t != inside and span:
            text = tok.decode_rendered(span)
            out.append(f"[[{text}]]" if inside else text)
            span = []
        inside = t
        span.append(i)
    if span:
        text = tok.decode_rendered(span)
        out.append(f"[[{text}]]" if inside else text)
    return "".join(out)




def encode_batch(tok, texts: list[str]) -> list[list[int]]:
    """Rendered conversations -> ids (the parallel batch encoder for a tokenizer file)."""
    if hasattr(tok, "tok"):
        return [e.ids for e in tok.tok.encode_batch_fast(texts, add_special_tokens=False)]
    return [tok.encode_rendered(t) for t in texts]


def write_row(row: np.ndarray, dtype, out) -> None:
    """One packed row as stored: its planes with the targets + 1 (0 meaning "does not teach")."""
    stored = row.copy()
    stored[1] = np.where(row[1] == IGNORE, 0, row[1] + 1)
    stored.astype(dtype).tofile(out)


def build(reader, tok, template: Template, opts: ChatOptions, seq_len: int, dtype, out, progress, batch_bytes: int):
    """Pack the conversations `reader` yields into rows of (input, target + 1, position) x seq_len
    written to `out` (targets are stored + 1, 0 meaning "does not teach"); returns the counts and
    each row's number of taught tokens."""
    enc = Encoder(tok, template, opts)
    packer = Packer(seq_len, tok.pad, opts.pack, opts.drop_long)
    taught_per_row: list[int] = []
    index = 0

    def write(rows: list[np.ndarray]) -> None:
        for row in rows:
            write_row(row, dtype, out)
            taught_per_row.append(int((row[1] != IGNORE).sum()))

    for batch, size in read_ahead(batches(reader, batch_bytes)):
        texts = []
        for messages, tools in batch:
            texts.append(enc.render(with_system_prompt(messages, index, opts), tools))
            index += 1
        for ids in encode_batch(tok, texts):
            write(packer.add(ids, enc.taught(ids)))
        progress.update(size)
    write(packer.finish())
    st = packer.stats
    if st["truncated"] or st["dropped_long"] or st["untaught"]:
        import logging

        logging.getLogger("minimind").info(
            "chat data: %d conversation(s) longer than seq_len=%d %s, %d teach nothing (no assistant token) and were skipped",
            st["truncated"] + st["dropped_long"], seq_len, "dropped (data.drop_long)" if opts.drop_long else "truncated",
            st["untaught"])
    stats = {"conversations": st["conversations"], "num_samples": len(taught_per_row), "tokens": st["tokens"],
             "taught": st["taught"], "truncated": st["truncated"], "dropped_long": st["dropped_long"], "untaught": st["untaught"],
             "padding": len(taught_per_row) * seq_len - st["tokens"]}
    return stats, np.asarray(taught_per_row, dtype=np.uint32)


def _main(argv: list[str] | None = None) -> int:
    """`python -m data.chat inspect --tokenizer PATH FILE.jsonl [--n N] [--text]`."""
    import argparse

    from . import tokenizer as tokenizers
    from .sources import Corpus, Reader

    parser = argparse.ArgumentParser(prog="python -m data.chat", description="Check what a chat corpus teaches, before packing.")
    sub = parser.add_subparsers(dest="verb", required=True)
    ins = sub.add_parser("inspect", help="print each conversation's input_ids and labels (-100: does not teach) as JSON lines")
    ins.add_argument("file", type=Path, help="a JSONL file of {\"conversations\": [...]} lines (.gz or not)")
    ins.add_argument("--tokenizer", default=tokenizers.BYTES, help="bytes (default) or a tokenizer.json with a chat_template beside it")
    ins.add_argument("--n", type=int, default=0, help="the first N conversations only (default: all)")
    ins.add_argument("--text", action="store_true", help="print the rendered text with the taught spans in [[ ]] instead")
    ins.add_argument("--loss-on", choices=("assistant", "all"), default="assistant", help="as data.loss_on (default %(default)s)")
    ins.add_argument("--system-prompt-ratio", type=float, default=0.0, help="as data.system_prompt_ratio (with --seed)")
    ins.add_argument("--seed", type=int, default=1337, help="the run's seed, for --system-prompt-ratio (default %(default)s)")
    args = parser.parse_args(argv)
    tok = tokenizers.load(args.tokenizer)
    opts = ChatOptions(loss_on=args.loss_on, system_prompt_ratio=args.system_prompt_ratio, seed=args.seed)
    enc = Encoder(tok, template_of(tok), opts)
    if not args.file.is_file():
        raise DataError(f"{args.file}: no such file (expected a JSONL file of {{\"conversations\": [...]}} lines)")
    for index, ((messages, tools), _) in enumerate(Reader(Corpus.of_file(args.file), parse=parse_conversation)):
        if args.n and index >= args.n:
            break
        ids, taught = enc.encode(with_system_prompt(messages, index, opts), tools)
        if args.text:
            print(marked_text(tok, ids, taught))
        else:
            print(json.dumps({"input_ids": ids, "labels": labels_of(ids, taught)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    from common.outcome import command

    return command(_main, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
