"""`python -m checkpoint plot RUN [RUN ...] --out FILE.png [--keys KEY ...]`: loss, validation loss and LR
against the step, and other logged figures a panel each (matplotlib: requirements-extra.txt)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from run import folder

from .arguments import place

HELP = "draw loss, validation loss and LR against the step for one or more runs (matplotlib)"


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", type=place, nargs="+")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--keys", nargs="+", metavar="KEY", help="other logged figures to draw, a panel each (e.g. distill_loss "
                                                            "top1_agreement ce_loss)")


def plot(runs: list[Path], out: Path, keys: list[str] | None = None) -> int:
    """Loss (solid), validation loss (dots) and LR (below) against the optimizer step, one colour per run;
    each of `keys` (a figure metrics.jsonl logs, e.g. distill_loss) in a panel of its own between them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: plot needs matplotlib: pip install -r requirements-extra.txt", file=sys.stderr)
        return 2
    formats = set(plt.gcf().canvas.get_supported_filetypes())
    plt.close("all")
    if out.suffix.lstrip(".").lower() not in formats:
        raise folder.RunFolderError(f"--out {out}: unknown image extension {out.suffix or '(none)'!r}; expected one of "
                                       f"{', '.join('.' + f for f in sorted(formats))}")
    if not out.parent.is_dir():
        raise folder.RunFolderError(f"--out {out}: the folder {out.parent} does not exist")
    every = {}
    for run in runs:
        rows = folder.read_metrics(run)
        for lineno, row in enumerate(rows, 1):
            if not isinstance(row, dict) or not all(isinstance(row.get(k), (int, float)) for k in ("step", "loss", "lr")):
                raise folder.RunFolderError(f"{run / folder.METRICS}:{lineno}: a metrics line needs numeric 'step', 'loss' and 'lr'")
        every[run] = rows
        for key in keys or ():
            if not any(isinstance(r.get(key), (int, float)) for r in rows):
                raise folder.RunFolderError(f"--keys {key}: {run / folder.METRICS} logs no numeric {key!r}")
    keys = list(keys or ())
    fig, (top, *middle, bottom) = plt.subplots(2 + len(keys), 1, figsize=(8, 6 + 2 * len(keys)), sharex=True,
                                               gridspec_kw={"height_ratios": [3, *[2] * len(keys), 1]})
    for i, (run, rows) in enumerate(every.items()):
        colour, name = f"C{i}", run.name
        top.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=colour, label=f"{name} train")
        val = [r for r in rows if "val_loss" in r]
        if val:
            top.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=colour, label=f"{name} validation")
        bottom.plot([r["step"] for r in rows], [r["lr"] for r in rows], color=colour)
        for panel, key in zip(middle, keys):
            have = [r for r in rows if isinstance(r.get(key), (int, float))]
            panel.plot([r["step"] for r in have], [r[key] for r in have], color=colour)
    for panel, key in zip(middle, keys):
        panel.set_ylabel(key)
        panel.grid(alpha=0.3)
    top.set_ylabel("loss (nats/token)")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_ylabel("LR")
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")
    return 0


def run(args: argparse.Namespace) -> int:
    return plot(args.runs, args.out, args.keys)
