"""FP8 checkpoints written by the tests, in the formats vLLM reads, from a float state dict (HF names); and the
de-quantized float checkpoint of the same fp8 weights (the reference they must load as).

Formats (:data:`FORMATS`): ``quant_method: "fp8"`` with per-tensor ``weight_scale`` of shape ``()`` (AutoFP8), its
static variant with ``input_scale``; ``compressed-tensors`` ``float-quantized`` with ``strategy: "channel"``
(``weight_scale [rows, 1]``, bf16 as llm-compressor writes it) or ``"tensor"`` (``[1]``), activations dynamic
per token, static per tensor, or none (weight-only). Each ignores ``lm_head`` and layer 1's ``down_proj``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from treedec.models.fp8 import FP8, FP8_MAX, quantize_rows

#: (format, weight strategy, activations) of each checkpoint the tests write.
FORMATS = [("fp8", "tensor", "dynamic"), ("fp8", "tensor", "static"), ("compressed-tensors", "channel", "dynamic"),
           ("compressed-tensors", "tensor", "static"), ("compressed-tensors", "channel", "none")]
IGNORED = "model.layers.1.mlp.down_proj"
_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


def quantization_config(fmt: str, strategy: str, activations: str) -> dict:
    """The ``quantization_config`` of a checkpoint of that format (as AutoFP8 / llm-compressor write them)."""
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": activations, "ignored_layers": ["lm_head", IGNORED]}
    acts = None if activations == "none" else {"num_bits": 8, "type": "float", "symmetric": True,
                                                "dynamic": activations == "dynamic",
                                                "strategy": "token" if activations == "dynamic" else "tensor"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "output_activations": None,
                                          "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                      "dynamic": False, "strategy": strategy}}}}


def fp8_state(state: dict[str, torch.Tensor], fmt: str, strategy: str, activations: str
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(fp8 checkpoint tensors, the de-quantized bf16 tensors of the same weights)`` of a float ``state``."""
    out, ref = {}, {}
    for name, w in state.items():
        if not _PROJECTION.fullmatch(name) or name.startswith(IGNORED):
            out[name] = ref[name] = w.to(torch.bfloat16).contiguous()
            continue
        base = name[:-len("weight")]
        if strategy == "channel":
            q, scale = quantize_rows(w)
        else:
            scale = w.float().abs().amax() / FP8_MAX
            q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out[name] = q.contiguous()
        if strategy == "channel":   # llm-compressor writes per-channel scales in the model dtype
            out[base + "weight_scale"] = scale.to(torch.bfloat16)
            scale = out[base + "weight_scale"].float()
        else:
            out[base + "weight_scale"] = scale.reshape(() if fmt == "fp8" else (1,)).float()
        if activations == "static":
            out[base + "input_scale"] = torch.tensor(0.02).reshape(() if fmt == "fp8" else (1,))
        ref[name] = (q.float() * scale.reshape(-1, 1) if scale.dim() else q.float() * scale).to(torch.bfloat16)
    return out, ref


def write_checkpoints(state: dict[str, torch.Tensor], config: dict, root: Path, fmt: str, strategy: str,
                      activations: str) -> tuple[Path, Path]:
    """Write the fp8 checkpoint of ``state`` (HF names) and ``config`` (a ``config.json`` object) under ``root``
    and its de-quantized bf16 twin; returns ``(fp8 folder, bf16 folder)``."""
    fp8, ref = fp8_state(state, fmt, strategy, activations)
    folders = root / "fp8", root / "dequantized"
    for folder, tensors, extra in ((folders[0], fp8, {"quantization_config":
                                                      quantization_config(fmt, strategy, activations)}),
                                   (folders[1], ref, {})):
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16",
                                                                  **extra}))
    return folders
