"""Qwen3 (dense) against transformers: per-head q/k RMSNorm, an explicit head dim, biases, sliding layers."""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.models.families import check_against_transformers, check_tree_steps, tiny
from treedec.engine import Engine
from treedec.models import ModelConfig, config_from_hf, from_hf_model, from_pretrained, to_hf_config


@pytest.mark.parametrize("fields", [dict(rms_norm_eps=1e-6), dict(attention_bias=True, tie_word_embeddings=True),
                                    dict(use_sliding_window=True, sliding_window=6, max_window_layers=2),
                                    dict(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})])
def test_tiny_qwen3_equals_transformers(fields):
    check_against_transformers(tiny(Qwen3Config, Qwen3ForCausalLM, seed=1, **fields), list(range(3, 40, 2)))


def test_qwen3_tree_steps_equal_transformers():
    hf = tiny(Qwen3Config, Qwen3ForCausalLM, seed=2)
    check_tree_steps(Engine(from_hf_model(hf), kv_tokens=512, page_size=4, backend="torch"), hf)


def test_qwen3_reads_its_config_and_checkpoint(tmp_path):
    hf = tiny(Qwen3Config, Qwen3ForCausalLM, seed=3, use_sliding_window=True, sliding_window=6, max_window_layers=2)
    c = config_from_hf(hf.config)
    assert c.qk_norm and c.model_type == "qwen3" and c.layer_types == ("full", "full", "sliding", "sliding")
    assert [v.window for v in from_hf_model(hf).attention_variants()] == [None, None, 6, 6]
    hf.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, device="cpu")
    assert loaded.config == c and torch.equal(loaded.layers[1].q_norm.weight, hf.model.layers[1].self_attn.q_norm.weight)
    assert config_from_hf(to_hf_config(ModelConfig.from_name("qwen3-8b"))) == ModelConfig.from_name("qwen3-8b")
