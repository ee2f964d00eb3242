"""The Phi-3 family (Phi-3 mini 4k and 128k, Phi-3.5 mini): Llama's block, its checkpoints fusing q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj`` (treedec's own layout: loaded as they are, cut in their parts by
tensor parallelism), ``longrope`` RoPE on the 128k models, a sliding window on every layer (mini-4k: 2047)."""
from __future__ import annotations

from functools import partial

from treedec.models.config import ModelConfig
from treedec.models.family import Family
from treedec.models.hf_config import swiglu_fields
from treedec.models.llama import hf_common, hf_rope_scaling
from treedec.models.weights import decoder_weights

__all__ = ["FAMILY"]


def config_from_hf(hf_config) -> ModelConfig:
    """Read a transformers ``Phi3Config``."""
    fields, theta, scaling = swiglu_fields(hf_config)
    return ModelConfig(**fields, rope_theta=float(theta), rope_scaling=scaling)


def to_hf_config(config: ModelConfig):
    """The transformers ``Phi3Config`` of ``config``."""
    from transformers import Phi3Config

    c = config
    if c.qkv_bias or c.o_bias or c.mlp_bias or c.layer_types is not None:
        raise ValueError("Phi-3 has no biases and one sliding window for every layer")
    scaling = hf_rope_scaling(c.rope_scaling)
    original = {} if c.rope_scaling is None or c.rope_scaling.kind != "longrope" else \
        {"original_max_position_embeddings": c.rope_scaling.original_max_position}
    # (no token ids: Phi3Config's defaults, 32000, are Phi-3's own vocabulary's, not every config's)
    return Phi3Config(**hf_common(c), rope_scaling=scaling, sliding_window=c.sliding_window, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, **original)


FAMILY = Family(
    name="phi3", title="Phi-3 mini 4k / 128k, Phi-3.5 mini", architectures=("Phi3ForCausalLM",),
    model_types=("phi3",), gguf_architectures=("phi3",), config_from_hf=config_from_hf,
    weight_map=partial(decoder_weights, fused_qkv=True, fused_gate_up=True), to_hf_config=to_hf_config,
    tests="tests/models/test_phi3.py")
