"""`python -m checkpoint compare RUN_A RUN_B`: are two runs bit-identical, weights and every logged loss
(exit 0 identical, 1 not)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from run import folder

from .arguments import CommandError, place

HELP = "compare two run folders: model_sha256 and every logged loss (exit 0 when identical)"


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", type=place)
    p.add_argument("run_b", type=place)


def _losses(run: Path) -> list[tuple[int, float]]:
    if not (run / folder.METRICS).exists():
        return []
    try:
        return [(int(m["step"]), float(m["loss"])) for m in folder.read_metrics(run)]
    except (KeyError, TypeError, ValueError) as e:
        raise CommandError(f"{run / folder.METRICS}: a line without a numeric 'step' and 'loss' ({type(e).__name__}: {e})") from None


def compare_runs(a: Path, b: Path) -> dict:
    """Two run folders side by side: the newest valid checkpoints' weights and every logged loss.
    `identical` is True only for equal model_sha256 and bit-equal losses at every step."""
    from weights import checkpoint_weights, identity

    (_, ma, ca, wa), (_, mb, cb, wb) = checkpoint_weights(a), checkpoint_weights(b)
    sha_a, sha_b = identity(wa, ca), identity(wb, cb)
    max_dw = max(((wa[k].double() - wb[k].double()).abs().max().item() for k in wa if k in wb and wa[k].shape == wb[k].shape),
                 default=float("nan"))
    la, lb = _losses(a), _losses(b)
    steps_equal = [s for s, _ in la] == [s for s, _ in lb]
    dloss = [abs(x - y) for (_, x), (_, y) in zip(la, lb)]
    return {
        "identical": sha_a == sha_b and steps_equal and la == lb,
        "model_sha256": [sha_a, sha_b],
        "step": [ma["step"], mb["step"]],
        "max_abs_weight_diff": max_dw,
        "logged_steps": [len(la), len(lb)],
        "losses_equal": steps_equal and la == lb,
        "max_abs_loss_diff": max(dloss, default=0.0),
        "first_differing_step": next((s for (s, x), (_, y) in zip(la, lb) if x != y), None),
    }


def run(args: argparse.Namespace) -> int:
    result = compare_runs(args.run_a, args.run_b)
    print(json.dumps(result, indent=1))
    return 0 if result["identical"] else 1
