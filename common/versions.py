"""The torch releases the trainer supports, checked before anything else runs (docs/gpus.md).

A GPU cluster runs its image's torch, not the pin in requirements.txt, so the code keeps to the APIs
of the oldest release in the range: torch 2.10 is the first with Inductor's deterministic mode
(`torch._inductor.config.deterministic`, which a compiled run's exactness needs) beside FSDP2's
public `fully_shard`, `torch.compiler.set_stance` and `clip_grads_with_norm_` (2.6). CI runs the
multi-process exact-resume tests on the oldest (tests/test_torch_range.py) as well as on the pin.
Outside the range a launch stops with one line naming both, exit 2, before any import that could
fail on a missing API.
"""
from __future__ import annotations

import re

OLDEST = (2, 10)
"""The oldest supported torch (major, minor): requirements.txt's comment and README say the same."""
NEWEST = (2, 15)
"""The newest supported torch (major, minor); any patch release of it is in the range."""


def supported() -> str:
    return f"torch {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}.x"


def parse(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ("2.11.0+cu130", "2.13.0a0+git..."), None if unreadable."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def refusal(version: str) -> str | None:
    """The one line refusing `version`, or None when it is in the range."""
    got = parse(version)
    if got is not None and OLDEST <= got <= NEWEST:
        return None
    return f"error: torch {version} is installed; this trainer supports {supported()} (requirements.txt pins one of them)"


def require_torch() -> None:
    """Exit 2 with one line on stderr when the installed torch is outside the range (a rank of a
    torchrun launch each says it; the lines are identical)."""
    import sys

    import torch

    from .outcome import exit_code

    line = refusal(str(torch.__version__))
    if line:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        raise SystemExit(exit_code("bad_input"))
