"""Replay through the engine (tiny model, CPU): shapes, pages freed, the same greedy tokens everywhere, CLI, bench."""
import json
import sys
from pathlib import Path

import pytest
import torch

from treedec.attention import PLANNERS
from treedec.cli import main
from treedec.engine import Engine
from treedec.models import ModelConfig, from_config
from treedec.replay import AttentionTimer, ReplayConfig, ScheduleDriver, replay, replay_results, timed_attention
from treedec.workloads import Schedule, ScheduleError, fewshot_schedule, workload_schedule

REPO = Path(__file__).resolve().parents[2]
ALL_PLANNERS = ("flatten", "node", "node_chunk", "path")


@pytest.fixture(scope="module")
def tiny():
    return from_config("tiny", seed=0, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def schedules():
    return {"tot": workload_schedule("tot-keyword", iterations=6),
            "medusa": workload_schedule("medusa-32", iterations=5, prompt_tokens=40),
            "fewshot": fewshot_schedule(prompt_tokens=60, branches=3, iterations=5)}


def test_fewshot_replay_shapes_and_pages(tiny):
    schedule = fewshot_schedule(prompt_tokens=30, branches=3, iterations=4)
    engine = Engine(tiny, kv_tokens=256, page_size=4, backend="torch")
    driver = ScheduleDriver(engine)
    for i, step in enumerate(schedule.steps[:-1]):
        for op in step:
            driver.apply(op)
        driver.forward()
        root = driver.nodes["prompt"]
        if i:
            assert [len(engine.tree.tokens(c)) for c in engine.tree.children(root)] == [i] * 3
    assert engine.tree.num_tokens == 30 + 3 * 4 and driver.generated == 12
    for op in schedule.steps[-1]:
        driver.apply(op)
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_medusa_accept_moves_kv_like_a_prefill(tiny):
    """After verify/accept steps, one more decode step equals a fresh prefill of the whole sequence."""
    schedule = workload_schedule("medusa-32", iterations=4, prompt_tokens=20)
    engine = Engine(tiny, kv_tokens=512, page_size=4, backend="torch")
    driver = ScheduleDriver(engine)
    for step in schedule.steps[:5]:   # prompt, 3 verify steps, the 4th accept + a token tree
        for op in step:
            driver.apply(op)
        driver.forward()
    seq = driver.nodes["seq"]
    for child in engine.tree.children(seq):
        engine.tree.prune(child)
    accepted = engine.tree.sequence(seq)
    assert len(accepted) == 20 + sum(len(s[0].ids) for s in schedule.steps[2:5])
    engine.tree.extend(seq, [7])
    logits = engine.step().logits[0]
    fresh = Engine(tiny, kv_tokens=512, page_size=4, backend="torch")
    expected = fresh.prefill(accepted + [7]).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    engine.tree.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tot", "medusa", "fewshot"])
def test_same_greedy_tokens_with_every_planner_and_backend(tiny, schedules, family):
    planners = [p for p in ALL_PLANNERS if p in PLANNERS]
    configs = [ReplayConfig(planner=p, page_size=4) for p in planners]
    configs.append(ReplayConfig(planner="flatten", backend="reference", page_size=4))
    runs = [replay(tiny, schedules[family], c) for c in configs]
    for run in runs:
        assert run.summary["pages_free_at_end"]
        assert run.summary["decode_steps"] == schedules[family].stats.forward_steps
        assert run.emitted == runs[0].emitted, f"{run.planner}/{run.backend} differs from flatten/torch"
    if "path" not in PLANNERS:
        pytest.skip("the 'path' planner is not in treedec.attention yet: compared flatten, node, node_chunk only")


def test_replay_measurements(tiny, schedules):
    run = replay(tiny, schedules["fewshot"], ReplayConfig(planner="flatten", page_size=4, warmup_steps=1))
    kinds = [s["kind"] for s in run.steps]
    assert kinds == ["prefill"] + ["decode"] * 5 + ["edit"]
    c = tiny.config
    for s in run.steps[1:6]:
        assert s["queries"] == 3 and s["total_ms"] > 0 and s["attention_ms"] > 0
        parts = s["bookkeeping_ms"] + s["plan_ms"] + s["attention_ms"] + s["other_ms"]
        assert parts == pytest.approx(s["total_ms"], rel=1e-6)
        # DeFT-Flatten reads every tree token once (3 queries fit one tile): the shared prompt is not re-read
        assert s["kv_io_bytes"] == s["tree_tokens"] * 2 * c.num_kv_heads * c.head_dim * 4 * c.num_layers
    assert run.summary["peak_kv_pages"] == run.summary["dry_run_peak_pages"] == 15 + 3 * 2
    assert run.summary["tokens_generated"] == 15 and run.summary["pages_free_at_end"]



def test_timed_attention_restores_the_engine_attention_when_the_block_fails(tiny):
    engine = Engine(tiny, kv_tokens=64, page_size=4, backend="torch")
    attn = engine.attn
    with pytest.raises(RuntimeError, match="step failed"):
        with timed_attention(engine, time_run=True) as timer:
            assert isinstance(engine.attn, AttentionTimer) and timer._attn is attn
            raise RuntimeError("step failed")
    assert engine.attn is attn


def test_a_failing_timed_replay_leaves_the_engine_attention_as_it_was(tiny, schedules, monkeypatch):
    engines = []

    def recording_engine(*args, **kwargs):
        engine = Engine(*args, **kwargs)
        engines.append((engine, engine.attn))
        return engine

    def failing_run(self, *args, **kwargs):
        raise RuntimeError("attention failed")

    monkeypatch.setattr("treedec.replay.runner.Engine", recording_engine)
    monkeypatch.setattr(AttentionTimer, "run", failing_run)
    with pytest.raises(RuntimeError, match="attention failed"):
        replay(tiny, schedules["fewshot"], ReplayConfig(planner="flatten", page_size=4))
    [(engine, attn)] = engines
    assert engine.attn is attn


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if replay gets as far as a dry run or an engine."""
    monkeypatch.setattr("treedec.replay.runner.dry_run", lambda *a, **k: pytest.fail("ran a dry run"))
    monkeypatch.setattr("treedec.replay.runner.Engine", lambda *a, **k: pytest.fail("built an engine"))


def test_replay_checks_before_running(tiny):
    schedule = fewshot_schedule(prompt_tokens=30, branches=2, iterations=2)   # 34 tokens in 10 pages of 4
    with pytest.raises(ScheduleError, match=r"fewshot: step 0, op 0 \(prompt\): node 'prompt' grows the tree to 30 "
                                            r"tokens, more than kv_tokens = 16"):
        replay(tiny, schedule, ReplayConfig(kv_tokens=16, page_size=4))
    with pytest.raises(ValueError, match="kv_tokens=36 is too small: fewshot holds up to 10 pages of 4 tokens"):
        replay(tiny, schedule, ReplayConfig(kv_tokens=36, page_size=4))
    with pytest.raises(ValueError, match="needs a KV pool of 44 tokens .* more than max_kv_tokens=40"):
        replay(tiny, schedule, ReplayConfig(max_kv_tokens=40, page_size=4))


def test_replay_sizes_the_pool_for_wide_branches(tiny):
    schedule = Schedule.from_json({"format": "treedec-schedule", "version": 1, "steps": [
        [{"op": "prompt", "id": "p", "tokens": 1}], [{"op": "branch", "node": "p", "ids": list("abcde")}],
        [{"op": "extend", "node": "a", "tokens": 1}], [{"op": "prune", "node": "p"}]]}, "wide.json")
    run = replay(tiny, schedule, ReplayConfig(page_size=4))
    assert run.summary["kv_pool_pages"] == 6 and run.summary["pages_free_at_end"]
    with pytest.raises(ValueError, match=r"kv_tokens=16 is too small: wide.json holds up to 2 pages of 4 tokens and "
                                         r"branches into up to 5 children"):
        replay(tiny, schedule, ReplayConfig(kv_tokens=16, page_size=4))


def huge_schedule(tokens):
    return Schedule.from_json({"format": "treedec-schedule", "version": 1, "steps": [
        [{"op": "prompt", "id": "p", "tokens": tokens}], [{"op": "extend", "node": "p", "tokens": 1}]]}, "huge.json")


@pytest.mark.parametrize("schedule, config, message", [
    (huge_schedule(10**9), ReplayConfig(), r"huge.json: step 0, op 0 \(prompt\): node 'p' grows the tree to "
                                           r"1000000000 tokens, more than max_kv_tokens = 1048576"),
    (huge_schedule(10**9), ReplayConfig(kv_tokens=4096), "grows the tree to 1000000000 tokens, more than kv_tokens"),
    (huge_schedule(100), ReplayConfig(max_kv_tokens=100), r"step 1, op 0 \(extend\): node 'p' grows the tree to 101 "
                                                          r"tokens, more than max_kv_tokens = 100"),
    (huge_schedule(4096), ReplayConfig(), r"step 1, op 0 \(extend\): node 'p' reaches position 4096 \(sequence length "
                                          r"4097\), past the model's max_position \(max_position_embeddings\) = 4096"),
    (huge_schedule(10**9), ReplayConfig(kv_tokens=2 * 10**9), r"step 0, op 0 \(prompt\): node 'p' reaches position "
                                                              r"999999999 .* past the model's max_position"),
    (Schedule.from_json({"format": "treedec-schedule", "version": 1, "steps": [
        [{"op": "prompt", "id": "p", "tokens": [1, 2, 512]}]]}, "v.json"), ReplayConfig(),
     r"v.json: step 0, op 0 \(prompt\): field 'tokens\[2\]' = 512 is outside the model's vocabulary of 512"),
])
def test_replay_refuses_what_does_not_fit_before_allocating(tiny, no_allocation, schedule, config, message):
    with pytest.raises(ScheduleError, match=message):
        replay(tiny, schedule, config)


def test_replay_checks_the_sliding_window(no_allocation):
    model = from_config(ModelConfig.from_name("tiny", sliding_window=16), dtype=torch.float32, device="cpu")
    with pytest.raises(ScheduleError, match=r"step 1, op 0 \(extend\): node 'p' reaches position 16 .* past the "
                                            r"model's sliding window = 16"):
        replay(model, huge_schedule(16), ReplayConfig(page_size=4))


@pytest.mark.parametrize("field, value, minimum", [("page_size", 0, 1), ("kv_tokens", -5, 1), ("max_kv_tokens", 0, 1),
                                                   ("warmup_steps", -1, 0), ("page_size", 4.0, 1)])
def test_replay_config_is_validated(field, value, minimum):
    with pytest.raises(ValueError, match=f"ReplayConfig.{field} must be an int >= {minimum}, got {value!r}"):
        ReplayConfig(**{field: value})


@pytest.mark.slow
def test_cli_replay_and_plot(tmp_path, capsys):
    out, fig = tmp_path / "r.json", tmp_path / "r.png"
    planners = "flatten,path" if "path" in PLANNERS else "flatten,node"
    assert main(["replay", "tot-sorting", "--iterations", "3", "--compare", planners, "--no-progress",
                 "--warmup", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "greedy tokens identical across runs: yes" in printed
    results = json.loads(out.read_text())
    assert [r["planner"] for r in results["runs"]] == planners.split(",")
    assert results["model"] == "tiny (random weights)" and results["device"] == "cpu"
    for run in results["runs"]:
        assert len(run["steps"]) == 5 and run["summary"]["pages_free_at_end"]
    assert main(["plot", str(out), "--out", str(fig)]) == 0
    assert fig.stat().st_size > 10_000


def test_cli_rejects_a_bad_schedule_before_loading_a_model(tmp_path, monkeypatch, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "treedec-schedule", "version": 1, "steps": [
        [{"op": "prompt", "id": "p", "tokens": 5}], [{"op": "extend", "node": "p", "tokens": 1}],
        [{"op": "extend", "node": "q", "tokens": 1}]]}))
    monkeypatch.setattr("treedec.commands.replay.load_model", lambda args: pytest.fail("loaded a model"))
    assert main(["replay", str(path)]) == 2   # a user error: one line on stderr
    assert f"{path}: step 2, op 0 (extend): field 'node' names unknown node 'q'" in capsys.readouterr().err
    with pytest.raises(ScheduleError, match=f"{path}: step 2, op 0 \\(extend\\): field 'node' names unknown node 'q'"):
        main(["replay", str(path), "--debug"])


def test_saved_schedule_replays_identically(tiny, tmp_path, schedules):
    path = tmp_path / "s.json"
    schedules["medusa"].save(path)
    configs = [ReplayConfig(page_size=4)]
    a = replay_results(tiny, schedules["medusa"], configs, "tiny", "medusa")
    b = replay_results(tiny, workload_schedule(str(path)), configs, "tiny", "medusa")
    assert a["runs"][0]["emitted_tokens_sha256"] == b["runs"][0]["emitted_tokens_sha256"]


@pytest.mark.slow
def test_bench_replay_smoke(tmp_path):
    sys.path.insert(0, str(REPO))
    try:
        from bench import replay as bench_replay
    finally:
        sys.path.remove(str(REPO))
    planners = "flatten,path" if "path" in PLANNERS else "flatten,node"
    assert bench_replay.main(["--smoke", "--iterations", "2", "--planners", planners, "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-replay-smoke.json")
    results = json.loads(path.read_text())
    assert set(results["speedups"]) == {"tot", "medusa", "fewshot"}
    for family, s in results["speedups"].items():
        other = planners.split(",")[1]
        assert s["same_tokens"] and s[other]["decode_speedup_mean"] > 0 and s[other]["attention_speedup"] > 0


def test_cuda_graph_replays_exclude_the_attention_split():
    with pytest.raises(ValueError, match="choose one of cuda_graphs and profile_split"):
        ReplayConfig(cuda_graphs=True, profile_split=True)


def test_engine_counts_planning_time_and_kv_reads():
    """Replay's plan_ms and KV IO come from engine.stats, which eager and graphed steps both fill."""
    from tests.engines import make_engine, tiny_model
    engine = make_engine(tiny_model())
    root = engine.prefill(list(range(20))).node
    engine.tree.branch(root, [[1], [2]])
    before = dict(engine.stats)
    engine.step()
    assert engine.stats["plan_seconds"] > before["plan_seconds"] > 0
    read = engine.stats["kv_tokens_read"] - before["kv_tokens_read"]
    assert 20 + 2 <= read < 2 * 20   # the prompt is read once for both branches (one chunk, one work item)
