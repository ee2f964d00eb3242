"""``--batch-invariant`` in the commands that build a decoding engine: the engine runs the mode, the stderr lines,
results files and the server's startup line say so, a flag the mode cannot take is one line."""
import json

from tests.commands.test_cli import assert_one_line_error, run
from tests.commands.test_serve import _Recorded, tiny_serve
from treedec.cli import main


def test_generate_runs_the_mode_and_says_so(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ids, "max_tokens": 3}) + "\n" for ids in ([1, 2, 3], [9] * 7)))
    assert main(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "r.jsonl"), "--batch-invariant"]) == 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batch-invariant mode: ")]
    assert "GEMMs and norms rows" in line and "the path planner, 256-token chunks, torch backend" in line


def test_spec_records_the_mode_and_still_equals_plain_greedy(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["spec", "--speculative", "ngram", "--check", "--batch-invariant", "--out", str(out),
                 "--max-tokens", "6", "--no-progress"]) == 0
    results = json.loads(out.read_text())
    assert results["batch_invariant"] is True and results["check"]["equal"]


def test_tot_records_the_mode_and_refuses_a_planner(tmp_path, capsys):
    out = tmp_path / "tot.json"
    assert main(["tot", "--k", "2", "--n", "1", "--depth", "1", "--thought-max-tokens", "2", "--value-max-tokens", "1",
                 "--no-check-steps", "--no-progress", "--kv-tokens", "1024", "--batch-invariant", "--out",
                 str(out)]) == 0
    settings = json.loads(out.read_text())
    assert settings["batch_invariant"] is True and settings["planner"] == "path"
    capsys.readouterr()
    code, _, err = run(["tot", "--batch-invariant", "--planner", "node"], capsys)
    assert code != 0
    assert_one_line_error(err, "--batch-invariant plans attention with the path planner", "--planner node")


def test_serve_says_so_at_start(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TREEDEC_API_KEY", raising=False)
    recorded = _Recorded(monkeypatch)
    assert tiny_serve(tmp_path, "--batch-invariant") == 0
    assert recorded.llm.engine.batch_invariance.kernel == "rows"
    assert ", batch-invariant" in capsys.readouterr().err
