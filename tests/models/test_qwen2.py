"""Qwen2's per-layer sliding window as transformers reads it: with ``use_sliding_window`` the layers from
``max_window_layers`` on attend to their last ``sliding_window`` keys, the ones before it to their whole path;
without it no layer slides whatever ``sliding_window`` says."""
import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

from tests.models.families import check_against_transformers, check_tree_steps, tiny
from treedec.engine import Engine
from treedec.models import config_from_hf, from_hf_model, from_pretrained
from treedec.models.llama import FAMILY


@pytest.mark.parametrize("max_window_layers", [0, 1, 3])
def test_tiny_qwen2_per_layer_window_equals_transformers(max_window_layers):
    """Windows of 5 over 40 tokens: each position's logits and 8 greedy tokens == transformers."""
    hf = tiny(Qwen2Config, Qwen2ForCausalLM, seed=1, use_sliding_window=True, sliding_window=5,
              max_window_layers=max_window_layers)
    expected = [None] * max_window_layers + [5] * (4 - max_window_layers)
    assert [v.window for v in from_hf_model(hf).attention_variants()] == expected
    check_against_transformers(hf, list(range(3, 83, 2)))


def test_qwen2_window_off_keeps_every_layer_global():
    c = config_from_hf(Qwen2Config(use_sliding_window=False, sliding_window=5, max_window_layers=0))
    assert c.sliding_window is None and c.layer_types is None


def test_qwen2_per_layer_window_tree_steps_and_round_trip(tmp_path):
    hf = tiny(Qwen2Config, Qwen2ForCausalLM, seed=2, use_sliding_window=True, sliding_window=6, max_window_layers=2)
    c = config_from_hf(hf.config)
    assert c.model_type == "qwen2" and c.layer_types == ("full", "full", "sliding", "sliding")
    check_tree_steps(Engine(from_hf_model(hf), kv_tokens=512, page_size=4, backend="torch"), hf)
    back = FAMILY.to_hf_config(c)
    assert (back.use_sliding_window, back.sliding_window, back.max_window_layers) == (True, 6, 2)
    hf.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, device="cpu")
    assert loaded.config == c
    torch.testing.assert_close(loaded.embed_tokens.weight, hf.model.embed_tokens.weight)
