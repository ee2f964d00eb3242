import json

import pytest

from bench.cpu_generate import main
from bench.real_checkpoint import CheckpointUnavailable, smollm2_checkpoint


@pytest.mark.slow
def test_cpu_generate_bench_smoke_run(tmp_path, capsys):
    try:
        smollm2_checkpoint()
    except CheckpointUnavailable as e:
        pytest.skip(str(e))
    assert main(["--smoke", "--threads", "1", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-cpu-generate-smoke.json")
    results = json.loads(path.read_text())
    assert results["machine"]["torch_threads"] == 1 and len(results["rounds"]) == 1
    # one request: every forward (the prefill and 3 decode steps) attends in the dense form
    assert len(results["tokens"]) == 4 and results["attention_forms"] == {"dense": 4}
    assert "tokens identical" in capsys.readouterr().out
