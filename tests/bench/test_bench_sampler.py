"""CPU smoke run of bench/sampler.py: every case timed at every row count, written to the results file;
an unknown case is a usage error."""
import json

import pytest

from bench.sampler import CASES, main


def test_sampler_bench_smoke_run(tmp_path, capsys):
    assert main(["--smoke", "--cases", "greedy,top_p,all", "--out", str(tmp_path)]) == 0
    assert "top_p" in capsys.readouterr().out
    [path] = tmp_path.glob("*-sampler-smoke.json")
    results = json.loads(path.read_text())
    assert results["rows"] == [1, 4] and results["vocab"] == 1000
    assert sorted(results["us"]) == ["all", "greedy", "top_p"]
    # case -> kernel -> timing -> one time a row count (the CPU: the torch path, eager only; auto is torch)
    assert results["kernels"] == {"auto": "torch"}
    assert all(list(v) == ["torch"] and list(v["torch"]) == ["eager"] and len(v["torch"]["eager"]) == 2
               and min(v["torch"]["eager"]) > 0 for v in results["us"].values())
    assert set(CASES) >= {"greedy", "temperature", "top_p", "top_k", "min_p", "penalties", "all"}


def test_sampler_bench_unknown_case_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit):
        main(["--smoke", "--cases", "top_q", "--out", str(tmp_path)])
