"""The Qwen3 family (dense): Llama's block with a per-head RMSNorm of q and of k before RoPE, an explicit head dim
(often not ``hidden / heads``), q/k/v/o biases when ``attention_bias``, Qwen2's sliding-window layers."""
from __future__ import annotations

from treedec.models.config import ModelConfig
from treedec.models.family import Family
from treedec.models.hf_config import swiglu_fields
from treedec.models.llama import hf_common, hf_rope_scaling, hf_sliding
from treedec.models.weights import decoder_weights

__all__ = ["FAMILY"]


def config_from_hf(hf_config) -> ModelConfig:
    """Read a transformers ``Qwen3Config``."""
    fields, theta, scaling = swiglu_fields(hf_config)
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ModelConfig(**fields, rope_theta=float(theta), rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
                       qk_norm=True)


def to_hf_config(config: ModelConfig):
    """The transformers ``Qwen3Config`` of ``config``."""
    from transformers import Qwen3Config

    c = config
    if c.qkv_bias != c.o_bias or c.mlp_bias:
        raise ValueError(f"Qwen3 has one attention_bias for q/k/v/o and no MLP bias; got (qkv, o, mlp) biases "
                         f"{(c.qkv_bias, c.o_bias, c.mlp_bias)}")
    return Qwen3Config(**hf_common(c), rope_scaling=hf_rope_scaling(c.rope_scaling), attention_bias=c.qkv_bias,
                       **hf_sliding(c))


FAMILY = Family(
    name="qwen3", title="Qwen3 (dense)", architectures=("Qwen3ForCausalLM",), model_types=("qwen3",),
    gguf_architectures=("qwen3",), config_from_hf=config_from_hf, weight_map=decoder_weights,
    to_hf_config=to_hf_config, tests="tests/models/test_qwen3.py")
