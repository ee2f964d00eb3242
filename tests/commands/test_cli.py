"""``treedec`` (and ``python -m treedec``): the demo, and how every command reports a user error:
one line on stderr, exit code 2, the traceback only with ``--debug``."""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treedec.cli import UsageError, main

REPO = Path(__file__).resolve().parents[2]


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


#: Lines a command prints on stderr as it starts (what it chose), before any error: not part of the error.
STARTUP_LINES = ("KV pool: ",)


def assert_one_line_error(err: str, *fragments: str, prog: str | None = None) -> None:
    """``err`` is one line ``treedec <command>: error: ...`` holding every fragment, with no traceback (after the
    :data:`STARTUP_LINES` a command printed before it)."""
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith(STARTUP_LINES))
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert ": error: " in err and "Traceback" not in err, err
    if prog is not None:
        assert err.startswith(f"{prog}: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command gets as far as loading a model (its checks come first)."""
    for module in ("treedec.commands.args", "treedec.commands.replay", "treedec.commands.spec", "treedec.commands.tot"):
        monkeypatch.setattr(f"{module}.load_model", lambda args: pytest.fail("loaded a model"))


def results_file(tmp_path, **replace) -> Path:
    """A minimal ``treedec replay --out`` results file (two decode steps), with top-level fields replaced."""
    step = {"kind": "decode", "total_ms": 1.0, "plan_ms": 0.1, "bookkeeping_ms": 0.1, "attention_ms": None,
            "other_ms": 0.8}
    doc = {"workload": "fewshot", "schedule": {"name": "fewshot-p8-b2"}, "model": "tiny", "device": "cpu",
           "runs": [{"planner": "flatten", "steps": [{"step": 1, **step}, {"step": 2, **step}]}], **replace}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    return path


# ================================================================ the demo


@pytest.mark.parametrize("planner", ["flatten", "node", "node_chunk"])
def test_demo_matches_reference(planner, capsys):
    code, out, err = run(["demo", "--planner", planner, "--json"], capsys)
    summary = json.loads(out)  # stdout is the JSON and nothing else
    assert code == 0 and summary["matches_reference"] and summary["tolerance"] == 1e-4
    assert summary["backend"] == "torch" and summary["requests"] == 2
    assert summary["queries"] == 24 + 4
    assert summary["max_abs_err_vs_reference"] < 1e-4


def test_demo_table_says_it_matches(capsys):
    code, out, _ = run(["demo", "--page-size", "7"], capsys)
    assert code == 0 and out.splitlines()[-1] == "OK: matches the dense fp32 reference"


def test_demo_rejects_unknown_backend(capsys):
    code, _, err = run(["demo", "--backend", "nope"], capsys)
    assert code == 2
    assert_one_line_error(err, "argument --backend: must be auto or one of reference, torch, triton, cuda, got 'nope'",
                          prog="treedec demo")


# ================================================================ the defects of the issue, one test each


def test_compare_with_no_planner_is_a_usage_error(capsys, no_model):
    # was: IndexError from an empty planner list, after the schedule was built
    code, _, err = run(["replay", "fewshot", "--compare", ","], capsys)
    assert code == 2
    assert_one_line_error(err, "argument --compare: must be comma-separated planners from flatten, node, "
                               "node_chunk, path, got ','", prog="treedec replay")


def test_demo_page_size_zero_is_a_usage_error(capsys):
    # was: ZeroDivisionError sizing the pool
    code, _, err = run(["demo", "--page-size", "0"], capsys)
    assert code == 2
    assert_one_line_error(err, "argument --page-size: must be an int in [1, 1024], got 0", "treedec demo --help")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize("command", [["demo"], ["replay", "fewshot"], ["spec"], ["tot"]])
def test_cuda_device_without_cuda_is_a_usage_error(command, capsys, no_model):
    # was: AssertionError "Torch not compiled with CUDA enabled" from deep inside torch
    code, _, err = run([*command, "--device", "cuda"], capsys)
    assert code == 2
    what = "is a CPU build; use --device cpu" if torch.version.cuda is None else "no CUDA device is visible"
    assert_one_line_error(err, "argument --device: 'cuda'", what)


def test_plot_of_a_json_that_is_not_results_names_what_is_missing(tmp_path, capsys):
    # was: KeyError 'runs'
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"schedule": {"name": "x"}, "model": "m"}))
    code, _, err = run(["plot", str(path), "--out", str(tmp_path / "fig.png")], capsys)
    assert code == 2 and not (tmp_path / "fig.png").exists()
    assert_one_line_error(err, f"{path} is not a treedec replay results file (the top level has no 'workload', "
                               f"'device', 'runs')", "treedec replay <workload> --out FILE", prog="treedec plot")


@pytest.mark.parametrize("argv", [
    ["replay", "fewshot", "--out"], ["replay", "fewshot", "--save-schedule"], ["spec", "--out"],
    ["tot", "--out"], ["plot", "RESULTS", "--out"]])
def test_output_into_a_missing_folder_fails_before_the_run(argv, tmp_path, capsys, no_model):
    # was: the whole run, then FileNotFoundError writing the file
    argv = [str(results_file(tmp_path)) if a == "RESULTS" else a for a in argv]
    missing = tmp_path / "no" / "such"
    code, out, err = run([*argv, str(missing / "out.json")], capsys)
    assert code == 2 and out == "" and not missing.exists()
    assert_one_line_error(err, f"folder '{missing}' of '{missing / 'out.json'}' does not exist; create it first "
                               f"(mkdir -p {missing})")


def test_demo_json_is_the_only_thing_on_stdout(capsys):
    # was: the JSON, then an "OK: matches ..." line on stdout
    code, out, _ = run(["demo", "--json", "--planner", "path"], capsys)
    assert code == 0 and json.loads(out)["matches_reference"] is True


def test_python_dash_m_treedec_help():
    # was: No module named treedec.__main__
    proc = subprocess.run([sys.executable, "-m", "treedec", "--help"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: treedec ")
    for command in ("demo", "replay", "plot", "spec", "tot", "--debug"):
        assert command in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("debug", [[], ["--debug"]])
def test_python_dash_m_treedec_error_is_one_line_unless_debug(debug):
    proc = subprocess.run([sys.executable, "-m", "treedec", *debug, "demo", "--page-size", "0"],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if debug:  # the traceback, ending in the same message
        assert proc.returncode == 1 and proc.stderr.startswith("Traceback")
        assert "UsageError: argument --page-size: must be an int in [1, 1024], got 0" in proc.stderr
    else:
        assert proc.returncode == 2 and proc.stdout == ""
        assert_one_line_error(proc.stderr, "argument --page-size: must be an int in [1, 1024], got 0",
                              prog="treedec demo")


# ================================================================ how errors are reported


@pytest.mark.parametrize("argv", [["--debug", "demo", "--page-size", "0"], ["demo", "--page-size", "0", "--debug"]])
def test_debug_before_or_after_the_command_raises(argv):
    with pytest.raises(UsageError, match="argument --page-size"):
        main(argv)


def test_library_user_error_is_one_line_and_debug_raises_it(capsys, no_model):
    code, _, err = run(["spec", "--check", "--accept", "sample"], capsys)
    assert code == 2
    assert_one_line_error(err, "--check compares with plain greedy decoding and needs --accept greedy",
                          prog="treedec spec")
    with pytest.raises(ValueError, match="--check compares"):
        main(["--debug", "spec", "--check", "--accept", "sample"])


def test_multi_line_message_is_collapsed_to_one_line(monkeypatch, capsys):
    def bad(args):
        raise ValueError("first line\n  second line")
    monkeypatch.setattr("treedec.cli.run_demo", bad)
    code, _, err = run(["demo"], capsys)
    assert code == 2 and err == "treedec demo: error: first line second line\n"


def test_internal_bug_is_one_line_exit_1_pointing_at_debug(monkeypatch, capsys):
    def bug(args):
        raise AssertionError("len(a)=3, len(b)=4")
    monkeypatch.setattr("treedec.cli.run_demo", bug)
    code, _, err = run(["demo"], capsys)
    assert code == 1
    assert_one_line_error(err, "AssertionError: len(a)=3, len(b)=4", "rerun with --debug for the traceback")
    with pytest.raises(AssertionError):
        main(["demo", "--debug"])


def test_ctrl_c_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr("treedec.cli.run_demo", interrupted)
    code, _, err = run(["demo"], capsys)
    assert code == 130 and err == "treedec demo: error: interrupted\n"


# ================================================================ every argument's check


TOO_BIG = str(2**31)
BAD_ARGUMENTS = [  # (argv, fragment of the one-line error); none of them gets to run anything
    ([], "the following arguments are required"),
    (["nope"], "invalid choice: 'nope'"),
    (["demo", "--unknown"], "unrecognized argument --unknown"),
    (["demo", "--planner", "nope"], "argument --planner: invalid choice: 'nope'"),
    (["demo", "--chunk-size", "0"], "argument --chunk-size: must be an int >= 1, got 0"),
    (["demo", "--chunk-size", TOO_BIG], "argument --chunk-size: must be an int >= 1"),
    (["demo", "--query-tile", "-1"], "argument --query-tile: must be an int >= 1, got -1"),
    (["demo", "--query-tile", "1.5"], "argument --query-tile: must be an int >= 1, got '1.5'"),
    (["demo", "--page-size", "1025"], "argument --page-size: must be an int in [1, 1024], got 1025"),
    (["demo", "--seed", "-1"], "argument --seed: must be an int in [0, 2**63), got -1"),
    (["demo", "--seed", str(2**63)], "argument --seed: must be an int in [0, 2**63)"),
    (["demo", "--device", "gpu"], "argument --device: must be cpu, cuda or cuda:N, got 'gpu'"),
    (["demo", "--device", "meta"], "argument --device: must be cpu, cuda or cuda:N, got 'meta'"),
    (["demo", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["replay"], "the following arguments are required: workload"),
    (["replay", "nope"], "argument workload: must be one of tot-docmerge"),
    (["replay", "TMP"], "is not a file (give a schedule JSON file or one of tot-docmerge"),
    (["replay", "fewshot", "--planner", "nope"], "argument --planner: invalid choice: 'nope'"),
    (["replay", "fewshot", "--compare", "flatten,nope"], "argument --compare: must be comma-separated planners"),
    (["replay", "fewshot", "--compare", ""], "argument --compare: must be comma-separated planners"),
    (["replay", "fewshot", "--backend", "hybrid"], "argument --backend: must be auto or one of"),
    (["replay", "fewshot", "--page-size", "0"], "argument --page-size: must be an int >= 1, got 0"),
    (["replay", "fewshot", "--kv-tokens", "-5"], "argument --kv-tokens: must be an int >= 1, got -5"),
    (["replay", "fewshot", "--iterations", "0"], "argument --iterations: must be an int >= 1, got 0"),
    (["replay", "tot-keyword", "--tree", "-1"], "argument --tree: must be an int >= 0, got -1"),
    (["replay", "medusa-32", "--record", "x"], "argument --record: must be an int >= 0, got 'x'"),
    (["replay", "fewshot", "--prompt-tokens", "0"], "argument --prompt-tokens: must be an int >= 1, got 0"),
    (["replay", "fewshot", "--branches", "0"], "argument --branches: must be an int >= 1, got 0"),
    (["replay", "fewshot", "--warmup", "-1"], "argument --warmup: must be an int >= 0, got -1"),
    (["replay", "fewshot", "--seed", "x"], "argument --seed: must be an int in [0, 2**63), got 'x'"),
    (["replay", "fewshot", "--out", "TMP"], "is a folder; give a file path"),
    (["replay", "fewshot", "--out", ""], "argument --out: must be a file path, got ''"),
    (["replay", "fewshot", "--model", "/no/such/checkpoint"], "argument --model: '/no/such/checkpoint' is not a "
                                                               "directory"),
    (["replay", "fewshot", "--config", "llama9"], "argument --config: must be one of tiny, llama2-7b"),
    (["replay", "fewshot", "--model", "smollm2", "--config", "tiny"], "argument --config: not allowed with argument "
                                                                      "--model"),
    (["replay", "fewshot", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["replay", "tot-keyword", "--tree", "100000"], "--tree: tree_index must be in [0, "),
    (["replay", "medusa-32", "--record", "100000"], "--record: record must be in [0, "),
    (["plot"], "the following arguments are required: results"),
    (["plot", "/no/such/results.json"], "argument results: file '/no/such/results.json' does not exist"),
    (["plot", "TMP"], "is not a file"),
    (["plot", "RESULTS", "--out", "TMP/fig"], "--out 'TMP/fig' must end with an image extension, one of"),
    (["plot", "RESULTS", "--out", "TMP/fig.docx"], "must end with an image extension"),
    (["plot", "NOTJSON"], "results file NOTJSON is not JSON"),
    (["plot", "LISTJSON"], "is not a treedec replay results file (the top level: expected a JSON object, got list)"),
    (["spec", "--speculative", "nope"], "argument --speculative: must be one of ngram, medusa, eagle, eagle3, "
                                        "draft_model, tree, got 'nope'"),
    (["spec", "--speculative", "draft-model"], "got 'draft-model'; did you mean draft_model?"),
    (["spec", "--draft", "ngram"], "--draft is now --speculative"),
    (["spec", "--max-new-tokens", "8"], "--max-new-tokens is now --max-tokens"),
    (["generate", "--max-new-tokens", "8"], "--max-new-tokens is now --max-tokens"),
    (["generate", "--max-token", "8"], "unrecognized argument --max-token; did you mean --max-tokens?"),
    (["generate", "--max-tok", "8"], "unrecognized argument --max-tok; did you mean --max-tokens?"),
    (["generate", "question"], "unexpected argument 'question'; give it as --prompt question"),
    (["spec", "--accept", "nope"], "argument --accept: invalid choice: 'nope'"),
    (["spec", "--max-tokens", "0"], "argument --max-tokens: must be an int >= 1, got 0"),
    (["spec", "--prompt-ids", "1,2,x"], "argument --prompt-ids: must be comma-separated token ids (ints >= 0)"),
    (["spec", "--prompt-ids", "1,-2"], "argument --prompt-ids: must be comma-separated token ids (ints >= 0)"),
    (["spec", "--prompt-ids", ","], "argument --prompt-ids: must be comma-separated token ids (ints >= 0)"),
    (["spec", "--prompt", "hi", "--prompt-ids", "1"], "argument --prompt-ids: not allowed with argument --prompt"),
    (["spec", "--backend", "nope"], "argument --backend: must be auto or one of"),
    (["spec", "--page-size", "-1"], "argument --page-size: must be an int >= 1, got -1"),
    (["spec", "--kv-tokens", "0"], "argument --kv-tokens: must be an int >= 1, got 0"),
    (["spec", "--seed", "-3"], "argument --seed: must be an int in [0, 2**63), got -3"),
    (["spec", "--temperature", "0"], "argument --temperature: must be a finite number > 0, got '0'"),
    (["spec", "--temperature", "nan"], "argument --temperature: must be a finite number > 0, got 'nan'"),
    (["spec", "--posterior-threshold", "-0.1"], "argument --posterior-threshold: must be a finite number >= 0"),
    (["spec", "--posterior-alpha", "inf"], "argument --posterior-alpha: must be a finite number >= 0, got 'inf'"),
    (["spec", "--medusa", "/no/such/heads.pt"], "argument --medusa: '/no/such/heads.pt' does not exist"),
    (["spec", "--medusa-heads", "0"], "argument --medusa-heads: must be an int >= 1, got 0"),
    (["spec", "--medusa-choices", "[[0],"], "argument --medusa-choices: must be a non-empty JSON list of index paths"),
    (["spec", "--medusa-choices", "[]"], "argument --medusa-choices: must be a non-empty JSON list of index paths, "
                                         "e.g. '[[0],[1],[0,0]]', got []"),
    (["spec", "--medusa-choices", "[[0],[1,0]]"], r"choices path [1, 0] has no parent path [1]"),
    (["spec", "--draft-model", "/no/such/model"], "argument --draft-model: '/no/such/model' is not a directory"),
    (["spec", "--draft-config", "huge"], "argument --draft-config: must be one of tiny"),
    (["spec", "--draft-seed", "-1"], "argument --draft-seed: must be an int in [0, 2**63), got -1"),
    (["spec", "--depth", "0"], "argument --depth: must be an int >= 1, got 0"),
    (["spec", "--top-k", "0"], "argument --top-k: must be an int >= 1, got 0"),
    (["spec", "--total-tokens", "0"], "argument --total-tokens: must be an int >= 1, got 0"),
    (["spec", "--max-ngram", "0"], "argument --max-ngram: must be an int >= 1, got 0"),
    (["spec", "--num-draft-tokens", "0"], "argument --num-draft-tokens: must be an int >= 1, got 0"),
    (["spec", "--max-matches", "0"], "argument --max-matches: must be an int >= 1, got 0"),
    (["spec", "--tree-json", "/no/such/tree.json"], "argument --tree-json: file '/no/such/tree.json' does not exist"),
    (["spec", "--speculative", "tree", "--tree-json", "NOTJSON"], "--tree-json NOTJSON is not JSON"),
    (["spec", "--speculative", "tree", "--tree-json", "LISTJSON"], "must hold an object with 'parents' or 'choices'"),
    (["spec", "--out", "TMP"], "argument --out: 'TMP' is a folder"),
    (["spec", "--check", "--accept", "typical"], "--check compares with plain greedy decoding"),
    (["tot", "--numbers", "1", "2", "3"], "argument --numbers: expected 4 arguments"),
    (["tot", "--numbers", "1", "2", "3", "0"], "argument --numbers: must be an int >= 1, got 0"),
    (["tot", "--algorithm", "astar"], "argument --algorithm: invalid choice: 'astar'"),
    (["tot", "--k", "0"], "argument --k: must be an int >= 1, got 0"),
    (["tot", "--n", "0"], "argument --n: must be an int >= 1, got 0"),
    (["tot", "--depth", "-2"], "argument --depth: must be an int >= 1, got -2"),
    (["tot", "--selection", "best"], "argument --selection: invalid choice: 'best'"),
    (["tot", "--threshold", "nan"], "argument --threshold: must be a finite number, got 'nan'"),
    (["tot", "--max-expansions", "0"], "argument --max-expansions: must be an int >= 1, got 0"),
    (["tot", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0, got '-1'"),
    (["tot", "--value-samples", "0"], "argument --value-samples: must be an int >= 1, got 0"),
    (["tot", "--value-temperature", "1e999"], "argument --value-temperature: must be a finite number >= 0"),
    (["tot", "--thought-max-tokens", "0"], "argument --thought-max-tokens: must be an int >= 1, got 0"),
    (["tot", "--value-max-tokens", "0"], "argument --value-max-tokens: must be an int >= 1, got 0"),
    (["tot", "--planner", "nope"], "argument --planner: invalid choice: 'nope'"),
    (["tot", "--backend", "nope"], "argument --backend: must be auto or one of"),
    (["tot", "--page-size", "0"], "argument --page-size: must be an int >= 1, got 0"),
    (["tot", "--kv-tokens", "0"], "argument --kv-tokens: must be an int >= 1, got 0"),
    (["tot", "--seed", "-1"], "argument --seed: must be an int in [0, 2**63), got -1"),
]


@pytest.mark.parametrize("argv, fragment", BAD_ARGUMENTS, ids=[" ".join(a) or "(none)" for a, _ in BAD_ARGUMENTS])
def test_bad_argument_is_one_line_exit_2(argv, fragment, tmp_path, capsys, no_model):
    files = {"TMP": str(tmp_path), "RESULTS": str(results_file(tmp_path)), "NOTJSON": str(tmp_path / "a.json"),
             "LISTJSON": str(tmp_path / "list.json")}
    (tmp_path / "a.json").write_text("not json")
    (tmp_path / "list.json").write_text("[1, 2]")

    def fill(text):
        for key, value in files.items():
            text = text.replace(key, value)
        return text

    code, out, err = run([fill(a) for a in argv], capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, fill(fragment))


def test_plot_draws_a_results_file(tmp_path, capsys):
    fig = tmp_path / "fig.svg"
    code, out, _ = run(["plot", str(results_file(tmp_path)), "--out", str(fig)], capsys)
    assert code == 0 and out == f"figure: {fig}\n" and fig.stat().st_size > 1000


@pytest.mark.parametrize("replace, fragment", [
    ({"runs": {}}, "the top level 'runs' must be a list"),
    ({"runs": [{"planner": 3, "steps": []}]}, "the top level runs[0] 'planner' must be a string"),
    ({"runs": [{"planner": "flatten", "steps": [{"step": 1}]}]}, "the top level runs[0] steps[0] has no 'kind', "
                                                                 "'total_ms'"),
    ({"schedule": []}, "the top level 'schedule': expected a JSON object, got list"),
    ({"families": {}}, "'families' must be a non-empty JSON object"),
    ({"families": {"tot": {"runs": []}}}, "families['tot'] has no 'workload', 'schedule', 'model', 'device'"),
])
def test_plot_names_what_a_results_file_lacks(replace, fragment, tmp_path, capsys):
    code, _, err = run(["plot", str(results_file(tmp_path, **replace)), "--out", str(tmp_path / "f.png")], capsys)
    assert code == 2
    assert_one_line_error(err, "is not a treedec replay results file (" + fragment, prog="treedec plot")


def test_env_prints_the_installed_versions(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    lines = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines() if line.strip())
    assert lines["torch"] == torch.__version__ and lines["numpy"] == importlib.metadata.version("numpy")


def test_generate_runs_a_prompts_file_batched(tmp_path, capsys):
    prompts = tmp_path / "requests.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3, 4, 5], "max_tokens": 6, "n": 2, "seed": 1}\n'
                       '\n'
                       '{"id": "g", "prompt_ids": [9, 8, 7], "temperature": 0, "stop_token_ids": [511]}\n')
    out = tmp_path / "results.jsonl"
    assert main(["generate", "--prompts", str(prompts), "--out", str(out), "--max-tokens", "5"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # each request's lines as it finishes: "g" (5 tokens, or fewer at its stop id) before request 1 (6 tokens)
    assert [(r["id"], r["index"]) for r in lines] == [("g", 0), (1, 0), (1, 1)]
    assert [len(r["output_ids"]) for r in lines] == [5, 6, 6] or lines[0]["stop_reason"] == "eos"
    assert lines[1]["output_ids"] != lines[2]["output_ids"] and lines[1]["prompt_ids"] == [1, 2, 3, 4, 5]
    err = capsys.readouterr().err
    assert "2 requests, 3 outputs" in err and f"results in {out}" in err


@pytest.mark.parametrize("line,fragment", [
    ('{"prompt": "hi"}', "request 1 gives its prompt as text: it needs the checkpoint's tokenizer"),
    ('{"prompt_ids": [1], "temperature": -1}', "requests.jsonl:1: "),
    ('{"prompt_ids": [1], "max_tokens": 1000, "n": 8}', "request 1 may need"),
])
def test_generate_errors_are_one_line(line, fragment, tmp_path, capsys):
    prompts = tmp_path / "requests.jsonl"
    prompts.write_text(line + "\n")
    assert main(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "r.jsonl"), "--kv-tokens",
                 "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treedec generate: error: ") and fragment in err and "\n" not in err
    assert not (tmp_path / "r.jsonl").exists()


# ================================================================ the front door (issue 48)


@pytest.mark.parametrize("pythonpath", ["", ":"])
def test_python_dash_m_treedec_does_not_import_the_working_directory_s_modules(pythonpath, tmp_path):
    """Was: ``python -m treedec`` (and an empty entry of PYTHONPATH) put the working directory first on the import
    path, so the ``fractions.py`` lying there was imported by ``treedec tot`` (and any command: the parser imports
    every command)."""
    (tmp_path / "fractions.py").write_text("raise RuntimeError('the working directory fractions.py was imported')\n")
    env = {**os.environ, "PYTHONPATH": pythonpath + os.environ.get("PYTHONPATH", str(REPO))}
    proc = subprocess.run([sys.executable, "-m", "treedec", "tot", "--help"], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0 and "usage: treedec tot" in proc.stdout, proc.stderr[-2000:]


def test_import_treedec_imports_nothing_else():
    """The package's face imports its names when first used, so ``python -m treedec`` cleans the path before torch
    (or any other module a working directory could shadow) is imported: only its lazy-names helper comes with it
    (which imports importlib alone)."""
    code = ("import sys; before = set(sys.modules); import treedec\n"
            "print(sorted(m for m in set(sys.modules) - before))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "['treedec', 'treedec.lazy']"
    proc = subprocess.run([sys.executable, "-c", "from treedec import LLM, SamplingParams, PagedKVPool; print(LLM)"],
                          capture_output=True, text=True, check=True)
    assert "treedec.llm.LLM" in proc.stdout


#: Each command with the arguments it cannot start without.
REQUIRED = {"replay": ["fewshot"], "plot": ["RESULTS"], "serve": ["--model", "smollm2"]}


@pytest.mark.parametrize("command", ["demo", "generate", "replay", "plot", "spec", "tot", "serve", "env"])
def test_an_unknown_flag_names_the_command_and_the_flag(command, tmp_path, capsys, no_model):
    """Was: 'treedec: error: unrecognized arguments: ...' for every command, naming neither it nor what to do. No
    flag may be abbreviated either (a prefix is an unknown flag, never another one)."""
    required = [str(results_file(tmp_path)) if a == "RESULTS" else a for a in REQUIRED.get(command, [])]
    code, _, err = run([command, *required, "--no-such-flag", "3"], capsys)
    assert code == 2
    assert_one_line_error(err, "unrecognized argument --no-such-flag", f"(see 'treedec {command} --help')",
                          prog=f"treedec {command}")
    code, _, err = run([command, *required, "--debu"], capsys)   # --debug, which every command takes, abbreviated
    assert code == 2
    assert_one_line_error(err, "unrecognized argument --debu; did you mean --debug?", prog=f"treedec {command}")


def test_version(capsys):
    """Was: no --version. It is the package's (treedec.__version__, the same as pyproject.toml's)."""
    import treedec
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"treedec {treedec.__version__}\n"
    assert f'\nversion = "{treedec.__version__}"\n' in (REPO / "pyproject.toml").read_text()


def test_replay_without_out_prints_the_table_writes_nothing_and_says_how(tmp_path, capsys, monkeypatch):
    """The README said replay "writes a results JSON"; it writes one only with --out (a command writing a file it
    was not asked for, in the working directory, would surprise more): the README says so, and so does the run."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["replay", "fewshot", "--iterations", "1", "--prompt-tokens", "32", "--branches", "2",
                          "--warmup", "0", "--no-progress"], capsys)
    assert code == 0 and "flatten" in out and list(tmp_path.iterdir()) == []
    assert "the results JSON, every step's times, which treedec plot draws: --out FILE" in err
    readme = (REPO / "README.md").read_text()
    replay = readme[readme.index("`treedec replay <workload>` forces"):][:600]
    assert "`--out FILE` writes the results\nJSON" in replay and "without `--out` no file is written" in replay
