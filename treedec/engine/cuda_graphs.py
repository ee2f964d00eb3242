"""CUDA graphs for engine steps: one captured forward per query bucket.

A step's plan is written into a :class:`~treedec.attention.StaticPlan` of its bucket (the
attention layer's one static-plan mechanism, for every kernel backend; see
:mod:`treedec.attention.static_plan`), together with the step's token ids, positions and KV
slots (one pinned buffer, one or a few asynchronous copies), and the bucket's graph is
replayed. Buckets are powers of two of the plan's sizes, its queries' past 256 also 5/8 and 3/4 of the next power
(:meth:`PlanBounds.for_plan`, :meth:`~treedec.attention.static_plan.PlanBounds.query_bucket`); graphed
steps run the same kernels as eager ones. Padded query rows (past the step's
queries) embed token 0 at position 0 and write their K/V to a scratch slot past the pool's
pages (the engine keeps one spare page for it); their outputs are dropped.

A plan that does not fit its bucket's bounds makes the runner capture a larger graph (the
union of both bounds), up to ``max_graphs`` graphs; beyond that, or past ``max_queries``,
the step runs eagerly and the reason is counted in :attr:`GraphRunner.stats`.

A model whose layers form several attention groups (:mod:`treedec.engine.attention_groups`: a window's
layers and the others) has one plan per group a step: a bucket holds one static plan per group (the first
carries the step's inputs), each bounded on its own, all inside the one graph.
"""
from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Hashable

import numpy as np
import torch

from treedec.attention import PlanBounds, StaticPlan, TreeAttention, TreePlan, backend_names

Plans = tuple[TreePlan, ...]   # a step's plans, one per attention group
from treedec.checks import positive_int

logger = logging.getLogger("treedec")

MAX_TAILS = 4  # graphs of a forward with a tail kept per bucket (the latest used)
GATHERS = 3  # row-index arrays a step sends with its inputs (the engine's logits rows, hidden rows, token rows)


@dataclass(frozen=True)
class CudaGraphConfig:
    """When the engine replays captured graphs.

    ``max_queries``: steps with more queries (e.g. long prefill chunks) run eagerly. 512 (vLLM's largest
    capture size too): 64 tree-of-thought tasks of 6 branches decode 384 rows a step, eagerly past 256.
    ``max_graphs``: most graphs kept captured (one per bucket, grown on demand).
    ``capture``: False runs the static buffers eagerly instead of capturing: the same
    arithmetic as a replay, for checking the padding where there is no CUDA device.
    """

    max_queries: int = 512
    max_graphs: int = 16
    capture: bool = True

    def __post_init__(self):
        for name in ("max_queries", "max_graphs"):
            positive_int(f"CudaGraphConfig.{name}", getattr(self, name))


@dataclass
class GraphEntry:
    """One bucket's buffers (:meth:`GraphRunner.new_entry`): its static plans (one per attention group; the first
    holds the step's inputs) and per-row inputs, and once captured its graph and the outputs each replay writes."""

    statics: tuple[StaticPlan, ...]
    row_inputs: dict[str, torch.Tensor]      # per-row float inputs (a drafter's features), [max_queries, width]
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, ...] = ()   # the captured graph's outputs, [queries, ...] each
    gathered: list[int | None] = field(default_factory=lambda: [None] * GATHERS)  # the last load's gather lengths
    # graphs of the forward with a tail (:mod:`treedec.engine.step_tail`), by tail key: (graph, outputs, buffers)
    tails: dict = field(default_factory=dict)
    replaced: "GraphEntry | None" = None     # the entry it replaced, alive until its first capture

    @property
    def static(self) -> StaticPlan:
        """The first group's static plan: the one whose ``extra["inputs"]`` holds the step's inputs."""
        return self.statics[0]


class GraphRunner:
    """Runs steps from static plans, replaying one captured graph per query bucket.

    ``forward(statics, row_inputs) -> (logits [bounds.max_queries, vocab], hidden [bounds.max_queries,
    hidden_size], ...)`` is the model forward over :class:`StaticPlan` buffers, one per attention group
    (``planners``: the TreeAttention that writes each group's), its inputs in ``statics[0].extra["inputs"]``
    ([3 + GATHERS, max_queries] int32: token ids, positions, slots, then :meth:`load`'s gathers; the engine
    provides it) and ``row_inputs`` (one ``[max_queries, width]`` buffer per name of the
    constructor's ``row_inputs``, e.g. a drafter's features), returning a tuple of per-row outputs.
    Every graph keeps all of them, so steps that need hidden states (Medusa heads, draft models)
    replay the same graphs as steps that need logits only.
    """

    def __init__(self, config: CudaGraphConfig,
                 forward: Callable[[tuple[StaticPlan, ...], dict[str, torch.Tensor]], tuple[torch.Tensor, ...]],
                 planners: tuple[TreeAttention, ...], scratch_slot: int,
                 row_inputs: dict[str, tuple[int, torch.dtype]] | None = None):
        self.config = config
        self.planners = tuple(planners)
        self.attn = self.planners[0]
        self._forward = forward
        self._scratch_slot = scratch_slot
        self._row_inputs = dict(row_inputs or {})
        self._graphs: dict[int, GraphEntry] = {}  # by the bucket's max_queries
        self._pool = torch.cuda.graph_pool_handle() if config.capture else None
        self.stats: Counter = Counter()

    def load(self, plans: Plans, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
             gathers: tuple[np.ndarray | None, ...] = ()) -> GraphEntry | None:
        """Write the step planned by ``plans`` (one per attention group) into its bucket's static plans (the host
        side of a graphed step); None when it must run eagerly (the reason counted in :attr:`stats`).

        ``gathers``: up to :data:`GATHERS` arrays of output rows (e.g. the rows whose logits the step
        returns), sent to the device in the same copy as the step's inputs; :meth:`gather_index` gives
        each one's device indices."""
        if len(gathers) > GATHERS:
            raise ValueError(f"at most {GATHERS} gathers, got {len(gathers)}")
        num_queries = plans[0].num_queries
        if num_queries > self.config.max_queries:
            return self._eager(f"more than max_queries={self.config.max_queries} queries")
        key = PlanBounds.query_bucket(num_queries)
        entry = self._graphs.get(key)
        replaced = None  # kept alive until the new graph is captured (see below)
        if entry is None or not self.holds(entry, plans):
            if entry is None and len(self._graphs) >= self.config.max_graphs:
                return self._eager(f"max_graphs={self.config.max_graphs} graphs already captured")
            replaced = self._graphs.pop(key, None)
            entry = self._graphs[key] = self.new_entry(plans, None if replaced is None else replaced.statics)
        self.write(entry, plans, tokens, positions, slots, gathers)
        # The replaced graphs go once this entry's first graph is captured (:meth:`run`): their memory returns to
        # the shared pool, and a private pool whose last graph died cannot be captured into again (allocator
        # assert).
        if replaced is not None:
            entry.replaced = replaced
        return entry

    @staticmethod
    def holds(entry: GraphEntry, plans: Plans) -> bool:
        """Whether each of ``plans`` can be written into ``entry``'s static plan of its group (within its bounds,
        same query tile)."""
        for static, plan in zip(entry.statics, plans):   # (a loop: a generator costs calls every step)
            if static.current.query_tile != plan.query_tile or static.bounds.problem(plan) is not None:
                return False
        return True

    def new_entry(self, plans: Plans, grow: tuple[StaticPlan, ...] | None = None,
                  extra: dict[str, tuple[int, ...]] | None = None) -> GraphEntry:
        """Static buffers (a plan per group, inputs, per-row inputs; ``extra``: more int32 sections of the first
        group's) for plans like ``plans``: the bounds :meth:`PlanBounds.for_plan` gives each, joined with those
        of ``grow`` (the static plans of an entry it replaces); one query bucket for all."""
        bounds = [PlanBounds.for_plan(plan) for plan in plans]
        if grow is not None:
            bounds = [need.union(old.bounds) for need, old in zip(bounds, grow)]
        width = bounds[0].max_queries
        assert all(b.max_queries == width for b in bounds), [b.max_queries for b in bounds]   # one step's queries
        statics = tuple(attn.static_plan(b, extra={"inputs": (3 + GATHERS, width), **(extra or {})} if g == 0 else None)
                        for g, (attn, b) in enumerate(zip(self.planners, bounds)))
        buffers = {name: torch.zeros(width, row_width, dtype=dtype, device=statics[0].device)
                   for name, (row_width, dtype) in self._row_inputs.items()}
        return GraphEntry(statics, buffers)

    def write(self, entry: GraphEntry, plans: Plans, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
              gathers: tuple[np.ndarray | None, ...] = (), extra: dict[str, np.ndarray] | None = None) -> None:
        """Write a step (its plans, token ids, positions, slots, gathers and ``extra`` sections) into ``entry``'s
        buffers, padded (see the module docstring); one asynchronous copy a group."""
        width = entry.static.bounds.max_queries
        inputs = np.zeros((3 + GATHERS, width), dtype=np.int32)
        inputs[2] = self._scratch_slot
        inputs[:3, :plans[0].num_queries] = (tokens, positions, slots)
        entry.gathered = [None] * GATHERS
        for i, rows in enumerate(gathers):
            n = -1 if rows is None else len(rows)
            if 0 <= n <= width:   # more rows (repeats) go by a copy of their own
                inputs[3 + i, :n] = rows
                entry.gathered[i] = n
        entry.static.write(plans[0], extra={"inputs": inputs, **(extra or {})})
        for static, plan in zip(entry.statics[1:], plans[1:]):
            static.write(plan)

    def capture(self, forward: Callable[[], tuple[torch.Tensor, ...]]
                ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        """Warm ``forward`` up on a side stream (Triton compiles, the cuda extension loads), then capture it
        into the runner's memory pool: the graph and the outputs it writes at every replay."""
        device = self.attn.device
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            forward()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = tuple(forward())
        self.stats["captures"] += 1
        logger.info("captured a CUDA graph (%d outputs) on %s", len(outputs), self.attn.backend)
        return graph, outputs

    def forward(self, entry: GraphEntry) -> tuple[torch.Tensor, ...]:
        """The forward over ``entry``'s buffers, every row (what a capture records; a
        :class:`~treedec.engine.step_chain.StepChain` calls it inside its own graph)."""
        return self._forward(entry.statics, entry.row_inputs)

    def gather_index(self, entry: GraphEntry, which: int) -> torch.Tensor | None:
        """The device indices (int32) of the step's gather ``which`` (:meth:`load`'s ``gathers``), None when
        it was None or too long for the inputs section."""
        count = entry.gathered[which]
        return None if count is None else entry.static.extra["inputs"][3 + which, :count]

    def run(self, entry: GraphEntry, num_queries: int, row_inputs: dict[str, torch.Tensor] | None = None,
            tail: tuple[Hashable, Callable[[], tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...],
                        tuple[torch.Tensor, ...]] | None = None
            ) -> tuple[torch.Tensor, ...]:
        """The forward's outputs (``logits [num_queries, vocab], hidden [num_queries, hidden_size],
        ...``) for the step :meth:`load` wrote into ``entry``: its graph replayed (or, with
        ``capture`` off, the same forward over the static buffers). ``row_inputs``: this step's
        ``[num_queries, width]`` values of the runner's per-row inputs (all of them, when it has
        any). Views of the graph's outputs: valid until the next run.

        ``tail``: ``(key, body, buffers, state)``: ``body()`` runs the forward (:meth:`forward`) with device work
        before and after it (:mod:`treedec.engine.step_tail`) and returns the forward's outputs; one graph is
        recorded per ``key`` (the :data:`MAX_TAILS` latest kept per entry, with the ``buffers`` they read) and
        replayed; ``state``: the tensors whose values the capture's warm-up run must leave as they were."""
        given = row_inputs or {}
        if (given or entry.row_inputs) and set(given) != set(entry.row_inputs):
            raise ValueError(f"a step of this graph needs row inputs {sorted(entry.row_inputs)}, got {sorted(given)}")
        for name, value in given.items():
            entry.row_inputs[name][:num_queries].copy_(value)
        if not self.config.capture:
            self.stats["static_eager" if tail is None else "static_eager_tail"] += 1
            return tuple([t[:num_queries] for t in (self.forward(entry) if tail is None else tail[1]())])
        if tail is None:
            if entry.graph is None:
                entry.graph, entry.outputs = self.capture(lambda: self.forward(entry))
            graph, outputs = entry.graph, entry.outputs
            self.stats["replays"] += 1
        else:
            key, body, buffers, state = tail
            got = entry.tails.pop(key, None)   # (re-inserted last: the dict's order is the use order)
            if got is None:
                saved = [t.clone() for t in state]   # (the warm-up run of the capture is undone on them)
                got = (*self.capture(body), buffers)
                for t, value in zip(state, saved):
                    t.copy_(value)
                if len(entry.tails) >= MAX_TAILS:   # (dropped after the capture: the pool keeps a live graph)
                    entry.tails.pop(next(iter(entry.tails)))
            entry.tails[key] = got
            graph, outputs = got[0], got[1]
            self.stats["tail_replays"] += 1
        entry.replaced = None
        graph.replay()
        return tuple([t[:num_queries] for t in outputs])   # (a list first: a generator costs a call an output)

    def reset(self) -> None:
        """Drop every captured graph (the forward's outputs changed); the next steps capture anew,
        into a new memory pool (a pool whose graphs all died cannot be captured into again)."""
        self._graphs.clear()
        if self.config.capture:
            self._pool = torch.cuda.graph_pool_handle()

    def _eager(self, reason: str) -> None:
        key = f"eager: {reason}"
        if self.stats[key] == 0:
            logger.info("tree step runs eagerly: %s", reason)
        self.stats[key] += 1
        return None


def build_graph_runner(engine, forward: Callable, cuda_graphs: bool | CudaGraphConfig, compile_model: bool | dict
                       ) -> GraphRunner | None:
    """The :class:`GraphRunner` of ``engine``'s graphed steps of ``forward`` (its static forward; ``cuda_graphs``
    and ``compile_model`` checked), or None without graphs."""
    if compile_model is not False and cuda_graphs is False:
        raise ValueError("compile_model compiles the forward of graphed steps: it needs cuda_graphs")
    if not isinstance(compile_model, (bool, dict)):
        raise TypeError(f"compile_model must be a bool or a dict of torch.compile arguments, got {compile_model!r}")
    if cuda_graphs is False:
        return None
    config = CudaGraphConfig() if cuda_graphs is True else cuda_graphs
    if not isinstance(config, CudaGraphConfig):
        raise TypeError(f"cuda_graphs must be a bool or a CudaGraphConfig, got {cuda_graphs!r}")
    if config.capture and engine.device.type != "cuda":
        raise ValueError(f"cuda_graphs needs a CUDA device, the model is on {engine.device}")
    if not engine.attn.backend_impl.static_plans:
        raise ValueError(f"cuda_graphs needs a kernel attention backend "
                         f"({' or '.join(backend_names(lambda b: b.static_plans))}: their kernels read the "
                         f"plan from device memory only); this engine's is {engine.attn.backend!r}")
    scratch_slot = engine.pool.scratch_slot
    row_inputs = {} if engine.feature_size is None else {"features": (engine.feature_size, engine.model.dtype)}
    if compile_model is False:
        return GraphRunner(config, forward, engine.attention.planners, scratch_slot, row_inputs)
    options = {"fullgraph": True, "dynamic": False, **(compile_model if isinstance(compile_model, dict) else {})}
    compiled = torch.compile(functools.partial(forward, ops=True), **options)

    def compiled_forward(statics: tuple[StaticPlan, ...], inputs: dict[str, torch.Tensor]):
        # One compile per graph bucket (its static plans): allow as many as there are graphs.
        with torch._dynamo.config.patch(recompile_limit=max(8, 2 * config.max_graphs)), torch.no_grad():
            return compiled(statics, inputs)
    return GraphRunner(config, compiled_forward, engine.attention.planners, scratch_slot, row_inputs)


def token_sources(token_rows: np.ndarray, num_q: int) -> np.ndarray:
    """[num_q] int64: for each query, the index of its id among the step's device tokens (``token_rows``' order),
    -1 for the tree's own: what a graphed step's fill reads (fixed shapes, whatever the rows)."""
    sources = np.empty(num_q, dtype=np.int64)
    sources.fill(-1)
    sources[token_rows] = np.arange(len(token_rows))
    return sources


def fill_tokens(inputs: torch.Tensor, tokens: torch.Tensor) -> None:
    """A graphed step's token ids (``inputs[0]``) where its sources section (``inputs[5]``, :func:`token_sources`)
    names a device token (padded queries past the step's read token 0: their outputs are dropped)."""
    sources = inputs[3 + 2]
    picked = tokens.index_select(0, sources.clamp(min=0)).to(inputs.dtype)
    inputs[0].copy_(torch.where(sources >= 0, picked, inputs[0]))
