"""from_pretrained on hostile or careless checkpoints: every bad config value and every tensor that does not fit
is a CheckpointError naming the file, the key or tensor, the expected and the actual value, raised from the
config and the safetensors headers alone, before the model is allocated."""
import json
import logging
import math
import re
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.test_llama import tiny_hf
from treedec.models import loading
from treedec.models import Decoder, ModelConfig, RopeScaling, config_from_hf, from_pretrained
from treedec.models.checkpoint_headers import hf_tensor_shapes
from treedec.errors import CheckpointError, UnsupportedModelError
from treedec.models.hf_tensors import hf_targets


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama checkpoint (read-only: tests copy it), in one file and in shards."""
    base = tmp_path_factory.mktemp("bad_inputs")
    hf = tiny_hf("llama", seed=12)
    hf.save_pretrained(base / "single")
    hf.save_pretrained(base / "sharded", max_shard_size="200KB")
    return base


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if a model is built: every check must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was allocated before the checkpoint was checked")

    monkeypatch.setattr(loading, "_empty_model", refuse)


def copy_of(saved, tmp_path, layout="single"):
    root = tmp_path / "ckpt"
    shutil.copytree(saved / layout, root)
    return root


def edit_config(root, **changes):
    """Set (or, for the value `...`, remove) top-level fields of config.json."""
    path = root / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return path


NAN, INF = float("nan"), float("inf")
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# (config.json changes, what the message must say after "config.json: ")
BAD_CONFIGS = [
    ({"hidden_size": "abc"}, "field 'hidden_size' must be a positive int, got str 'abc'"),
    ({"hidden_size": [128]}, "field 'hidden_size' must be a positive int, got list \\[128\\]"),
    ({"hidden_size": 128.0}, "field 'hidden_size' must be a positive int, got float 128.0"),
    ({"hidden_size": True}, "field 'hidden_size' must be a positive int, got bool True"),
    ({"hidden_size": None}, "field 'hidden_size' must be a positive int, got NoneType None"),
    ({"hidden_size": 0}, "field 'hidden_size' must be a positive int, got int 0"),
    ({"num_attention_heads": 0}, "field 'num_attention_heads' must be a positive int, got int 0"),
    ({"num_attention_heads": -4}, "field 'num_attention_heads' must be a positive int, got int -4"),
    ({"vocab_size": -1}, "field 'vocab_size' must be a positive int, got int -1"),
    ({"vocab_size": 0}, "field 'vocab_size' must be a positive int, got int 0"),
    ({"vocab_size": "256"}, "field 'vocab_size' must be a positive int, got str '256'"),
    ({"intermediate_size": {"a": 1}}, "field 'intermediate_size' must be a positive int, got dict"),
    ({"num_hidden_layers": [2]}, "field 'num_hidden_layers' must be a positive int, got list \\[2\\]"),
    ({"num_hidden_layers": 2.5}, "field 'num_hidden_layers' must be a positive int, got float 2.5"),
    ({"num_hidden_layers": -1}, "field 'num_hidden_layers' must be a positive int, got int -1"),
    ({"max_position_embeddings": 0}, "field 'max_position_embeddings' must be a positive int, got int 0"),
    ({"num_key_value_heads": 3}, "field 'num_attention_heads' \\(4\\) must be a multiple of field "
                                 "'num_key_value_heads' \\(3\\)"),
    ({"num_key_value_heads": 8}, "must be a multiple of field 'num_key_value_heads' \\(8\\)"),
    ({"num_key_value_heads": 0}, "field 'num_key_value_heads' must be a positive int or null, got int 0"),
    ({"num_key_value_heads": "2"}, "field 'num_key_value_heads' must be a positive int or null, got str '2'"),
    ({"head_dim": 63}, "field 'head_dim' must be even \\(RoPE rotates pairs\\), got 63"),
    ({"head_dim": 0}, "field 'head_dim' must be a positive int or null, got int 0"),
    ({"head_dim": "64"}, "field 'head_dim' must be a positive int or null, got str '64'"),
    ({"head_dim": ..., "hidden_size": 130}, "field 'hidden_size' \\(130\\) must be a multiple of field "
                                            "'num_attention_heads' \\(4\\) when field 'head_dim' is not given"),
    ({"head_dim": None, "hidden_size": 102}, "must be a multiple of field 'num_attention_heads' \\(4\\) when"),
    ({"head_dim": None, "hidden_size": 12, "num_attention_heads": 4}, "field 'hidden_size' / field "
                                                                     "'num_attention_heads' .*must be even"),
    ({"tie_word_embeddings": "yes"}, "field 'tie_word_embeddings' must be true or false, got str 'yes'"),
    ({"attention_bias": 1}, "field 'attention_bias' must be true or false, got int 1"),
    ({"mlp_bias": None}, "field 'mlp_bias' must be true or false, got NoneType None"),
    ({"sliding_window": -5}, "field 'sliding_window' must be a positive int or null, got int -5"),
    ({"rms_norm_eps": -1e-5}, "field 'rms_norm_eps' must be a finite number > 0, got float -1e-05"),
    ({"rms_norm_eps": 0.0}, "field 'rms_norm_eps' must be a finite number > 0, got float 0.0"),
    ({"rms_norm_eps": NAN}, "field 'rms_norm_eps' must be a finite number > 0, got float nan"),
    ({"rms_norm_eps": INF}, "field 'rms_norm_eps' must be a finite number > 0, got float inf"),
    ({"rms_norm_eps": -INF}, "field 'rms_norm_eps' must be a finite number > 0, got float -inf"),
    ({"rms_norm_eps": "1e-5"}, "field 'rms_norm_eps' must be a finite number > 0, got str '1e-5'"),
    ({"rms_norm_eps": True}, "field 'rms_norm_eps' must be a finite number > 0, got bool True"),
    ({"rms_norm_eps": None}, "field 'rms_norm_eps' must be a finite number > 0, got NoneType None"),
    ({"rms_norm_eps": [1e-5]}, "field 'rms_norm_eps' must be a finite number > 0, got list"),
    ({"rope_parameters": {**LLAMA3, "rope_theta": -1.0}},
     "field 'rope_parameters.rope_theta' must be a finite number > 0, got float -1.0"),
    ({"rope_parameters": {**LLAMA3, "rope_theta": 0}},
     "field 'rope_parameters.rope_theta' must be a finite number > 0, got int 0"),
    ({"rope_parameters": {**LLAMA3, "rope_theta": NAN}}, "'rope_parameters.rope_theta' .* got float nan"),
    ({"rope_parameters": {**LLAMA3, "rope_theta": INF}}, "'rope_parameters.rope_theta' .* got float inf"),
    ({"rope_parameters": {**LLAMA3, "rope_theta": "1e4"}}, "'rope_parameters.rope_theta' .* got str '1e4'"),
    ({"rope_parameters": {**LLAMA3, "rope_theta": False}}, "'rope_parameters.rope_theta' .* got bool False"),
    ({"rope_parameters": ..., "rope_theta": -10000.0}, "field 'rope_theta' must be a finite number > 0, got "
                                                         "float -10000.0"),
    ({"rope_parameters": ..., "rope_theta": NAN}, "field 'rope_theta' must be a finite number > 0, got float nan"),
    ({"rope_parameters": [10000.0]}, "field 'rope_parameters' must be an object or null, got list"),
    ({"rope_parameters": "llama3"}, "field 'rope_parameters' must be an object or null, got str 'llama3'"),
    ({"rope_parameters": ..., "rope_scaling": 8}, "field 'rope_scaling' must be an object or null, got int 8"),
    ({"rope_parameters": {**LLAMA3, "factor": NAN}}, "'rope_parameters.factor' must be a finite number > 0, got "
                                                     "float nan"),
    ({"rope_parameters": {**LLAMA3, "factor": "8"}}, "'rope_parameters.factor' .* got str '8'"),
    ({"rope_parameters": {**LLAMA3, "factor": -8.0}}, "'rope_parameters.factor' .* got float -8.0"),
    ({"rope_parameters": {**LLAMA3, "low_freq_factor": INF}}, "'rope_parameters.low_freq_factor' .* got float inf"),
    ({"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 0}},
     "'rope_parameters.original_max_position_embeddings' must be a positive int, got int 0"),
    ({"rope_parameters": {**LLAMA3, "rope_type": 3}}, "'rope_parameters.rope_type' must be a string, got int 3"),
    ({"hidden_act": ["silu"]}, "field 'hidden_act' must be a string, got list"),
    # issue 48 item 13: finite and > 0, but garbage (no NaN): refused by name
    ({"rms_norm_eps": 1e308}, "field 'rms_norm_eps' must be at most 0.01 \\(checkpoints use .*\\), got 1e\\+308"),
    ({"rms_norm_eps": 0.5}, "field 'rms_norm_eps' must be at most 0.01"),
    ({"rope_parameters": {**LLAMA3, "factor": 1e308}}, "field 'rope_parameters.factor' must be at most 1024 "
                                                       "\\(a RoPE scaling factor .*\\), got 1e\\+308"),
    ({"rope_parameters": {**LLAMA3, "factor": 0.25}}, "field 'rope_parameters.factor' must be at least 1.0"),
    ({"rope_parameters": {**LLAMA3, "rope_theta": 1e308}}, "field 'rope_parameters.rope_theta' must be at most 1e\\+12"),
    ({"rope_parameters": ..., "rope_theta": 1e300}, "field 'rope_theta' must be at most 1e\\+12"),
    ({"rope_parameters": {**LLAMA3, "high_freq_factor": 1e30}}, "'rope_parameters.high_freq_factor' must be at most"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e308}}},
     "field 'rope_parameters.full_attention.rope_theta' must be at most 1e\\+12"),
    ({"rope_parameters": ..., "rope_scaling": {"rope_type": "linear", "factor": 1e308}},
     "field 'rope_scaling.factor' must be at most 1024"),
    # a default transformers takes that is known wrong for the checkpoint: refused
    ({"rope_parameters": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}},
     "field 'rope_parameters.rope_type' is 'llama3' .* no field 'rope_theta': transformers' default base "
     "\\(10000\\) is not these checkpoints' \\(500000\\)"),
]


@pytest.mark.parametrize("changes, message", BAD_CONFIGS, ids=[str(c) for c, _ in BAD_CONFIGS])
def test_bad_config_values_are_named_before_allocation(saved, tmp_path, no_allocation, changes, message):
    root = copy_of(saved, tmp_path)
    config = edit_config(root, **changes)
    with pytest.raises(CheckpointError, match=message) as e:
        from_pretrained(root, device="cpu")
    assert str(e.value).startswith(f"{config}: "), e.value


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 100_000}, "lacks 899982 tensor\\(s\\) the config needs, e.g. \\['model.layers.2."),
    ({"num_hidden_layers": 10 ** 12}, "lacks 8999999999982 tensor\\(s\\)"),
    ({"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
      "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 32000},    # a 7B config beside tiny weights
     "checkpoint tensor (lm_head|model.embed_tokens).weight has shape \\(256, 128\\), expected \\(32000, 4096\\)"),
    ({"vocab_size": 10 ** 15}, "(lm_head|model.embed_tokens).weight has shape \\(256, 128\\), expected "
                               "\\(1000000000000000, 128\\)"),
    ({"intermediate_size": 10 ** 9}, "mlp.(gate|up|down)_proj.weight has shape \\(\\d+, \\d+\\), expected "
                                     "\\((1000000000, 128|128, 1000000000)\\)"),
])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_config_larger_than_its_weights_fails_fast(saved, tmp_path, no_allocation, changes, message, layout):
    """Item 5 of issue 34: the header check, not a model of the config's size, finds the mismatch."""
    root = copy_of(saved, tmp_path, layout)
    edit_config(root, **changes)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=message):
        from_pretrained(root, device="cpu")
    assert time.monotonic() - start < 5


def _rewrite_tensor(root, name, make):
    """Replace (make returns a tensor) or drop (make returns None) tensor ``name`` in whichever shard holds it."""
    for shard in sorted(root.glob("*.safetensors")):
        state = load_file(shard)
        if name in state:
            value = make(state[name])
            if value is None:
                del state[name]
            else:
                state[name] = value
            save_file(state, shard)
            return shard
    raise AssertionError(f"no shard holds {name}")


@pytest.mark.parametrize("name, make, message", [
    ("model.norm.weight", lambda t: t[:3], "{shard}: checkpoint tensor model.norm.weight has shape \\(3,\\), "
                                           "expected \\(128,\\)"),
    ("model.layers.1.self_attn.k_proj.weight", lambda t: t[:, :64].contiguous(), "{shard}: checkpoint tensor "
     "model.layers.1.self_attn.k_proj.weight has shape \\(128, 64\\), expected \\(128, 128\\)"),
    ("model.layers.1.mlp.up_proj.weight", lambda t: t[None], "model.layers.1.mlp.up_proj.weight has shape "
                                                             "\\(1, 256, 128\\), expected \\(256, 128\\)"),
    ("model.layers.0.input_layernorm.weight", lambda t: t.to(torch.int64), "{shard}: tensor "
     "model.layers.0.input_layernorm.weight has dtype torch.int64, expected one of"),
    ("model.layers.0.input_layernorm.weight", lambda t: t.to(torch.bool), "has dtype torch.bool, expected one of"),
    ("model.layers.0.input_layernorm.weight", lambda t: t.to(torch.float64), "has dtype torch.float64, expected"),
    ("model.layers.0.input_layernorm.weight", lambda t: t.to(torch.uint8), "has dtype torch.uint8, expected"),
    ("model.embed_tokens.weight", lambda t: None, "{root}: the checkpoint lacks 1 tensor\\(s\\) the config needs, "
                                                  "e.g. \\['model.embed_tokens.weight'\\]"),
    ("lm_head.weight", lambda t: None, "lacks 1 tensor.*lm_head.weight"),
    ("model.layers.1.mlp.down_proj.weight", lambda t: None, "lacks 1 tensor.*layers.1.mlp.down_proj.weight"),
])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_tensors_are_checked_from_the_headers_before_allocation(saved, tmp_path, no_allocation, name, make, message,
                                                                layout):
    root = copy_of(saved, tmp_path, layout)
    shard = _rewrite_tensor(root, name, make)
    with pytest.raises(CheckpointError, match=message.format(shard=shard, root=root)):
        from_pretrained(root, device="cpu")


@pytest.mark.parametrize("extra, message", [
    ({"model.layers.2.mlp.up_proj.weight": torch.zeros(256, 128)}, "does not use, e.g. "
                                                                   "\\['model.layers.2.mlp.up_proj.weight'\\]"),
    ({"model.layers.01.mlp.up_proj.weight": torch.zeros(256, 128)}, "does not use.*model.layers.01.mlp"),
    ({"model.layers.0.self_attn.q_proj.bias": torch.zeros(256)}, "does not use.*q_proj.bias"),
    ({"model.vision_tower.weight": torch.zeros(2)}, "does not use.*vision_tower"),
    ({"model.norm.weight": torch.ones(128)}, "tensor model.norm.weight is stored twice"),
])
def test_unknown_and_repeated_tensors_are_named_before_allocation(saved, tmp_path, no_allocation, extra, message):
    root = copy_of(saved, tmp_path, "sharded")
    shard = sorted(root.glob("*.safetensors"))[0]
    if "model.norm.weight" in load_file(shard):
        shard = sorted(root.glob("*.safetensors"))[1]
    save_file({**load_file(shard), **extra}, shard)
    with pytest.raises(CheckpointError, match=message):
        from_pretrained(root, device="cpu")


def test_ignored_tensors_still_load(saved, tmp_path):
    """Tensors some checkpoints carry and the decoder recomputes (rotary inv_freq), or a tied head's copy."""
    root = copy_of(saved, tmp_path)
    shard = root / "model.safetensors"
    save_file({**load_file(shard), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)}, shard)
    assert from_pretrained(root, device="cpu").config.num_layers == 2
    edit_config(root, tie_word_embeddings=True)
    model = from_pretrained(root, device="cpu")   # its lm_head.weight is ignored: the head is the embedding
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("kind, tie, mlp_bias", [("llama", False, False), ("llama", True, True),
                                                 ("qwen2", True, False), ("mistral", False, False)])
def test_header_shapes_are_the_model_s(kind, tie, mlp_bias):
    """hf_tensor_shapes (arithmetic, no model) gives every tensor hf_targets loads, with the model's shapes."""
    config = config_from_hf(tiny_hf(kind, seed=1, tie_word_embeddings=tie,
                                         **({"mlp_bias": mlp_bias} if kind == "llama" else {})).config)
    with torch.device("meta"):
        model = Decoder(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {hf: tuple(params[p][rows].shape) for hf, (p, rows) in hf_targets(config).items()}
    assert dict(hf_tensor_shapes(config)) == expected


# ================================================================ defaults that used to be silent


@pytest.mark.parametrize("changes, key, value", [
    ({"rms_norm_eps": ...}, "rms_norm_eps", "1e-06"),
    ({"rope_parameters": ...}, "rope_theta", "10000.0"),
    ({"rope_parameters": {"rope_type": "default"}}, "rope_theta", "10000.0"),
])
def test_missing_eps_and_theta_take_transformers_defaults_with_a_warning(saved, tmp_path, caplog, changes, key,
                                                                           value):
    root = copy_of(saved, tmp_path)
    config = edit_config(root, **changes)
    with caplog.at_level(logging.WARNING, logger="treedec"):
        model = from_pretrained(root, device="cpu")
    assert getattr(model.config, key) == float(value)
    warnings = [r.getMessage() for r in caplog.records if r.name == "treedec" and r.levelno == logging.WARNING]
    assert any(str(config) in w and f"'{key}'" in w and value in w and "for a llama model" in w
               and "as transformers does" in w for w in warnings), warnings


def test_a_complete_config_loads_without_warnings(saved, tmp_path, caplog):
    root = copy_of(saved, tmp_path)
    with caplog.at_level(logging.WARNING, logger="treedec"):
        from_pretrained(root, device="cpu")
    assert not [r for r in caplog.records if r.name == "treedec"]


# ================================================================ ModelConfig and RopeScaling themselves


@pytest.mark.parametrize("field, value", [("rope_theta", 0.0), ("rope_theta", -1.0), ("rope_theta", NAN),
                                          ("rope_theta", INF), ("rms_norm_eps", -1e-5), ("rms_norm_eps", NAN),
                                          ("rms_norm_eps", 0.0), ("rms_norm_eps", INF), ("rms_norm_eps", "1e-5"),
                                          ("rope_theta", True)])
def test_model_config_refuses_nan_producing_values(field, value):
    with pytest.raises(ValueError, match=f"ModelConfig.{field} must be a finite number > 0, got {value!r}"):
        ModelConfig.from_name("tiny", **{field: value})


@pytest.mark.parametrize("field, value, message", [("rms_norm_eps", 1e308, "at most 0.01"),
                                                   ("rope_theta", 1e300, "at most 1e\\+12")])
def test_model_config_refuses_values_out_of_range(field, value, message):
    with pytest.raises(ValueError, match=f"ModelConfig.{field} must be {message} .*got {re.escape(repr(value))}"):
        ModelConfig.from_name("tiny", **{field: value})
    with pytest.raises(ValueError, match="RopeScaling.factor must be at most 1024"):
        RopeScaling("llama3", 1e308)


@pytest.mark.parametrize("kwargs", [{"factor": NAN}, {"factor": INF}, {"factor": 8.0, "low_freq_factor": NAN},
                                    {"factor": 8.0, "high_freq_factor": INF}])
def test_rope_scaling_refuses_nan(kwargs):
    with pytest.raises(ValueError, match="RopeScaling"):
        RopeScaling("llama3", **kwargs)
    assert math.isfinite(RopeScaling("llama3", 8.0).factor)


# ================================================================ what treedec does not run (issue 48's front door)


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}


def _awq_tensors(root):
    """Replace each projection's weight by AWQ's packed parts (qweight, qzeros, scales), as AutoAWQ saves them."""
    shard = root / "model.safetensors"
    state = load_file(shard)
    for name in [n for n in state if "_proj.weight" in n]:
        rows, cols = state.pop(name).shape
        base = name[:-len("weight")]
        state.update({base + "qweight": torch.zeros(cols, rows // 8, dtype=torch.int32),
                      base + "qzeros": torch.zeros(1, rows // 8, dtype=torch.int32),
                      base + "scales": torch.ones(1, rows, dtype=torch.float16)})
    save_file(state, shard)


def test_a_quantized_checkpoint_is_refused_as_one(saved, tmp_path, no_allocation):
    root = copy_of(saved, tmp_path)
    _awq_tensors(root)
    config = edit_config(root, quantization_config=AWQ)
    with pytest.raises(UnsupportedModelError, match=f"{config}: field 'quantization_config' says the weights are "
                                                    f"quantized with 'awq': a quantized \\(AWQ, GPTQ, .*\\) checkpoint, "
                                                    f"which treedec does not load; it loads float32, float16 and "
                                                    f"bfloat16 weights and fp8 checkpoints"):
        from_pretrained(root, device="cpu")
    edit_config(root, quantization_config=...)   # the tensors alone say it
    with pytest.raises(UnsupportedModelError, match=f"{root}: its tensors .*qweight.* says the weights are quantized: "
                                                    f"a quantized .*checkpoint"):
        from_pretrained(root, device="cpu")


def test_a_quantization_config_over_plain_weights_is_refused(saved, tmp_path, no_allocation):
    """The weights load, but the config says they are fp8: refused by the header check, naming a tensor, not
    loaded silently."""
    root = copy_of(saved, tmp_path)
    edit_config(root, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(CheckpointError, match="tensor model.layers.0.* has dtype torch.float32, expected one of "
                                              "\\['torch.float8_e4m3fn'\\]"):
        from_pretrained(root, device="cpu")


def test_an_unsupported_family_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=f"{tmp_path / 'config.json'}: model_type 'gpt2' \\(architectures "
                                                    f"\\['GPT2LMHeadModel'\\]\\) is not supported; treedec runs Llama "
                                                    f".*: LlamaForCausalLM, .*Gemma3ForCausalLM"):
        from_pretrained(tmp_path, device="cpu")
