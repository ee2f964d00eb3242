"""Gemma 2 and Gemma 3 (text) against transformers: (1 + w) RMSNorms, four a layer, GeLU-tanh, scaled embeddings,
query_pre_attn_scalar, soft-caps (Gemma 2), sliding-window layers with their own RoPE base (Gemma 3)."""
import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from tests.models.families import check_against_transformers, check_tree_steps, tiny
from treedec.engine import Engine
from treedec.models import ModelConfig, config_from_hf, from_hf_model, from_pretrained, to_hf_config

GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
SLIDING = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


@pytest.mark.parametrize("fields", [
    dict(sliding_window=8, query_pre_attn_scalar=48, final_logit_softcapping=5.0, attn_logit_softcapping=3.0),
    dict(sliding_window=64, final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=False),
])
def test_tiny_gemma2_equals_transformers(fields):
    """Soft-capped attention and final logits, windows of 8 on every other layer over 19 tokens."""
    check_against_transformers(tiny(Gemma2Config, Gemma2ForCausalLM, seed=2, **fields), list(range(3, 40, 2)))


@pytest.mark.parametrize("fields", [
    dict(sliding_window=8, query_pre_attn_scalar=48, layer_types=SLIDING, rope_parameters=GEMMA3_ROPE),
    dict(sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
])
def test_tiny_gemma3_equals_transformers(fields):
    """Local layers (window 8, RoPE base 1e4) and a global one (base 1e6, linear x4), q/k norms."""
    check_against_transformers(tiny(Gemma3TextConfig, Gemma3ForCausalLM, seed=3, **fields), list(range(3, 40, 2)))


def test_gemma3_variants_and_config():
    hf = tiny(Gemma3TextConfig, Gemma3ForCausalLM, sliding_window=8, query_pre_attn_scalar=48, layer_types=SLIDING,
              rope_parameters=GEMMA3_ROPE)
    c = config_from_hf(hf.config)
    assert (c.local_rope_theta, c.rope_theta, c.rope_scaling.factor) == (1e4, 1e6, 4.0)
    assert c.layer_types == ("sliding", "sliding", "full", "sliding") and c.qk_norm and c.norm_offset == 1.0
    variants = from_hf_model(hf).attention_variants()
    assert [v.window for v in variants] == [8, 8, None, 8] and {v.sm_scale for v in variants} == {48 ** -0.5}
    for name in ("gemma3-270m", "gemma3-4b", "gemma2-9b"):
        named = ModelConfig.from_name(name)
        assert config_from_hf(to_hf_config(named)) == named, name


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_tree_steps_equal_transformers(kind):
    """Tree steps on the engine, each layer's variant run by its attention group: windows of 4 (local layers) and
    whole paths (global ones) over a 13-token prompt and its branches, query_pre_attn_scalar 48, Gemma 2's
    soft-cap."""
    if kind == "gemma2":
        hf = tiny(Gemma2Config, Gemma2ForCausalLM, seed=4, sliding_window=4, query_pre_attn_scalar=48,
                  attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    else:
        hf = tiny(Gemma3TextConfig, Gemma3ForCausalLM, seed=5, sliding_window=4, query_pre_attn_scalar=48,
                  layer_types=SLIDING, rope_parameters=GEMMA3_ROPE)
    engine = Engine(from_hf_model(hf), kv_tokens=512, page_size=4, backend="torch")
    assert len({v.window for v in engine.model.attention_variants()}) == 2
    check_tree_steps(engine, hf)


def test_gemma3_checkpoint_round_trip(tmp_path):
    hf = tiny(Gemma3TextConfig, Gemma3ForCausalLM, seed=6, sliding_window=8, layer_types=SLIDING,
              rope_parameters=GEMMA3_ROPE)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, device="cpu")
    layer = hf.model.layers[1]
    assert torch.equal(model.layers[1].pre_feedforward_norm.weight, layer.pre_feedforward_layernorm.weight)
    assert torch.equal(model.layers[1].k_norm.weight, layer.self_attn.k_norm.weight)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()   # tied
