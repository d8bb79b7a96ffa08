"""A LoRA checkpoint's bytes and save time against a full fine-tune's."""
from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from checkpoint import storage

from . import section
from .helpers import SMALL, folder_bytes, launch, vocab_6400


def lora_rows(work: Path) -> list[dict]:
    """A LoRA checkpoint (rank 16 on MiniMind's square linears) against a full fine-tune's of the
    same 26M model: the step folder's bytes and the save's time as the runs log them."""
    tok = vocab_6400(work)
    base = ["--config", "configs/tiny.yaml", *SMALL, f"data.tokenizer={tok}", "model.seq_len=128", "train.global_batch=4",
            "train.micro_batch=4", "train.steps=6", "checkpoint.interval=2", "log.progress=false", f"data.cache_dir={work / 'c-cache'}"]
    got = {}
    for name, extra in (("full", []), ("lora", ["train.lora.rank=16"])):
        out = work / f"lora-{name}"
        _, err = launch([*base, *extra, f"out_dir={out}"], work / "lora.log")
        saves = [float(x) for x in re.findall(r"saved \S+: step \d+, ([\d.]+)s", err)]
        got[name] = (folder_bytes(out / storage.CHECKPOINTS / storage.step_dir_name(6)), statistics.median(saves))
    (bf, sf), (bl, sl) = got["full"], got["lora"]
    return [{"row": "checkpoint of a LoRA run (rank 16, q_proj + o_proj) vs a full fine-tune, 26M shape", "what": "LoRA / full, bytes",
             "value": bl / bf, "detail": f"{bl / 2**20:.2f} MiB / {bf / 2**20:.1f} MiB per step folder (the base is pinned by its hash)"},
            {"row": "checkpoint of a LoRA run vs a full fine-tune, 26M shape", "what": "LoRA / full, save time", "value": sl / sf,
             "detail": f"{sl:.2f} s / {sf:.2f} s (medians of 3 saves)"}]


@section("lora", order=70)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    return lora_rows(work)
