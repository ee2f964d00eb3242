"""The KV cache's storage dtype (vLLM's ``kv_cache_dtype``) and the fp8 (e4m3) quantization of stored K/V.

``"auto"`` stores K/V in the model's dtype; ``"fp8"`` / ``"fp8_e4m3"`` (vLLM's values) store them as
``torch.float8_e4m3fn``, half the bytes of bf16: a token's stored ``k`` is ``saturate(k / k_scale)``, read
back as ``stored * k_scale`` (the same for v), with one scale per layer and KV head (a checkpoint's
per-layer scalar broadcast over the heads; 1.0 by default, as vLLM's). Values past e4m3's largest
(:data:`FP8_E4M3_MAX` = 448) saturate to it rather than becoming NaN.

Round trip error (:func:`fp8_round_trip_bound`): e4m3 keeps 3 mantissa bits, so a value ``x`` with
``|x| / scale`` in e4m3's normal range (``>= 2**-6``) comes back within ``2**-4 * |x|`` (round to nearest);
smaller ones (subnormals, spaced ``2**-9``) within ``2**-10 * scale``.

The pool stores and copies these bytes; the attention backends read them (the torch and reference backends
de-quantize to fp32; the triton kernel converts a tile in registers after its load, K's scale folded into the
softmax scale and V's into the output).
"""
from __future__ import annotations

import torch

__all__ = ["FP8_E4M3", "FP8_E4M3_MAX", "KV_CACHE_DTYPES", "dequantize_kv", "fp8_round_trip_bound", "is_fp8",
           "kv_storage_dtype", "quantize_kv"]

#: The values of ``kv_cache_dtype`` / ``--kv-cache-dtype`` (vLLM's).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_E4M3 = torch.float8_e4m3fn
#: The largest finite e4m3 value: stored K/V saturate there.
FP8_E4M3_MAX = 448.0


def kv_storage_dtype(kv_cache_dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype K/V are stored in for ``kv_cache_dtype`` (one of :data:`KV_CACHE_DTYPES`, a torch dtype, or None
    for ``"auto"``) beside a model of ``model_dtype``; ValueError for anything else."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3") or kv_cache_dtype == FP8_E4M3:
        return FP8_E4M3
    if kv_cache_dtype in (torch.float16, torch.bfloat16, torch.float32):
        return kv_cache_dtype
    raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r:.60}")


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is the fp8 KV storage dtype."""
    return dtype == FP8_E4M3


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [n, Hkv, D]`` (any float dtype) as e4m3: ``x / scale`` per KV head (``scale [Hkv]`` float32),
    saturated to +-448 (a NaN stays NaN)."""
    y = x.float() / scale[:, None]
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored e4m3 ``x [..., Hkv, D]`` back as ``dtype``: ``x * scale`` per KV head (``scale [Hkv]`` float32)."""
    return (x.float() * scale[:, None]).to(dtype)


def fp8_round_trip_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most ``|dequantize(quantize(x)) - x|`` may be for each element of ``x [n, Hkv, D]`` below saturation
    (see the module docstring): ``max(2**-4 |x|, 2**-10 scale)`` per element."""
    return torch.maximum(x.float().abs() * 2.0 ** -4, (scale * 2.0 ** -10)[:, None].expand_as(x))
