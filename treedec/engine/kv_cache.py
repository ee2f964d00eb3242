"""An engine's KV cache dtype (vLLM's ``kv_cache_dtype``) and an fp8 pool's scales: from the checkpoint, 1.0, or
calibrated on prompts.

``kv_cache_dtype="fp8"`` (or ``"fp8_e4m3"``) stores K/V as e4m3 (:mod:`treedec.tree.kv_cache_dtype`) with a scale
per layer and KV head, chosen once when the engine is made (:func:`initial_kv_scales`):

- the checkpoint's, where it has them (an FP8 checkpoint's ``k_scale`` / ``v_scale`` or legacy ``kv_scale``
  tensors: ``model.kv_scales``, :mod:`treedec.models.kv_scales`);
- else 1.0 (vLLM's default): right for K/V of magnitude up to 448, which most models' are;
- or :func:`calibrate_kv_scales` on a few prompts before the first step (vLLM's ``calculate_kv_scales``): each
  layer's and KV head's ``amax / 448`` over the prompts' K and V (with no attention to a pool: each prompt runs
  as one causal sequence in fp32), so its largest value is stored at e4m3's largest; later, larger values
  saturate.

On the CPU an fp8 pool still saves memory but not time: the torch backend de-quantizes K/V as it reads them
(said once, as a warning).
"""
from __future__ import annotations

import logging
import warnings
from typing import Sequence

import torch

from treedec.attention.variant import FP8_KV, AttentionVariant
from treedec.models.base import DecoderModel
from treedec.tree import PagedKVPool
from treedec.tree.kv_cache_dtype import FP8_E4M3_MAX, is_fp8, kv_storage_dtype

__all__ = ["calibrate_kv_scales", "initial_kv_scales", "kv_cache_name", "variant_kv_dtype"]

logger = logging.getLogger("treedec")


def variant_kv_dtype(kv_cache_dtype, model_dtype: torch.dtype) -> str | None:
    """The attention variants' ``kv_dtype`` for ``kv_cache_dtype`` (ValueError for a value not in
    :data:`~treedec.tree.kv_cache_dtype.KV_CACHE_DTYPES`)."""
    return FP8_KV if is_fp8(kv_storage_dtype(kv_cache_dtype, model_dtype)) else None


def kv_cache_name(pool: PagedKVPool) -> str:
    """What a pool stores, as results files and logs say it: ``"auto (bfloat16)"`` or ``"fp8_e4m3"``."""
    return FP8_KV if is_fp8(pool.kv_dtype) else f"auto ({str(pool.kv_dtype).removeprefix('torch.')})"


def initial_kv_scales(pool: PagedKVPool, model: DecoderModel) -> str | None:
    """Set an fp8 ``pool``'s scales from the checkpoint's (``model.kv_scales``) where it has them, else leave
    them 1.0; returns where they came from, in words (None for a pool that takes no scales). Warns once that the
    CPU de-quantizes."""
    if pool.kv_scale is None:
        return None
    if pool.k.device.type == "cpu":
        warnings.warn("an fp8 KV cache on the CPU stores K/V as e4m3 (half the memory) but the torch attention "
                      "backend de-quantizes them to fp32 as it reads them: no faster than the model's dtype",
                      stacklevel=3)
    scales = model.kv_scales
    if scales is None:
        return "1.0 (the checkpoint has no k_scale / v_scale)"
    pool.set_kv_scales(scales[:, 0], scales[:, 1])
    return "the checkpoint's k_scale / v_scale"


@torch.inference_mode()
def calibrate_kv_scales(model: DecoderModel, pool: PagedKVPool, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set an fp8 ``pool``'s scales to each layer's and KV head's ``amax / 448`` of K and V over ``prompts``
    (lists of token ids, each run as one causal sequence at positions ``0 ..``, attention in fp32 with each
    layer's variant: nothing is stored in the pool). Set them before the pool holds K/V (stored values keep the
    scales they were stored with). Returns the scales, ``[num_layers, 2, num_kv_heads]`` float32 (as
    :attr:`PagedKVPool.kv_scale`).

    Raises ValueError for a pool that takes no scales, no prompts or an empty one, token ids out of the
    vocabulary."""
    if pool.kv_scale is None:
        raise ValueError(f"calibrate_kv_scales: the pool stores {pool.kv_dtype}, which takes no scales "
                         f"(kv_cache_dtype='fp8' does)")
    prompts = [list(p) for p in prompts]
    vocab = model.config.vocab_size
    if not prompts or any(not p for p in prompts):
        raise ValueError("calibrate_kv_scales needs one non-empty prompt at least")
    bad = [t for p in prompts for t in p if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"calibrate_kv_scales: token ids must be ints in [0, {vocab}), got {bad[:5]}")
    variants = model.attention_variants()
    amax = torch.zeros(pool.num_layers, 2, pool.num_kv_heads, dtype=torch.float32, device=pool.kv_scale.device)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        amax[layer, 0] = torch.maximum(amax[layer, 0], k.float().abs().amax(dim=(0, 2)))
        amax[layer, 1] = torch.maximum(amax[layer, 1], v.float().abs().amax(dim=(0, 2)))
        return _causal_attention(q, k, v, variants[layer]).to(q.dtype)

    for prompt in prompts:
        tokens = torch.tensor(prompt, dtype=torch.int64, device=model.device)
        model(tokens, torch.arange(len(prompt), device=model.device), attend, tokens.new_zeros(1))
    scales = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    pool.kv_scale.copy_(scales)
    logger.info("fp8 KV scales calibrated on %d prompt(s): K %.3g..%.3g, V %.3g..%.3g", len(prompts),
                scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(), scales[:, 1].max())
    return scales


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: AttentionVariant) -> torch.Tensor:
    """Causal softmax attention of one sequence in fp32: ``q [n, Hq, D]`` over ``k, v [n, Hkv, D]``, the variant's
    scale, logit hooks and window."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    kf, vf = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    scores = variant.logits(torch.einsum("qhd,khd->hqk", q.float(), kf) * variant.scale(d))
    pos = torch.arange(n, device=q.device)
    scores = scores.masked_fill(~variant.visible(pos, pos)[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf)
