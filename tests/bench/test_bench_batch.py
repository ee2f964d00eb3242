"""CPU smoke runs of bench/batch.py: shared and unshared system prompts give the same outputs; speculative
batches with a fixed tree and with EAGLE-3 drafts (one drafter engine for the batch) run and record their
draft; bad EAGLE options are one-line usage errors."""
import json

import pytest

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
    assert results["draft"] == {"kind": "tree", "tree_tokens": 64, "depth": 4, "top_k": None}
    assert [r["draft_budget"] for r in results["runs"]] == [None, None]   # auto on the CPU: no limit


def test_batch_bench_draft_budget_cuts_the_steps(tmp_path, capsys):
    """--draft-budget 8: a step verifies 8 tokens in all, the requests' roots included (1 request: its root and 7
    draft tokens; 4 requests: 4 roots and 4 draft tokens)."""
    assert main(["--smoke", "--speculative", "--draft-budget", "8", "--out", str(tmp_path)]) == 0
    assert "budget 8, 8 queries a step" in capsys.readouterr().out
    [path] = tmp_path.glob("*-batch-smoke.json")
    runs = json.loads(path.read_text())["runs"]
    assert [r["draft_budget"] for r in runs] == [8, 8]
    # (one request's last timed step may verify less: a tree is cut to the tokens the request has left)
    assert 7 <= runs[0]["mean_step_queries"] <= 8 and runs[1]["mean_step_queries"] == 8.0
    assert all(r["tokens_per_s"] > 0 for r in runs)


@pytest.mark.parametrize("tree, tokens", [("dynamic", 21), ("chains", 9)])
def test_batch_bench_eagle3_smoke_run(tmp_path, capsys, tree, tokens):
    """EAGLE-3 drafts over one drafter engine shared by the batch (the smoke's tiny target with 3 layers);
    the floor counts the drafter's weights once per drafter step (depth of them)."""
    assert main(["--smoke", "--speculative", "--eagle", "eagle3", "--eagle-depth", "2", "--eagle-top-k", "4",
                 "--eagle-tree", tree, "--out", str(tmp_path)]) == 0
    # EAGLE-2 keeps the best of top_k + (depth - 1) * top_k^2 = 20 candidates: 21-token trees with the root;
    # chains: top_k * depth = 8 draft tokens
    out = capsys.readouterr().out
    assert f"4 requests, speculative (EAGLE-3 depth 2, top-k 4, {tokens}-token {tree} trees):" in out
    [path] = tmp_path.glob("*-batch-smoke.json")
    results = json.loads(path.read_text())
    draft = results["draft"]
    assert {k: draft[k] for k in ("kind", "tree_tokens", "depth", "top_k", "eagle_tree")} == \
        {"kind": "eagle3", "tree_tokens": tokens, "depth": 2, "top_k": 4, "eagle_tree": tree}
    assert results["model_layers"] == 3 and [r["requests"] for r in results["runs"]] == [1, 4]
    for r in results["runs"]:
        assert r["weight_bytes"] == results["target_weight_bytes"] + 2 * draft["drafter_weight_bytes"]
        assert r["step_ms"] > 0 and r["drafter_eager"] == {} and r["decode_steps"] >= 3


def test_batch_bench_draft_model_smoke_run(tmp_path, capsys):
    """Draft-model trees over one draft engine shared by the batch, drafting together; the floor counts the
    draft model's weights and K/V once per draft step (depth of them)."""
    assert main(["--smoke", "--speculative", "--draft-model", "--out", str(tmp_path)]) == 0
    assert "4 requests, speculative (draft model tiny, depth 4, top-k 4, 16 tokens):" in capsys.readouterr().out
    [path] = tmp_path.glob("*-batch-smoke.json")
    results = json.loads(path.read_text())
    draft = results["draft"]
    assert results["draft_model"] == "tiny" and (draft["kind"], draft["tree_tokens"], draft["depth"]) == \
        ("draft_model", 17, 4)
    for r in results["runs"]:
        assert r["weight_bytes"] == results["target_weight_bytes"] + 4 * draft["drafter_weight_bytes"]
        assert r["step_ms"] > 0 and r["drafter_eager"] == {} and r["decode_steps"] >= 3


@pytest.mark.parametrize("argv, message", [
    (["--draft-model"], "--draft-model is a --speculative draft"),
    (["--speculative", "--draft-model", "--eagle", "eagle"], "in place of --medusa-heads and --eagle"),
    (["--eagle", "eagle3"], "--eagle eagle3 is a --speculative draft"),
    (["--speculative", "--medusa-heads", "--eagle", "eagle"], "drop --medusa-heads"),
    (["--speculative", "--eagle", "eagle", "--eagle-depth", "0"],
     "--eagle-depth and --eagle-top-k must be >= 1, got 0"),
    (["--speculative", "--eagle", "eagle", "--eagle-top-k", "-1"], "must be >= 1, got 5 and -1"),
    (["--model", "tiny", "--speculative", "--eagle", "eagle3"], "--model tiny has 2"),
    (["--speculative", "--eagle-depth", "3"], "give --eagle eagle|eagle3 with them (got --eagle-depth 3"),
])
def test_batch_bench_rejects_bad_eagle_arguments(tmp_path, capsys, argv, message):
    """A bad EAGLE option is a one-line usage error (exit 2) before any model is made; nothing is written."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--out", str(tmp_path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_batch_bench_batch_invariant_mode_is_recorded(tmp_path):
    """--batch-invariant runs every target engine in the mode (its cost, issue #53), recorded in the results (the
    default --compile-model compiles on a GPU only)."""
    assert main(["--smoke", "--batch-invariant", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-batch-smoke.json")
    results = json.loads(path.read_text())
    assert results["batch_invariant"] is True and results["compile_model"] is False
    assert [r["requests"] for r in results["runs"]] == [1, 4]
