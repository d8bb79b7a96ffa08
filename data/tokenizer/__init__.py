"""Tokenizers: the built-in byte tokenizer, or a Hugging Face `tokenizers` file (`tokenizer.json`).

`data.tokenizer: bytes` (the default) maps text to its UTF-8 bytes (ids 0-255), then BOS, EOS and
PAD (256-258). `data.tokenizer: PATH/tokenizer.json` (MiniMind's, or one trained with
`python -m data.tokenizer train`) is used as it is: its BOS, EOS and PAD tokens are read from the
`tokenizer_config.json` beside it (`bos_token`, `eos_token`, `pad_token`, as Hugging Face keeps
them), never guessed. A tokenizer's `name` is its identity in the data fingerprint: "bytes-v1", or
the sha256 of the file and the three special ids, so a different file or a different reading of it
is a different corpus. `byte_tokenizer_files` writes the byte tokenizer as Hugging Face files
(a byte-level model without merges) for the exports, with the same ids.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
from pathlib import Path

import numpy as np

from common.outcome import BadInput

BYTES = "bytes"
"""`data.tokenizer` value of the built-in byte tokenizer."""
BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259
NAME = "bytes-v1"  # recorded in the data fingerprint; change it when the mapping changes
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""MiniMind's special tokens (pad, bos, eos), ids 0-2 of a tokenizer trained here."""


class TokenizerError(BadInput, ValueError):
    """A tokenizer file that cannot be used; the message names the file and what was expected."""


def id_dtype(vocab_size: int) -> np.dtype:
    """The packed file's id type: uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def frame(flat: np.ndarray, lengths: list[int], bos: int, eos: int, dtype) -> np.ndarray:
    """The documents laid end to end in `flat` (their `lengths`), each framed by BOS and EOS."""
    n = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(n + 2) - (n + 2)  # where each document's BOS goes
    out = np.empty(int(n.sum()) + 2 * len(n), dtype=dtype)
    body = np.ones(len(out), dtype=bool)
    body[starts] = body[starts + n + 1] = False
    out[starts], out[starts + n + 1] = bos, eos
    out[body] = flat
    return out


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The ChatML template the byte tokenizer uses and `python -m data.tokenizer train` writes (data/chat.py renders with it)."""
_SPECIAL_TEXT = re.compile("(" + "|".join(re.escape(t) for t in SPECIALS) + ")")


class ByteTokenizer:
    """The built-in tokenizer: nothing to download, 259 ids."""

    name, vocab_size, bos, eos, pad = NAME, VOCAB_SIZE, BOS, EOS, PAD
    files: dict[str, bytes] = {}
    """What a checkpoint carries to rebuild this tokenizer: nothing."""
    special_texts = {"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "pad_token": SPECIALS[0]}
    """The texts of BOS, EOS and PAD in a rendered conversation (ChatML's, as MiniMind's)."""

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered conversation: the special tokens' texts become BOS/EOS/PAD, the rest UTF-8 bytes."""
        ids, ids_of = [], {v: getattr(self, k.split("_")[0]) for k, v in self.special_texts.items()}
        for part in _SPECIAL_TEXT.split(text):
            ids.extend([ids_of[part]] if part in ids_of else part.encode("utf-8"))
        return ids

    def decode_rendered(self, ids: list[int]) -> str:
        """The inverse of encode_rendered: special tokens as their texts."""
        texts = {self.bos: self.special_texts["bos_token"], self.eos: self.special_texts["eos_token"], self.pad: self.special_texts["pad_token"]}
        out, run = [], bytearray()
        for i in ids:
            if i in texts:
                out.append(run.decode("utf-8", errors="replace") + texts[i])
                run = bytearray()
            elif 0 <= i < 256:
                run.append(i)
        return "".join(out) + run.decode("utf-8", errors="replace")

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """The UTF-8 bytes of `text`, optionally framed by BOS/EOS."""
        return ([BOS] if bos else []) + list(text.encode("utf-8")) + ([EOS] if eos else [])

    def decode(self, ids: list[int]) -> str:
        """Special tokens are dropped and broken UTF-8 is replaced, never raised."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def pack_batch(self, texts: list[str]) -> np.ndarray:
        """BOS + ids + EOS of every text, concatenated (uint16), without a Python loop per byte."""
        encoded = [t.encode("utf-8") for t in texts]
        return frame(np.frombuffer(b"".join(encoded), dtype=np.uint8), list(map(len, encoded)), BOS, EOS, np.uint16)


def _byte_symbols() -> list[str]:
    """The printable character that byte-level `tokenizers` models (GPT-2's scheme) use for each byte
    0-255: printable Latin-1 bytes stand for themselves, the rest for 256 + their rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def byte_tokenizer_files(model_max_length: int) -> dict[str, bytes]:
    """The byte tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json) that
    transformers' AutoTokenizer loads: a byte-level BPE with the 256 bytes as ids 0-255 and no
    merges, BOS, EOS and PAD as special tokens 256-258 with ChatML's texts, and the ChatML chat
    template. Its ids equal ByteTokenizer's on any text (encode) and rendered conversation
    (encode_rendered); the same bytes every time."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={s: b for b, s in enumerate(_byte_symbols())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # no merges: no splitting needed
    tok.decoder = decoders.ByteLevel()
    texts = ByteTokenizer.special_texts
    tok.add_special_tokens([AddedToken(texts[k], special=True, normalized=False) for k in ("bos_token", "eos_token", "pad_token")])
    if [tok.token_to_id(texts[k]) for k in ("bos_token", "eos_token", "pad_token")] != [BOS, EOS, PAD]:
        raise AssertionError("the byte tokenizer's special ids moved")  # a change of the library, caught before writing
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **texts, "add_bos_token": False, "add_eos_token": False,
              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False, "chat_template": CHATML}
    return {TOKENIZER_FILE: (tok.to_str(pretty=True) + "\n").encode(), CONFIG_FILE: (json.dumps(config, indent=1) + "\n").encode()}


class FileTokenizer:
    """A Hugging Face `tokenizers` file with its special tokens from `tokenizer_config.json`."""

    def __init__(self, tokenizer_json: bytes, config_json: bytes | None, source: str) -> None:
        from tokenizers import Tokenizer

        self.source = source
        try:
            self.tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise TokenizerError(f"{source}: not a Hugging Face tokenizers file ({type(e).__name__}: {e})") from None
        config_name = str(Path(source).with_name(CONFIG_FILE))
        if config_json is None:
            raise TokenizerError(f"{config_name}: missing; it names the tokenizer's bos_token, eos_token and pad_token "
                                 f"(Hugging Face's layout: tokenizer.json and tokenizer_config.json side by side)")
        try:
            config = json.loads(config_json)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{config_name}: does not parse ({e})") from None
        ids, self.special_texts = {}, {}
        self.config = config if isinstance(config, dict) else {}
        for role in ("bos", "eos", "pad"):
            token = config.get(f"{role}_token") if isinstance(config, dict) else None
            if isinstance(token, dict):  # the older AddedToken form {"content": ...}
                token = token.get("content")
            if not isinstance(token, str):
                example = dict(zip(("pad", "bos", "eos"), SPECIALS))[role]
                raise TokenizerError(f"{config_name}: no {role}_token (expected the token's text, e.g. \"{example}\")")
            self.special_texts[f"{role}_token"] = token
            ids[role] = self.tok.token_to_id(token)
            if ids[role] is None:
                raise TokenizerError(f"{config_name}: {role}_token {token!r} is not a token of {source}")
        self.bos, self.eos, self.pad = ids["bos"], ids["eos"], ids["pad"]
        unk = self.config.get("unk_token")
        if isinstance(unk, (str, dict)):
            self.special_texts["unk_token"] = unk.get("content") if isinstance(unk, dict) else unk
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.sha256 = hashlib.sha256(tokenizer_json).hexdigest()
        self.name = f"sha256:{self.sha256} bos={self.bos} eos={self.eos} pad={self.pad}"
        self.files = {TOKENIZER_FILE: tokenizer_json, CONFIG_FILE: config_json}

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered conversation, its special tokens' texts recognized (as transformers tokenizes it)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode_rendered(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def pack_batch(self, texts: list[str]) -> np.ndarray:
        """BOS + ids + EOS of every text, concatenated, encoded by the library's parallel batch encoder."""
        encodings = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        lengths = [len(e) for e in encodings]
        flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=sum(lengths))
        return frame(flat, lengths, self.bos, self.eos, id_dtype(self.vocab_size))


def load(spec: str) -> ByteTokenizer | FileTokenizer:
    """The tokenizer `data.tokenizer` names: "bytes", or the path of a tokenizer.json file (or of
    the folder holding it)."""
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(f"data.tokenizer: {spec} is not a file (expected '{BYTES}' or the path of a Hugging Face "
                             f"tokenizer.json, e.g. MiniMind's)")
    try:
        data = path.read_bytes()
        config = path.with_name(CONFIG_FILE)
        config_data = config.read_bytes() if config.is_file() else None
    except OSError as e:
        raise TokenizerError(f"data.tokenizer: {path} cannot be read ({e.strerror})") from None
    return FileTokenizer(data, config_data, str(path.resolve()))


def from_files(files: dict[str, bytes], source: str) -> ByteTokenizer | FileTokenizer:
    """The tokenizer a checkpoint carries (`files`: its tokenizer files' bytes; none: bytes)."""
    if TOKENIZER_FILE not in files:
        return ByteTokenizer()
    return FileTokenizer(files[TOKENIZER_FILE], files.get(CONFIG_FILE), f"{source}/{TOKENIZER_FILE}")


def train_bpe(corpora: list[Path], vocab_size: int, out_dir: Path, min_frequency: int = 2) -> Path:
    """Train a byte-level BPE on the "text" of JSONL `corpora` (MiniMind's recipe: ByteLevel
    pre-tokenizer and decoder, MiniMind's special tokens first), write `out_dir/tokenizer.json`
    and its `tokenizer_config.json`. Deterministic: the same corpora and arguments give the same bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ..sources import iter_documents  # the corpus reader with its file:line errors

    if vocab_size < 256 + len(SPECIALS):
        raise TokenizerError(f"--vocab-size {vocab_size}: must be at least {256 + len(SPECIALS)} (the 256 byte symbols "
                             f"and the {len(SPECIALS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def texts():
        for corpus in corpora:
            yield from iter_documents(corpus)

    tok.train_from_iterator(texts(), trainer=trainer)
    if tok.get_vocab_size() < vocab_size:
        raise TokenizerError(
            f"--vocab-size {vocab_size}: the corpus gives only {tok.get_vocab_size()} ids (no more merges occur at least "
            f"--min-frequency {min_frequency} times); use a larger corpus, --vocab-size {tok.get_vocab_size()} or less, "
            f"or a lower --min-frequency (nothing was written)")
    from common.files import atomic_write


    out_dir.mkdir(parents=True, exist_ok=True)
    path = atomic_write(out_dir / TOKENIZER_FILE, tok.to_str(pretty=True) + "\n")
    pad, bos, eos = SPECIALS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
              "unk_token": pad, "add_bos_token": False, "add_eos_token": False, "model_max_length": 32768,
              "clean_up_tokenization_spaces": False, "chat_template": CHATML}
    atomic_write(out_dir / CONFIG_FILE, json.dumps(config, indent=1) + "\n")
    return path
