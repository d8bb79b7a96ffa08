"""data.format=text: MiniMind's pretraining JSONL ({"text": ...}) packed end to end into samples of seq_len + 1 ids."""
from __future__ import annotations

from pathlib import Path

from ..dataset import PackedDataset, counts_path
from . import DataFormat, register


def _build(reader, tok, template, opts, seq_len: int, dtype, out, progress, batch_bytes: int):
    from ..prepare import _build_text

    stats, side = _build_text(reader, tok, seq_len, dtype, out, progress, batch_bytes)
    return stats, side, None


def _stdlib(cache_dir: Path) -> Path:
    from ..prepare import build_stdlib_corpus

    return build_stdlib_corpus(cache_dir / "stdlib_docstrings.jsonl")


register(DataFormat(name="text", chat=False, planes=0, parse=None, build=_build, side=counts_path, dataset=PackedDataset,
                    builtins={"stdlib": _stdlib}))
