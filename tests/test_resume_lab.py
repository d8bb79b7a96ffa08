"""The resume lab in a reduced form: the exact case is 0, every ablation is not."""
import json
import subprocess

import pytest

import launch

pytestmark = pytest.mark.e2e


def test_the_lab_finds_the_exact_resume_at_zero_and_every_ablation_away_from_it(tmp_path, tiny):
    overrides = [o for o in tiny if not o.startswith(("train.steps", "checkpoint.interval", "runtime.threads"))]
    proc = subprocess.run([launch.PY, "scripts/resume_lab.py", "--out", str(tmp_path), "--steps", "12", "--halt", "6", *overrides],
                          cwd=launch.ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {r["case"]: r for r in result["rows"]}
    for exact in ("exact", "world_size_ours"):
        assert rows[exact]["max_abs_dw"] == 0 and rows[exact]["sha256_equal"]
        assert rows[exact]["samples_repeated"] == rows[exact]["samples_skipped"] == 0
    ablations = ["optimizer", "data_position", "fp16_weights", "minimind_world_size_rule", "lr_schedule"]
    for case in ablations:
        assert rows[case]["max_abs_dw"] > 0 and rows[case]["rel_l2"] > 0 and not rows[case]["sha256_equal"], case
    g = 8  # global batch
    assert rows["data_position"]["samples_repeated"] == rows["data_position"]["samples_skipped"] == 6 * g
    assert rows["minimind_world_size_rule"]["samples_repeated"] == (6 - 6 * 1 // 2) * g
    sizes = result["sizes"]
    assert 0 < sizes["optimizer_share_of_resume"] < 1 and sizes["resume_over_weights"] > 1
    assert sizes["max_abs_logit_diff_fp16_vs_fp32"] > 0
    assert set(result["curves"]["optimizer"]) == {str(s) for s in range(7, 13)}
    assert "| nothing left out: stop at 6, resume | 0 | 0 |" in proc.stdout
