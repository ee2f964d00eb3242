"""A CPU smoke run of bench/step.py: every method runs and treedec's verify logits equal transformers'."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_step_bench_smoke_run(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "step.py"), "--smoke", "--reps", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = tmp_path.glob("*-step-smoke.json")
    results = json.loads(path.read_text())
    assert results["smoke"] and results["model"] == "tiny" and results["tree_tokens"] == 64
    assert results["floor_ms"] > 0 and results["kv_pool"]["tokens"] > 0
    assert list(results["prompts"]) == ["200", "1600"]
    for prompt, methods in results["prompts"].items():
        assert {"hf_sdpa", "treedec_eager"} <= set(methods)
        for name, r in methods.items():
            assert r["verify"]["ms"] > 0 and r["decode"]["ms"] > 0, (prompt, name)
        assert methods["treedec_eager"]["verify"]["rel_err_vs_hf"] < 1e-5
        assert methods["treedec_eager"]["verify"]["plan"]["queries"] == 64
    assert "| 1600 | treedec_eager |" in proc.stdout
