"""Corpus preparation at scale: packing against the batch encoder alone, and its peak memory at twice the size."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from . import section
from .helpers import MINIMIND_TOKENIZER, ROOT, mixed_corpus, vocab_6400


AIMS = {
    "packing / batch encoder alone, MiniMind's tokenizer": (">=", 0.8),
    "peak RSS packing 400 MB / 200 MB": ("<=", 1.1),
}


_PACK_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from data import pack, prepare, sources
from data import tokenizer as tokenizers
mode, source, cache = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
tok = tokenizers.load(sys.argv[5])
t0 = time.perf_counter()
if mode == "pack":
    _, meta = pack(prepare.resolve_source(str(source), cache), 512, cache, tok)
    n = meta["num_tokens"]
elif mode == "encoder":  # the ceiling: the batch encoder alone, on the same batches held in memory
    batches = [texts for texts, _ in sources.batches(sources.Reader(prepare.resolve_source(str(source), cache)), 4 << 20)]
    t0 = time.perf_counter()
    n = sum(len(e) for texts in batches for e in tok.tok.encode_batch_fast(texts, add_special_tokens=False))
else:  # json: parsing every line, the floor of any packer
    n = sum(len(texts) for texts, _ in sources.batches(sources.Reader(prepare.resolve_source(str(source), cache)), 4 << 20))
seconds = time.perf_counter() - t0
# VmHWM: this process image's peak RSS (ru_maxrss would carry the forking parent's peak over)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "n": n, "rss": hwm * 1024}))
"""


def split_corpus(source: Path, folder: Path, parts: int, megabytes: int | None = None) -> Path:
    """The first `megabytes` (all, for None) of `source` in `parts` files of whole lines, in a folder."""
    folder.mkdir(parents=True)
    limit = (megabytes * 1_000_000 if megabytes else source.stat().st_size) // parts
    with open(source, "rb") as src:
        for i in range(parts):
            with open(folder / f"part-{i:03d}.jsonl", "wb") as dst:
                dst.write(src.read(limit))
                dst.write(src.readline())
    return folder


def _pack_child(mode: str, source: Path, cache: Path, tok: str) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", _PACK_CHILD, str(ROOT), mode, str(source), str(cache), tok],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    if out.returncode != 0:
        raise SystemExit(f"bench: packing child ({mode}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def packing_rows(work: Path, megabytes: int) -> list[dict]:
    """Corpus preparation at scale, each figure from a fresh process: packing with MiniMind's
    tokenizer against its batch encoder alone on the same text in memory; peak RSS of packing a
    corpus and one twice its size; the byte tokenizer's packing against parsing the JSON alone."""
    tok = vocab_6400(work)
    whole = work / f"mixed-{2 * megabytes}.jsonl"
    mixed_corpus(whole, 2 * megabytes, tok)
    small, big = split_corpus(whole, work / f"mixed-{megabytes}", 4, megabytes), split_corpus(whole, work / f"mixed-{2 * megabytes}", 8)
    whole.unlink()
    mb = sum(p.stat().st_size for p in small.iterdir()) / 1e6
    ours = _pack_child("pack", small, work / "pc", str(tok))
    ceiling = _pack_child("encoder", small, work / "pc", str(tok))
    twice = _pack_child("pack", big, work / "pc", str(tok))
    by_bytes = _pack_child("pack", small, work / "pc", "bytes")
    parse = _pack_child("json", small, work / "pc", "bytes")
    shutil.rmtree(work / "pc", ignore_errors=True)
    name = "MiniMind's tokenizer" if tok == MINIMIND_TOKENIZER else "a 6,400-id tokenizer trained here"
    return [
        {"row": f"packing {mb:.0f} MB of mixed Chinese/English JSONL in 4 files, {name}", "what": "packing / batch encoder alone",
         "value": ceiling["seconds"] / ours["seconds"],
         "detail": f"{mb / ours['seconds']:.1f} MB/s packed (parse, encode, write, fsync) / {mb / ceiling['seconds']:.1f} MB/s "
                   f"encoder alone on the text in memory; {ours['n'] / 1e6:.0f}M tokens",
         "aim": "packing / batch encoder alone, MiniMind's tokenizer"},
        {"row": f"peak RSS of packing, {2 * megabytes} MB vs {megabytes} MB corpus", "what": "RSS ratio",
         "value": twice["rss"] / ours["rss"],
         "detail": f"{twice['rss'] / 2**20:.0f} MiB / {ours['rss'] / 2**20:.0f} MiB (whole process)", "aim": "peak RSS packing 400 MB / 200 MB"},
        {"row": f"packing {mb:.0f} MB with the byte tokenizer", "what": "packing / JSON parsing alone",
         "value": parse["seconds"] / by_bytes["seconds"],
         "detail": f"{mb / by_bytes['seconds']:.0f} MB/s packed / {mb / parse['seconds']:.0f} MB/s parsing the JSON lines"},
    ]


@section("packing", order=110, aims=AIMS)
def run(work: Path, a: argparse.Namespace) -> list[dict]:
    q = a.quick
    return packing_rows(work, 50 if q else a.corpus_mb)
