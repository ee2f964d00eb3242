import json

from bench.tot_batch import main


def test_tot_batch_bench_smoke_run(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    assert "3 ToT-BFS tasks" in capsys.readouterr().out
    [path] = tmp_path.glob("*-tot-batch-smoke.json")
    results = json.loads(path.read_text())
    # fp32 on the CPU: the forest's searches are the searches alone
    assert results["searches_agreeing"] == 3 and results["speedup"] > 0
    assert results["batched"]["steps"] < results["one_at_a_time"]["steps"]
