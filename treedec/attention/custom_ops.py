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
    hq, d = q.shape[1], q.shape[2]
    # The backend modules import triton / the CUDA build: only when an op runs, since registering
    # the ops must work where neither is installed.
    if backend == "triton":
        from treedec.attention.backends import triton_backend
        from treedec.kernels.triton_tree_attention import plan_launch
        num_items, num_queries, num_entries, query_tile, fp32_workspace = sizes
        launch = plan_launch(num_items, num_queries, num_entries, query_tile, hq, k_cache.shape[2], d, q.dtype,
                             q.device.type == "cpu")
        o_ws = torch.empty(num_entries, hq, d, dtype=torch.float32 if fp32_workspace else q.dtype, device=q.device)
        lse_ws = torch.empty(num_entries, hq, dtype=torch.float32, device=q.device)
        arrays = dict(zip(triton_backend.KERNEL_ARRAYS, tensors))
        return triton_backend.launch_prepared(q, k_cache, v_cache, arrays, o_ws, lse_ws, launch, sm_scale)[0]
    if backend == "cuda":
        from treedec.attention.backends import cuda_backend
        partials, merge, tile_tokens, max_query_entries = sizes
        o_ws = torch.empty(partials, hq, d, dtype=torch.float32, device=q.device)
        lse_ws = torch.empty(partials, hq, dtype=torch.float32, device=q.device)
        arrays = dict(zip(cuda_backend.KERNEL_ARRAYS, tensors))
        return cuda_backend.launch_prepared(q, k_cache, v_cache, arrays, tensors[-2], tensors[-1], o_ws, lse_ws,
                                            bool(merge), tile_tokens, max_query_entries, sm_scale)[0]
    raise ValueError(f"treedec::tree_attention runs the {OP_BACKENDS} kernels, got backend {backend!r}")


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
