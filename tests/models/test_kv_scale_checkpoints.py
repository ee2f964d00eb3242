"""An FP8 checkpoint's KV-cache scales (models/kv_scales.py): each of vLLM's names (``k_proj.k_scale`` /
``v_proj.v_scale``, compressed-tensors' ``self_attn.k_scale`` / ``v_scale`` with its ``kv_cache_scheme``, the legacy
``kv_scale``) loads as ``model.kv_scales`` and becomes an fp8 engine's pool scales; a float KV cache ignores them; bad
ones (not one float, not > 0, some layers only, twice, past the layers) are refused naming the tensor, the header
checks before anything is built."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.fp8_checkpoints import write_checkpoints
from tests.models.test_llama import tiny_hf
from treedec.engine import Engine
from treedec.errors import CheckpointError, UnsupportedModelError
from treedec.models import from_pretrained, loading

LAYERS = 2   # tiny_hf's


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvscale")
    tiny_hf("llama", seed=7).save_pretrained(root / "float")
    state = load_file(str(root / "float" / "model.safetensors"))
    config = json.loads((root / "float" / "config.json").read_text())
    fp8, _ = write_checkpoints(state, config, root, "compressed-tensors", "channel", "dynamic")
    return fp8


def with_scales(folder, tmp_path, scales: dict[str, torch.Tensor], kv_scheme=None):
    out = tmp_path / "ckpt"
    out.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, **scales}, str(out / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    if kv_scheme is not None:
        config["quantization_config"]["kv_cache_scheme"] = kv_scheme
    (out / "config.json").write_text(json.dumps(config))
    return out


def names(form: str, layer: int) -> dict[str, str]:
    a = f"model.layers.{layer}.self_attn"
    return {"proj": {"k": f"{a}.k_proj.k_scale", "v": f"{a}.v_proj.v_scale"},
            "attn": {"k": f"{a}.k_scale", "v": f"{a}.v_scale"}, "legacy": {"kv": f"{a}.kv_scale"}}[form]


@pytest.mark.parametrize("form", ["proj", "attn", "legacy"])
def test_each_name_loads_and_becomes_the_fp8_pool_s_scales(fp8_folder, tmp_path, form):
    scales = {}
    for i in range(LAYERS):
        for which, name in names(form, i).items():
            scales[name] = torch.tensor(0.01 * (i + 1) * (2 if which == "v" else 1), dtype=torch.float32).reshape(
                () if form == "proj" else (1,))
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    model = from_pretrained(with_scales(fp8_folder, tmp_path, scales, scheme if form == "attn" else None),
                            device="cpu")
    expected = torch.tensor([[0.01 * (i + 1), 0.01 * (i + 1) * (1 if form == "legacy" else 2)] for i in range(LAYERS)])
    assert torch.allclose(model.kv_scales, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = Engine(model, kv_tokens=256, page_size=16, backend="torch", kv_cache_dtype="fp8")
    assert e.kv_scale_source == "the checkpoint's k_scale / v_scale"
    assert torch.allclose(e.pool.kv_scale, expected[:, :, None].expand(LAYERS, 2, model.config.num_kv_heads))
    assert e.prefill([5, 6, 7]).logits.isfinite().all()
    assert Engine(model, kv_tokens=256, page_size=16, backend="torch").pool.kv_scale is None   # auto: ignored


def test_a_checkpoint_without_scales_has_none(fp8_folder):
    assert from_pretrained(fp8_folder, device="cpu").kv_scales is None


@pytest.mark.parametrize("scales, error, message", [
    ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, CheckpointError, "must be one float"),
    ({"model.layers.9.self_attn.k_scale": torch.ones(1)}, CheckpointError, "the KV scale of layer 9, but the config "
                                                                            "has 2 layers"),
    ({"model.layers.0.self_attn.k_scale": torch.ones(1, dtype=torch.int32)}, CheckpointError, "must be one float"),
])
def test_bad_scale_headers_are_refused_before_anything_is_built(fp8_folder, tmp_path, monkeypatch, scales, error,
                                                                message):
    monkeypatch.setattr(loading, "_empty_model",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("built before the check")))
    with pytest.raises(error, match=message):
        from_pretrained(with_scales(fp8_folder, tmp_path, scales), device="cpu")


@pytest.mark.parametrize("scales, message", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor([-1.0])}, "must be finite and > 0"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor([float("inf")])}, "must be finite and > 0"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor([1.0])}, "KV-cache scales .* for some layers only"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor([1.0]),
      "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(1.0)}, "K scale is given twice"),
])
def test_bad_scale_values_are_refused_naming_them(fp8_folder, tmp_path, scales, message):
    with pytest.raises(CheckpointError, match=message):
        from_pretrained(with_scales(fp8_folder, tmp_path, scales), device="cpu")


def test_a_kv_cache_scheme_treedec_cannot_read_is_refused(fp8_folder, tmp_path):
    with pytest.raises(UnsupportedModelError, match="kv_cache_scheme' is .* treedec reads static per-tensor"):
        from_pretrained(with_scales(fp8_folder, tmp_path, {}, {"num_bits": 4, "type": "int"}), device="cpu")
