"""A CPU smoke run of bench/batch.py: shared and unshared system prompts give the same outputs."""
import json

from bench.batch import main


def test_batch_bench_smoke_run(tmp_path, capsys):
    assert main(["--smoke", "--compare-unshared", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 requests: shared and unshared outputs equal (4 of 4 equal" in out
    [path] = tmp_path.glob("*-batch-smoke.json")
    runs = json.loads(path.read_text())["runs"]
    assert [(r["requests"], r["shared"]) for r in runs] == [(1, True), (1, False), (4, True), (4, False)]
    shared, unshared = runs[2], runs[3]
    # the 40-token system prompt is shared as whole 16-token pages: 32 tokens
    assert shared["shared_prefix_tokens"] == 32 * 3 and unshared["shared_prefix_tokens"] == 0
    assert shared["peak_pages"] < unshared["peak_pages"] and shared["floor_ms"] < unshared["floor_ms"]
    assert all(r["step_ms"] > 0 and r["decode_steps"] == 5 for r in runs)


def test_batch_bench_speculative_smoke_run(tmp_path, capsys):
    assert main(["--smoke", "--speculative", "--out", str(tmp_path)]) == 0
    assert "4 requests, speculative (Medusa-64 tree):" in capsys.readouterr().out
    [path] = tmp_path.glob("*-batch-smoke.json")
    results = json.loads(path.read_text())
    assert results["speculative"] and [r["requests"] for r in results["runs"]] == [1, 4]
