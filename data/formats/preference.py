"""data.format=preference: pairs ({"chosen", "rejected"}, optionally "prompt") packed whole with their side plane (data/preference.py)."""
from __future__ import annotations

from pathlib import Path

from .. import preference
from ..dataset import PreferenceDataset, pairs_path
from . import DataFormat, register


def _build(reader, tok, template, opts, seq_len: int, dtype, out, progress, batch_bytes: int):
    stats, side = preference.build(reader, tok, template, opts, seq_len, dtype, out, progress, batch_bytes)
    return stats, side, None


def _stdlib(cache_dir: Path) -> Path:
    from ..prepare import build_stdlib_chat

    return preference.build_stdlib_preference(build_stdlib_chat(cache_dir / "stdlib_chat.jsonl"), cache_dir / "stdlib_preference.jsonl")


register(DataFormat(name="preference", chat=True, planes=4, parse=preference.parse_pair, build=_build, side=pairs_path,
                    dataset=PreferenceDataset, builtins={"stdlib-preference": _stdlib}, unit="pairs"))
