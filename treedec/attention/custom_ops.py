"""Tree attention and the K/V store as torch custom ops, so ``torch.compile`` sees a whole decoder.

``torch.ops.treedec.tree_attention`` runs a prepared plan on the triton or cuda kernels and
``torch.ops.treedec.store_kv`` writes a step's K/V into the paged caches in place. Both have
fake (meta) implementations, so Dynamo traces a model forward that calls them without graph
breaks and Inductor fuses the code around them (norms, RoPE, residuals); a captured CUDA
graph then replays the compiled forward. They are registered when this module is imported
(``treedec.attention`` imports it).

A prepared plan is passed as plain values: its int32 tensors and a few ints (the sizes its
launch was prepared for), from :meth:`TreeAttention.op_args`. Inside ``torch.compile`` the
ints are constants of the compiled graph: a static plan (fixed buffers, sizes at its bounds)
keeps them, so one compile serves every plan written into it. The workspace of partial
states is allocated inside the op (from a CUDA graph's private pool when captured).

    tensors, sizes = attn.op_args(plan)
    out = torch.ops.treedec.tree_attention(q, k_cache, v_cache, tensors, sizes, plan.backend, attn.sm_scale)
"""
from __future__ import annotations

import torch

OP_BACKENDS = ("triton", "cuda")


@torch.library.custom_op("treedec::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tensors: list[torch.Tensor],
                   sizes: list[int], backend: str, sm_scale: float) -> torch.Tensor:
    """Tree attention of a prepared plan: ``out [Q, Hq, D]`` in q's dtype.

    ``q`` [Q, Hq, D]; ``k_cache``, ``v_cache`` [num_pages, page_size, Hkv, D]; ``tensors`` and
    ``sizes`` from :meth:`TreeAttention.op_args` for ``backend`` ("triton" or "cuda").
    """
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    # The kernel modules import triton / the CUDA build only when an op runs: registering the ops
    # must work where neither is installed.
    if backend == "triton":
        from treedec.attention.backends.triton_backend import KERNEL_ARRAYS as TRITON_ARRAYS
        from treedec.kernels import triton_tree_attention as kernels
        num_items, num_queries, num_entries, query_tile, fp32_workspace = sizes
        launch = kernels.plan_launch(num_items, num_queries, num_entries, query_tile, q.shape[1], hkv, d, q.dtype,
                                     q.device.type == "cpu")
        ws_dtype = torch.float32 if fp32_workspace else q.dtype
        o_ws = torch.empty(num_entries, q.shape[1], d, dtype=ws_dtype, device=q.device)
        lse_ws = torch.empty(num_entries, q.shape[1], dtype=torch.float32, device=q.device)
        kernels.attend(q, k_flat, v_flat, out, lse, o_ws, lse_ws, dict(zip(TRITON_ARRAYS, tensors)), sm_scale,
                       launch)
    elif backend == "cuda":
        from treedec.attention.backends.cuda_backend import KERNEL_ARRAYS as CUDA_ARRAYS
        from treedec.kernels import cuda_tree_attention as kernels
        partials, merge, tile_tokens, max_query_entries = sizes
        arrays = dict(zip(CUDA_ARRAYS, tensors))
        o_ws = torch.empty(partials, q.shape[1], d, dtype=torch.float32, device=q.device)
        lse_ws = torch.empty(partials, q.shape[1], dtype=torch.float32, device=q.device)
        kernels.launch(q, k_flat, v_flat, out, lse, o_ws, lse_ws, arrays, tensors[-2], tensors[-1],
                       arrays["entry_mask"].stride(0), sm_scale, bool(merge), tile_tokens, max_query_entries)
    else:
        raise ValueError(f"treedec::tree_attention runs the {OP_BACKENDS} kernels, got backend {backend!r}")
    return out


@tree_attention.register_fake
def _(q, k_cache, v_cache, tensors, sizes, backend, sm_scale):
    return torch.empty_like(q)


@torch.library.custom_op("treedec::store_kv", mutates_args=("k_slots", "v_slots"))
def store_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write ``k``, ``v`` [n, Hkv, D] at ``slots`` [n] int64 of the caches viewed as [num_slots, Hkv, D], in place."""
    k_slots.index_copy_(0, slots, k)
    v_slots.index_copy_(0, slots, v)


@store_kv.register_fake
def _(k_slots, v_slots, slots, k, v):
    return None
