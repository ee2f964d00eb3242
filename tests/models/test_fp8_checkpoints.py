"""FP8 checkpoints (each format vLLM reads, written by tests/models/fp8_checkpoints.py, with ignored layers) load
as the de-quantized bf16 model of the same fp8 weights: the same logits bit for bit on the CPU (which
de-quantizes, and says so) and the same greedy tokens; quantize-on-load stays close to the float model; bad
scales are refused naming the tensor, before anything is built where the headers show it."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engines import plain_greedy
from tests.models.families import dense_logits
from tests.models.fp8_checkpoints import FORMATS, IGNORED, write_checkpoints
from tests.models.test_llama import tiny_hf
from treedec.errors import CheckpointError, UnsupportedModelError
from treedec.models import from_pretrained, loading, to_hf_state_dict
from treedec.models.fp8 import DEQUANTIZE, FP8, Fp8Linear
from treedec.models.linear import UNQUANTIZED

PROMPT = [5, 17, 3, 99, 42, 7, 250, 31]
# quantize-on-load (fp32 model, per-channel weight scales, de-quantized on the CPU) against the float model: the
# logits' relative error (Frobenius norm; seen 0.056 on this tiny random model, 4 layers of e4m3 rounding, each
# weight within 1/16 of itself) and the largest one relative to the largest logit (seen 0.051)
QUANTIZE_ON_LOAD_TOL, QUANTIZE_ON_LOAD_MAX = 0.1, 0.1


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    """A tiny random Llama (fp32) saved by transformers: (folder, its tensors, its config object)."""
    root = tmp_path_factory.mktemp("fp8") / "float"
    tiny_hf("llama", seed=7).save_pretrained(root)
    return root, load_file(str(root / "model.safetensors")), json.loads((root / "config.json").read_text())


@pytest.fixture(scope="module", params=FORMATS, ids=["-".join(f) for f in FORMATS])
def fp8_pair(request, float_checkpoint, tmp_path_factory):
    _, state, config = float_checkpoint
    return request.param, write_checkpoints(state, config, tmp_path_factory.mktemp("fp8"), *request.param)


def test_fp8_checkpoint_loads_as_its_dequantized_model(fp8_pair, caplog):
    (fmt, strategy, activations), (fp8, dequantized) = fp8_pair
    with caplog.at_level(logging.INFO, logger="treedec"):
        model = from_pretrained(fp8, device="cpu")
    reference = from_pretrained(dequantized, device="cpu")
    assert model.dtype == reference.dtype == torch.bfloat16
    layer0, layer1 = model.layers[0], model.layers[1]
    method = layer0.qkv_proj.method
    assert isinstance(method, Fp8Linear) and (method.source, method.weight_scales) == ("checkpoint", strategy)
    assert method.activations == ("none" if activations == "none" else "dynamic")
    assert layer0.qkv_proj.weight.dtype == FP8 and layer0.down_proj.weight.dtype == FP8
    assert layer1.down_proj.method is UNQUANTIZED and layer1.down_proj.weight.dtype == torch.bfloat16   # ignored
    assert model.lm_head.method is UNQUANTIZED
    n = model.config.num_layers
    assert model.linear_paths() == {DEQUANTIZE: 4 * n - 1, "F.linear": 2}
    assert any(r.levelname == "WARNING" and "de-quantize + F.linear" in r.getMessage() and
               f"{fmt} checkpoint" in r.getMessage() for r in caplog.records)
    assert torch.equal(dense_logits(model, PROMPT), dense_logits(reference, PROMPT))
    assert plain_greedy(model, PROMPT, 8) == plain_greedy(reference, PROMPT, 8)


def test_quantize_on_load_is_close_to_the_float_model(float_checkpoint):
    root = float_checkpoint[0]
    model = from_pretrained(root, dtype=torch.float32, device="cpu", quantization="fp8")
    reference = from_pretrained(root, dtype=torch.float32, device="cpu")
    assert isinstance(model.layers[0].o_proj.method, Fp8Linear) and model.lm_head.method is UNQUANTIZED
    assert model.weight_bytes() < 0.6 * reference.weight_bytes()
    ours, ref = dense_logits(model, PROMPT), dense_logits(reference, PROMPT)
    assert float((ours - ref).norm() / ref.norm()) < QUANTIZE_ON_LOAD_TOL
    assert float((ours - ref).abs().max() / ref.abs().max()) < QUANTIZE_ON_LOAD_MAX
    with pytest.raises(ValueError, match="to_hf_state_dict reads float weights; 8 projection\\(s\\) of this model "
                                         "are quantized"):
        to_hf_state_dict(model)
    with pytest.raises(ValueError, match="quantization must be one of \\['fp8'\\] or None, got 'int4'"):
        from_pretrained(root, device="cpu", quantization="int4")


def test_llm_quantizes_on_load(float_checkpoint, monkeypatch):
    from treedec.llm import LLM
    monkeypatch.setattr("treedec.llm.load_tokenizer", lambda name: None)   # (the tiny checkpoint has none)
    llm = LLM(str(float_checkpoint[0]), device="cpu", quantization="fp8", kv_tokens=64, backend="torch")
    assert isinstance(llm.model.layers[0].qkv_proj.method, Fp8Linear)
    with pytest.raises(ValueError, match="quantization must be one of \\['fp8'\\] or None, got 'fp4'"):
        LLM(str(float_checkpoint[0]), device="cpu", quantization="fp4")
    with pytest.raises(ValueError, match="device, dtype and quantization apply to a model loaded by name"):
        LLM(llm.model, quantization="fp8")


# ================================================================ refused, naming the tensor


@pytest.fixture
def no_allocation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was allocated before the checkpoint was checked")

    monkeypatch.setattr(loading, "_empty_model", refuse)


def _edited(float_checkpoint, tmp_path, fmt, strategy, activations, edit):
    _, state, config = float_checkpoint
    fp8, _ = write_checkpoints(state, config, tmp_path, fmt, strategy, activations)
    tensors = load_file(str(fp8 / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(fp8 / "model.safetensors"))
    return fp8


Q_SCALE = "model.layers.0.self_attn.q_proj.weight_scale"


@pytest.mark.parametrize("fmt, strategy, edit, message", [
    ("compressed-tensors", "channel", lambda t: t.update({Q_SCALE: t[Q_SCALE].reshape(-1)}),
     f"tensor {Q_SCALE} has shape \\(256,\\), expected \\(256, 1\\)"),
    ("compressed-tensors", "channel", lambda t: t.update({Q_SCALE: t[Q_SCALE][:7]}),
     f"tensor {Q_SCALE} has shape \\(7, 1\\), expected \\(256, 1\\)"),
    ("fp8", "tensor", lambda t: t.update({Q_SCALE: torch.ones(3)}),
     f"tensor {Q_SCALE} has shape \\(3,\\), expected \\(\\) or \\(1,\\)"),
    ("fp8", "tensor", lambda t: t.update({Q_SCALE: torch.ones((), dtype=torch.int32)}),
     f"tensor {Q_SCALE} has dtype torch.int32, expected one of \\['torch.float32', 'torch.bfloat16', "
     f"'torch.float16'\\]"),
    ("fp8", "tensor", lambda t: t.pop(Q_SCALE), f"lacks 1 tensor\\(s\\) the config needs, e.g. \\['{Q_SCALE}'\\]"),
    ("fp8", "tensor", lambda t: t.update({"model.layers.0.mlp.up_proj.weight":
                                          t["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)}),
     "tensor model.layers.0.mlp.up_proj.weight has dtype torch.bfloat16, expected one of \\['torch.float8_e4m3fn'\\]"),
    ("fp8", "tensor", lambda t: t.update({f"{IGNORED}.weight_scale": torch.ones(())}),
     f"tensor\\(s\\) this decoder does not use.*{IGNORED}.weight_scale"),   # an ignored layer has no scale
])
def test_bad_scales_are_refused_before_anything_is_built(float_checkpoint, tmp_path, no_allocation, fmt, strategy,
                                                          edit, message):
    fp8 = _edited(float_checkpoint, tmp_path, fmt, strategy, "dynamic", edit)
    with pytest.raises((CheckpointError, UnsupportedModelError), match=message):
        from_pretrained(fp8, device="cpu")


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_scales_that_are_not_finite_and_positive_are_refused_by_name(float_checkpoint, tmp_path, value):
    fp8 = _edited(float_checkpoint, tmp_path, "compressed-tensors", "channel", "dynamic",
                  lambda t: t[Q_SCALE].__setitem__((3, 0), value))
    with pytest.raises(CheckpointError, match=f"tensor {Q_SCALE} must hold finite scales > 0"):
        from_pretrained(fp8, device="cpu")


@pytest.mark.parametrize("changes, message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise fp8 scales \\(weight_scale_inv\\) are not "
                                                               "implemented"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format' is 'pack-quantized'"),
    ({"quant_method": "gptq", "bits": 4}, "quantized with 'gptq': a quantized \\(AWQ, GPTQ, bitsandbytes, ...\\) "
                                          "checkpoint, which treedec does not load; it loads .* fp8 checkpoints"),
])
def test_quantizations_not_implemented_are_refused_by_name(float_checkpoint, tmp_path, no_allocation, changes,
                                                           message):
    _, state, config = float_checkpoint
    fp8, _ = write_checkpoints(state, config, tmp_path, "fp8", "tensor", "dynamic")
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": changes}))
    with pytest.raises(UnsupportedModelError, match=message):
        from_pretrained(fp8, device="cpu")


def test_a_fused_projection_half_ignored_is_refused(float_checkpoint, tmp_path, no_allocation):
    _, state, config = float_checkpoint
    fp8, _ = write_checkpoints(state, config, tmp_path, "fp8", "tensor", "dynamic")
    raw = json.loads((fp8 / "config.json").read_text())
    raw["quantization_config"]["ignored_layers"].append("model.layers.0.self_attn.k_proj")
    (fp8 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="quantizes some of \\['model.layers.0.self_attn.k_proj', "
                                                    "'model.layers.0.self_attn.q_proj', .*layers.0.qkv_proj"):
        from_pretrained(fp8, device="cpu")
