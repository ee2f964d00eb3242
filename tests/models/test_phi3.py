"""Phi-3 against transformers: fused qkv_proj / gate_up_proj checkpoints, mini-4k's sliding window, the 128k
models' longrope (its long factors: the model's context is past the original one)."""
import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from tests.models.families import check_against_transformers, check_tree_steps, tiny
from treedec.engine import Engine
from treedec.models import ModelConfig, config_from_hf, from_hf_model, from_pretrained, to_hf_config

# Phi3Config derives its head dim (hidden / heads): 256 / 4 = 64, one the engine runs
PHI3 = dict(hidden_size=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
LONGROPE = dict(original_max_position_embeddings=16, rope_scaling={
    "rope_type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(32)],
    "long_factor": [1.0 + 0.5 * i for i in range(32)]})


@pytest.mark.parametrize("fields", [dict(), dict(sliding_window=8), LONGROPE])
def test_tiny_phi3_equals_transformers(fields):
    """mini-4k (window 8 here, on every layer) and 128k-style longrope over 29 tokens, past its original 16
    (transformers then takes the long factors, as treedec always does for a model of 512 positions)."""
    check_against_transformers(tiny(Phi3Config, Phi3ForCausalLM, seed=4, **PHI3, **fields), list(range(3, 60, 2)))


def test_longrope_reads_both_factors_and_the_attention_factor():
    c = config_from_hf(tiny(Phi3Config, Phi3ForCausalLM, **PHI3, **LONGROPE).config)
    s = c.rope_scaling
    assert s.kind == "longrope" and s.original_max_position == 16 and len(s.long_factor) == 32
    assert s.longrope_attention_factor(c.max_position) == pytest.approx((1 + torch.log(torch.tensor(32.0)).item()
                                                                         / torch.log(torch.tensor(16.0)).item()) ** 0.5)


def test_phi3_tree_steps_equal_transformers():
    hf = tiny(Phi3Config, Phi3ForCausalLM, seed=5, **PHI3)
    check_tree_steps(Engine(from_hf_model(hf), kv_tokens=512, page_size=4, backend="torch"), hf)


def test_phi3_checkpoint_loads_its_fused_tensors(tmp_path):
    hf = tiny(Phi3Config, Phi3ForCausalLM, seed=6, **PHI3, sliding_window=2047)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, device="cpu")
    assert torch.equal(model.layers[2].qkv_proj.weight, hf.model.layers[2].self_attn.qkv_proj.weight)
    assert torch.equal(model.layers[2].gate_up_proj.weight, hf.model.layers[2].mlp.gate_up_proj.weight)
    assert [v.window for v in model.attention_variants()] == [2047] * 4
    named = ModelConfig.from_name("phi3-mini-4k")
    assert config_from_hf(to_hf_config(named)) == named
