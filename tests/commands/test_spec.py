"""``treedec spec`` on the tiny random default (CPU): every draft source with --check, sampled
rules, the results JSON, and bad inputs refused before a model is loaded."""
import json
import re
from pathlib import Path

import pytest
import torch

from treedec.cli import main
from treedec.models import from_config
from treedec.models.medusa import MedusaHeads

FAST = ["--max-tokens", "16", "--no-progress"]


@pytest.mark.parametrize("draft", ["ngram", "medusa", "draft_model", "tree"])
def test_greedy_check_passes_for_every_draft(draft, tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["spec", "--speculative", draft, "--check", "--out", str(out), *FAST]) == 0
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
    if draft == "draft_model":
        assert "the target's own weights" in printed and s["accepted_mean"] > 1


@pytest.mark.parametrize("accept", ["typical", "sample"])
def test_sampled_acceptance_runs(accept, tmp_path):
    runs = []
    for _ in range(2):
        out = tmp_path / f"{accept}.json"
        assert main(["spec", "--speculative", "ngram", "--accept", accept, "--temperature", "0.9", "--seed", "5",
                     "--out", str(out), *FAST]) == 0
        runs.append(json.loads(out.read_text()))
    assert runs[0]["tokens"] == runs[1]["tokens"]            # seeded
    assert runs[0]["acceptance"]["rule"] == accept and "temperature=0.9" in runs[0]["acceptance"]["repr"]


def test_medusa_checkpoint_and_tree_json(tmp_path, capsys):
    model = from_config("tiny", seed=0, dtype=torch.float32, device="cpu")
    torch.save(MedusaHeads.untrained(model, num_heads=2).medusa_head.state_dict(), tmp_path / "medusa_lm_head.pt")
    assert main(["spec", "--speculative", "medusa", "--medusa", str(tmp_path), "--medusa-choices", "[[0],[1],[0,0]]",
                 "--check", *FAST]) == 0
    assert f"Medusa heads from {tmp_path}; 2 heads x 1 ResBlock(s), 3 draft tokens per step" in capsys.readouterr().out
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"parents": [-1, 0, 1, 0], "tokens": [5, 6, 7]}))
    assert main(["spec", "--speculative", "tree", "--tree-json", str(tree), "--check", *FAST]) == 0
    assert "3 draft tokens every step" in capsys.readouterr().out


@pytest.mark.parametrize("argv, error, match", [
    (["--check", "--accept", "sample"], ValueError, "--check compares with plain greedy decoding and needs "
                                                    "--accept greedy, got --accept sample"),
    (["--prompt-ids", "1,600"], ValueError, r"--prompt-ids must be token ids in \[0, 512\) for random weights"),
    (["--prompt", "hello"], ValueError, "--prompt needs a tokenizer"),
    (["--eos", "3,600"], ValueError, r"--eos must be token ids in \[0, 512\) for random weights, got 600"),
    (["--speculative", "medusa", "--medusa-choices", "[[0],[0,0],[0,0,0]]", "--medusa-heads", "2"], ValueError,
     r"is 3 deep but there are 2 Medusa heads"),
    (["--speculative", "medusa", "--medusa-choices", "[[600]]"], ValueError, r"candidate rank >= the vocabulary size 512"),
])
def test_bad_inputs_raise_clear_errors(argv, error, match, capsys):
    """One line and exit code 2; with --debug the exception itself."""
    assert main(["spec", *argv, *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("treedec spec: error: ") and re.search(match, err), err
    with pytest.raises(error, match=match):
        main(["--debug", "spec", *argv, *FAST])


@pytest.mark.parametrize("argv, match", [
    (["--medusa-choices", "[[0],[1,0]]"], r"argument --medusa-choices: .*choices path \[1, 0\] has no parent path"),
    (["--medusa-choices", "[[0],"], "argument --medusa-choices: must be a non-empty JSON list of index paths"),
    (["--accept", "typical", "--temperature", "0"], "argument --temperature: must be a finite number > 0, got '0'"),
    (["--accept", "typical", "--posterior-alpha", "-1"], "argument --posterior-alpha: must be a finite number >= 0"),
    (["--prompt-ids", "1,2,x"], "argument --prompt-ids: must be comma-separated token ids"),
    (["--eos", "eos"], "argument --eos: must be comma-separated token ids .ints >= 0. or 'none', got 'eos'"),
    (["--eos", "-1"], "argument --eos: must be comma-separated token ids"),
    (["--speculative", "medusa", "--medusa", "/nonexistent/heads.pt"], "argument --medusa: '/nonexistent/heads.pt' does "
                                                                 "not exist"),
    (["--max-tokens", "0"], "argument --max-tokens: must be an int >= 1, got 0"),
    (["--top-k", "0"], "argument --top-k: must be an int >= 1, got 0"),
    (["--depth", "0"], "argument --depth: must be an int >= 1, got 0"),
    (["--page-size", "0"], "argument --page-size: must be an int >= 1, got 0"),
])
def test_bad_arguments_are_refused_when_parsed(argv, match, capsys, monkeypatch):
    monkeypatch.setattr("treedec.commands.spec.load_model", lambda args: pytest.fail("loaded a model"))
    assert main(["spec", *argv, *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(match, err), err


@pytest.mark.parametrize("spec, match", [
    ({"parents": [-1, 0], "tokens": [5, 6]}, "TreeDraft needs 1 draft tokens"),
    ({"parents": [-1, 0], "tokens": "ab"}, "'tokens' must be a list of ints"),
    ({"parents": 5, "tokens": [5]}, "'parents' must be a list of ints"),
    ({"parents": [-1, 0], "tokens": [-5]}, "'tokens' must be token ids >= 0"),
    ({"choices": [[0]], "parents": [-1, 0], "tokens": [5]}, "must hold an object with 'parents' or 'choices' (one"),
])
def test_bad_tree_json_is_refused_before_a_model_is_loaded(spec, match, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("treedec.commands.spec.load_model", lambda args: pytest.fail("loaded a model"))
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(spec))
    assert main(["spec", "--speculative", "tree", "--tree-json", str(path), *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--tree-json {path}" in err and match in err, err


def test_tree_json_token_past_the_vocabulary_is_refused(tmp_path, capsys):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"parents": [-1, 0], "tokens": [512]}))
    assert main(["spec", "--speculative", "tree", "--tree-json", str(path), *FAST]) == 2
    assert "'tokens' must be token ids in [0, 512), got 512" in capsys.readouterr().err


def first_new_token(tokens, start):
    """A position >= start whose token occurs there first, and that token."""
    p = next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])
    return p, tokens[p]


@pytest.mark.parametrize("draft", ["ngram", "draft_model"])
def test_eos_stops_the_run_and_the_check(draft, tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["spec", "--speculative", draft, "--out", str(out), *FAST]) == 0
    free = json.loads(out.read_text())
    assert free["summary"]["stop_reason"] == "length" and free["eos_token_ids"] == []
    assert "eos: none" in capsys.readouterr().out    # random weights: no EOS ids of their own
    p, eos = first_new_token(free["tokens"], 5)
    assert main(["spec", "--speculative", draft, "--eos", f"511,{eos}", "--check", "--out", str(out), *FAST]) == 0
    results = json.loads(out.read_text())
    assert results["tokens"] == free["tokens"][:p + 1] and results["summary"]["new_tokens"] == p + 1
    assert results["summary"]["stop_reason"] == "eos" and results["eos_token_ids"] == [511, eos]
    assert results["check"]["equal"]
    printed = capsys.readouterr().out
    assert f"eos: [511, {eos}]" in printed and "stopped: eos" in printed
    assert "check: equal to plain greedy decoding" in printed


def test_eos_defaults_to_the_checkpoint_s(tmp_path, capsys):
    from tests.models.test_llama import tiny_hf

    tiny_hf("llama", seed=9).save_pretrained(tmp_path)
    argv = ["spec", "--model", str(tmp_path), "--device", "cpu", "--dtype", "fp32", "--prompt-ids", "5,9,2,7,1,3",
            "--check", "--out", str(tmp_path / "spec.json"), *FAST]
    assert main([*argv, "--eos", "none"]) == 0
    free = json.loads((tmp_path / "spec.json").read_text())
    assert free["summary"]["stop_reason"] == "length" and free["eos_token_ids"] == []
    p, eos = first_new_token(free["tokens"], 3)
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": [eos, 255]}))
    capsys.readouterr()
    assert main(argv) == 0
    results = json.loads((tmp_path / "spec.json").read_text())
    assert results["tokens"] == free["tokens"][:p + 1] and results["summary"]["stop_reason"] == "eos"
    assert results["eos_token_ids"] == [eos, 255] and results["check"]["equal"]
    assert f"eos: [{eos}, 255]" in capsys.readouterr().out


def read_results(path) -> dict:
    """A results JSONL file's lines by request id (lines come in the order requests finish)."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert len({r["id"] for r in lines}) == len(lines)
    return {r["id"]: r for r in lines}


def write_prompts(path, count=3):
    lines = [json.dumps({"id": f"r{k}", "prompt_ids": [(13 * k + 5 * i) % 512 for i in range(8)] * 2,
                         "max_tokens": 10 + k}) for k in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return [json.loads(line) for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["ngram", "medusa", "draft_model", "tree"])
def test_a_prompts_file_runs_batched_with_every_draft(draft, tmp_path, capsys):
    """Every request's tokens are plain greedy decoding's (greedy acceptance), whatever the draft."""
    from tests.engines import plain_greedy

    requests = write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "r.jsonl"
    assert main(["spec", "--speculative", draft, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)]) == 0
    assert "3 requests" in capsys.readouterr().err
    results = read_results(out)
    model = from_config("tiny", seed=0)
    assert list(sorted(results)) == [r["id"] for r in requests]
    for request in requests:
        result = results[request["id"]]
        assert result["stop_reason"] == "length"
        assert result["output_ids"] == plain_greedy(model, request["prompt_ids"], request["max_tokens"])
        assert len(result["stats"]["accepted"]) == result["stats"]["steps"]


@pytest.mark.parametrize("accept", ["typical", "sample"])
def test_a_prompts_file_with_sampled_acceptance(accept, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "r.jsonl"
    argv = ["spec", "--accept", accept, "--temperature", "0.8", "--prompts", str(tmp_path / "p.jsonl"), "--out"]
    assert main([*argv, str(out)]) == 0
    first = out.read_text()
    assert main([*argv, str(tmp_path / "again.jsonl")]) == 0   # seeded: the same tokens again
    assert (tmp_path / "again.jsonl").read_text().count("output_ids") == 2
    again = read_results(tmp_path / "again.jsonl")
    assert {r["id"]: r["output_ids"] for r in map(json.loads, first.splitlines())} == \
        {i: r["output_ids"] for i, r in again.items()}


@pytest.mark.parametrize("extra, match", [
    (["--out", "r.jsonl", "--check"], "--check goes with a single prompt, not with --prompts"),
    (["--out", "r.jsonl", "--eos", "3"], "--eos goes with a single prompt, not with --prompts .give each request's "
                                         "stop_token_ids"),
    ([], "--prompts needs --out results.jsonl"),
])
def test_prompts_file_conflicts_are_one_line_errors(extra, match, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_prompts(tmp_path / "p.jsonl", 1)
    assert main(["spec", "--prompts", "p.jsonl", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(match, err), err
    assert not (tmp_path / "r.jsonl").exists()


def test_sampled_draft_model_trees_with_top_k_acceptance(tmp_path):
    out = tmp_path / "spec.json"
    argv = ["spec", "--speculative", "draft_model", "--draft-sample", "--accept", "sample", "--temperature", "0.9",
            "--top-k", "8", "--top-p", "0.95", "--out", str(out), *FAST]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert "top_k=8" in results["acceptance"]["repr"] and len(results["tokens"]) == 16
    assert sum(step["accepted"] for step in results["steps"]) > 0   # the draft model is the target's own weights


@pytest.mark.parametrize("argv, match", [
    (["--draft-sample"], "--draft-sample samples a draft model's or EAGLE drafter's trees for --accept sample, got --speculative ngram"),
    (["--top-k", "4"], "--top-k / --top-p shape --accept sample's distribution"),
    (["--accept", "sample", "--top-p", "1.5"], r"top_p must be a number in \(0, 1\], got 1.5"),
])
def test_sampling_flags_are_checked(argv, match, capsys):
    assert main(["spec", *argv, *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(match, err), err


def test_a_prompts_file_with_sampled_draft_model_trees(tmp_path):
    """--draft-sample and --top-k reach every request's draft and rule in batch mode."""
    write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "r.jsonl"
    assert main(["spec", "--speculative", "draft_model", "--draft-sample", "--accept", "sample", "--temperature", "0.9",
                 "--top-k", "6", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)]) == 0
    results = read_results(out)
    assert {i: len(r["output_ids"]) for i, r in results.items()} == {"r0": 10, "r1": 11}
    assert sum(sum(r["stats"]["accepted"]) for r in results.values()) > 0   # the draft model is the target's own weights


def test_a_checkpoint_whose_tokenizer_does_not_load_is_a_one_line_error(tmp_path, capsys):
    """Tokenizer files that transformers cannot read are reported, not silently dropped."""
    from tests.models.test_llama import tiny_hf

    tiny_hf("llama", seed=9).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ not json")
    capsys.readouterr()   # save_pretrained's progress bar
    argv = ["spec", "--model", str(tmp_path), "--device", "cpu", "--dtype", "fp32", "--prompt-ids", "5,9,2", *FAST]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot load its tokenizer" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("kind, tree", [("eagle", "dynamic"), ("eagle3", "dynamic"), ("eagle3", "chains")])
def test_eagle_drafter_checkpoint(kind, tree, tmp_path, capsys):
    """``--speculative eagle|eagle3 --drafter PATH``: a drafter saved in the EAGLE reference layout for a
    6-layer checkpoint (EAGLE-3 reads three of its layers), EAGLE-2 trees or fixed chains
    (``--eagle-tree``); greedy, single prompt and prompts file."""
    from tests.engines import plain_greedy
    from tests.models.test_llama import tiny_hf
    from treedec.models import from_pretrained
    from treedec.models.eagle_drafter import EagleDrafter, save_eagle

    tiny_hf("llama", seed=9, num_hidden_layers=6).save_pretrained(tmp_path / "model")
    model = from_pretrained(tmp_path / "model", dtype=torch.float32, device="cpu")
    save_eagle(EagleDrafter.random(model, kind, seed=2), tmp_path / "eagle")
    argv = ["spec", "--model", str(tmp_path / "model"), "--device", "cpu", "--dtype", "fp32", "--speculative", kind,
            "--drafter", str(tmp_path / "eagle"), "--eagle-tree", tree, "--eos", "none"]
    capsys.readouterr()
    assert main([*argv, "--prompt-ids", "5,9,2,7,1,3", "--check", *FAST]) == 0
    printed = capsys.readouterr().out
    assert f"{kind} drafter from {tmp_path / 'eagle'}" in printed and "check: equal" in printed
    assert ("4 chains of 4 tokens" if tree == "chains" else "16 tokens") in printed
    if kind == "eagle3":
        assert "target layers [0, 3, 5]" in printed
    requests = write_prompts(tmp_path / "p.jsonl", 2)
    argv.remove("--eos"), argv.remove("none")
    assert main([*argv, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "r.jsonl")]) == 0
    results = read_results(tmp_path / "r.jsonl")
    for request in requests:
        assert results[request["id"]]["output_ids"] == plain_greedy(model, request["prompt_ids"],
                                                                    request["max_tokens"])


def test_eagle_flags_are_checked(tmp_path, capsys):
    assert main(["spec", "--speculative", "ngram", "--drafter", str(tmp_path)]) == 2
    assert "--drafter is an EAGLE checkpoint for --speculative eagle / eagle3" in capsys.readouterr().err
    assert main(["spec", "--speculative", "eagle3", *FAST]) == 2     # the 2-layer default model
    assert "a 2-layer target has fewer" in capsys.readouterr().err
    assert main(["spec", "--speculative", "eagle", "--drafter", str(tmp_path), *FAST]) == 2
    assert "has no config.json" in capsys.readouterr().err
    for argv, match in [(["--speculative", "draft_model"], "--eagle-tree chains is for --speculative eagle / eagle3"),
                        (["--speculative", "eagle", "--draft-sample", "--accept", "sample"], "it takes no --draft-sample"),
                        (["--speculative", "eagle", "--total-tokens", "12"], "top-k x depth = 16 draft tokens")]:
        assert main(["spec", *argv, "--eagle-tree", "chains", *FAST]) == 2
        assert match in capsys.readouterr().err


@pytest.mark.parametrize("line, argv, match", [
    ({"prompt_ids": [1, 2, 3], "temperature": 0.8}, [],
     r"request 1 \(line 1\) samples at temperature 0.8, which --accept greedy cannot take: run the file with "
     r"--accept sample"),
    ({"prompt_ids": [1, 2, 3], "n": 2}, [], r"request 1 \(line 1\) asks for n=2 outputs"),
    ({"prompt_ids": [1, 2, 3], "temperature": 0.8, "top_k": 5}, ["--accept", "typical"],
     r"request 1 \(line 1\) gives top_k / top_p, which --accept typical does not take"),
    ({"prompt_ids": [1, 2, 3], "temperature": 0}, ["--accept", "sample"],
     r"request 1 \(line 1\): --accept sample samples and needs a temperature > 0"),
    ({"prompt": "hello"}, [], r"request 1 \(line 1\) gives its prompt as text: it needs --model with a tokenizer, "
                              r"and the model is random weights"),
    ({"prompt_ids": [1, 2], "stop": ["x"]}, [], r"request 1 \(line 1\) has stop strings"),
])
def test_a_request_spec_cannot_take_is_refused_before_the_model_loads(line, argv, match, tmp_path, capsys,
                                                                      monkeypatch):
    """Was: refused only after the model loaded (19 s for SmolLM2); now no model is loaded at all."""
    import treedec.commands.spec as spec

    def no_load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(spec, "load_model", no_load)
    (tmp_path / "p.jsonl").write_text(json.dumps(line) + "\n")
    assert main(["spec", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "r.jsonl"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(match, err), err
    assert not (tmp_path / "r.jsonl").exists()


def test_check_prints_a_table_against_plain_greedy_and_out_is_the_json(tmp_path, capsys):
    """One --out for both modes: one prompt writes the JSON document (whatever the suffix)."""
    out = tmp_path / "spec.jsonl"
    assert main(["spec", "--check", "--out", str(out), *FAST]) == 0
    printed = capsys.readouterr().out
    header, spec_row, plain_row = [line.split() for line in printed.splitlines() if
                                   line.startswith(("method", "speculative", "plain greedy"))
                                   and "tokens" not in line[12:16]][:3]
    assert header == ["method", "tokens", "steps", "tokens/step", "tokens/s"]
    results = json.loads(out.read_text())
    s, check = results["summary"], results["check"]
    assert spec_row[:5] == ["speculative", "(ngram)", "16", str(s["steps"]), f"{s['tokens_per_step']:.2f}"]
    assert plain_row[:5] == ["plain", "greedy", "16", "15", "1.00"]
    assert check["plain_new_tokens"] == 16 and check["plain_steps"] == 15 and check["plain_tokens_per_second"] > 0


@pytest.mark.parametrize("argv, match", [
    (["--chat-template", "--prompt-ids", "1,2,3"], "--chat-template renders a text prompt through --model's "
                                                   "tokenizer: give --model .* not --prompt-ids"),
    (["--chat-template"], "--chat-template renders a text prompt .* not random weights"),
])
def test_chat_template_needs_a_text_prompt_and_a_tokenizer(argv, match, capsys):
    assert main(["spec", *argv, *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(match, err), err


def test_a_request_s_top_k_reaches_its_sampled_acceptance(tmp_path):
    """--prompts lines give their own top_k (as treedec generate's do; the flag only a default): top_k 1
    samples from the argmax alone, so rejection sampling gives plain greedy decoding's tokens."""
    from tests.engines import plain_greedy

    prompt = [(5 * i) % 512 for i in range(8)] * 2
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": prompt, "max_tokens": 12,
                                                  "temperature": 1.0, "top_k": 1}) + "\n")
    out = tmp_path / "r.jsonl"
    assert main(["spec", "--accept", "sample", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)]) == 0
    assert read_results(out)["a"]["output_ids"] == plain_greedy(from_config("tiny", seed=0), prompt, 12)
