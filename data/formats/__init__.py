"""The data formats, one registered record each: what `data.format=<name>` reads, validates, packs and maps.

Each format is one module of this package that calls `register(DataFormat(...))`; the packer (data/prepare.py),
the run's data (data/run.py) and `python -m data.prepare --format` read the registry, so a format added is one module.

    name       data.format's value
    chat       its rows are rendered with the tokenizer's chat template (data/chat.py ChatOptions: data.loss_on, data.pack,
               ...); False: pretraining text, packed without a template
    planes     the planes of a packed row of seq_len positions (0: text's seq_len + 1 ids)
    parse      one JSONL line -> a record, or DataError naming file:line and what was expected (None: text's own reader)
    build      (reader, tok, template, opts, seq_len, dtype, out, progress, batch_bytes) -> (stats, side data, fields or None):
               the records packed into rows written to `out`
    side       the packed file's side file (a .npy beside it: counts, taught tokens, pairs, lengths per row)
    dataset    the PackedDataset class that maps the rows into a run's samples (its batch shape)
    builtins   the built-in corpora it owns: data.path value -> (cache folder -> the JSONL file, written once)
    unit       the fingerprint's count of what a row holds, for the run's log ("conversations", "pairs", ...)
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from ..sources import DataError


@dataclass(frozen=True)
class DataFormat:
    """One data format (the package docstring says each field)."""

    name: str
    chat: bool
    planes: int
    parse: Callable | None
    build: Callable
    side: Callable[[Path], Path]
    dataset: type
    builtins: Mapping[str, Callable[[Path], Path]] = field(default_factory=dict)
    unit: str = ""


_REGISTRY: dict[str, DataFormat] = {}
_LOADED = False


def register(fmt: DataFormat) -> DataFormat:
    """Add a format; a name or a built-in corpus taken twice is a mistake."""
    taken = {b for other in _REGISTRY.values() for b in other.builtins}
    if fmt.name in _REGISTRY or taken & set(fmt.builtins):
        raise ValueError(f"data format {fmt.name!r}: the name or a built-in corpus ({', '.join(fmt.builtins)}) is registered already")
    _REGISTRY[fmt.name] = fmt
    return fmt


def _load() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for module in pkgutil.iter_modules(__path__):  # each format's module registers itself
            if not module.name.startswith("_"):
                importlib.import_module(f"{__name__}.{module.name}")


def formats() -> dict[str, DataFormat]:
    """Every registered format by name, text first, then by name."""
    _load()
    return dict(sorted(_REGISTRY.items(), key=lambda kv: (kv[0] != "text", kv[0])))


def format_of(name: str) -> DataFormat:
    """data.format=`name`'s record (a name not registered: DataError listing those that are)."""
    known = formats()
    if name not in known:
        raise DataError(f"data.format={name!r}: expected one of {', '.join(known)}")
    return known[name]


def builtin(path: str) -> Callable[[Path], Path] | None:
    """The builder of the built-in corpus `path` names (data.path=stdlib-...), or None."""
    return next((f.builtins[path] for f in formats().values() if path in f.builtins), None)


__all__ = ["DataFormat", "builtin", "format_of", "formats", "register"]
