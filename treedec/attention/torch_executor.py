"""The ``torch`` backend's execution of a TreePlan with PyTorch ops (fp32 math), in one of three forms.

:func:`prepare_torch` turns a step's plan into a :class:`TorchLaunch` once (index tensors, masks), which
:func:`run_torch` runs for every layer:

- ``chunks``: the plan as the kernels run it: a partial (O, LSE) per entry, chunk by chunk, then the per-query
  merge. It checks planners on any machine.
- ``rows``: ``chunks`` with each entry's partial its own attention over its chunk's K/V (gathered once a chunk):
  a CPU GEMM takes other code paths (and sums in other orders) for other row counts, so only one row at a time
  gives a query the same bits whatever else reads its chunk (the batch-invariant mode's form, as its projections
  run ``F.linear`` row by row). It costs a few ops an entry.
- ``dense``: one masked attention of every query over all of the plan's KV tokens at once (a handful of ops
  a layer). It computes what the queries do not read too, so ``auto`` takes it only where that is at most
  :data:`DENSE_MAX_WASTE` times the scores they need (one request decoding, a token tree or a prompt chunk of one
  request: every query reads most of the tokens). On the CPU a step of one decoding request then runs ~8 ops a
  layer instead of ~15 per chunk plus the merge (``bench/cpu_generate.py``).

Both are exact softmax attention in fp32; they differ by rounding only. The variant's logit hooks
(:meth:`AttentionVariant.logits`: a soft-cap) run on the scaled scores; its mask fields (a window) are the
plan's masks already (the planner clipped the read intervals).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from treedec.attention.merge import merge_states
from treedec.attention.tree_plan import MASK_BITS, TreePlan
from treedec.attention.variant import AttentionVariant
from treedec.tree.kv_cache_dtype import dequantize_kv

TORCH_FORMS = ("auto", "dense", "chunks", "rows")

#: ``auto`` runs the dense form while its score count (queries x KV tokens) is at most this many times the
#: scores the queries need (the tokens each reads): one request's decode, token tree or causal prompt chunk.
DENSE_MAX_WASTE = 2


class TorchAttention(NamedTuple):
    """What :func:`run_torch` returns: ``out [Q, Hq, D]`` float32 and ``lse [Q, Hq]`` float32 (natural log), None
    where it was not asked for."""

    out: torch.Tensor
    lse: torch.Tensor | None


@dataclass(frozen=True)
class TorchChunk:
    """One chunk of the ``chunks`` form: ``slots [L]`` int64 pool slots, ``rows [g]`` int64 queries reading it,
    ``reads [g, L]`` bool (None: every row reads every token), its entries ``[entry_start, entry_stop)``."""

    slots: torch.Tensor
    rows: torch.Tensor
    reads: torch.Tensor | None
    entry_start: int
    entry_stop: int


@dataclass(frozen=True)
class TorchLaunch:
    """A step's plan as the ``torch`` backend runs it (:func:`prepare_torch`); what ``plan.prepared`` holds.

    ``form``: ``"dense"``, ``"chunks"`` or ``"rows"`` (what ``auto`` chose, or what was asked). Dense: ``slots [T]``
    int64, or ``slot_range`` ``(start, stop)`` where they are consecutive (K/V read as a view of the pool, not gathered:
    one request's pages in order, as a fresh pool hands them out), and ``reads [Q, T]`` bool or None (every query
    reads every token). Chunks and rows: ``chunks``, and the merge's CSR ``query_entry_start [Q + 1]``,
    ``query_entries [E]`` int64 and ``num_entries``.
    """

    form: str
    num_queries: int
    slots: torch.Tensor | None = None
    slot_range: tuple[int, int] | None = None
    reads: torch.Tensor | None = None
    chunks: tuple[TorchChunk, ...] = ()
    query_entry_start: torch.Tensor | None = None
    query_entries: torch.Tensor | None = None
    num_entries: int = 0
    dtype: torch.dtype | None = None   # any: the torch backend runs every float dtype

    def op_args(self):
        raise ValueError("the torch backend runs in Python, not as the treedec::tree_attention op")


def prepare_torch(plan: TreePlan, device: torch.device | str, form: str = "auto") -> TorchLaunch:
    """The :class:`TorchLaunch` of ``plan`` (its host arrays; a dynamic span already masked there) on ``device``.

    ``form``: ``"auto"`` (dense where its waste is at most :data:`DENSE_MAX_WASTE`, see the module), ``"dense"``,
    ``"chunks"`` or ``"rows"``.
    """
    if form not in TORCH_FORMS:
        raise ValueError(f"form must be one of {TORCH_FORMS}, got {form!r}")
    starts = plan.chunk_kv_start
    lengths = starts[1:] - starts[:-1]
    # (query, token) pairs read: one bit each in the entries' masks (bits past a chunk are 0)
    needed = int(np.unpackbits(np.ascontiguousarray(plan.entry_mask).view(np.uint8)).sum())
    scores = plan.num_queries * plan.num_tokens
    if form == "auto":
        form = "dense" if scores <= DENSE_MAX_WASTE * needed else "chunks"
    if form == "dense" and needed == scores:   # every query reads every token (one request decoding): no mask
        return _dense(plan, None, device)
    entry_chunk = np.repeat(np.arange(plan.num_chunks), plan.chunk_entry_start[1:] - plan.chunk_entry_start[:-1])
    reads = _entry_reads(plan, entry_chunk, lengths)
    if form == "dense":
        dense = np.zeros((plan.num_queries, plan.num_tokens), dtype=bool)
        entry, column = np.nonzero(reads)
        dense[plan.entry_query[entry], starts[entry_chunk[entry]] + column] = True
        return _dense(plan, torch.from_numpy(dense).to(device), device)
    chunks = []
    for c in range(plan.num_chunks):
        e0, e1 = int(plan.chunk_entry_start[c]), int(plan.chunk_entry_start[c + 1])
        if e0 == e1:
            continue
        chunk_reads = reads[e0:e1, :lengths[c]]
        chunks.append(TorchChunk(_tensor(plan.kv_slots[starts[c]:starts[c + 1]], device),
                                 _tensor(plan.entry_query[e0:e1], device),
                                 None if chunk_reads.all() else torch.from_numpy(chunk_reads).to(device), e0, e1))
    return TorchLaunch(form, plan.num_queries, chunks=tuple(chunks),
                       query_entry_start=_tensor(plan.query_entry_start, device),
                       query_entries=_tensor(plan.query_entries, device), num_entries=plan.num_entries)


def run_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, launch: TorchLaunch,
              variant: AttentionVariant, return_lse: bool = True, kv_scale: torch.Tensor | None = None
              ) -> TorchAttention:
    """Tree attention of a prepared step.

    Parameters
    ----------
    q : [Q, Hq, D]
    k_cache, v_cache : [num_pages, page_size, Hkv, D]
    launch : from :func:`prepare_torch`, on q's device
    variant : the layer's (its scale and logit hooks; the plan holds its mask)
    return_lse : False: the dense form skips the LSE (``lse`` None); the chunks form merges by it anyway
    kv_scale : [2, Hkv] float32 for fp8 caches (de-quantized as they are read), else None

    Returns
    -------
    :class:`TorchAttention`: ``out [Q, Hq, D]`` float32, ``lse [Q, Hq]`` float32 (natural log) or None
    """
    num_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    k_flat = k_cache.reshape(-1, hkv, d)
    v_flat = v_cache.reshape(-1, hkv, d)

    def read(slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:   # K/V of slots (None: the range)
        if slots is None:
            k, v = (flat[launch.slot_range[0]:launch.slot_range[1]] for flat in (k_flat, v_flat))
        elif kv_scale is None:
            k, v = (flat.index_select(0, slots) for flat in (k_flat, v_flat))
        else:   # (the bytes: index_select has no fp8 kernel on every device)
            k, v = (flat.view(torch.uint8).index_select(0, slots).view(flat.dtype) for flat in (k_flat, v_flat))
        if kv_scale is None:
            return k.float(), v.float()
        return dequantize_kv(k, kv_scale[0]), dequantize_kv(v, kv_scale[1])

    if launch.form == "dense":
        return _attend(q.float(), *read(launch.slots if launch.slot_range is None else None), launch.reads, variant,
                       return_lse)
    o_parts = torch.empty(launch.num_entries, hq, d, dtype=torch.float32, device=q.device)
    lse_parts = torch.empty(launch.num_entries, hq, dtype=torch.float32, device=q.device)
    for chunk in launch.chunks:
        k, v = read(chunk.slots)
        if launch.form == "chunks":
            part = _attend(q.index_select(0, chunk.rows).float(), k, v, chunk.reads, variant, True)
            o_parts[chunk.entry_start:chunk.entry_stop] = part.out
            lse_parts[chunk.entry_start:chunk.entry_stop] = part.lse
            continue
        for row in range(chunk.entry_stop - chunk.entry_start):   # (rows: one query's GEMMs at a time)
            part = _attend(q.index_select(0, chunk.rows[row:row + 1]).float(), k, v,
                           None if chunk.reads is None else chunk.reads[row:row + 1], variant, True)
            o_parts[chunk.entry_start + row] = part.out[0]
            lse_parts[chunk.entry_start + row] = part.lse[0]
    return TorchAttention(*merge_states(o_parts, lse_parts, launch.query_entry_start, launch.query_entries))


def run_plan_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TreePlan,
                   variant: AttentionVariant, form: str = "chunks", kv_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`run_torch` over ``prepare_torch(plan, q.device, form)``: by default the plan
    executed chunk by chunk as the kernels run it (what their tests compare with)."""
    result = run_torch(q, k_cache, v_cache, prepare_torch(plan, q.device, form), variant, kv_scale=kv_scale)
    return result.out, result.lse


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reads: torch.Tensor | None,
            variant: AttentionVariant, return_lse: bool) -> TorchAttention:
    """Softmax attention of ``q [g, Hq, D]`` over ``k, v [L, Hkv, D]`` (fp32), row i reading the tokens where
    ``reads [g, L]`` (None: all; every row reads one at least): ``out [g, Hq, D]``, ``lse [g, Hq]`` (or None)."""
    g, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    # [Hkv, g * G, D]: the query heads of a KV head are its rows, one batched GEMM per product.
    qh = q.view(g, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, g * group, d)
    scores = variant.logits(torch.bmm(qh, k.permute(1, 2, 0)).mul_(variant.scale(d)))   # [Hkv, g * G, L]
    if reads is not None:
        scores.view(hkv, g, group, -1).masked_fill_(~reads[None, :, None, :], float("-inf"))
    lse = None
    if return_lse:
        # (not torch.logsumexp: ten times the cost of these four ops on small CPU tensors)
        m = scores.amax(dim=-1, keepdim=True)
        p = scores.sub_(m).exp_()
        s = p.sum(dim=-1, keepdim=True)
        out = torch.bmm(p, v.permute(1, 0, 2)).div_(s)                        # [Hkv, g * G, D]
        lse = s.log_().add_(m).view(hkv, g, group).permute(1, 0, 2).reshape(g, hq)
    else:
        out = torch.bmm(torch.softmax(scores, dim=-1), v.permute(1, 0, 2))
    return TorchAttention(out.view(hkv, g, group, d).permute(1, 0, 2, 3).reshape(g, hq, d), lse)


def _dense(plan: TreePlan, reads: torch.Tensor | None, device) -> TorchLaunch:
    """The dense launch of ``plan`` with its ``reads`` mask: the slots as a range where they are consecutive."""
    slots = plan.kv_slots
    if len(slots) and slots[-1] - slots[0] == len(slots) - 1 and (slots[1:] - slots[:-1] == 1).all():
        return TorchLaunch("dense", plan.num_queries, slot_range=(int(slots[0]), int(slots[-1]) + 1), reads=reads)
    return TorchLaunch("dense", plan.num_queries, _tensor(slots, device), reads=reads)


def _entry_reads(plan: TreePlan, entry_chunk: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[E, max_chunk_len] bool: entry e reads token t of its chunk (bits past the chunk cleared)."""
    words = np.ascontiguousarray(plan.entry_mask).view(np.uint32)
    bits = (words[:, :, None] >> np.arange(MASK_BITS, dtype=np.uint32)) & 1
    reads = bits.reshape(len(words), -1)[:, :plan.max_chunk_len].astype(bool)
    reads &= np.arange(reads.shape[1]) < lengths[entry_chunk][:, None]
    return reads


def _tensor(array: np.ndarray, device) -> torch.Tensor:
    """An int64 tensor of ``array`` on ``device`` (a copy: plan arrays are read-only)."""
    return torch.from_numpy(np.array(array, dtype=np.int64)).to(device)
