"""Peer implementations of one tree-attention step, for bench/attention.py.

Each peer is ``make(layout, q, k_cache, v_cache, variant, kv_scale=None) -> run`` where ``run()`` returns
``out [Q, Hq, D]`` (any layout of strides) of the layer ``variant`` (an ``AttentionVariant``: its scale,
soft-cap and sliding window, which a peer computes its own way: FlashInfer's ``logits_soft_cap`` and
``window_left``, a window in a dense mask, flex_attention's ``score_mod``). With the variant's fp8 ``kv_dtype`` the
caches are e4m3 and ``kv_scale`` ``[2, Hkv]`` their K and V scales, one value a cache (FlashInfer's ``k_scale`` /
``v_scale`` of ``run``, its fp8-KV kernels, ``kv_data_type`` e4m3); the torch peers have no fp8 KV path and say so.
``make`` does all setup outside the timed call: gathering, mask building, planning, compiling. A peer that cannot
run here says why:
:attr:`Peer.unavailable` returns the reason, or ``make`` raises :class:`PeerUnavailable`
(e.g. "fails to compile: ...", "n/a: no soft-cap"); the runner records that reason, it never skips silently.

Shapes: ``q [Q, Hq, D]``, ``k_cache``/``v_cache [num_pages, page_size, Hkv, D]`` (contiguous),
the layout's slots index the flattened ``[num_pages * page_size]`` token dimension.

FlashInfer peers view the same K/V storage as pages of one token
(``[num_pages * page_size, 1, Hkv, D]``, ``kv_indices`` = slots): exact for any tree, no copy.
Only outputs are compared; FlashInfer's LSE would be base 2 (treedec's is natural log).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from treedec import TreeLayout
from treedec.attention import AttentionVariant, dense_tree_mask
from treedec.attention.reference import token_positions

FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024

#: BENCH.md's DeFT-repo Triton times on an NVIDIA H200, microseconds (not reproducible here).
DEFT_TRITON_H200_US = {
    "spec_medusa64_p4k": 119.5, "spec_medusa256_p4k": 326.1, "spec_medusa64_p32k": 603.3,
    "fewshot_b30_p4k": 117.7, "fewshot_b50_p16k": 395.9, "tot_d5w10": 117.0,
    "tot_sorting1": 119.5, "tot_docmerge0": 124.0,
}

RunFn = Callable[[], torch.Tensor]


class PeerUnavailable(RuntimeError):
    """This peer cannot run this workload here; the message says why."""


@dataclass(frozen=True)
class Peer:
    """A peer: ``unavailable(device)`` is None when ``make`` can run on ``device``, else the reason.

    ``make`` is None for a peer that is listed only to be reported (never runnable here).
    """

    name: str
    description: str
    unavailable: Callable[[torch.device], str | None]
    make: Callable[..., RunFn] | None


# ===================================================================== PyTorch peers


def _no_fp8(variant: AttentionVariant, what: str) -> None:
    if variant.fp8_kv:
        raise PeerUnavailable(f"n/a: {what} has no fp8 KV path (a de-quantizing gather at setup would not be timed)")


def _fp8_scales(variant: AttentionVariant, kv_scale) -> dict:
    """FlashInfer ``run``'s ``k_scale`` / ``v_scale`` of fp8 caches (one value each), or nothing."""
    if not variant.fp8_kv:
        return {}
    if kv_scale is None or not bool((kv_scale == kv_scale[:, :1]).all()):
        raise PeerUnavailable("n/a: FlashInfer's fp8 KV takes one K and one V scale a layer, not one per head")
    return {"k_scale": float(kv_scale[0, 0]), "v_scale": float(kv_scale[1, 0])}


def make_sdpa_dense_mask(layout: TreeLayout, q, k_cache, v_cache, variant: AttentionVariant, kv_scale=None) -> RunFn:
    """``scaled_dot_product_attention`` over the tree's KV gathered to ``[T]`` with the dense [Q, T] mask (a window
    in it; no soft-cap: SDPA has no logit hook).

    K/V heads are repeated to the query heads at setup (SDPA's masked kernels take no GQA;
    HF transformers does the same ``repeat_kv`` when it passes a mask).
    """
    _no_fp8(variant, "SDPA")
    if variant.logit_softcap is not None:
        raise PeerUnavailable("n/a: SDPA has no logit soft-cap")
    sm_scale = variant.scale(q.shape[-1])
    group = q.shape[1] // k_cache.shape[2]
    k = _gather(layout, k_cache).repeat_interleave(group, dim=1).contiguous()   # [1, Hq, T, D]
    v = _gather(layout, v_cache).repeat_interleave(group, dim=1).contiguous()
    mask = _dense_mask(layout, q.device, variant)[None, None]                     # [1, 1, Q, T]
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()                             # [1, Hq, Q, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        return sdpa(qh, k, v, attn_mask=mask, scale=sm_scale)[0].transpose(0, 1)
    return run


def make_flex_attention(layout: TreeLayout, q, k_cache, v_cache, variant: AttentionVariant, kv_scale=None) -> RunFn:
    """``torch.compile(flex_attention)`` with a block mask made from the dense tree mask (GQA native; a window in
    the mask, a soft-cap as its ``score_mod``)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _no_fp8(variant, "flex_attention")
    sm_scale = variant.scale(q.shape[-1])
    dense = _dense_mask(layout, q.device, variant)                                # [Q, T]
    cap = variant.logit_softcap
    score_mod = None if cap is None else (lambda score, b, h, q_idx, kv_idx: torch.tanh(score / cap) * cap)

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[q_idx, kv_idx]

    num_q, num_t = dense.shape
    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=num_q, KV_LEN=num_t, device=q.device)
    k, v = _gather(layout, k_cache), _gather(layout, v_cache)                   # [1, Hkv, T, D]
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()                             # [1, Hq, Q, D]
    torch._dynamo.reset()  # a fresh compile per workload, never the eager fallback past the recompile limit
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)

    def run():
        return compiled(qh, k, v, score_mod=score_mod, block_mask=block_mask, scale=sm_scale,
                        enable_gqa=True)[0].transpose(0, 1)
    try:
        run()
    except Exception as e:  # report, as BENCH.md does, rather than time an eager fallback
        raise PeerUnavailable(f"fails to compile: {type(e).__name__}: {_first_line(e)}") from e
    return run


# ===================================================================== FlashInfer peers


def make_flashinfer_custom_mask(layout: TreeLayout, q, k_cache, v_cache, variant: AttentionVariant,
                                kv_scale=None) -> RunFn:
    """One prefill request per tree of the layout (one for a single tree): its queries over its
    flattened tokens, boolean ``custom_mask`` (each request's [Q_r * T_r], concatenated; a sliding window is in
    the mask: FlashInfer's ``window_left`` counts positions from a request's KV end, not along the tree's paths),
    its ``logits_soft_cap``."""
    flashinfer = _import_flashinfer()
    dev = q.device
    qo_indptr, kv_indptr, masks = request_masks(layout, variant)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(dev), "NHD")
    wrapper.plan(
        _i32(qo_indptr, dev),                        # qo_indptr
        _i32(kv_indptr, dev),                        # paged_kv_indptr
        _i32(layout.kv_slots, dev),                  # paged_kv_indices: one-token pages = slots
        _i32(np.ones(len(qo_indptr) - 1), dev),      # paged_kv_last_page_len
        q.shape[1], k_cache.shape[2], q.shape[2], 1,  # num_qo_heads, num_kv_heads, head_dim_qk, page_size
        custom_mask=torch.from_numpy(masks).to(dev),
        causal=False,
        sm_scale=variant.scale(q.shape[-1]),
        logits_soft_cap=variant.logit_softcap or 0.0,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    kv, scales = _one_token_pages(k_cache, v_cache), _fp8_scales(variant, kv_scale)
    return lambda: wrapper.run(q, kv, **scales)


def make_flashinfer_per_path_decode(layout: TreeLayout, q, k_cache, v_cache, variant: AttentionVariant,
                                    kv_scale=None) -> RunFn:
    """One decode request per query whose KV is its own root-to-query path (Radix / Q-guided style), FlashInfer's
    windowed decode (``window_left``: a path's last tokens are its query's window) and ``logits_soft_cap``."""
    flashinfer = _import_flashinfer()
    dev = q.device
    indptr, indices = path_slots(layout)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(dev), "NHD", use_tensor_cores=True)
    wrapper.plan(
        _i32(indptr, dev),                           # indptr
        _i32(indices, dev),                          # indices: one-token pages = slots
        _i32(np.ones(layout.num_queries), dev),      # last_page_len
        q.shape[1], k_cache.shape[2], q.shape[2], 1,  # num_qo_heads, num_kv_heads, head_dim, page_size
        **_decode_variant(variant, q.shape[2]),
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    kv, scales = _one_token_pages(k_cache, v_cache), _fp8_scales(variant, kv_scale)
    return lambda: wrapper.run(q, kv, **scales)


def make_flashinfer_batch_decode(layout: TreeLayout, q, k_cache, v_cache, variant: AttentionVariant,
                                 kv_scale=None) -> RunFn:
    """``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores) as a serving engine runs unshared decoding:
    one request per query over its sequence's own pages, at the pool's page size (FlashInfer's windowed batch
    decode with the variant's window, ``window_left``; its ``logits_soft_cap``).

    Unavailable where a query's path is not whole pages (tree nodes that start mid-page):
    ``flashinfer_per_path_decode`` runs those with one-token pages.
    """
    flashinfer = _import_flashinfer()
    dev, page_size = q.device, k_cache.shape[1]
    indptr, pages, last_page_len = path_pages(layout, page_size)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(dev), "NHD", use_tensor_cores=True)
    wrapper.plan(
        _i32(indptr, dev),                           # indptr
        _i32(pages, dev),                            # indices: the pool's pages
        _i32(last_page_len, dev),                    # last_page_len
        q.shape[1], k_cache.shape[2], q.shape[2], page_size,  # num_qo_heads, num_kv_heads, head_dim, page_size
        **_decode_variant(variant, q.shape[2]),
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    scales = _fp8_scales(variant, kv_scale)
    return lambda: wrapper.run(q, (k_cache, v_cache), **scales)


def make_flashinfer_cascade(layout: TreeLayout, q, k_cache, v_cache, variant: AttentionVariant,
                            kv_scale=None) -> RunFn:
    """Two-level ``MultiLevelCascadeAttentionWrapper``: the shared prefix, then each query's own rest.

    Level 0 is one request with all queries over the nodes every query reads that hold no
    query; level 1 is one request per query over the rest of its path. Unavailable when
    no such shared prefix exists, or with a window (a level's window would count its own positions).
    """
    if variant.window is not None:
        raise PeerUnavailable("n/a: a sliding window across the cascade's levels")
    flashinfer = _import_flashinfer()
    dev, num_q = q.device, layout.num_queries
    shared_slots, rest_indptr, rest_slots = cascade_levels(layout)
    if len(shared_slots) == 0:
        raise PeerUnavailable("n/a: no tokens are read by every query outside the query nodes")
    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, _workspace(dev), "NHD")
    wrapper.plan(
        [_i32([0, num_q], dev), _i32(np.arange(num_q + 1), dev)],                   # qo_indptr per level
        [_i32([0, len(shared_slots)], dev), _i32(rest_indptr, dev)],                # paged_kv_indptr per level
        [_i32(shared_slots, dev), _i32(rest_slots, dev)],                           # paged_kv_indices per level
        [_i32([1], dev), _i32(np.ones(num_q), dev)],                                # last_page_len per level
        q.shape[1], k_cache.shape[2], q.shape[2], 1,  # num_qo_heads, num_kv_heads, head_dim, page_size
        causal=False,
        sm_scale=variant.scale(q.shape[-1]),
        logits_soft_cap=variant.logit_softcap or 0.0,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    kv, scales = _one_token_pages(k_cache, v_cache), _fp8_scales(variant, kv_scale)
    return lambda: wrapper.run(q, kv, **scales)


# ===================================================================== registry


def _needs_cuda(device: torch.device) -> str | None:
    return None if device.type == "cuda" else f"needs a CUDA device, running on {device}"


def _flashinfer_status(device: torch.device) -> str | None:
    if importlib.util.find_spec("flashinfer") is None:
        return "the 'flashinfer' package is not installed (bring flashinfer-python wheels, see bench/README.md)"
    return _needs_cuda(device)


PEERS: dict[str, Peer] = {p.name: p for p in [
    Peer("sdpa_dense_mask", "torch SDPA over the gathered tree KV with a dense boolean mask",
         lambda device: None, make_sdpa_dense_mask),
    Peer("flex_attention", "torch.compile(flex_attention), block mask from the dense tree mask",
         lambda device: None, make_flex_attention),
    Peer("deft_triton", "DeFT repository Triton kernel (BENCH.md's recorded H200 number)",
         lambda device: "the DeFT repository's Triton kernel is not vendored in treedec; "
                        "the README quotes BENCH.md's H200 number", None),
    Peer("flashinfer_custom_mask", "FlashInfer batch prefill, one request, boolean custom_mask",
         _flashinfer_status, make_flashinfer_custom_mask),
    Peer("flashinfer_per_path_decode", "FlashInfer batch decode, one request per query over its path",
         _flashinfer_status, make_flashinfer_per_path_decode),
    Peer("flashinfer_batch_decode", "FlashInfer batch decode (tensor cores), one request per query over its "
                                    "sequence's pages", _flashinfer_status, make_flashinfer_batch_decode),
    Peer("flashinfer_cascade", "FlashInfer 2-level cascade: shared prefix + per-query rest",
         _flashinfer_status, make_flashinfer_cascade),
]}


def path_slots(layout: TreeLayout) -> tuple[np.ndarray, np.ndarray]:
    """Every query's root-to-query path as CSR: ``indptr [Q + 1]``, ``slots [sum of path lengths]``
    (root first: the rows of ``dense_tree_mask``, walked up the parents instead of built densely)."""
    start, parts, lengths = layout.kv_start, [], []
    for node, offset in zip(layout.query_node.tolist(), layout.query_offset.tolist()):
        ranges = [(start[node], start[node] + offset + 1)]
        node = layout.parent[node]
        while node >= 0:
            ranges.append((start[node], start[node + 1]))
            node = layout.parent[node]
        path = np.concatenate([layout.kv_slots[a:b] for a, b in reversed(ranges)])
        parts.append(path)
        lengths.append(len(path))
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return indptr, np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def path_pages(layout: TreeLayout, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every query's path as pages of ``page_size`` slots: ``indptr [Q + 1]``, ``pages``, ``last_page_len [Q]``.

    Raises PeerUnavailable when a path is not a run of whole pages (its slots t = 0, 1, ... at
    page[t // page_size] * page_size + t % page_size), as in a tree whose nodes start mid-page.
    """
    indptr, slots = path_slots(layout)
    page_indptr, pages, last = [0], [], []
    for i in range(layout.num_queries):
        path = slots[indptr[i]:indptr[i + 1]]
        own = path[::page_size] // page_size
        t = np.arange(len(path))
        if np.any(path[::page_size] % page_size) or np.any(path != own[t // page_size] * page_size + t % page_size):
            raise PeerUnavailable(f"n/a: query {i}'s path is not whole pages of {page_size} slots")
        pages.append(own)
        page_indptr.append(page_indptr[-1] + len(own))
        last.append(len(path) - (len(own) - 1) * page_size)
    return (np.asarray(page_indptr, dtype=np.int64), np.concatenate(pages) if pages else np.zeros(0, dtype=np.int64),
            np.asarray(last, dtype=np.int64))


def request_masks(layout: TreeLayout, variant: AttentionVariant = AttentionVariant()
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layout's trees as prefill requests with custom masks: ``qo_indptr [R + 1]``, ``kv_indptr [R + 1]``
    (into the flattened tokens) and the requests' [Q_r, T_r] masks (and-ed with the variant's window) flattened and
    concatenated.

    Raises PeerUnavailable when the queries are not grouped by tree in tree order (the requests
    would need q permuted).
    """
    parts = split_by_root(layout)
    if not np.array_equal(np.concatenate([queries for queries, _ in parts]), np.arange(layout.num_queries)):
        raise PeerUnavailable("n/a: the queries are not grouped by tree")
    qo_indptr = np.cumsum([0] + [sub.num_queries for _, sub in parts])
    kv_indptr = np.cumsum([0] + [sub.num_tokens for _, sub in parts])
    masks = np.concatenate([variant_mask(sub, variant).reshape(-1) for _, sub in parts])
    return qo_indptr.astype(np.int64), kv_indptr.astype(np.int64), masks


def split_by_root(layout: TreeLayout) -> list[tuple[np.ndarray, TreeLayout]]:
    """The layout's trees, one per root: (indices of its queries in ``layout``, its own layout).

    Nodes are in preorder, so a tree is a contiguous range of nodes and of tokens.
    """
    roots = np.flatnonzero(layout.parent < 0)
    bounds = np.append(roots, layout.num_nodes)
    parts = []
    for r0, r1 in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        t0, t1 = int(layout.kv_start[r0]), int(layout.kv_start[r1])
        queries = np.flatnonzero((layout.query_node >= r0) & (layout.query_node < r1))
        parent = layout.parent[r0:r1].copy()
        parent[parent >= 0] -= r0
        sub = TreeLayout(node_ids=layout.node_ids[r0:r1], parent=parent, kv_start=layout.kv_start[r0:r1 + 1] - t0,
                         kv_slots=layout.kv_slots[t0:t1], query_node=layout.query_node[queries] - r0,
                         query_offset=layout.query_offset[queries])
        parts.append((queries, sub))
    return parts


def cascade_levels(layout: TreeLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split every query's path into a prefix shared by all queries and its own rest.

    The shared level is every token that all queries read, outside the nodes that hold a
    query (so each query's rest is not empty). Returns ``shared_slots [S]`` and the rest as
    CSR: ``rest_indptr [Q + 1]``, ``rest_slots``.
    """
    mask = dense_tree_mask(layout)
    token_node = np.repeat(np.arange(layout.num_nodes), layout.node_len)
    shared = mask.all(axis=0) & ~np.isin(token_node, layout.query_node)
    rest = mask & ~shared
    rest_indptr = np.concatenate([[0], np.cumsum(rest.sum(axis=1))]).astype(np.int64)
    return layout.kv_slots[shared], rest_indptr, layout.kv_slots[np.nonzero(rest)[1]]


# ===================================================================== private


def _gather(layout: TreeLayout, cache: torch.Tensor) -> torch.Tensor:
    """``[1, Hkv, T, D]`` contiguous copy of the tree's tokens in flattened order."""
    hkv, d = cache.shape[2], cache.shape[3]
    slots = torch.tensor(layout.kv_slots, device=cache.device)   # a copy: layout arrays are read-only
    return cache.reshape(-1, hkv, d)[slots].transpose(0, 1).unsqueeze(0).contiguous()


def variant_mask(layout: TreeLayout, variant: AttentionVariant) -> np.ndarray:
    """[Q, T] bool: the tree mask and-ed with the variant's (its window, by root-path positions)."""
    mask = dense_tree_mask(layout)
    if variant.window is not None:
        mask &= variant.visible(layout.query_position, token_positions(layout))
    return mask


def _decode_variant(variant: AttentionVariant, head_dim: int) -> dict:
    """FlashInfer decode ``plan`` arguments of ``variant``: a path's last ``window`` tokens are its window."""
    return dict(sm_scale=variant.scale(head_dim), logits_soft_cap=variant.logit_softcap or 0.0,
                window_left=-1 if variant.window is None else variant.window - 1)


def _dense_mask(layout: TreeLayout, device, variant: AttentionVariant = AttentionVariant()) -> torch.Tensor:
    return torch.from_numpy(variant_mask(layout, variant)).to(device)


def _i32(values, device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int32), device=device)


def _one_token_pages(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool viewed as pages of one token, FlashInfer NHD: ``[num_slots, 1, Hkv, D]`` each (no copy)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    return k_cache.view(-1, 1, hkv, d), v_cache.view(-1, 1, hkv, d)


def _workspace(device) -> torch.Tensor:
    return torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _import_flashinfer():
    try:
        import flashinfer
    except Exception as e:
        raise PeerUnavailable(f"flashinfer cannot be imported: {type(e).__name__}: {_first_line(e)}") from e
    return flashinfer


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""
