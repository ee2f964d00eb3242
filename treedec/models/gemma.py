"""The Gemma 2 and Gemma 3 (text) families: four ``(1 + w)`` RMSNorms a layer (before and after attention and
the MLP), GeLU-tanh, embeddings times ``sqrt(hidden_size)``, the attention scale ``query_pre_attn_scalar ** -0.5``,
local sliding-window layers alternating with global ones.

- Gemma 2: every other layer local; attention logits soft-capped (``attn_logit_softcapping``, 50) and the final
  logits too (``final_logit_softcapping``, 30).
- Gemma 3: five local layers to each global one, the local layers with their own RoPE base
  (``rope_local_base_freq``, 10000; the global ones ``rope_theta``, 1e6, linearly scaled from 4B up), per-head
  q/k norms; no soft-caps (unless the config sets them).

The soft-cap and the windows are the layers' attention variants (the engine's attention runs them).
"""
from __future__ import annotations

from treedec.errors import UnsupportedModelError
from treedec.models.config import ModelConfig
from treedec.models.family import Family
from treedec.models.hf_config import common_fields, rope_from_hf
from treedec.models.llama import hf_common, hf_rope_scaling
from treedec.models.weights import decoder_weights

__all__ = ["GEMMA2", "GEMMA3"]

# transformers' names of the activation (hidden_activation) for GeLU with the tanh approximation
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def gemma2_config_from_hf(hf_config) -> ModelConfig:
    """Read a transformers ``Gemma2Config``."""
    fields = _gemma_fields(hf_config)
    theta, scaling = rope_from_hf(hf_config, head_dim=fields["head_dim"])
    return ModelConfig(**fields, rope_theta=float(theta), rope_scaling=scaling)


def gemma3_config_from_hf(hf_config) -> ModelConfig:
    """Read a transformers ``Gemma3TextConfig`` (its ``rope_parameters`` per layer type: ``full_attention``,
    ``sliding_attention``)."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention (Gemma 3 embedding models) is not supported: "
                                    "treedec decodes causally")
    fields = _gemma_fields(hf_config)
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta, scaling = rope_from_hf(hf_config, params.get("full_attention"), fields["head_dim"])
    local = None
    if fields["sliding_window"] is not None:
        local, local_scaling = rope_from_hf(hf_config, params.get("sliding_attention"), fields["head_dim"])
        if local_scaling is not None:
            raise UnsupportedModelError(f"a scaled RoPE on Gemma 3's sliding layers ({local_scaling.kind}) is not "
                                        f"supported (their RoPE is the default one)")
    return ModelConfig(**fields, rope_theta=float(theta), rope_scaling=scaling, qk_norm=True,
                       local_rope_theta=None if local is None else float(local))


def _gemma_fields(hf_config) -> dict:
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    if act not in _GELU_TANH:
        raise UnsupportedModelError(f"hidden_activation {act!r} is not supported (Gemma's GeLU-tanh, "
                                    f"{_GELU_TANH[0]!r})")
    bias = bool(getattr(hf_config, "attention_bias", False))
    final, attn = getattr(hf_config, "final_logit_softcapping", None), getattr(hf_config, "attn_logit_softcapping",
                                                                              None)
    return dict(common_fields(hf_config), qkv_bias=bias, o_bias=bias, norm_offset=1.0, sandwich_norms=True,
                activation="gelu_tanh", embed_scale=True, query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
                final_logit_softcap=None if final is None else float(final),
                attn_logit_softcap=None if attn is None else float(attn))


def gemma2_to_hf_config(config: ModelConfig):
    """The transformers ``Gemma2Config`` of ``config``."""
    from transformers import Gemma2Config

    return Gemma2Config(**_hf_gemma(config), rope_scaling=hf_rope_scaling(config.rope_scaling))


def gemma3_to_hf_config(config: ModelConfig):
    """The transformers ``Gemma3TextConfig`` of ``config``."""
    from transformers import Gemma3TextConfig

    c = config
    full = {"rope_type": "default", **(hf_rope_scaling(c.rope_scaling) or {}), "rope_theta": c.rope_theta}
    sliding = {"rope_type": "default", "rope_theta": c.rope_theta if c.local_rope_theta is None
               else c.local_rope_theta}
    fields = {k: v for k, v in _hf_gemma(c).items() if k != "rope_theta"}
    return Gemma3TextConfig(**fields, rope_parameters={"full_attention": full, "sliding_attention": sliding})


def _hf_gemma(c: ModelConfig) -> dict:
    if c.qkv_bias != c.o_bias or c.mlp_bias:
        raise ValueError(f"Gemma has one attention_bias for q/k/v/o and no MLP bias; got (qkv, o, mlp) biases "
                         f"{(c.qkv_bias, c.o_bias, c.mlp_bias)}")
    types = [("sliding_attention" if c.layer_window(i) is not None else "full_attention") for i in range(c.num_layers)]
    return dict(hf_common(c), hidden_activation="gelu_pytorch_tanh", attention_bias=c.qkv_bias,
                query_pre_attn_scalar=_int_if_whole(c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None
                                                    else c.head_dim),
                final_logit_softcapping=c.final_logit_softcap, attn_logit_softcapping=c.attn_logit_softcap,
                sliding_window=c.sliding_window if c.sliding_window is not None else c.max_position,
                layer_types=types)


def _int_if_whole(value: float) -> int | float:
    """transformers' Gemma configs type ``query_pre_attn_scalar`` as an int (checkpoints write 256, 144)."""
    return int(value) if float(value).is_integer() else value


GEMMA2 = Family(
    name="gemma2", title="Gemma 2", architectures=("Gemma2ForCausalLM",), model_types=("gemma2",),
    gguf_architectures=("gemma2",), config_from_hf=gemma2_config_from_hf, weight_map=decoder_weights,
    to_hf_config=gemma2_to_hf_config, tests="tests/models/test_gemma.py")
GEMMA3 = Family(
    name="gemma3", title="Gemma 3 (text: 270M, 1B; the text part of 4B-27B is not read)",
    architectures=("Gemma3ForCausalLM",), model_types=("gemma3_text",), gguf_architectures=("gemma3",),
    config_from_hf=gemma3_config_from_hf, weight_map=decoder_weights, to_hf_config=gemma3_to_hf_config,
    tests="tests/models/test_gemma.py")
