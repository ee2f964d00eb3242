"""An EAGLE-3 drafter trained by self-distillation for a 6-layer tiny random model (CPU): the data keeps the prompts'
rows and three layers' inputs, the training-time test's attention is the drafter's own while drafting, the KL to the
target goes down, and the saved checkpoint (EAGLE's layout, d2t / t2d) loads through load_eagle and
SpeculativeConfig / LLM (treedec serve's path) and decodes exactly plain greedy's tokens."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from treedec import LLM, SamplingParams
from treedec.models import from_config
from treedec.models.config import ModelConfig
from treedec.models.eagle_config import default_aux_layers
from treedec.models.eagle_drafter import load_eagle, save_eagle
from treedec.programs.speculative import SpeculativeConfig
from tests.train.train_requests import id_requests
from treedec.train import (DistillConfig, Eagle3TrainConfig, MedusaTrainConfig, distill, evaluate_eagle3,
                           read_manifest, read_shard, train_eagle3, train_medusa)
from treedec.train.eagle3 import _positions, _TTTAttend


@pytest.fixture(scope="module")
def model():
    return from_config(dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=6), seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def data(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    config = DistillConfig(params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           aux_layers=default_aux_layers(6), progress=False)
    distill(model, id_requests(20), folder, config)
    return folder


def test_eagle3_data_keeps_the_prompts_rows_and_three_layers(model, data):
    manifest = read_manifest(data)
    assert manifest.prompt_rows and manifest.aux_layers == (0, 3, 5)
    shard = read_shard(data, manifest.shards[0][0])
    request = id_requests(20)[0]
    rows = shard["sequence"] == 0
    p = len(request.prompt_ids)
    assert int(rows.sum()) == p + 24 - 1 and shard["aux"].shape[1:] == (3, 128)
    assert shard["labels"][rows][:p - 1].tolist() == list(request.prompt_ids[1:])
    assert shard["answer"][rows].tolist() == [False] * (p - 1) + [True] * 24
    with pytest.raises(ValueError, match="distilled for EAGLE-3"):
        train_medusa(model, data, data, MedusaTrainConfig(), progress=False)


def test_ttt_attention_at_step_0_is_causal_attention_within_each_sequence():
    torch.manual_seed(0)
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    out = _TTTAttend(seq, _positions(seq))(0, q, k, v)
    for s in (0, 1):
        rows = seq == s
        ref = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k[rows].repeat_interleave(2, 1).transpose(0, 1),
                                             v[rows].repeat_interleave(2, 1).transpose(0, 1), is_causal=True)
        torch.testing.assert_close(out[rows], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert _positions(seq).tolist() == [0, 1, 2, 0, 1, 2, 3]


def test_ttt_attention_at_step_j_reads_the_chain_root_prefix_and_the_chains_own_keys():
    """Row i at step 2 attends to step 0's keys of rows <= i - 2 and to step 1's key of row i - 1 and its own."""
    torch.manual_seed(1)
    seq = torch.zeros(5, dtype=torch.int64)
    attend = _TTTAttend(seq, _positions(seq))
    keys = [(torch.randn(5, 1, 4), torch.randn(5, 1, 4)) for _ in range(3)]
    q = torch.randn(5, 1, 4)
    for j, (k, v) in enumerate(keys):
        attend.step = j
        out = attend(0, q, k, v)
    i = 4
    ks = torch.cat([keys[0][0][:i - 1], keys[1][0][i - 1:i], keys[2][0][i:i + 1]])[:, 0]
    vs = torch.cat([keys[0][1][:i - 1], keys[1][1][i - 1:i], keys[2][1][i:i + 1]])[:, 0]
    w = torch.softmax(ks @ q[i, 0] * 0.5, 0)
    torch.testing.assert_close(out[i, 0], w @ vs, rtol=1e-5, atol=1e-5)


def test_trained_drafter_loads_and_decodes_greedy_tokens(model, data, tmp_path):
    result = train_eagle3(model, data, Eagle3TrainConfig(draft_vocab_size=256, epochs=6, batch_tokens=128, lr=3e-3,
                                                         ttt_steps=3), progress=False)
    assert result.steps == len(result.losses) > 10
    assert sum(result.losses[-3:]) < 0.8 * sum(result.losses[:3]), result.losses
    save_eagle(result.drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 2, 4]
    loaded = load_eagle(tmp_path, model, "eagle3")
    for name in ("fc.weight", "lm_head.weight", "d2t", "norm.weight", "layer.qkv_proj.weight"):
        torch.testing.assert_close(loaded.state_dict()[name], result.drafter.state_dict()[name], rtol=0, atol=0)
    acceptance = evaluate_eagle3(model, loaded, id_requests(3, seed=5), None, max_tokens=16, depth=3, top_k=4,
                                 total_tokens=12, progress=False)
    assert acceptance.equal_to_greedy and acceptance.tokens_per_step >= 1.0
    # LLM(speculative_config=...) (what treedec serve --speculative eagle3 --drafter DIR builds)
    llm = LLM(model, kv_tokens=4096, speculative_config=SpeculativeConfig(method="eagle3", model=str(tmp_path)))
    plain = LLM(model, kv_tokens=4096)
    prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in id_requests(3, seed=7)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] ==
            [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)])


def test_bad_eagle3_settings_and_data_are_refused(model, tmp_path):
    with pytest.raises(ValueError, match="ttt_steps"):
        Eagle3TrainConfig(ttt_steps=0)
    folder = tmp_path / "medusa-data"
    folder.mkdir()
    distill(model, id_requests(2), folder, DistillConfig(params=SamplingParams(temperature=0, max_tokens=4),
                                                         progress=False))
    with pytest.raises(ValueError, match="no EAGLE-3 data"):
        train_eagle3(model, folder, progress=False)
