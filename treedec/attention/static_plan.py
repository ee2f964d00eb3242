"""Static plans: a step's plan in device buffers of fixed address, so one CUDA graph serves every tree.

A captured CUDA graph replays its kernels with the pointers and grid sizes of the capture,
but every step's :class:`TreePlan` differs in size. A :class:`StaticPlan` allocates every plan
array (and what its kernel backend derives from a plan: the cuda backend's work schedule)
once, at :class:`PlanBounds`, prepares the backend's launch at those sizes, and then
:meth:`StaticPlan.write` loads any plan within the bounds into the same buffers, **padded** so
that the launch prepared at the bounds computes exactly that plan:

- padded work items have no entries (the triton programs of such an item load three ints and stop);
- padded queries have no entries (``query_entry_start`` repeats its last value): the merge
  stores nothing for them, their output rows are unspecified;
- mask words past a chunk's length are never read, so mask rows are zero-padded;
- the cuda backend's schedule lists only the plan's units, on its fixed persistent grid.

So::

    attn = TreeAttention(32, 8, 128, dtype=torch.bfloat16)
    static = attn.static_plan(PlanBounds(max_queries=64, max_tokens=8192))
    plan = attn.plan(tree, into=static)              # plan() of any tree within the bounds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.run(q_static, k_cache, v_cache, plan)   # q_static: [max_queries, Hq, D]
    attn.plan(other_tree, into=static); graph.replay()     # out now holds other_tree's attention

The host side is one pinned int32 buffer; :meth:`StaticPlan.write` copies the used part of
each section to the device asynchronously on the current stream (adjacent sections in one
copy), together with caller-owned ``extra`` sections (the engine's token ids, positions and
slots), so a step's whole input travels in one or a few transfers.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from treedec.attention.planner_choice import planner_impl
from treedec.attention.tree_plan import DEVICE_ARRAYS, MASK_BITS, DeviceTreePlan, TreePlan
from treedec.checks import positive_int
from treedec.errors import PlanError

# How a section is padded, as the compiled planner's stage_sections takes it (kernels/planner/static_write.h):
# only the values, zeros to the bounds, the last value repeated to the bounds, a 2-D section's rows zero
# past the values' width.
_PREFIX, _ZEROS, _EDGE, _ZERO_TAILS = range(4)
# Arrays padded by repeating their last value (CSR starts: empty rows); the rest with zeros.
_EDGE_PADDED = ("chunk_kv_start", "chunk_entry_start", "query_entry_start")
# Arrays a launch reads to the bounds (the triton grid covers every item, the merge every query);
# of the others only what the plan's own items point at is read, so only that prefix is copied.
_READ_TO_BOUNDS = ("item_chunk", "item_entry_start", "item_num_entries", "query_entry_start")
_COALESCE_GAP = 16384  # int32 words (64 KiB): copying a gap this small beats another copy launch


@dataclass(frozen=True)
class PlanBounds:
    """Upper bounds of the plans a :class:`StaticPlan` holds (the sizes of its buffers).

    max_queries : query tokens per step (rows of ``q``).
    max_tokens : KV tokens the step's queries read (the tree's needed tokens).
    max_chunks : KV chunks (default: enough for ``max_tokens`` in 64-token chunks plus one per query).
    max_entries : (chunk, query) pairs (default: 16 per query plus one per chunk); each costs
        ``Hq * D * 4`` bytes of partial-state workspace.
    max_items : work items (default ``max_entries``: an item has at least one entry).
    max_chunk_tokens : longest chunk (sets the mask row length; the planner's automatic chunk
        sizes are at most 4096).
    """

    max_queries: int
    max_tokens: int
    max_chunks: int | None = None
    max_entries: int | None = None
    max_items: int | None = None
    max_chunk_tokens: int = 4096

    def __post_init__(self):
        for name, label in _BOUND_FIELDS:
            value = getattr(self, name)
            if value is not None:
                positive_int(label, value)
        # (queries, tokens, chunks, entries, items): what problem() compares a plan's sizes with, every graphed step
        object.__setattr__(self, "_limits", (self.max_queries, self.max_tokens, self.chunks, self.entries,
                                             self.items))

    @classmethod
    def for_plan(cls, plan: TreePlan) -> "PlanBounds":
        """Bounds that hold ``plan`` (powers of two; the queries' :meth:`query_bucket`): a bucket that plans of
        similar steps share."""
        q = cls.query_bucket(plan.num_queries)
        return cls(max_queries=q, max_tokens=_pow2(max(plan.num_tokens, 1024)),
                   max_chunks=_pow2(max(plan.num_chunks, 16)),
                   # more entries than queries, so that the merge is part of every launch
                   max_entries=_pow2(max(plan.num_entries, 2 * q, 64)), max_items=_pow2(max(plan.num_items, 16)),
                   max_chunk_tokens=MASK_BITS * _pow2(plan.mask_words))

    @staticmethod
    def query_bucket(num_queries: int) -> int:
        """The ``max_queries`` of :meth:`for_plan` for a plan of ``num_queries`` queries: the power of two up to
        :data:`POW2_QUERY_BUCKETS`, past it 5/8, 3/4 or all of the next power of two (320, 384, 512, 640, 768,
        1024, ...).

        Every row of a bucket runs the model's GEMMs; up to a few hundred rows they cost about one read of the
        weights whatever the rows (an 8B model's knee is ~256 rows on an H200), past it each row costs its
        arithmetic: a power of two there ran 8 Medusa-64 requests' 264 verify tokens as 512 rows
        (bench/results/2026-12-02-nvidia-h200-batch-s19-tree-prof.json: 10.9 of a 16 ms step in GEMMs; 11.8 ms
        a step at 320 rows). No 7/8 bucket: cuBLAS ran an 8B step's GEMMs at 448 rows in 14.3 ms, at 512 in 11.2
        (...-gemm-rows-s19.json). vLLM captures multiples of 8 up to 256 and of 16 past it; each bucket here is
        captured (and, with ``compile_model``, compiled) when first needed, so fewer, coarser ones."""
        bucket = _pow2(num_queries)
        if bucket <= POW2_QUERY_BUCKETS:
            return bucket
        return next(b for b in (bucket * 5 // 8, bucket * 3 // 4, bucket) if b >= num_queries)

    @property
    def chunks(self) -> int:
        return self.max_chunks or -(-self.max_tokens // 64) + self.max_queries

    @property
    def entries(self) -> int:
        return self.max_entries or 16 * self.max_queries + self.chunks

    @property
    def items(self) -> int:
        return self.max_items or self.entries

    @property
    def mask_words(self) -> int:
        return -(-self.max_chunk_tokens // MASK_BITS)

    def problem(self, plan: TreePlan) -> str | None:
        """None if ``plan`` fits, else which bound it exceeds (a sentence)."""
        sizes = plan.sizes()
        for value, bound, (what, name) in zip(sizes, self._limits, _SIZE_NAMES):
            if value > bound:
                return f"the tree's plan has {value} {what}, over PlanBounds.{name}={bound}"
        # The mask's width bounds the longest chunk: only a plan near max_chunk_tokens has its chunks scanned.
        if MASK_BITS * sizes[-1] > self.max_chunk_tokens and plan.max_chunk_len > self.max_chunk_tokens:
            return (f"the tree's plan has {plan.max_chunk_len} tokens in its longest chunk, over "
                    f"PlanBounds.max_chunk_tokens={self.max_chunk_tokens}")
        return None

    def fits(self, plan: TreePlan) -> bool:
        return self.problem(plan) is None

    def union(self, other: "PlanBounds") -> "PlanBounds":
        """The smallest bounds holding both (explicitly sized)."""
        return PlanBounds(max(self.max_queries, other.max_queries), max(self.max_tokens, other.max_tokens),
                          max(self.chunks, other.chunks), max(self.entries, other.entries),
                          max(self.items, other.items), max(self.max_chunk_tokens, other.max_chunk_tokens))

    def array_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every :class:`DeviceTreePlan` array at these bounds."""
        e, c = self.entries, self.chunks
        return {"kv_slots": (self.max_tokens,), "chunk_kv_start": (c + 1,), "chunk_entry_start": (c + 1,),
                "entry_query": (e,), "entry_mask": (e, self.mask_words), "query_entry_start": (self.max_queries + 1,),
                "query_entries": (e,), "entry_direct": (e,), "item_chunk": (self.items,),
                "item_entry_start": (self.items,), "item_num_entries": (self.items,)}


#: (field, how its error names it) of every PlanBounds size: built once, as the check runs every graphed step.
_BOUND_FIELDS = tuple((f.name, f"PlanBounds.{f.name}") for f in dataclasses.fields(PlanBounds))
#: how problem() names each of TreePlan.sizes() but the mask's width, and its bound
_SIZE_NAMES = (("queries", "max_queries"), ("needed KV tokens", "max_tokens"), ("chunks", "max_chunks"),
               ("entries", "max_entries"), ("work items", "max_items"))
#: a plan's DEVICE_ARRAYS in one call (a graphed step writes them all)
_device_arrays = operator.attrgetter(*DEVICE_ARRAYS)


class StaticBackend(Protocol):
    """What a backend of static plans (``Backend.static_plans``: ``TritonBackend``, ``CudaBackend``) provides
    for them, from its ``Backend.for_static_plans``."""

    name: str

    def static_sections(self, bounds: PlanBounds) -> dict[str, int]:
        """int32 words of each buffer section the backend writes per plan (its schedule), by name."""

    def prepare_static(self, plan: DeviceTreePlan, bounds: PlanBounds, sections: dict[str, torch.Tensor]) -> object:
        """The launch of every plan written into ``plan``'s buffers (device views of its sections)."""

    def static_values(self, plan: TreePlan, prepared: object) -> dict[str, np.ndarray]:
        """``plan``'s values of the backend's sections (a prefix of each), or PlanError if they do not fit."""


class StaticPlan:
    """A plan's device arrays (and its backend's) in buffers of fixed address, sized from ``bounds``.

    Made by :meth:`TreeAttention.static_plan`. :meth:`write` loads a plan (``TreeAttention.plan(tree,
    into=static)`` does that); :attr:`device_plan` is the prepared :class:`DeviceTreePlan` over the
    buffers, the same object for every plan, which a captured ``TreeAttention.run`` replays.
    ``extra`` names caller-owned int32 sections (name -> shape) written with each plan
    (:meth:`write`'s ``extra``) and read on the device from :attr:`extra`.
    """

    def __init__(self, bounds: PlanBounds, backend: StaticBackend, device: torch.device,
                 extra: dict[str, tuple[int, ...]] | None = None):
        self.bounds, self.backend, self.device = bounds, backend, torch.device(device)
        shapes = {**bounds.array_shapes(), **{n: (w,) for n, w in backend.static_sections(bounds).items()},
                  **(extra or {})}
        sizes = [int(np.prod(s)) for s in shapes.values()]
        offsets = np.cumsum([0, *sizes]).tolist()
        self._span = {name: (offsets[i], offsets[i] + sizes[i]) for i, name in enumerate(shapes)}
        self._host = torch.zeros(offsets[-1], dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._dev = torch.zeros(offsets[-1], dtype=torch.int32, device=self.device)
        host_np = self._host.numpy()
        self._host_views = {n: host_np[a:b].reshape(shapes[n]) for n, (a, b) in self._span.items()}
        self._dev_views = {n: self._dev[a:b].view(shapes[n]) for n, (a, b) in self._span.items()}
        self.extra = {n: self._dev_views[n] for n in (extra or {})}
        self._backend_sections = [n for n in shapes if n not in bounds.array_shapes() and n not in self.extra]
        # Where and how the compiled planner's stage_sections writes each section: (offset, rows, cols or 0
        # for 1-D, padding) as the numpy path below pads (_write_array).
        self._host_flat = host_np
        self._placement = {n: (start, shapes[n][0], shapes[n][1] if len(shapes[n]) == 2 else 0, _padding(n))
                           for n, (start, _) in self._span.items()}
        self._plan_placement = [self._placement[n] for n in DEVICE_ARRAYS]
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.device_plan: DeviceTreePlan | None = None  # prepared at the first write
        self.current: TreePlan | None = None            # the plan last written

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def write(self, plan: TreePlan, extra: dict[str, np.ndarray] | None = None) -> DeviceTreePlan:
        """Load ``plan`` (padded) and the ``extra`` sections' values, and copy them to the device.

        Raises PlanError, changing nothing, when ``plan`` exceeds the bounds (or, after the first
        plan, has another query tile: the launch is prepared for one; or another window: the layers that replay it
        are of one). The copy is asynchronous
        on the current stream; the pinned buffer is reused only after the previous copy read it.
        """
        device_plan, used = self._stage(plan, extra)
        for start, end in used:
            self._dev[start:end].copy_(self._host[start:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.device_plan, self.current = device_plan, plan
        return device_plan

    def _stage(self, plan: TreePlan, extra: dict[str, np.ndarray] | None
               ) -> tuple[DeviceTreePlan, list[tuple[int, int]]]:
        """The host work of :meth:`write` (bench/plan_cost.py times it on the CPU): the checks, raising before
        any change, then ``plan``, its backend's values and ``extra`` in the pinned buffer. Returns the
        prepared plan and the word ranges to copy."""
        problem = self.bounds.problem(plan)
        if problem is None and self.current is not None and plan.query_tile != self.current.query_tile:
            problem = (f"the plan's query tile {plan.query_tile} differs from this static plan's "
                       f"{self.current.query_tile}")
        if problem is None and self.current is not None and plan.window != self.current.window:
            problem = f"the plan's window {plan.window} differs from this static plan's {self.current.window}"
        if problem is not None:
            raise PlanError(problem)
        device_plan = self.device_plan or self._prepare(plan, self._padded(plan))
        backend_values = self.backend.static_values(plan, device_plan.prepared)
        unknown = sorted(set(extra or {}) - set(self.extra))
        if unknown:
            raise ValueError(f"extra sections {unknown} are not this static plan's {sorted(self.extra)}")
        module = planner_impl().module
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the pinned buffer
        values = {**backend_values, **(extra or {})}
        if module is not None:  # the compiled port of the code below (treedec/kernels/planner/static_write.h)
            sections = [(array, *placed) for array, placed in zip(_device_arrays(plan), self._plan_placement)]
            sections += [(value, *self._placement[name]) for name, value in values.items()]
            return device_plan, module.stage_sections(self._host_flat, sections)
        used = [self._write_array(name, getattr(plan, name)) for name in DEVICE_ARRAYS]
        for name, value in values.items():
            value, view = np.asarray(value), self._host_views[name]
            view[tuple(slice(0, n) for n in value.shape)] = value
            start = self._span[name][0]
            end = start + value.size
            if value.ndim == 2 and value.size:  # a 2-D prefix: its rows lie a section row apart
                end = start + (value.shape[0] - 1) * view.shape[1] + value.shape[1]
            used.append((start, end))
        return device_plan, _coalesce(sorted(used))

    def _write_array(self, name: str, src: np.ndarray) -> tuple[int, int]:
        """Write one plan array into its host section, padded where the launch reads to the bounds;
        returns the span of words to copy (the rest of the section is never read)."""
        view, start = self._host_views[name], self._span[name][0]
        n = len(src)
        if src.ndim == 2:   # entry_mask: the plan's rows at the bounds' width, words past its width 0
            view[:n, :src.shape[1]] = src
            view[:n, src.shape[1]:] = 0
            return start, start + n * view.shape[1]
        view[:n] = src
        if name not in _READ_TO_BOUNDS:
            return start, start + n
        view[n:] = src[-1] if name in _EDGE_PADDED else 0
        return start, start + view.size

    def _padded(self, plan: TreePlan) -> dict[str, np.ndarray]:
        """``plan``'s arrays padded to the bounds' shapes (int32): what the launch prepared at the bounds reads."""
        shapes = self.bounds.array_shapes()
        out = {}
        for name in DEVICE_ARRAYS:
            src, dst = getattr(plan, name), np.zeros(shapes[name], dtype=np.int32)
            if src.ndim == 2:   # entry_mask: words past the plan's width and rows past its entries are 0
                dst[:len(src), :src.shape[1]] = src
            else:
                dst[:len(src)] = src
                if name in _EDGE_PADDED:
                    dst[len(src):] = src[-1]
            out[name] = dst
        return out

    def _prepare(self, first: TreePlan, padded: dict[str, np.ndarray]) -> DeviceTreePlan:
        """The DeviceTreePlan over the buffers, its host plan carrying the bounds' array lengths
        (what the launch is sized by), prepared once by the backend."""
        arrays = {name: value.astype(np.int64) for name, value in padded.items()}
        arrays["entry_mask"] = padded["entry_mask"]
        arrays["entry_direct"] = arrays["entry_direct"].astype(bool)
        host = dataclasses.replace(first, num_queries=self.bounds.max_queries, **arrays)
        device_plan = DeviceTreePlan(host, **{name: self._dev_views[name] for name in DEVICE_ARRAYS},
                                     backend=self.backend.name, static=self)
        sections = {n: self._dev_views[n] for n in self._backend_sections}
        return dataclasses.replace(device_plan, prepared=self.backend.prepare_static(device_plan, self.bounds,
                                                                                      sections))


def _padding(name: str) -> int:
    """How :meth:`StaticPlan._write_array` pads section ``name`` (the other sections: values only)."""
    if name == "entry_mask":
        return _ZERO_TAILS
    if name in _READ_TO_BOUNDS:
        return _EDGE if name in _EDGE_PADDED else _ZEROS
    return _PREFIX


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted [start, end) ranges merged where the gap between them is small."""
    out: list[list[int]] = []
    for start, end in ranges:
        if out and start - out[-1][1] <= _COALESCE_GAP:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


#: query buckets are powers of two up to this many queries (:meth:`PlanBounds.query_bucket`)
POW2_QUERY_BUCKETS = 256


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
