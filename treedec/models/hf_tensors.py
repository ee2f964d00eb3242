"""Hugging Face tensor names onto treedec's (fused) Llama parameters, and the copy of named tensors into a model:
what :mod:`~treedec.models.loading` (whole checkpoints) and :mod:`~treedec.models.tensor_parallel` (a rank's
slices) share, so that neither imports the other back."""
from __future__ import annotations

from typing import Iterable

import torch

from treedec.errors import CheckpointError
from treedec.models.checkpoint_headers import IGNORED_TENSORS, unused_tensors_error
from treedec.models.config import ModelConfig
from treedec.models.llama import Llama

__all__ = ["hf_targets", "init_random_", "load_hf_tensors", "safetensors_device"]

_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.o_proj.weight": "o_proj.weight", "self_attn.o_proj.bias": "o_proj.bias",
    "mlp.down_proj.weight": "down_proj.weight", "mlp.down_proj.bias": "down_proj.bias",
}
_FUSED = {  # HF projection -> (treedec parameter, which part)
    "self_attn.q_proj": ("qkv_proj", "q"), "self_attn.k_proj": ("qkv_proj", "k"),
    "self_attn.v_proj": ("qkv_proj", "v"), "mlp.gate_proj": ("gate_up_proj", "gate"),
    "mlp.up_proj": ("gate_up_proj", "up"),
}


def init_random_(name: str, param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill ``param`` (named ``name``) as :func:`from_config` does: norms 1, biases 0, the rest ~ N(0, std)."""
    if name.endswith("norm.weight"):
        param.fill_(1.0)
    elif name.endswith(".bias"):
        param.zero_()
    else:
        param.normal_(0.0, std, generator=generator)


def safetensors_device(device: torch.device) -> str:
    """safetensors opens tensors straight on "cpu" or "cuda:<index>" (no CPU copy for a GPU)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
    return str(device)


def hf_targets(config: ModelConfig) -> dict[str, tuple[str, slice]]:
    """HF tensor name -> (treedec parameter name, rows of it) for every tensor the config needs."""
    c = config
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    parts = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv),
             "gate": slice(0, inter), "up": slice(inter, 2 * inter)}
    full = slice(None)
    out = {"model.embed_tokens.weight": ("embed_tokens.weight", full), "model.norm.weight": ("norm.weight", full)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", full)
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        for hf, ours in _LAYER_NAMES.items():
            if hf.endswith(".bias") and not (c.o_bias if "o_proj" in hf else c.mlp_bias):
                continue
            out[pre + hf] = (f"layers.{i}.{ours}", full)
        for hf, (ours, part) in _FUSED.items():
            bias = c.qkv_bias if ours == "qkv_proj" else c.mlp_bias
            for kind in ("weight", "bias") if bias else ("weight",):
                out[f"{pre}{hf}.{kind}"] = (f"layers.{i}.{ours}.{kind}", parts[part])
    return out


def load_hf_tensors(model: Llama, tensors: Iterable[tuple[str, torch.Tensor, str]], source: str,
                    dtypes: tuple[torch.dtype, ...] | None = None,
                    targets: dict[str, tuple[str, slice]] | None = None) -> None:
    """Copy HF-named (name, tensor, file) into ``model``; every needed tensor exactly once, no unknown names.

    ``dtypes``: the tensor dtypes accepted (None: any; a copy converts). ``targets``: HF name ->
    (parameter, rows), default :func:`hf_targets` of the model's config.
    """
    targets = hf_targets(model.config) if targets is None else targets
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: dict[str, str] = {}
    unexpected = []
    with torch.no_grad():
        for name, tensor, file in tensors:
            if name not in targets:
                tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
                if not IGNORED_TENSORS.fullmatch(name) and not tied_head:
                    unexpected.append(name)
                continue
            if name in seen:
                raise CheckpointError(f"{file}: tensor {name} is stored twice (also in {seen[name]})")
            if dtypes is not None and tensor.dtype not in dtypes:
                raise CheckpointError(f"{file}: tensor {name} has dtype {tensor.dtype}, expected one of "
                                      f"{[str(d) for d in dtypes]}")
            param_name, rows = targets[name]
            dst = params[param_name][rows]
            if tuple(tensor.shape) != tuple(dst.shape):
                raise CheckpointError(f"{file}: checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
                                      f"{tuple(dst.shape)} for the config {model.config}")
            dst.copy_(tensor)
            seen[name] = file
    if unexpected:
        raise unused_tensors_error(source, unexpected)
    missing = sorted(set(targets) - set(seen))
    if missing:
        raise CheckpointError(f"{source}: the checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
                              f"{missing[:5]}")
