"""TreePlan: the contract between the planner (CPU, once per step) and the kernels.

The needed KV of the tree (every token some query reads), flattened depth-first, is cut
into chunks. Each chunk is grouped with all the queries that read any of its tokens
(KV-guided grouping): one *entry* per (chunk, query) pair, with a bit mask saying which
of the chunk's tokens that query reads. An entry produces one partial attention state
(O, LSE); each query's partials are merged in a fixed order (per-query CSR). A *work
item* is a chunk with a tile of at most ``query_tile`` of its entries; kernels run one
program per (work item, KV head), the query heads of a KV head fused into the rows.

All arrays are numpy on the CPU; :meth:`TreePlan.to` copies them to a device as int32.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from treedec.transfer import to_device
from treedec.tree.layout import TreeLayout

MASK_BITS = 32  # bits per mask word


@dataclass(frozen=True)
class TreePlan:
    """Attention metadata for one decode step, shared by all layers.

    Attributes
    ----------
    planner : str
        "flatten", "node" or "node_chunk".
    num_queries : int
        Q, the number of query tokens (rows of ``q`` in ``run``).
    kv_slots : [T] int64
        Pool slot of every needed token, in flattened (depth-first) order.
    chunk_kv_start : [C + 1] int64
        Chunk c covers ``kv_slots[chunk_kv_start[c]:chunk_kv_start[c + 1]]``.
    chunk_entry_start : [C + 1] int64
        Chunk c's entries are ``chunk_entry_start[c]:chunk_entry_start[c + 1]``.
    entry_query : [E] int64
        Query of each entry (entries sorted by (chunk, query)).
    entry_mask : [E, W] int32
        Bit ``t % 32`` of word ``t // 32`` is set when the entry's query reads token t
        of its chunk (``W = ceil(max_chunk_len / 32)``; bits past the chunk are 0).
    query_entry_start : [Q + 1] int64, query_entries : [E] int64
        Per-query CSR of its entries, in chunk order: the fixed merge order.
    entry_direct : [E] bool
        True when the entry is its query's only partial: it may write the output directly.
    item_chunk, item_entry_start, item_num_entries : [I] int64
        Work items, heaviest first by the cost model ``rows + kv_tokens``.
    chunk_size : int or None
        The chunk size the planner cut with (None for the ``node`` planner).
    query_tile : int
        Most entries per work item.
    max_slot : int
        Largest pool slot the plan reads (checked against the cache size by ``run``).
    layout : TreeLayout
        The snapshot this plan was made from.
    dynamic_kv : tuple[tuple[int, int], ...] or [R, 2] int64 ndarray
        [start, stop) ranges of positions in the flattened KV order (indices into ``kv_slots``) whose
        mask bits the device may clear after the plan is written (pipelined speculative decoding: the runs
        of positions holding a batch's span slots, one a span, or more where a batch-invariant plan copies
        or cuts it); the cuda backend's schedule never flags a tile
        holding one of them full, so its kernel reads the mask words there. Sorted by start, not
        overlapping (adjacent ones may touch), each ``0 <= start < stop <= num_tokens``; the schedule
        raises ValueError otherwise. (): none. The planners make (); callers set it with
        ``plan.with_dynamic_kv(((start, stop), ...))``, or an ``[R, 2]`` int64 array of the
        same ranges (:meth:`~treedec.attention.dynamic_span.DynamicSpans.locate`: a batch's spans as arrays).
    window : int or None
        The sliding window the planner clipped the queries' reads to (``AttentionVariant.window``; None: whole
        root paths): the mask fields the plan serves.
    """

    planner: str
    num_queries: int
    kv_slots: np.ndarray
    chunk_kv_start: np.ndarray
    chunk_entry_start: np.ndarray
    entry_query: np.ndarray
    entry_mask: np.ndarray
    query_entry_start: np.ndarray
    query_entries: np.ndarray
    entry_direct: np.ndarray
    item_chunk: np.ndarray
    item_entry_start: np.ndarray
    item_num_entries: np.ndarray
    chunk_size: int | None
    query_tile: int
    max_slot: int
    layout: TreeLayout
    dynamic_kv: tuple[tuple[int, int], ...] | np.ndarray = ()
    window: int | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_kv_start) - 1

    @property
    def num_entries(self) -> int:
        return len(self.entry_query)

    @property
    def num_items(self) -> int:
        return len(self.item_chunk)

    @property
    def num_tokens(self) -> int:
        return len(self.kv_slots)

    @property
    def max_chunk_len(self) -> int:
        starts = self.chunk_kv_start  # not np.diff: its checks cost more than the subtraction (every static write)
        return int((starts[1:] - starts[:-1]).max(initial=0))

    @property
    def mask_words(self) -> int:
        return self.entry_mask.shape[1]

    def sizes(self) -> tuple[int, int, int, int, int, int]:
        """``(num_queries, num_tokens, num_chunks, num_entries, num_items, mask_words)`` in one call (a static
        plan's bounds check, every graphed step)."""
        return (self.num_queries, len(self.kv_slots), len(self.chunk_kv_start) - 1, len(self.entry_query),
                len(self.item_chunk), self.entry_mask.shape[1])

    def with_dynamic_kv(self, ranges: tuple[tuple[int, int], ...] | np.ndarray) -> TreePlan:
        """This plan with ``dynamic_kv`` set to ``ranges``: ``dataclasses.replace(plan, dynamic_kv=ranges)`` in two
        calls where replace takes two dozen (the speculative batch's spans are located in every step's plan)."""
        plan = object.__new__(TreePlan)
        plan.__dict__.update(self.__dict__, dynamic_kv=ranges)   # (every field is an init field; none is derived)
        return plan

    def kv_tokens_read(self) -> int:
        """KV tokens loaded from memory per KV head: each chunk once per work item."""
        starts = self.chunk_kv_start   # (np.diff's wrapper costs more than this subtraction: it runs every step)
        return int(np.add.reduce((starts[1:] - starts[:-1])[self.item_chunk]))

    def summary(self) -> dict:
        """Sizes of the plan, for logs and benchmark reports."""
        return {
            "planner": self.planner, "queries": self.num_queries, "tree_tokens": self.num_tokens,
            "chunks": self.num_chunks, "entries": self.num_entries, "work_items": self.num_items,
            "chunk_size": self.chunk_size, "max_chunk_len": self.max_chunk_len, "query_tile": self.query_tile,
            "direct_queries": int(self.entry_direct.sum()),
        }

    def to(self, device: torch.device | str) -> "DeviceTreePlan":
        """Copy the index arrays to ``device`` as int32 tensors (one transfer)."""
        held = vars(self)
        arrays = [held[n] for n in DEVICE_ARRAYS]
        mask = arrays[MASK_AT]   # (the one 2-D array)
        arrays[MASK_AT] = mask.reshape(-1)
        flat = to_device(np.concatenate(arrays, dtype=np.int32, casting="unsafe"), device)   # (bool, int64 -> int32)
        parts = list(flat.split_with_sizes([a.size for a in arrays]))
        parts[MASK_AT] = parts[MASK_AT].view(mask.shape)
        return DeviceTreePlan(self, *parts)


@dataclass(frozen=True)
class DeviceTreePlan:
    """The int32 tensors of a :class:`TreePlan` on a device (same names and shapes).

    ``backend`` names the kernel backend that runs the plan and ``prepared`` holds what that
    backend derived from it at plan time (launch parameters, work schedule, workspace; e.g.
    ``TritonPrepared``, ``CudaPrepared``): ``TreeAttention.plan`` fills both, and every layer of
    the step launches with them. A plan straight from :meth:`TreePlan.to` has neither. ``static``
    is the :class:`~treedec.attention.StaticPlan` whose buffers hold the arrays, if any: its
    ``current`` plan is what they hold (``plan`` then only carries the bounds' sizes).
    """

    plan: TreePlan
    kv_slots: torch.Tensor
    chunk_kv_start: torch.Tensor
    chunk_entry_start: torch.Tensor
    entry_query: torch.Tensor
    entry_mask: torch.Tensor
    query_entry_start: torch.Tensor
    query_entries: torch.Tensor
    entry_direct: torch.Tensor
    item_chunk: torch.Tensor
    item_entry_start: torch.Tensor
    item_num_entries: torch.Tensor
    backend: str | None = None
    prepared: object = field(default=None, repr=False, compare=False)
    static: object = field(default=None, repr=False, compare=False)  # the StaticPlan holding these arrays

    def with_launch(self, backend: str, prepared: object) -> DeviceTreePlan:
        """This plan with ``backend`` and ``prepared`` set: ``dataclasses.replace`` in two calls where replace takes
        two dozen (an eager step prepares its plans every step)."""
        plan = object.__new__(DeviceTreePlan)
        plan.__dict__.update(self.__dict__, backend=backend, prepared=prepared)   # (every field is an init field)
        return plan


DEVICE_ARRAYS = tuple(f.name for f in fields(DeviceTreePlan) if f.type == "torch.Tensor")
MASK_AT = DEVICE_ARRAYS.index("entry_mask")
