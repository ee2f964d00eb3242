"""Medusa heads trained by self-distillation on the tiny random model (CPU): the data pipeline (rows, targets,
bounded memory), training (the loss goes down; resumed == uninterrupted), the saved checkpoint read back by every
path that loads Medusa heads (load_medusa_heads, SpeculativeConfig / LLM, treedec spec, treedec serve's config), and
bad arguments refused."""
from __future__ import annotations

import json

import pytest
import torch

from treedec import LLM, SamplingParams
from treedec.cli import main
from treedec.engine import Engine
from treedec.models import from_config
from treedec.models.medusa import load_medusa_heads
from treedec.programs.speculative import SpeculativeConfig
from tests.train.train_requests import id_requests
from treedec.train import (DEFAULT_PROMPTS, HELDOUT_PROMPTS, DistillConfig, MedusaTrainConfig, distill,
                           evaluate_medusa, read_manifest, read_shard, save_medusa_heads, train_medusa)
from treedec.train.medusa import IGNORE, head_targets, medusa_logits

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return from_config("tiny", seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def data(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    config = DistillConfig(params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           shard_tokens=100, batch_tokens=120, progress=False)
    summary = distill(model, id_requests(20), folder, config, model_name="tiny")
    return folder, summary


def write_prompts(path, requests):
    path.write_text("".join(json.dumps({"prompt_ids": list(r.prompt_ids)}) + "\n" for r in requests))
    return str(path)


# ================================================================ data


def test_distilled_rows_are_the_models_own_answers_and_hidden_states(model, data):
    folder, summary = data
    manifest = read_manifest(folder)
    assert manifest.sequences == 20 and manifest.rows == 20 * MAX_TOKENS == summary.answer_tokens
    assert len(manifest.shards) > 1 and sum(r for _, r, _ in manifest.shards) == manifest.rows
    shard = read_shard(folder, manifest.shards[0][0])
    request = id_requests(20)[0]
    rows = shard["sequence"] == 0
    answer = shard["labels"][rows].tolist()
    engine = Engine(model, kv_tokens=512)
    assert answer == greedy_answer(engine, list(request.prompt_ids), MAX_TOKENS)
    # the hidden state at the prompt's last token and every answer token but the last, as one prefill computes it
    sequence = list(request.prompt_ids) + answer[:-1]
    node = engine.tree.add_prompt(sequence)
    out = engine.step(logits_rows=[0], return_hidden=True, hidden_rows=engine.pending_token_rows([node]))
    expected = out.hidden[len(request.prompt_ids) - 1:]
    torch.testing.assert_close(shard["hidden"][rows], expected, rtol=1e-4, atol=1e-4)


def greedy_answer(engine, prompt, n):
    from treedec.programs.greedy import greedy_generate
    tokens = greedy_generate(engine, prompt, n, eos_token_id=None)
    engine.tree.prune_many(list(engine.tree.roots))
    return tokens


def test_distill_memory_is_bounded_by_a_shard_and_a_step(model, tmp_path):
    """However many prompts, memory holds one shard being filled (and one step's states): the writer's peak rows
    stay under shard_tokens + one answer, and the shards together hold every row."""
    config = DistillConfig(params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), shard_tokens=48,
                           batch_tokens=64, progress=False)
    summary = distill(model, id_requests(40, seed=1), tmp_path, config)
    assert summary.peak_buffered_rows < 48 + 16
    assert summary.manifest.rows == 40 * 16 and len(summary.manifest.shards) >= 40 * 16 // (48 + 16)
    assert all(rows < 48 + 16 for _, rows, _ in summary.manifest.shards)


def test_head_targets_stay_inside_their_answer():
    labels = torch.tensor([10, 11, 12, 20, 21])
    sequence = torch.tensor([0, 0, 0, 1, 1])
    t = head_targets(labels, sequence, 3)
    assert t.tolist() == [[11, 12, IGNORE], [12, IGNORE, IGNORE], [IGNORE] * 3, [21, IGNORE, IGNORE], [IGNORE] * 3]


# ================================================================ training, checkpoints, loading


CONFIG = MedusaTrainConfig(num_heads=3, epochs=4, batch_size=32, lr=5e-3, save_every=2, seed=0)


def test_training_lowers_the_loss_and_every_loader_reads_the_heads(model, data, tmp_path):
    folder, _ = data
    result = train_medusa(model, folder, tmp_path, CONFIG, progress=False)
    assert result.steps == result.total_steps == len(result.losses) > 8
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < 0.8 * first, result.losses
    save_medusa_heads(result.heads, tmp_path, "tiny")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 1)
    assert config["base_model_name_or_path"] == "tiny"

    loaded = load_medusa_heads(tmp_path, model)   # treedec spec --medusa, SpeculativeConfig's path
    hidden = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden), medusa_logits(result.heads, hidden), rtol=0, atol=0)

    # LLM(speculative_config=...) (what treedec serve --speculative medusa --drafter DIR builds): greedy tokens
    llm = LLM(model, kv_tokens=2048, speculative_config=SpeculativeConfig(method="medusa", model=str(tmp_path),
                                                                          medusa_choices=[[0], [1], [0, 0], [0, 0, 0]]))
    plain = LLM(model, kv_tokens=2048)
    prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in id_requests(3, seed=7)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fast = llm.generate(prompts, params, use_tqdm=False)
    slow = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]
    assert "Medusa heads from" in llm.drafts.note

    # treedec spec with the heads (the tiny model of --config tiny --seed 0), checked against plain greedy
    code = main(["spec", "--config", "tiny", "--speculative", "medusa", "--medusa", str(tmp_path),
                 "--medusa-choices", "[[0],[1],[0,0],[0,0,0]]", "--check", "--no-progress", "--max-tokens", "16"])
    assert code == 0

    acceptance = evaluate_medusa(model, loaded, id_requests(2, seed=9), None, max_tokens=12, progress=False)
    assert acceptance.equal_to_greedy and acceptance.tokens_per_step >= 1.0 and acceptance.draft_tokens == 61


def test_resumed_training_equals_uninterrupted(model, data, tmp_path):
    folder, _ = data
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = train_medusa(model, folder, tmp_path / "a", CONFIG, progress=False)
    first = train_medusa(model, folder, tmp_path / "b", MedusaTrainConfig(**{**CONFIG.__dict__, "max_steps": 5}),
                         progress=False)
    assert first.steps == 5
    rest = train_medusa(model, folder, tmp_path / "b", CONFIG, resume=True, progress=False)
    assert rest.resumed_from == 5   # the state saved at the stop
    assert rest.losses == whole.losses
    for a, b in zip(whole.heads.parameters(), rest.heads.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resume_with_other_settings_is_refused(model, data, tmp_path):
    folder, _ = data
    train_medusa(model, folder, tmp_path, MedusaTrainConfig(**{**CONFIG.__dict__, "max_steps": 2}), progress=False)
    with pytest.raises(ValueError, match="other settings.*lr"):
        train_medusa(model, folder, tmp_path, MedusaTrainConfig(**{**CONFIG.__dict__, "lr": 1e-2}), resume=True,
                     progress=False)


@pytest.mark.parametrize("field, value, message", [
    ("num_heads", 0, "num_heads"), ("lr", 0.0, "lr must be"), ("decay", 1.5, "decay must be"),
    ("batch_size", -1, "batch_size"), ("train_output_layers", "yes", "train_output_layers")])
def test_bad_training_settings_are_refused(field, value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        MedusaTrainConfig(**{field: value})


# ================================================================ the command


def test_command_trains_saves_evaluates_and_resumes(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", id_requests(10, seed=3))
    held = write_prompts(tmp_path / "h.jsonl", id_requests(2, seed=4))
    out = tmp_path / "heads"
    argv = ["train-drafter", "--config", "tiny", "--out", str(out), "--prompts", prompts, "--heldout", held,
            "--max-tokens", "12", "--batch-size", "16", "--num-heads", "2", "--eval-prompts", "2",
            "--eval-max-tokens", "8", "--no-progress", "--max-steps", "3"]
    assert main(argv) == 0
    for name in ("medusa_lm_head.safetensors", "config.json", "loss.png", "acceptance.json", "train.json",
                 "trainer_state.pt", "data/data.json"):
        assert (out / name).is_file(), name
    acceptance = json.loads((out / "acceptance.json").read_text())
    assert acceptance["equal_to_greedy"] and len(acceptance["prompts"]) == 2
    assert all(len(p["accepted"]) == p["steps"] for p in acceptance["prompts"])
    assert main(argv) == 2   # the run exists: --resume or another --out
    assert "pass --resume" in capsys.readouterr().err
    assert main([a if a != "3" else "6" for a in argv] + ["--resume"]) == 0
    report = json.loads((out / "train.json").read_text())
    assert report["steps"] == 6 and report["resumed_from"] == 3


@pytest.mark.parametrize("extra, message", [
    (["--method", "eagle3"], "EAGLE-3 reads three distinct target layers"),
    (["--method", "eagle3", "--resume"], "not resumable"),
    (["--resume"], "holds no training run"),
    (["--eval-prompts", "-1"], "--eval-prompts"),
    (["--num-heads", "0"], "--num-heads"),
    (["--lr", "0"], "--lr"),
    (["--out", "/nonexistent-folder/heads"], "does not exist"),
])
def test_command_refuses_bad_arguments(tmp_path, capsys, extra, message):
    argv = ["train-drafter", "--config", "tiny", "--out", str(tmp_path / "heads"), "--no-progress", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_text_prompts_need_a_tokenizer(tmp_path, capsys):
    assert main(["train-drafter", "--config", "tiny", "--out", str(tmp_path / "h"), "--no-progress"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_shipped_prompt_files_are_disjoint_and_varied():
    train = [json.loads(line)["prompt"] for line in DEFAULT_PROMPTS.read_text().splitlines()]
    held = [json.loads(line)["prompt"] for line in HELDOUT_PROMPTS.read_text().splitlines()]
    assert len(train) >= 300 and len(held) >= 30 and not set(train) & set(held) and len(set(train)) == len(train)
    for kind in ("Rewrite", "Explain", "List", "Python", "What is"):
        assert sum(kind in p for p in train) >= 15 and any(kind in p for p in held), kind
