"""DPO's step time with a precomputed reference against a live one, and packed pairs against padded ones."""
from __future__ import annotations

import argparse
from pathlib import Path

from data import pack, resolve_source

from . import section
from .helpers import launch, step_median


AIMS = {
    "DPO, precomputed / live reference, step time": ("<=", 0.6),
}


def dpo_rows(work: Path, steps: int) -> list[dict]:
    """DPO on the built-in pairs at the tiny shape (seq_len 512, 1 process): step time with the
    precomputed reference against a live one; and packed pairs against one padded pair per row:
    taught tokens per computed position (data.pack)."""
    base = ["--config", "configs/tiny.yaml", "data.path=stdlib-preference", "data.format=preference", "train.objective=dpo",
            "model.seq_len=512", "train.global_batch=8", "train.micro_batch=4", f"train.steps={steps}", "checkpoint.interval=0",
            "log.progress=false", "data.num_samples=400", f"data.cache_dir={work / 'dpo-cache'}"]
    t, taught = {}, {}
    for name, extra in (("precompute", []), ("live", ["train.dpo.precompute=false"])):
        out = work / f"dpo-{name}"
        launch([*base, *extra, f"out_dir={out}"], work / "dpo.log")
        t[name] = step_median(out, 2)
    from data import tokenizer as tokenizers
    from data.chat import ChatOptions

    source = resolve_source("stdlib-preference", work / "dpo-cache")
    for packed in (True, False):
        _, meta = pack(source, 512, work / "dpo-cache", tokenizers.ByteTokenizer(), chat=ChatOptions(pack=packed, kind="preference"))
        taught[packed] = meta["taught"] / (meta["num_samples"] * 512)
    return [{"row": "DPO, tiny shape at seq_len 512, batch 8 rows, 1 process", "what": "DPO, precomputed / live reference, step time",
             "value": t["precompute"] / t["live"], "aim": "DPO, precomputed / live reference, step time",
             "detail": f"{t['precompute'] * 1e3:.0f} ms / {t['live'] * 1e3:.0f} ms (the live reference: one more forward per row)"},
            {"row": "DPO rows, the built-in pairs at seq_len 512", "what": "taught tokens per computed position, packed / padded pairs",
             "value": taught[True] / taught[False], "detail": f"{taught[True]:.3f} packed / {taught[False]:.3f} one pair per row"}]


@section("dpo", order=80, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return dpo_rows(work, 6 if q else 12)
