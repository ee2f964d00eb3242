"""Loading the decoder: saved HF checkpoints (single file, sharded), in-memory models, random weights."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from tests.test_engine_llama import hf_logits, tiny_hf
from treedec.engine import (MODEL_SIZES, Engine, ModelConfig, from_config, from_hf_model, from_pretrained,
                            to_hf_config, to_hf_state_dict)


def run_steps(model) -> list[torch.Tensor]:
    """Prefill + a branching step; all logits."""
    engine = Engine(model, kv_tokens=256, page_size=4, backend="torch")
    root, first = engine.prefill([5, 9, 2, 7, 1, 3])
    engine.tree.branch(root, [[4], [8, 6]])
    return [first, engine.step()]


@pytest.mark.parametrize("kind,shard", [("llama", None), ("llama", "200KB"), ("qwen2", "200KB")])
def test_from_pretrained_equals_in_memory_model(tmp_path, kind, shard):
    hf = tiny_hf(kind, seed=7)
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    loaded = from_pretrained(tmp_path, device="cpu")
    assert loaded.dtype == torch.float32 and loaded.config == ModelConfig.from_hf(hf.config)
    for a, b in zip(run_steps(loaded), run_steps(from_hf_model(hf))):
        assert torch.equal(a, b)
    torch.testing.assert_close(run_steps(loaded)[0], hf_logits(hf, [5, 9, 2, 7, 1, 3]), atol=1e-4, rtol=0)


def test_from_pretrained_dtype_and_tied_head(tmp_path):
    hf = tiny_hf("qwen2", seed=8)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert model.weight_bytes() == 2 * model.config.num_parameters()


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        from_pretrained("meta-llama/Llama-3.1-8B")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path)


def test_checkpoint_problems_are_named(tmp_path):
    hf = tiny_hf("llama", seed=9)
    hf.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)

    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}, weights)
    with pytest.raises(ValueError, match="lacks 1 tensor.*layers.1.mlp.up_proj"):
        from_pretrained(tmp_path, device="cpu")
    save_file({**state, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, weights)
    with pytest.raises(ValueError, match="does not use.*extra"):
        from_pretrained(tmp_path, device="cpu")
    save_file({**state, "model.norm.weight": torch.zeros(3)}, weights)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\), expected \(128,\)"):
        from_pretrained(tmp_path, device="cpu")
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        from_pretrained(tmp_path, device="cpu")


def test_unsupported_architecture(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="model_type 'gpt2'"):
        from_pretrained(tmp_path, device="cpu")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "gpt2"


def test_from_config_is_seeded():
    a = from_config("tiny", seed=3, dtype=torch.float32, device="cpu")
    b = from_config(MODEL_SIZES["tiny"], seed=3, dtype=torch.float32, device="cpu")
    c = from_config("tiny", seed=4, dtype=torch.float32, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.layers[0].qkv_proj.weight, c.layers[0].qkv_proj.weight)
    assert torch.all(a.norm.weight == 1)
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        from_config("huge")


def test_named_sizes():
    c = ModelConfig.from_name("llama3-8b")
    assert c.num_parameters() == 8_030_261_248   # Llama-3-8B: 16.06 GB in bf16
    assert ModelConfig.from_name("llama3.1-8b").rope_scaling.kind == "llama3"
    assert ModelConfig.from_name("tiny", num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_name("tiny", num_kv_heads=3)


@pytest.mark.parametrize("name", ["tiny", "llama3.1-8b", "qwen2.5-7b", "mistral-7b", "llama2-7b"])
def test_hf_config_round_trip(name):
    config = ModelConfig.from_name(name)
    assert ModelConfig.from_hf(to_hf_config(config)) == config


def test_transformers_model_sharing_treedec_weights():
    """to_hf_state_dict gives views: a transformers model built on them computes what treedec does."""
    model = from_config(ModelConfig.from_name("tiny", vocab_size=256), seed=2, dtype=torch.float32, device="cpu")
    hf_config = to_hf_config(model.config)
    hf_config._attn_implementation = "eager"
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    hf.load_state_dict(to_hf_state_dict(model), assign=True, strict=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)   # its buffers were made on the meta device
    qkv, attn = model.layers[0].qkv_proj.weight, hf.model.layers[0].self_attn
    q_rows = model.config.num_heads * model.config.head_dim
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == qkv[q_rows:].data_ptr()
    engine = Engine(model, kv_tokens=64, backend="torch")
    _, logits = engine.prefill([3, 1, 4, 1, 5])
    torch.testing.assert_close(logits, hf_logits(hf.eval(), [3, 1, 4, 1, 5]), atol=1e-4, rtol=0)
