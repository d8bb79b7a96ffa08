"""The bench's sections, one module each, found by the registry: a section registers its name, its place in
the table, the aims its rows are held to, and the function that measures them.

A new section is a new module here with one `@section(...)`-decorated `run(work, a)`; scripts/bench.py,
its --only choices and docs/bench.json's order read the registry, and nothing else is edited.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.kernels import reproducible_kernels  # noqa: E402

# Before the first matmul: every section, and every process it starts (MiniMind's trainer too), runs
# MKL's branch of the trainer's default (its reproducible one unless MKL_CBWR is set), so a row's two
# sides share their arithmetic and --only SECTION runs as the whole bench does; the JSON records it.
reproducible_kernels()

Run = Callable[[Path, argparse.Namespace], list[dict]]
"""A section's measurement: (a scratch folder removed after the bench, the command's flags) -> its rows."""


@dataclass(frozen=True)
class Section:
    """One section of the table: `order` places it (and its rows in docs/bench.json), `aims` maps an
    aim's name (a row's "aim") to ("<=" or ">=", the bound)."""
    name: str
    order: int
    aims: dict[str, tuple[str, float]]
    run: Run


_REGISTRY: dict[str, Section] = {}


def section(name: str, order: int, aims: dict[str, tuple[str, float]] | None = None) -> Callable[[Run], Run]:
    """Register the decorated function as section `name`; a name or a place taken twice is a mistake."""
    def register(run: Run) -> Run:
        if name in _REGISTRY or any(s.order == order for s in _REGISTRY.values()):
            raise ValueError(f"bench section {name!r} (order {order}): the name or the place is taken")
        _REGISTRY[name] = Section(name, order, dict(aims or {}), run)
        return run
    return register


def sections() -> list[Section]:
    """Every section, each module of this package imported once, in table order."""
    for info in pkgutil.iter_modules(__path__):
        if info.name != "helpers":
            importlib.import_module(f"{__name__}.{info.name}")
    return sorted(_REGISTRY.values(), key=lambda s: s.order)


def aims() -> dict[str, tuple[str, float]]:
    """Every section's aims in one table; two sections naming one aim must agree on it."""
    out: dict[str, tuple[str, float]] = {}
    for s in sections():
        for what, aim in s.aims.items():
            if out.setdefault(what, aim) != aim:
                raise ValueError(f"bench aim {what!r}: {out[what]} in one section, {aim} in {s.name}")
    return out
