import json

import pytest

from bench.acceptance_real import main
from tests.engines import smollm2_or_skip


@pytest.mark.slow
def test_acceptance_bench_smoke_run(tmp_path):
    smollm2_or_skip()
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-acceptance-real-smoke.json")
    results = json.loads(path.read_text())
    [row] = results["prompts"]
    assert set(row["sources"]) == {"ngram", "draft-model", "medusa-untrained", "eagle-untrained", "eagle3-untrained"}
    assert all(s["tokens_per_step"] >= 1 for s in row["sources"].values())
