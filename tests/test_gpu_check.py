"""scripts/gpu_check.sh's plan on the CPU (`--cpu-dry-run`, shrunk): the groups a GPU run reports
beside MiniMind's own trainer and the deterministic mode's kernels run end to end here, so the one
GPU run a session may be lent does not find the script broken (docs/gpus.md). The figures are a
contended CPU's and are not asserted; what is: every row is there and none failed."""
import json
import os
import subprocess

import pytest

import launch
from conftest import MINIMIND_SHARED, needs_referee

UPSTREAM = MINIMIND_SHARED / "upstream" / "trainer" / "train_pretrain.py"


@pytest.mark.e2e
@needs_referee(UPSTREAM, "MiniMind's train_pretrain.py")
def test_the_gpu_checks_peer_and_determinism_groups_run_on_the_cpu_beside_minimind_s_own_trainer(tmp_path):
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-dry-run", "--only", "determinism", "peer"], cwd=launch.ROOT,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    checks = [r["check"] for r in rows]
    assert not [r for r in rows if r["result"] in ("FAILED", "SKIPPED")], rows
    assert sum("one eager step at MiniMind's shape" in c for c in checks) == 3
    timed = [r for r in rows if r["check"].startswith("time per step")]
    assert sorted(r["check"].split(",")[1].strip() for r in timed) == sorted(
        f"{who} {mode}" for who in ("minimind", "ours deterministic", "ours non-deterministic") for mode in ("eager", "compiled"))
    assert all(r["seconds_per_step"] > 0 for r in timed)
    ratios = [r for r in rows if "/ MiniMind default" in r["check"]]
    assert len(ratios) == 4 and all(r["ok"] is None and r["ratio"] > 0 for r in ratios)  # a report in the dry run, a verdict on a GPU
