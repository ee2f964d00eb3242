"""Dense fp32 reference tree attention: the ground truth for every test.

It ignores any plan: the mask comes straight from the layout's parent pointers, and-ed with the variant's
(:meth:`AttentionVariant.visible`: a sliding window) by each token's position on its root path; the logits go
through the variant's hooks (:meth:`AttentionVariant.logits`: a soft-cap).
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.attention.variant import AttentionVariant
from treedec.tree.kv_cache_dtype import dequantize_kv
from treedec.tree.layout import TreeLayout


def dense_tree_mask(layout: TreeLayout) -> np.ndarray:
    """[Q, T] bool: query i reads flattened token t (its ancestors' tokens, its own prefix)."""
    mask = np.zeros((layout.num_queries, layout.num_tokens), dtype=bool)
    start = layout.kv_start
    for i, (node, offset) in enumerate(zip(layout.query_node.tolist(), layout.query_offset.tolist())):
        mask[i, start[node]:start[node] + offset + 1] = True
        node = layout.parent[node]
        while node >= 0:
            mask[i, start[node]:start[node + 1]] = True
            node = layout.parent[node]
    return mask


def token_positions(layout: TreeLayout) -> np.ndarray:
    """[T] int64: each flattened token's position on its root path (its node's first position plus its offset)."""
    lens = layout.node_len
    return np.repeat(layout.node_prefix_len - layout.kv_start[:-1], lens) + np.arange(layout.num_tokens)


def reference_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: TreeLayout,
    variant: AttentionVariant,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention over the whole tree in fp32.

    Parameters
    ----------
    q : [Q, Hq, D]; k_cache, v_cache : [num_pages, page_size, Hkv, D]
    variant : what the layer computes (scale, logit hooks, mask fields)
    kv_scale : [2, Hkv] float32: the caches hold fp8 values, de-quantized here (K times ``kv_scale[0]``, V times
        ``kv_scale[1]``, per KV head); None: they hold the values

    Returns
    -------
    out : [Q, Hq, D] float32, lse : [Q, Hq] float32 (natural log)
    """
    if not isinstance(variant, AttentionVariant):
        raise TypeError(f"variant must be an AttentionVariant, got {type(variant).__name__}")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    slots = torch.tensor(layout.kv_slots, device=q.device)   # a copy: layout arrays are read-only
    k, v = (cache.reshape(-1, hkv, d)[slots].float() for cache in (k_cache, v_cache))   # [T, Hkv, D]
    if kv_scale is not None:
        k, v = (dequantize_kv(t, kv_scale[i]) for i, t in enumerate((k, v)))
    k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))   # [T, Hq, D]
    scores = variant.logits(torch.einsum("qhd,thd->qht", q.float(), k) * variant.scale(d))
    mask = dense_tree_mask(layout) & variant.visible(layout.query_position, token_positions(layout))
    mask = torch.from_numpy(mask).to(q.device)
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("qht,thd->qhd", torch.softmax(scores, dim=-1), v)
    return out, lse
