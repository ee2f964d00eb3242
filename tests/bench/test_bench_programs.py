"""A CPU smoke run of bench/programs.py, in-process: every program and method is timed and the table printed last."""
import importlib.util
import json

import pytest
import torch

from bench.programs import EAGLE_PROGRAMS, PROGRAMS, main

TINY_PROGRAMS = [p for p in PROGRAMS if EAGLE_PROGRAMS.get(p) != "eagle3"]   # (tiny has too few layers for EAGLE-3)
SMOKE_METHODS = {"eager": TINY_PROGRAMS, "hf_sdpa": ["greedy", "tree_verify"]}


@pytest.mark.slow
def test_programs_bench_smoke_run(tmp_path, capsys):
    # Uncaptured graph steps run the Triton kernels in the CPU interpreter (conftest sets it
    # where there is no GPU); elsewhere the graphs method may fail and is then not required.
    graphs = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()
    assert main(["--smoke", "--hf", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    [path] = tmp_path.glob("*-programs-smoke.json")
    results = json.loads(path.read_text())
    assert results["smoke"] and results["model"] == "tiny" and results["tree_tokens"] == 64
    assert results["copy_bandwidth_TBps"] > 0 and results["medusa_heads"] == 4
    expected = {(m, p) for m, programs in SMOKE_METHODS.items() for p in programs}
    if graphs:
        expected.add(("graphs", "greedy"))
        assert not results.get("errors"), results.get("errors")
    runs = {(r["method"], r["program"]): r for r in results["runs"]}
    assert expected <= set(runs), expected - set(runs)
    for key, r in runs.items():
        assert r["prompt"] == 200 and r["ms"] > 0 and r["floor_ms"] > 0 and r["x_floor"] > 0, key
        assert r["kv_tokens"] > 200, key
        assert f"| {r['program']} | 200 | {r['method']} | {r['ms']:.2f} |" in out, key
    for program in TINY_PROGRAMS:
        r = runs["eager", program]
        assert r["steps"] == 3 and len(r["step_ms"]) == 4 and r["prefill_s"] > 0, program
    for program in ("tree_verify", "medusa_heads"):
        r = runs["eager", program]
        assert r["kv_tokens"] >= 200 + 64 and r["tokens_per_step"] >= 1 and r["verify_ms"] > 0, program
    assert runs["eager", "medusa_heads"]["weight_bytes"] > runs["eager", "greedy"]["weight_bytes"]
    assert runs["eager", "eagle"]["weight_bytes"] > runs["eager", "greedy"]["weight_bytes"]   # + drafter steps
    for program in ("eagle", "eagle_chains"):
        assert runs["eager", program]["tokens_per_step"] >= 1 and runs["eager", program]["kv_tokens"] > 200
    assert runs["eager", "eagle_chains"]["weight_bytes"] == runs["eager", "eagle"]["weight_bytes"]
    for program in ("greedy", "tree_verify"):   # the yardstick: fp32 here, so all three agree closely
        errors = runs["hf_sdpa", program]["verify_logits_rel_err"]
        assert set(errors) == {"hf_sdpa_vs_hf_eager", "treedec_vs_hf_sdpa", "treedec_vs_hf_eager"}
        assert all(0 <= e < 1e-4 for e in errors.values()), errors
    if graphs:
        r = runs["graphs", "greedy"]
        stats = r["graph_stats"]   # (lanes' steps run with their draw: the static path with a tail)
        assert r["eager_steps"] == 0 and stats.get("static_eager", 0) + stats.get("static_eager_tail", 0) == 4, stats
    assert out.rstrip().splitlines()[-1].startswith("| eagle_chains | 200 | eager |")   # the table comes last


def test_unknown_program_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown program"):
        main(["--smoke", "--programs", "greedy,beam", "--out", str(tmp_path)])


def test_profile_breaks_a_step_down(tmp_path):
    """--profile K: a separate profiled pass whose last K steps are summarised (on the CPU, host times only)."""
    assert main(["--smoke", "--methods", "eager", "--programs", "greedy", "--profile", "2", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-programs-smoke.json")
    [run] = json.loads(path.read_text())["runs"]
    profile = run["profile"]
    assert profile["steps"] == 2 and profile["wall_ms"] > 0 and profile["engine_step_host_ms"] > 0
    assert profile["gpu_busy_ms"] == 0 and profile["gpu_idle_ms"] == pytest.approx(profile["wall_ms"])


def test_host_cost_runs_every_program(capsys):
    """bench/host_cost.py: the programs' host work per step with the forward stubbed out."""
    from bench.host_cost import main as host_cost
    assert host_cost(["--model", "tiny", "--prompt", "40", "--steps", "3", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for program in (p for p in PROGRAMS if p not in EAGLE_PROGRAMS):   # (their drafter forwards are not stubbed)
        [line] = [x for x in lines if x.startswith(f"{program}: ")]
        assert float(line.split()[1]) > 0, line


def test_host_phases_names_functions_that_exist():
    """bench/host_phases.py (GPU only) wraps functions by name: a move or a rename must show here, on the CPU."""
    from bench.host_phases import PHASES
    missing = [label for owner, name, label in PHASES if not callable(getattr(owner, name, None))]
    assert not missing, missing


def test_batch_invariant_runs_are_recorded(tmp_path):
    """--batch-invariant: the engines run the mode (its cost is what the GPU run measures), the results say so;
    eager_compiled's compile_pointwise compiles the mode's ops (its norms stay custom ops)."""
    assert main(["--smoke", "--methods", "eager,eager_compiled", "--programs", "greedy,tree_verify",
                 "--batch-invariant", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-programs-smoke.json")
    results = json.loads(path.read_text())
    assert results["batch_invariant"] is True and set(results["linear_paths"]) == {"F.linear row by row"}
    assert {r["program"] for r in results["runs"]} == {"greedy", "tree_verify"} and not results.get("errors")
    assert {r["method"] for r in results["runs"]} == {"eager", "eager_compiled"}
