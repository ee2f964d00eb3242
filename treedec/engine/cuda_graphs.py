"""CUDA graphs for tree steps: padded plans in fixed-capacity buffers, one graph per capacity.

A captured graph replays fixed kernels with fixed grids and pointers, but every step's
:class:`~treedec.attention.TreePlan` differs in size. A :class:`StaticStep` holds
device buffers of fixed *capacity* (queries, tree tokens, chunks, entries, work items,
mask words) and loads each step's plan into them **padded**, so that the Triton kernels
captured with the capacity's launch grid compute the same result as for the unpadded plan:

- padded work items have ``item_num_entries = 0``: their programs load three ints and stop;
- padded queries have no entries (``query_entry_start`` repeats its last value): the merge
  kernel stores nothing for them; their rows carry garbage through the MLP and are dropped;
- padded queries write their K/V to a scratch slot past the pool's pages (the engine keeps
  one spare page in its K/V storage for that), so no tree token is overwritten;
- mask words past a chunk's length are never read, so rows are zero-padded to ``mask_words``.

The step's inputs (token ids, positions, slots) and all plan arrays are packed into one
pinned int32 host buffer and copied to the device in one transfer before ``replay()``.
Capacities are powers of two; a plan that does not fit its query bucket's graph makes the
runner capture a larger one (the union of both), up to ``max_graphs`` graphs; beyond that,
or past ``max_queries``, the step runs eagerly and the reason is counted in ``stats``.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from treedec.attention.tree_plan import DeviceTreePlan, TreePlan

logger = logging.getLogger("treedec")

# DeviceTreePlan's index tensors, in its field order (the kernels take them by name).
_PLAN_ARRAYS = tuple(f.name for f in dataclasses.fields(DeviceTreePlan) if f.name not in ("plan", "cache"))
# How each array is padded past the plan's length: "edge" repeats the last value (empty CSR rows).
_EDGE_PADDED = ("chunk_kv_start", "chunk_entry_start", "query_entry_start")


@dataclass(frozen=True)
class CudaGraphConfig:
    """When the engine replays captured graphs.

    ``max_queries``: steps with more queries (e.g. long prefill chunks) run eagerly.
    ``max_graphs``: most graphs kept captured (one per query bucket, grown on demand).
    ``capture``: False runs the padded static buffers eagerly instead of capturing: the
    same arithmetic as a replay, for checking the padding where there is no CUDA device.
    """

    max_queries: int = 256
    max_graphs: int = 16
    capture: bool = True

    def __post_init__(self):
        for name in ("max_queries", "max_graphs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CudaGraphConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class PlanCapacity:
    """Upper bounds of a padded plan (all powers of two)."""

    queries: int
    tokens: int
    chunks: int
    entries: int
    items: int
    mask_words: int

    @classmethod
    def for_plan(cls, plan: TreePlan) -> "PlanCapacity":
        q = _pow2(plan.num_queries)
        return cls(queries=q, tokens=_pow2(max(plan.num_tokens, 1024)), chunks=_pow2(max(plan.num_chunks, 16)),
                   # more entries than queries, so that the merge kernel is part of every graph
                   entries=_pow2(max(plan.num_entries, 2 * q, 64)), items=_pow2(max(plan.num_items, 16)),
                   mask_words=_pow2(plan.mask_words))

    def fits(self, plan: TreePlan) -> bool:
        return (plan.num_queries <= self.queries and plan.num_tokens <= self.tokens
                and plan.num_chunks <= self.chunks and plan.num_entries <= self.entries
                and plan.num_items <= self.items and plan.mask_words <= self.mask_words)

    def union(self, other: "PlanCapacity") -> "PlanCapacity":
        return PlanCapacity(*(max(a, b) for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every DeviceTreePlan array at this capacity."""
        e, i = self.entries, self.items
        return {"kv_slots": (self.tokens,), "chunk_kv_start": (self.chunks + 1,),
                "chunk_entry_start": (self.chunks + 1,), "entry_query": (e,), "entry_mask": (e, self.mask_words),
                "query_entry_start": (self.queries + 1,), "query_entries": (e,), "entry_direct": (e,),
                "item_chunk": (i,), "item_entry_start": (i,), "item_num_entries": (i,)}


class StaticStep:
    """Device buffers of one capacity: the step inputs ``[3, queries]`` (tokens, positions, slots) and a padded plan.

    :meth:`load` packs a step into the pinned host buffer and copies it over in one transfer;
    :attr:`device_plan` is the DeviceTreePlan over the device buffers that TreeAttention runs.
    """

    def __init__(self, capacity: PlanCapacity, device: torch.device, scratch_slot: int):
        self.capacity = capacity
        self.scratch_slot = scratch_slot
        shapes = {"inputs": (3, capacity.queries), **capacity.shapes()}
        sizes = [int(np.prod(s)) for s in shapes.values()]
        self._host = torch.empty(sum(sizes), dtype=torch.int32, pin_memory=device.type == "cuda")
        self._device = torch.empty(sum(sizes), dtype=torch.int32, device=device)
        host_parts = torch.split(self._host, sizes)
        device_parts = torch.split(self._device, sizes)
        self._host_views = {n: p.numpy().reshape(s) for n, p, s in zip(shapes, host_parts, shapes.values())}
        self._device_views = {n: p.view(s) for n, p, s in zip(shapes, device_parts, shapes.values())}
        self.inputs = self._device_views["inputs"]
        self.device_plan: DeviceTreePlan | None = None
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def load(self, plan: TreePlan, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """Pack the step (padded to capacity) and copy it to the device (asynchronous from pinned memory)."""
        assert self.capacity.fits(plan), f"{self.capacity=} cannot hold {plan.summary()=}"
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the pinned buffer
        n = plan.num_queries
        inputs = self._host_views["inputs"]
        inputs[:, :n] = (tokens, positions, slots)
        inputs[:, n:] = np.array([[0], [0], [self.scratch_slot]], dtype=np.int32)
        for name in _PLAN_ARRAYS:
            src, dst = getattr(plan, name), self._host_views[name]
            if src.ndim == 2:
                dst[: len(src), : src.shape[1]] = src
                dst[: len(src), src.shape[1]:] = 0
                dst[len(src):] = 0
            else:
                dst[: len(src)] = src
                dst[len(src):] = src[-1] if name in _EDGE_PADDED else 0
        self._device.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.device_plan is None:
            self.device_plan = self._make_device_plan(plan)

    def _make_device_plan(self, plan: TreePlan) -> DeviceTreePlan:
        """The DeviceTreePlan the kernels are launched (and captured) with: the capacity's sizes.

        Its host plan carries the capacity's array lengths, from which the Triton backend
        sizes its grids and partial-state workspace once (cached on this object).
        """
        padded = {name: self._host_views[name].astype(np.int64) for name in _PLAN_ARRAYS}
        padded["entry_mask"] = self._host_views["entry_mask"].copy()
        padded["entry_direct"] = padded["entry_direct"].astype(bool)
        host = dataclasses.replace(plan, num_queries=self.capacity.queries, **padded)
        return DeviceTreePlan(host, **{name: self._device_views[name] for name in _PLAN_ARRAYS})


@dataclass
class _Graph:
    static: StaticStep
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None    # [queries, vocab]: the captured graph's outputs
    hidden: torch.Tensor | None = None    # [queries, hidden_size]


class GraphRunner:
    """Runs steps from padded static buffers, replaying one captured graph per query bucket.

    ``forward(static) -> (logits [capacity.queries, vocab], hidden [capacity.queries,
    hidden_size])`` is the model forward over a :class:`StaticStep`'s buffers (the engine
    provides it). Every graph keeps both outputs, so steps that need hidden states (Medusa
    heads, draft models) replay the same graphs as steps that need logits only.
    """

    def __init__(self, config: CudaGraphConfig, forward: Callable[[StaticStep], torch.Tensor],
                 device: torch.device, scratch_slot: int):
        self.config = config
        self.device = device
        self._forward = forward
        self._scratch_slot = scratch_slot
        self._graphs: dict[int, _Graph] = {}   # by capacity.queries
        self._pool = torch.cuda.graph_pool_handle() if config.capture else None
        self.stats: Counter = Counter()

    def run(self, plan: TreePlan, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(logits [Q, vocab], hidden [Q, hidden_size])`` of the step, or None when it must run
        eagerly (the reason counted in :attr:`stats`). The tensors are views of the graph's
        outputs: valid until the next :meth:`run`."""
        if plan.num_queries > self.config.max_queries:
            return self._eager(f"more than max_queries={self.config.max_queries} queries")
        need = PlanCapacity.for_plan(plan)
        entry = self._graphs.get(need.queries)
        replaced = None  # kept alive until the new graph is captured (see below)
        if entry is None or not entry.static.capacity.fits(plan):
            if entry is None and len(self._graphs) >= self.config.max_graphs:
                return self._eager(f"max_graphs={self.config.max_graphs} graphs already captured")
            capacity = need if entry is None else entry.static.capacity.union(need)
            replaced = self._graphs.pop(need.queries, None)
            entry = self._graphs[need.queries] = _Graph(StaticStep(capacity, self.device, self._scratch_slot))
        entry.static.load(plan, tokens, positions, slots)
        if not self.config.capture:
            self.stats["static_eager"] += 1
            logits, hidden = self._forward(entry.static)
            return logits[: plan.num_queries], hidden[: plan.num_queries]
        if entry.graph is None:
            self._capture(entry)
        # Only now may a replaced graph go: its memory returns to the shared pool, and a
        # private pool whose last graph died cannot be captured into again (allocator assert).
        del replaced
        entry.graph.replay()
        self.stats["replays"] += 1
        return entry.logits[: plan.num_queries], entry.hidden[: plan.num_queries]

    def _capture(self, entry: _Graph) -> None:
        """Warm up on a side stream (Triton compiles; launch parameters and the workspace are cached
        on the static plan), then capture the forward over the static buffers."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._forward(entry.static)
        current.wait_stream(side)
        entry.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.graph, pool=self._pool):
            entry.logits, entry.hidden = self._forward(entry.static)
        self.stats["captures"] += 1
        logger.info("captured a CUDA graph for %s", entry.static.capacity)

    def _eager(self, reason: str) -> None:
        key = f"eager: {reason}"
        if self.stats[key] == 0:
            logger.info("tree step runs eagerly: %s", reason)
        self.stats[key] += 1
        return None


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
