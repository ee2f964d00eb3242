import json

import pytest

from bench.tot_batch import main


def test_tot_batch_bench_smoke_run(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    assert "3 ToT-BFS tasks" in capsys.readouterr().out
    [path] = tmp_path.glob("*-tot-batch-smoke.json")
    results = json.loads(path.read_text())
    # fp32 on the CPU: the forest's searches are the searches alone
    assert results["searches_agreeing"] == 3 and results["speedup"] > 0
    assert results["batched"]["steps"] < results["one_at_a_time"]["steps"]


def test_tot_batch_bench_times_one_at_a_time_over_the_first_tasks_only(tmp_path, capsys):
    assert main(["--smoke", "--alone-tasks", "2", "--out", str(tmp_path)]) == 0
    assert "one at a time" in capsys.readouterr().out
    [path] = tmp_path.glob("*-tot-batch-smoke.json")
    results = json.loads(path.read_text())
    alone = results["one_at_a_time"]
    assert alone["tasks"] == 2 and results["searches_agreeing"] == 2
    assert abs(results["speedup"] - results["batched"]["tasks_per_s"] / alone["tasks_per_s"]) < 1e-9
    with pytest.raises(SystemExit) as refused:   # (past --tasks)
        main(["--smoke", "--alone-tasks", "4", "--out", str(tmp_path)])
    assert refused.value.code == 2
