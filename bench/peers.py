"""Peer implementations of one tree-attention step, for bench/attention.py.

Each peer is ``make(layout, q, k_cache, v_cache, sm_scale) -> run`` where ``run()`` returns
``out [Q, Hq, D]`` (any layout of strides). ``make`` does all setup outside the timed call:
gathering, mask building, planning, compiling. A peer that cannot run here says why:
:attr:`Peer.unavailable` returns the reason, or ``make`` raises :class:`PeerUnavailable`
(e.g. "fails to compile: ..."); the runner records that reason, it never skips silently.

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
from treedec.attention import dense_tree_mask

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


def make_sdpa_dense_mask(layout: TreeLayout, q, k_cache, v_cache, sm_scale: float) -> RunFn:
    """``scaled_dot_product_attention`` over the tree's KV gathered to ``[T]`` with the dense [Q, T] mask.

    K/V heads are repeated to the query heads at setup (SDPA's masked kernels take no GQA;
    HF transformers does the same ``repeat_kv`` when it passes a mask).
    """
    group = q.shape[1] // k_cache.shape[2]
    k = _gather(layout, k_cache).repeat_interleave(group, dim=1).contiguous()   # [1, Hq, T, D]
    v = _gather(layout, v_cache).repeat_interleave(group, dim=1).contiguous()
    mask = _dense_mask(layout, q.device)[None, None]                              # [1, 1, Q, T]
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()                             # [1, Hq, Q, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        return sdpa(qh, k, v, attn_mask=mask, scale=sm_scale)[0].transpose(0, 1)
    return run


def make_flex_attention(layout: TreeLayout, q, k_cache, v_cache, sm_scale: float) -> RunFn:
    """``torch.compile(flex_attention)`` with a block mask made from the dense tree mask (GQA native)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dense = _dense_mask(layout, q.device)                                         # [Q, T]

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[q_idx, kv_idx]

    num_q, num_t = dense.shape
    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=num_q, KV_LEN=num_t, device=q.device)
    k, v = _gather(layout, k_cache), _gather(layout, v_cache)                   # [1, Hkv, T, D]
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()                             # [1, Hq, Q, D]
    torch._dynamo.reset()  # a fresh compile per workload, never the eager fallback past the recompile limit
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)

    def run():
        return compiled(qh, k, v, block_mask=block_mask, scale=sm_scale, enable_gqa=True)[0].transpose(0, 1)
    try:
        run()
    except Exception as e:  # report, as BENCH.md does, rather than time an eager fallback
        raise PeerUnavailable(f"fails to compile: {type(e).__name__}: {_first_line(e)}") from e
    return run


# ===================================================================== FlashInfer peers


def make_flashinfer_custom_mask(layout: TreeLayout, q, k_cache, v_cache, sm_scale: float) -> RunFn:
    """One prefill request holding all Q queries over the flattened tree, boolean ``custom_mask`` [Q * T]."""
    flashinfer = _import_flashinfer()
    dev, num_q, num_t = q.device, layout.num_queries, layout.num_tokens
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(dev), "NHD")
    wrapper.plan(
        _i32([0, num_q], dev),                       # qo_indptr
        _i32([0, num_t], dev),                       # paged_kv_indptr
        _i32(layout.kv_slots, dev),                  # paged_kv_indices: one-token pages = slots
        _i32([1], dev),                              # paged_kv_last_page_len
        q.shape[1], k_cache.shape[2], q.shape[2], 1,  # num_qo_heads, num_kv_heads, head_dim_qk, page_size
        custom_mask=_dense_mask(layout, dev).reshape(-1),
        causal=False,
        sm_scale=sm_scale,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    kv = _one_token_pages(k_cache, v_cache)
    return lambda: wrapper.run(q, kv)


def make_flashinfer_per_path_decode(layout: TreeLayout, q, k_cache, v_cache, sm_scale: float) -> RunFn:
    """One decode request per query whose KV is its own root-to-query path (Radix / Q-guided style)."""
    flashinfer = _import_flashinfer()
    dev = q.device
    indptr, indices = path_slots(layout)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(dev), "NHD", use_tensor_cores=True)
    wrapper.plan(
        _i32(indptr, dev),                           # indptr
        _i32(indices, dev),                          # indices: one-token pages = slots
        _i32(np.ones(layout.num_queries), dev),      # last_page_len
        q.shape[1], k_cache.shape[2], q.shape[2], 1,  # num_qo_heads, num_kv_heads, head_dim, page_size
        sm_scale=sm_scale,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    kv = _one_token_pages(k_cache, v_cache)
    return lambda: wrapper.run(q, kv)


def make_flashinfer_cascade(layout: TreeLayout, q, k_cache, v_cache, sm_scale: float) -> RunFn:
    """Two-level ``MultiLevelCascadeAttentionWrapper``: the shared prefix, then each query's own rest.

    Level 0 is one request with all queries over the nodes every query reads that hold no
    query; level 1 is one request per query over the rest of its path. Unavailable when
    no such shared prefix exists.
    """
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
        sm_scale=sm_scale,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    kv = _one_token_pages(k_cache, v_cache)
    return lambda: wrapper.run(q, kv)


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
    Peer("flashinfer_cascade", "FlashInfer 2-level cascade: shared prefix + per-query rest",
         _flashinfer_status, make_flashinfer_cascade),
]}


def path_slots(layout: TreeLayout) -> tuple[np.ndarray, np.ndarray]:
    """Every query's root-to-query path as CSR: ``indptr [Q + 1]``, ``slots [sum of path lengths]``."""
    mask = dense_tree_mask(layout)
    indptr = np.concatenate([[0], np.cumsum(mask.sum(axis=1))]).astype(np.int64)
    return indptr, layout.kv_slots[np.nonzero(mask)[1]]   # row-major: grouped by query, root first


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


def _dense_mask(layout: TreeLayout, device) -> torch.Tensor:
    return torch.from_numpy(dense_tree_mask(layout)).to(device)


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
