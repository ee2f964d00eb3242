"""``treedec spec`` on the tiny random default (CPU): every draft source with --check, sampled
rules, the results JSON, and bad inputs refused before a model is loaded."""
import json

import pytest
import torch

from treedec.cli import main
from treedec.engine import from_config
from treedec.search.medusa import MedusaHeads

FAST = ["--max-new-tokens", "16", "--no-progress"]


@pytest.mark.parametrize("draft", ["ngram", "medusa", "draft-model", "tree"])
def test_greedy_check_passes_for_every_draft(draft, tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["spec", "--draft", draft, "--check", "--json-out", str(out), *FAST]) == 0
    printed = capsys.readouterr().out
    assert "check: equal to plain greedy decoding" in printed and "accepted length histogram" in printed
    results = json.loads(out.read_text())
    s = results["summary"]
    assert results["check"]["equal"] and len(results["tokens"]) == s["new_tokens"] == 16
    assert len(results["steps"]) == s["steps"] and sum(s["accepted_histogram"].values()) == s["steps"]
    assert 1 + sum(st["accepted"] + 1 for st in results["steps"]) >= 16
    assert s["tokens_per_step"] == pytest.approx(1 + s["accepted_mean"], abs=1e-3)
    assert s["decode_tokens_per_second"] > 0 and results["draft"]["kind"] == draft
    if draft == "medusa":
        assert "UNTRAINED Medusa heads" in printed
    if draft == "draft-model":
        assert "the target's own weights" in printed and s["accepted_mean"] > 1


@pytest.mark.parametrize("accept", ["typical", "sample"])
def test_sampled_acceptance_runs(accept, tmp_path):
    runs = []
    for _ in range(2):
        out = tmp_path / f"{accept}.json"
        assert main(["spec", "--draft", "ngram", "--accept", accept, "--temperature", "0.9", "--seed", "5",
                     "--json-out", str(out), *FAST]) == 0
        runs.append(json.loads(out.read_text()))
    assert runs[0]["tokens"] == runs[1]["tokens"]            # seeded
    assert runs[0]["acceptance"]["rule"] == accept and "temperature=0.9" in runs[0]["acceptance"]["repr"]


def test_medusa_checkpoint_and_tree_json(tmp_path, capsys):
    model = from_config("tiny", seed=0, dtype=torch.float32, device="cpu")
    torch.save(MedusaHeads.untrained(model, num_heads=2).medusa_head.state_dict(), tmp_path / "medusa_lm_head.pt")
    assert main(["spec", "--draft", "medusa", "--medusa", str(tmp_path), "--medusa-choices", "[[0],[1],[0,0]]",
                 "--check", *FAST]) == 0
    assert f"Medusa heads from {tmp_path}; 2 heads x 1 ResBlock(s), 3 draft tokens per step" in capsys.readouterr().out
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"parents": [-1, 0, 1, 0], "tokens": [5, 6, 7]}))
    assert main(["spec", "--draft", "tree", "--tree-json", str(tree), "--check", *FAST]) == 0
    assert "3 draft tokens every step" in capsys.readouterr().out


@pytest.mark.parametrize("argv, error, match", [
    (["--check", "--accept", "sample"], ValueError, "--check compares with plain greedy decoding and needs "
                                                    "--accept greedy, got --accept sample"),
    (["--medusa-choices", "[[0],[1,0]]"], ValueError, r"choices path \[1, 0\] has no parent path \[1\]"),
    (["--medusa-choices", "[[0],"], ValueError, "--medusa-choices must be a JSON list of index paths"),
    (["--accept", "typical", "--temperature", "0"], ValueError, "temperature must be a finite number > 0, got 0"),
    (["--accept", "typical", "--posterior-alpha", "-1"], ValueError, "posterior_alpha must be a finite number >= 0"),
    (["--prompt-ids", "1,2,x"], ValueError, "--prompt-ids must be comma-separated ints"),
    (["--prompt-ids", "1,600"], ValueError, r"--prompt-ids must be token ids in \[0, 512\)"),
    (["--prompt", "hello"], ValueError, "--prompt needs a tokenizer"),
    (["--draft", "medusa", "--medusa", "/nonexistent/heads.pt"], FileNotFoundError, "does not exist"),
    (["--draft", "medusa", "--medusa-choices", "[[0],[0,0],[0,0,0]]", "--medusa-heads", "2"], ValueError,
     r"is 3 deep but there are 2 Medusa heads"),
])
def test_bad_inputs_raise_clear_errors(argv, error, match):
    with pytest.raises(error, match=match):
        main(["spec", *argv, *FAST])


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--top-k", "--depth", "--page-size"])
def test_non_positive_counts_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        main(["spec", flag, "0"])
    assert f"argument {flag}: must be an int >= 1, got 0" in capsys.readouterr().err
