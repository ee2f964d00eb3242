import json

import pytest

from bench.invariant_gemm import main, projections
from treedec.models.config import MODEL_SIZES

pytest.importorskip("triton")


def test_the_8b_projections_and_their_counts():
    p = projections(MODEL_SIZES["llama3-8b"])
    assert p == {"qkv": (6144, 4096, 32), "o": (4096, 4096, 32), "gate_up": (28672, 4096, 32),
                 "down": (4096, 14336, 32), "lm_head": (128256, 4096, 1)}


@pytest.mark.triton
def test_invariant_gemm_bench_smoke_run(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-invariant-gemm-smoke.json")
    results = json.loads(path.read_text())
    assert results["rows"] == [1, 3] and set(results["projections"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert set(results["step_ms"]["3"]) == {"cublas", "default"}
    assert "a forward's GEMMs" in capsys.readouterr().out
