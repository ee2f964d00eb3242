"""StaticTreeAttention: plan into fixed device buffers, so one captured CUDA graph serves every tree.

A CUDA graph replays kernels with the pointers and grid sizes of its capture. This class
allocates every plan array, the persistent schedule and the partial-state workspace once,
sized from :class:`PlanBounds`; :meth:`StaticTreeAttention.plan` (CPU) writes each new
step's metadata into those buffers (one pinned host buffer, asynchronous copies on the
current stream) and :meth:`StaticTreeAttention.run` launches the cuda kernels on a grid that
never changes. So::

    attn = StaticTreeAttention(32, 8, 128, torch.bfloat16, PlanBounds(max_queries=256, max_tokens=65536))
    attn.plan(tree)                                  # first tree
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.run(q_static, k_cache, v_cache)   # q_static: [max_queries, Hq, D]
    attn.plan(other_tree); graph.replay()             # out now holds other_tree's attention

Rows of ``q``/``out`` past the current plan's queries are ignored/left unspecified.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from treedec.attention.persistent_schedule import SCHEDULE_HEADER, TILE_TOKENS, UNIT_FIELDS, schedule_units
from treedec.attention.planners import PERSISTENT_MAX_CHUNK, PlanConfig, make_plan
from treedec.attention.tree_plan import MASK_BITS, TreePlan
from treedec.errors import BackendUnavailableError, PlanError
from treedec.tree.layout import TreeLayout
from treedec.tree.sequence_tree import SequenceTree


@dataclass(frozen=True)
class PlanBounds:
    """Upper bounds of the trees a :class:`StaticTreeAttention` plans (its buffers' sizes).

    max_queries : query tokens per step.
    max_tokens : KV tokens the step's queries read (the tree's needed tokens).
    max_chunks : KV chunks (default: enough for ``max_tokens`` in 64-token chunks plus one per query).
    max_entries : (chunk, query) pairs (default: 16 per query plus one per chunk); each costs
        ``Hq * D * 4`` bytes of partial-state workspace.
    max_chunk_tokens : longest chunk (sets the mask row length; the planner's automatic
        chunk sizes are at most 4096).
    """

    max_queries: int
    max_tokens: int
    max_chunks: int | None = None
    max_entries: int | None = None
    max_chunk_tokens: int = 4096

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"PlanBounds.{f.name} must be a positive int, got {value!r}")

    @property
    def chunks(self) -> int:
        return self.max_chunks or -(-self.max_tokens // 64) + self.max_queries

    @property
    def entries(self) -> int:
        return self.max_entries or 16 * self.max_queries + self.chunks

    @property
    def mask_words(self) -> int:
        return -(-self.max_chunk_tokens // MASK_BITS)


_SECTIONS = ("kv_slots", "chunk_kv_start", "entry_query", "entry_mask", "entry_direct", "query_entry_start",
             "query_entries", "cta_unit_start", "unit_info")


class StaticTreeAttention:
    """Tree attention (cuda backend) whose ``run`` is CUDA-graph capturable across plans.

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim :
        GQA of any ratio; head_dim 64, 128 or 256.
    dtype : torch.float16 or torch.bfloat16
    bounds : PlanBounds
    plan_config : PlanConfig
        Planner settings (``flatten`` by default; chunks must stay within ``bounds.max_chunk_tokens``).
    sm_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    device : CUDA device, default the current one.
    tile_tokens : int, optional
        The KV tile of every plan (a graph replays one stage-1 kernel): 64 (default; every kernel) or
        96 where a kernel takes it (sm_90a, head dims 64/128), faster when the trees' chunks are long
        (``cuda_tree_attention.LONG_CHUNK_TOKENS`` and more: prompts of many thousand tokens).

    The merge kernel is fixed per graph too: the one for ``bounds.chunks`` partials a query (the bound)
    and the graph's rows of q (16 partial rows at once where that is over 8 and the (query, head) pairs
    fit one wave of that kernel, else up to 8).
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, bounds: PlanBounds,
                 plan_config: PlanConfig = PlanConfig(), sm_scale: float | None = None,
                 device: torch.device | str | None = None, tile_tokens: int = TILE_TOKENS):
        from treedec.kernels import cuda_tree_attention as ck
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        if head_dim not in ck.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {ck.SUPPORTED_HEAD_DIMS}, got {head_dim}")
        if dtype not in ck.SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be one of {ck.SUPPORTED_DTYPES}, got {dtype}")
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda":
            raise ValueError(f"StaticTreeAttention runs the cuda backend and needs a CUDA device, got {self.device}")
        from treedec.kernels.cuda_build import build_problem
        problem = build_problem(self.device)
        if problem is not None:
            raise BackendUnavailableError(problem)
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.dtype = num_qo_heads, num_kv_heads, head_dim, dtype
        self.group = num_qo_heads // num_kv_heads
        self.bounds = bounds
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        props = torch.cuda.get_device_properties(self.device)
        self.rows_per_unit = ck.ROWS_PER_UNIT[head_dim]
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.num_ctas = ck.persistent_grid_size(index, dtype, head_dim)
        self._ext = ck.extension(self.device)
        self.tile_tokens = ck.check_tile_tokens(tile_tokens, dtype, head_dim, self._ext)
        if bounds.max_chunk_tokens < PERSISTENT_MAX_CHUNK and plan_config.light_tile_cost is None:
            plan_config = dataclasses.replace(plan_config, light_tile_cost=1.0)  # balanced chunks reach that length
        self.plan_config = ck.cuda_plan_config(
            dataclasses.replace(plan_config, num_kv_heads=num_kv_heads, num_sms=props.multi_processor_count),
            self.device, head_dim, self.group)
        e, mw = bounds.entries, bounds.mask_words
        max_units = num_kv_heads * (e + -(-e * self.group // self.rows_per_unit))
        max_tiles = e * -(-bounds.max_chunk_tokens // TILE_TOKENS)  # live-tile lists: <= one per item (tiles >= 64)
        self._sizes = {"kv_slots": bounds.max_tokens, "chunk_kv_start": bounds.chunks + 1, "entry_query": e,
                       "entry_mask": e * mw, "entry_direct": e, "query_entry_start": bounds.max_queries + 1,
                       "query_entries": e, "cta_unit_start": self.num_ctas + 1,
                       "unit_info": SCHEDULE_HEADER + len(UNIT_FIELDS) * max_units + max_tiles}
        offsets = np.cumsum([0, *self._sizes.values()])
        self._offsets = dict(zip(_SECTIONS, offsets[:-1].tolist()))
        total = int(offsets[-1])
        self._host = torch.zeros(total, dtype=torch.int32, pin_memory=True)
        self._dev = torch.zeros(total, dtype=torch.int32, device=self.device)
        self._host_np = self._host.numpy()
        self.arrays = {name: self._dev[self._offsets[name]:self._offsets[name] + self._sizes[name]]
                       for name in _SECTIONS}
        self.arrays["entry_mask"] = self.arrays["entry_mask"].view(e, mw)
        self.o_ws = torch.empty(e, num_qo_heads, head_dim, dtype=torch.float32, device=self.device)
        self.lse_ws = torch.empty(e, num_qo_heads, dtype=torch.float32, device=self.device)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.current: TreePlan | None = None
        self.schedule = None  # the current plan's PersistentSchedule

    def plan(self, tree: SequenceTree | TreeLayout) -> TreePlan:
        """Plan one step on the CPU and write it into the device buffers (asynchronous copy).

        Raises PlanError, changing nothing, when the tree exceeds :attr:`bounds`.
        """
        layout = tree.layout() if isinstance(tree, SequenceTree) else tree
        host = make_plan(layout, self.plan_config, self.group)
        self._check_bounds(host)
        schedule = schedule_units(host, self.group, self.num_kv_heads, self.num_ctas, self.rows_per_unit,
                                  self.tile_tokens)
        units = schedule.device_array()
        if units.size > self._sizes["unit_info"]:
            raise PlanError(f"the schedule has {schedule.num_units} units and {schedule.tiles.size} live tiles, more "
                            f"than the buffers hold ({self._sizes['unit_info']} words); raise PlanBounds.max_entries")
        self._copied.synchronize()  # the previous plan's copies have read the pinned buffer
        mw = self.bounds.mask_words
        words = host.mask_words
        mask = np.zeros((host.num_entries, mw), dtype=np.int32)
        mask[:, :words] = host.entry_mask
        padded_qstart = np.full(self.bounds.max_queries + 1, host.query_entry_start[-1], dtype=np.int64)
        padded_qstart[:host.num_queries + 1] = host.query_entry_start
        values = {"kv_slots": host.kv_slots, "chunk_kv_start": host.chunk_kv_start, "entry_query": host.entry_query,
                  "entry_mask": mask.reshape(-1), "entry_direct": host.entry_direct,
                  "query_entry_start": padded_qstart, "query_entries": host.query_entries,
                  "cta_unit_start": schedule.cta_unit_start, "unit_info": units}
        for name, value in values.items():
            start = self._offsets[name]
            self._host_np[start:start + len(value)] = value
            # only the used prefix travels; the kernels never read past it
            self._dev[start:start + len(value)].copy_(self._host[start:start + len(value)], non_blocking=True)
        self._copied.record()
        self.current, self.schedule = host, schedule
        return host

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned queries; capturable in a CUDA graph.

        Parameters
        ----------
        q : [R, Hq, D] with ``num_queries <= R <= bounds.max_queries`` (row i is query i of the plan)
        k_cache, v_cache : [num_pages, page_size, Hkv, D]
        out, lse : optional outputs [R, Hq, D] (q's dtype) and [R, Hq] float32

        Returns ``(out, lse)``; rows past the plan's queries are unspecified.
        """
        from treedec.kernels import cuda_tree_attention as ck
        if self.current is None:
            raise RuntimeError("StaticTreeAttention.run before any plan()")
        ck.check_inputs(q, k_cache, v_cache)
        rows = q.shape[0]
        if not self.current.num_queries <= rows <= self.bounds.max_queries:
            raise ValueError(f"q has {rows} rows; it needs between the plan's {self.current.num_queries} queries "
                             f"and bounds.max_queries={self.bounds.max_queries}")
        if tuple(q.shape[1:]) != (self.num_qo_heads, self.head_dim) or q.dtype != self.dtype:
            raise ValueError(f"q must be [rows, {self.num_qo_heads}, {self.head_dim}] {self.dtype}, "
                             f"got {tuple(q.shape)} {q.dtype}")
        if k_cache.shape[2:] != (self.num_kv_heads, self.head_dim) or k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache and v_cache must be [pages, page_size, {self.num_kv_heads}, {self.head_dim}], "
                             f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        if self.current.max_slot >= k_cache.shape[0] * k_cache.shape[1]:
            raise ValueError(f"the plan reads slot {self.current.max_slot} but the cache holds "
                             f"{k_cache.shape[0] * k_cache.shape[1]} slots")
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(rows, self.num_qo_heads, dtype=torch.float32, device=q.device) if lse is None else lse
        arrays = dict(self.arrays)
        arrays["query_entry_start"] = arrays["query_entry_start"][:rows + 1]  # the merge grid covers q's rows
        hkv, d = self.num_kv_heads, self.head_dim
        ck.launch(q, k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d), out, lse, self.o_ws, self.lse_ws, arrays,
                  arrays["cta_unit_start"], arrays["unit_info"], self.bounds.mask_words, self.sm_scale, merge=True,
                  tile_tokens=self.tile_tokens, max_query_entries=self.bounds.chunks, ext=self._ext)
        return out, lse

    def _check_bounds(self, plan: TreePlan) -> None:
        b = self.bounds
        checks = (("queries", plan.num_queries, b.max_queries, "max_queries"),
                  ("needed KV tokens", plan.num_tokens, b.max_tokens, "max_tokens"),
                  ("chunks", plan.num_chunks, b.chunks, "max_chunks"),
                  ("entries", plan.num_entries, b.entries, "max_entries"),
                  ("tokens in its longest chunk", plan.max_chunk_len, b.max_chunk_tokens, "max_chunk_tokens"))
        for what, value, bound, name in checks:
            if value > bound:
                raise PlanError(f"the tree's plan has {value} {what}, over PlanBounds.{name}={bound}")
