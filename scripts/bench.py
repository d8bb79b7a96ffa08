"""Where we stand: checkpoint I/O against the hardware's floor, throughput with saves, the loop
against a minimal one and against MiniMind's own trainer, compile and activation checkpointing,
MoE, LoRA, DPO, GRPO, resume cost, data preparation, sharding.

    python scripts/bench.py [--quick] [--only SECTION ...] [--json PATH]

One run, one table; each row is a ratio against a baseline measured beside it in the same run (the
hardware's floor, a minimal loop of our own, or a peer run unmodified). Timings live here and in
docs/bench.json (written whole by this script; with --only, those sections' rows replace theirs and
the file's "sections" says when and how each was run again), never in a test. The peer rows need MiniMind's
trainer's requirements (transformers, datasets: requirements-bench.txt), installed here when
missing, never by scripts/train.sh.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import benches  # first: it sets the kernels' arithmetic before torch's first matmul (scripts/benches/__init__.py)
import torch  # noqa: E402

ROOT = benches.ROOT


def main(argv: list[str] | None = None) -> int:
    names = [s.name for s in benches.sections()]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, rounds and steps")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here (docs/bench.json is a full run's, whole; with "
                                                  "--only, the sections run replace theirs in an existing file: reruns says when)")
    parser.add_argument("--only", nargs="+", choices=names, help="run only these sections")
    parser.add_argument("--corpus-mb", type=int, default=200, help="size of the packing rows' generated corpus (and twice it)")
    a = parser.parse_args(argv)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=ROOT / "runs" if (ROOT / "runs").exists() else None))
    wanted = set(a.only or names)
    rows: list[dict] = []
    try:
        for s in benches.sections():
            if s.name in wanted:
                t1 = time.time()
                got = s.run(work, a)
                for row in got:
                    row["section"] = s.name
                rows += got
                print(f"[bench] {s.name}: {len(got)} rows, {time.time() - t1:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(rows, a, t0)


def report(rows: list[dict], a: argparse.Namespace, t0: float) -> int:
    aims, names = benches.aims(), [s.name for s in benches.sections()]
    for row in rows:
        aim = aims.get(row.get("aim") or "")
        row["aim"] = f"{aim[0]} {aim[1]}" if aim else ""
        row["meets_aim"] = (row["value"] <= aim[1] if aim[0] == "<=" else row["value"] >= aim[1]) if aim else None
    print(f"bench ({' '.join(a.only) if a.only else ('quick' if a.quick else 'full')}, {time.time() - t0:.0f} s, torch {torch.__version__}, "
          f"{os.cpu_count()} cores)\n")
    print("| measured | ratio | value | aim | figures |")
    print("|---|---|---|---|---|")
    for row in rows:
        mark = "" if row["meets_aim"] is None else (" ✓" if row["meets_aim"] else " ✗")
        print(f"| {row['row']} | {row['what']} | {row['value']:.3f} | {row['aim']}{mark} | {row['detail']} |")
    if a.json:
        run = {"command": " ".join(["python", "scripts/bench.py", *(argv_of(a))]), "quick": a.quick, "only": a.only,
               "seconds": round(time.time() - t0), "torch": torch.__version__, "cores": os.cpu_count(),
               "mkl_cbwr": os.environ.get("MKL_CBWR", "(MKL's default)"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        if a.only and a.json.exists():  # some sections again: their rows replace theirs, the others' stay, each run said
            old = json.loads(a.json.read_text())
            kept = [r for r in old["rows"] if r.get("section") not in a.only]
            rows = sorted(kept + rows, key=lambda r: names.index(r["section"]) if r.get("section") in names else len(names))
            reruns = {**old.get("reruns", {}), **{name: {k: run[k] for k in ("command", "seconds", "date", "torch", "cores", "mkl_cbwr")}
                                                  for name in a.only}}
            run = {**{k: v for k, v in old.items() if k not in ("rows", "aims_missed", "reruns")}, "reruns": reruns}
        run["aims_missed"] = [r["what"] for r in rows if r["meets_aim"] is False]
        a.json.write_text(json.dumps({**run, "rows": rows}, indent=1) + "\n")
    return 0


def argv_of(a: argparse.Namespace) -> list[str]:
    return sys.argv[1:]


if __name__ == "__main__":
    sys.exit(main())
