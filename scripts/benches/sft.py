"""Packed against padded chat rows: real tokens per token computed and taught tokens per step."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from data import pack, resolve_source

from . import section
from .helpers import ROOT, run_train, vocab_6400


AIMS = {
    "packed: real tokens / tokens computed": (">=", 0.9),
    "taught tokens per token computed, packed / padded": (">=", 1.5),
}


def chat_corpus(path: Path, n: int, tok_path: Path, seed: int = 0) -> None:
    """`n` MiniMind-like conversations: a user turn and an assistant turn (a third of them with a
    system turn, a fifth with a second exchange), each turn Chinese (runs of the tokenizer's CJK
    vocabulary) or English (standard-library docstrings), answers longer than questions."""
    import random
    import re

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    cjk = [w for w in (tok.decode([i]) for i in range(tok.get_vocab_size())) if re.fullmatch(r"[\u4e00-\u9fff]+", w)]
    english = [json.loads(line)["text"] for line in open(resolve_source("stdlib", ROOT / "data" / "cache").files[0], encoding="utf-8")]
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        if rng.random() < 0.5:
            return "".join(rng.choice(cjk) + ("，。"[rng.random() < 0.5] if rng.random() < 0.1 else "") for _ in range(rng.randint(lo, hi)))
        return rng.choice(english)[: rng.randint(lo, hi) * 3]

    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            turns = [{"role": "system", "content": text(5, 30)}] if rng.random() < 0.33 else []
            for _ in range(2 if rng.random() < 0.2 else 1):
                turns += [{"role": "user", "content": text(5, 60)}, {"role": "assistant", "content": text(20, 300)}]
            f.write(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")


def sft_rows(work: Path, conversations: int, steps: int) -> list[dict]:
    """Packed against padded chat rows (data.pack) at seq_len 512 with MiniMind's tokenizer: the
    share of computed positions that are real tokens and that teach, and the step time per taught
    token training the tiny model's shape on each (1 process)."""
    from data import tokenizer as tokenizers
    from data.chat import ChatOptions
    from data.dataset import ChatDataset

    tok_path = vocab_6400(work)
    source = work / "sft.jsonl"
    chat_corpus(source, conversations, tok_path)
    tok = tokenizers.load(str(tok_path))
    got = {}
    for packed in (True, False):
        bin_path, meta = pack(source, 512, work / "sft-cache", tok, chat=ChatOptions(pack=packed))
        computed = meta["num_samples"] * 512
        rows = run_train([f"data.path={source}", "data.format=chat", f"data.pack={str(packed).lower()}", f"data.tokenizer={tok_path}",
                          f"data.cache_dir={work / 'sft-cache'}", "model.seq_len=512", "train.global_batch=16", "train.micro_batch=4",
                          f"train.steps={steps}", "checkpoint.interval=0", "log.sample_ids=true", f"out_dir={work / 'sft-run'}"],
                         work / "train.log")
        ds = ChatDataset(bin_path, 512, dtype=meta["dtype"])
        per_taught = statistics.median(r["step_s"] / ds.taught(r["sample_ids"]) for r in rows[2:])
        got[packed] = {"real": meta["tokens"] / computed, "taught": meta["taught"] / computed, "rows": meta["num_samples"],
                       "per_taught": per_taught}
    p, q = got[True], got[False]
    return [
        {"row": f"chat rows, {conversations} MiniMind-like conversations, seq_len 512", "what": "packed: real tokens / tokens computed",
         "value": p["real"], "aim": "packed: real tokens / tokens computed",
         "detail": f"packed {p['real']:.3f} in {p['rows']} rows; padded {q['real']:.3f} in {q['rows']} rows"},
        {"row": f"chat rows, {conversations} MiniMind-like conversations, seq_len 512", "what": "taught tokens per token computed, packed / padded",
         "value": p["taught"] / q["taught"], "aim": "taught tokens per token computed, packed / padded",
         "detail": f"packed {p['taught']:.3f}, padded {q['taught']:.3f} taught tokens per position computed"},
        {"row": "chat step time per taught token, tiny shape at seq_len 512, 1 process", "what": "packed / padded",
         "value": p["per_taught"] / q["per_taught"],
         "detail": f"{p['per_taught'] * 1e6:.1f} us / {q['per_taught'] * 1e6:.1f} us per taught token (median of {steps - 2} steps)"},
    ]


@section("sft", order=120, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return sft_rows(work, 1000 if q else 4000, 6 if q else 12)
