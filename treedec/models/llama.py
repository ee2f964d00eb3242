"""The Llama family: Llama 2/3/3.1/3.2, Mistral and Qwen2/2.5 — one block (RMSNorm, GQA attention with RoPE,
SwiGLU MLP), the checkpoints differing in RoPE scaling (Llama 3.1's ``llama3`` rule), projection biases (Qwen2
has q/k/v biases, Llama's ``attention_bias`` covers q/k/v/o) and sliding-window attention (Mistral v0.1 on
every layer; Qwen2 on the layers from ``max_window_layers`` when ``use_sliding_window``)."""
from __future__ import annotations

from treedec.models.config import ModelConfig, RopeScaling
from treedec.models.family import Family
from treedec.models.hf_config import swiglu_fields
from treedec.models.weights import decoder_weights

__all__ = ["FAMILY"]


def config_from_hf(hf_config) -> ModelConfig:
    """Read a transformers ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config`` (4.x or 5.x attributes)."""
    fields, theta, scaling = swiglu_fields(hf_config)
    model_type = fields["model_type"]
    if model_type == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif model_type == "llama":
        qkv_bias = o_bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
    else:
        qkv_bias = o_bias = mlp_bias = False
    return ModelConfig(**fields, rope_theta=float(theta), rope_scaling=scaling, qkv_bias=qkv_bias, o_bias=o_bias,
                       mlp_bias=mlp_bias)


def to_hf_config(config: ModelConfig):
    """The transformers config (``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config``) of ``config``.

    RoPE goes in as ``rope_theta`` + ``rope_scaling``, which transformers 4.x and 5.x both read.
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    c = config
    common = dict(hf_common(c), rope_scaling=hf_rope_scaling(c.rope_scaling))
    biases = (c.qkv_bias, c.o_bias, c.mlp_bias)
    if c.model_type == "llama":
        if c.qkv_bias != c.o_bias:
            raise ValueError(f"LlamaConfig has one attention_bias for q/k/v/o; got qkv_bias={c.qkv_bias}, "
                             f"o_bias={c.o_bias}")
        if c.sliding_window is not None:
            raise ValueError(f"LlamaConfig has no sliding window; got sliding_window={c.sliding_window}")
        return LlamaConfig(**common, attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)
    if c.model_type == "qwen2":
        if biases != (True, False, False):
            raise ValueError(f"Qwen2 has q/k/v biases only; got (qkv, o, mlp) biases {biases}")
        return Qwen2Config(**common, **hf_sliding(c))
    if any(biases):
        raise ValueError(f"Mistral has no biases; got (qkv, o, mlp) biases {biases}")
    if c.layer_types is not None:
        raise ValueError("Mistral's window applies to every layer; got per-layer types")
    return MistralConfig(**common, sliding_window=c.sliding_window)


def hf_common(c: ModelConfig) -> dict:
    """The transformers config fields every family writes alike (sizes, norm eps, positions, RoPE base)."""
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
                max_position_embeddings=c.max_position, rope_theta=c.rope_theta)


def hf_rope_scaling(scaling: RopeScaling | None) -> dict | None:
    """``scaling`` as transformers' ``rope_scaling`` object (None: default RoPE)."""
    if scaling is None:
        return None
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    if scaling.kind == "llama3":
        return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position}
    out = {"rope_type": "longrope", "short_factor": list(scaling.short_factor),
           "long_factor": list(scaling.long_factor), "original_max_position_embeddings": scaling.original_max_position}
    return out if scaling.attention_factor is None else {**out, "attention_factor": scaling.attention_factor}


def hf_sliding(c: ModelConfig) -> dict:
    """Qwen2/3's sliding-window fields: ``use_sliding_window``, ``sliding_window`` and the layers it applies to."""
    if c.sliding_window is None:
        return {"use_sliding_window": False, "sliding_window": None}
    types = ["sliding_attention" if c.layer_window(i) is not None else "full_attention" for i in range(c.num_layers)]
    return {"use_sliding_window": True, "sliding_window": c.sliding_window, "layer_types": types,
            "max_window_layers": types.index("sliding_attention")}


FAMILY = Family(
    name="llama", title="Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    model_types=("llama", "mistral", "qwen2"), gguf_architectures=("llama", "qwen2"),
    config_from_hf=config_from_hf, weight_map=decoder_weights, to_hf_config=to_hf_config,
    tests="tests/models/test_llama.py")
