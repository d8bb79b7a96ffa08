"""Byte-level tokenizer: ids 0-255 are the UTF-8 bytes, then BOS, EOS and PAD."""
from __future__ import annotations

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259
NAME = "bytes-v1"  # recorded in the data fingerprint; change it when the mapping changes


def encode(text: str, bos: bool = False, eos: bool = False) -> list[int]:
    """Token ids of `text`, optionally framed by BOS/EOS."""
    ids = list(text.encode("utf-8"))
    return ([BOS] if bos else []) + ids + ([EOS] if eos else [])


def decode(ids: list[int]) -> str:
    """Text of `ids`; special tokens are dropped and broken UTF-8 is replaced, never raised."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
