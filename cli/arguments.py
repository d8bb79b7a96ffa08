"""What the verbs share: the bad-input error, the argument types (a number in range, a local or remote
place), the sampling flags and their defaults, and fetching a place in object storage to a verified copy."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from checkpoint import storage
from common.outcome import BadInput
from common.store import is_url
from run import folder


class CommandError(BadInput):
    """A command given a path or an argument it cannot use; the message says which and why."""


def number(kind: type, low: float | None = None, high: float | None = None):
    """An argparse `type`: a finite `kind` within [low, high]; anything else is argparse's exit 2 naming the flag."""
    import math

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
            span = f"from {low:g} to {high:g}" if low is not None and high is not None else f"at least {low:g}" if low is not None else "finite"
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} {span}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def place(value: str):
    """A command's run or checkpoint argument: a URL as it is (s3://...; fetched by fetch), else a Path."""
    return value if is_url(value) else Path(value)


def fetch(place, checkpoint: bool = True):
    """A run folder or checkpoint in the store as a local copy the commands read like any folder
    (checkpoint/remote.py: fetch, every file verified as it comes down); a local path as it is."""
    if not is_url(place):
        return place
    from checkpoint import remote

    run, step = remote.split(place)
    local = remote.fetch(run, folder.fetched_dir(run), step, checkpoint)
    return local / storage.CHECKPOINTS / step if step else local


def sampling(temperature, top_k, top_p, repetition_penalty) -> tuple[float, int, float, float]:
    """The settings given, each one left None taken from model.generate.DEFAULTS."""
    from model.generate import DEFAULTS

    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "repetition_penalty": repetition_penalty}
    return tuple(getattr(DEFAULTS, k) if v is None else v for k, v in given.items())


def sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The sampling flags of `generate` and `chat`: one set, with model.generate.DEFAULTS' defaults."""
    from model.generate import DEFAULTS

    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature, help=f"0: greedy (default {DEFAULTS.temperature:g})")
    p.add_argument("--top-k", type=int, default=DEFAULTS.top_k, help=f"sample from the k likeliest ids (0: all; default {DEFAULTS.top_k})")
    p.add_argument("--top-p", type=float, default=DEFAULTS.top_p,
                   help=f"sample from the smallest set of ids holding this probability (1: all; default {DEFAULTS.top_p:g})")
    p.add_argument("--repetition-penalty", type=float, default=DEFAULTS.repetition_penalty,
                   help=f"> 1 discourages ids already in the text (1: none; default {DEFAULTS.repetition_penalty:g})")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed: the same seed, the same text")


class Stderr(logging.StreamHandler):
    """A handler that writes to whatever sys.stderr is when a line is logged."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _) -> None:
        pass
