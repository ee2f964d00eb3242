"""Rotary position embeddings at each query's own position, as transformers computes them.

The inverse frequencies follow ``transformers.modeling_rope_utils`` (``default``, ``linear``,
Llama 3.1's ``llama3`` rule, Phi-3's ``longrope``) operation for operation, so that cos/sin match
bit for bit in fp32. Rotation is the non-interleaved ``rotate_half`` form of the HF checkpoints.
A model has one RoPE, or two (Gemma 3: its sliding-window layers have their own, unscaled base,
:meth:`~treedec.models.config.ModelConfig.layer_rope`).
"""
from __future__ import annotations

import math

import torch

from treedec.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None, local: bool = False
                  ) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, scaled per ``config.rope_scaling``; ``local``: those of the
    sliding-window layers' own RoPE (``config.local_rope_theta``, unscaled)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    scaling = None if local else config.rope_scaling
    if scaling is not None and scaling.kind == "longrope":   # transformers' _compute_longrope_parameters
        long = config.max_position > scaling.original_max_position
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32,
                               device=device)
        return 1.0 / (factors * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: transformers' _compute_llama3_parameters
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def rope_attention_scale(config: ModelConfig, local: bool = False) -> float:
    """The factor cos and sin are multiplied by (longrope's attention factor; 1.0 for every other RoPE)."""
    scaling = None if local else config.rope_scaling
    if scaling is None or scaling.kind != "longrope":
        return 1.0
    return scaling.longrope_attention_factor(config.max_position)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n, head_dim]`` in ``dtype`` for int ``positions [n]`` (fp32 math, times ``scale``, then cast)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [n, heads, head_dim]`` by ``cos, sin [n, head_dim]``; returns a new contiguous tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
