"""Tree attention and the K/V store as torch custom ops, so ``torch.compile`` sees a whole decoder.

``torch.ops.treedec.tree_attention`` runs a prepared plan on a backend that has a custom op
launch (:attr:`Backend.custom_op`: the triton and cuda kernels) and ``torch.ops.treedec.store_kv``
writes a step's K/V into the paged caches in place. Both have fake (meta) implementations, so
Dynamo traces a model forward that calls them without graph breaks and Inductor fuses the code
around them (norms, RoPE, residuals); a captured CUDA graph then replays the compiled forward.
They are registered once, when this module is imported (``treedec.attention`` imports it).

A prepared plan is passed as plain values, :class:`~treedec.attention.backends.base.OpArgs` from
:meth:`TreeAttention.op_args`: its int32 tensors, the backend's typed launch sizes as a list of
ints (:class:`~treedec.attention.backends.base.OpSizes`) and the backend's registered name, which
the op looks up to launch (:meth:`Backend.run_op`). Inside ``torch.compile`` the ints are
constants of the compiled graph: a static plan (fixed buffers, sizes at its bounds) keeps them,
so one compile serves every plan written into it. The workspace of partial states is allocated
inside the op (from a CUDA graph's private pool when captured).

    args = attn.op_args(plan)
    out = torch.ops.treedec.tree_attention(*args.inputs(q, k_cache, v_cache, attn.variant, kv_scale))

The layer's :class:`~treedec.attention.variant.AttentionVariant` travels as ``list[float]``
(:meth:`~AttentionVariant.op_values`): a variant field is one more value, not one more argument.
"""
from __future__ import annotations

import torch

from treedec.attention.backends.base import get_backend
from treedec.attention.variant import AttentionVariant
from treedec.tree.paged_kv_pool import store_kv_slots


@torch.library.custom_op("treedec::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tensors: list[torch.Tensor],
                   sizes: list[int], backend: str, variant: list[float],
                   kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Tree attention of a prepared plan: ``out [Q, Hq, D]`` in q's dtype.

    ``q`` [Q, Hq, D]; ``k_cache``, ``v_cache`` [num_pages, page_size, Hkv, D] (q's dtype, or e4m3 with the layer's
    ``kv_scale`` [2, Hkv] float32); ``tensors``, ``sizes``, ``backend`` (a registered name whose backend has
    :attr:`~Backend.custom_op`) and ``variant`` (the layer's :meth:`AttentionVariant.op_values`) from
    :meth:`OpArgs.inputs`.
    """
    return get_backend(backend).run_op(q, k_cache, v_cache, tensors, sizes, AttentionVariant.from_op_values(variant),
                                       kv_scale)


@tree_attention.register_fake
def _(q, k_cache, v_cache, tensors, sizes, backend, variant, kv_scale=None):
    return torch.empty_like(q)


@torch.library.custom_op("treedec::store_kv", mutates_args=("k_slots", "v_slots"))
def store_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Write ``k``, ``v`` [n, Hkv, D] at ``slots`` [n] int64 of the caches viewed as [num_slots, Hkv, D], in place;
    with ``kv_scale`` ([2, Hkv] float32, an fp8 pool's layer scales) quantized to e4m3 first
    (:func:`~treedec.tree.paged_kv_pool.store_kv_slots`)."""
    store_kv_slots(k_slots, v_slots, slots, k, v, kv_scale)


@store_kv.register_fake
def _(k_slots, v_slots, slots, k, v, kv_scale=None):
    return None
