"""The ``cuda`` backend: what the CuTe kernels run with, decided at plan time; launch-only runs.

:meth:`CudaBackend.prepare` turns a :class:`DeviceTreePlan` into a :class:`CudaPrepared`: the
persistent schedule of its units over the grid (``persistent_schedule.schedule_units``, the
KV tile of :func:`choose_tile_tokens`), copied to the device, the partial-state workspace and
the merge kernel's row count. :meth:`CudaBackend.run` launches
``treedec.kernels.cuda_tree_attention.launch`` with them, for every layer of the step.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from treedec.attention.backends.base import Backend, OpArgs, OpSizes, SpanMasking
from treedec.attention.persistent_schedule import SCHEDULE_HEADER, UNIT_FIELDS, PersistentSchedule, schedule_units
from treedec.attention.planners import PlanConfig, default_query_tile as planner_query_tile
from treedec.attention.static_plan import PlanBounds
from treedec.attention.tree_plan import DeviceTreePlan, TreePlan
from treedec.attention.variant import AttentionVariant
from treedec.checks import positive_int
from treedec.errors import BackendUnavailableError, PlanError
from treedec.kernels import cuda_tree_attention as kernels
from treedec.kernels.cuda_build import build_problem
from treedec.kernels.cuda_tree_attention import ROWS_PER_UNIT, TILE_TOKENS, rows_per_unit

logger = logging.getLogger("treedec")

# What a KV tile costs a unit of at most half its rows (one of the sm_90a kernel's two consumer
# warpgroups computes) relative to a fuller unit's, for the planner's balanced chunks
# (PlanConfig.light_tile_cost). Measured per tile on an H200: 0.76-0.84 of a full unit's
# (bench/results/2026-11-22-nvidia-h200-tile-pace*.json); of the values A/B'd on the suite, 0.7
# ran fewshot_b30_p4k fastest and changed no other workload's chunks
# (bench/results/2026-11-22-nvidia-h200-balanced-chunks*.json).
LIGHT_TILE_COST = 0.7

# Plans whose longest chunk has at least LONG_CHUNK_TOKENS tokens run 96-token KV tiles where the
# kernel takes them (sm_90a, head dims 64/128), the rest 64-token ones. Measured over the suite on
# an H200 (bench/results/2026-11-22-nvidia-h200-ws-bn96-over-full-tile-ab.json): 96 ran the trees of
# 2128-4008-token chunks 1.1-3.2 us faster (medusa256_p4k, fewshot_b50_p16k, medusa64_p32k), the
# 768-token chunks of fewshot_b30_p4k even, and the trees of <= 512-token chunks 0.4-0.9 us slower.
# With head dim 64 (...-tile-rule-d64-ab.json) 96 ran those three long-chunk trees 2.5-3.4 us faster too.
LONG_CHUNK_TOKENS = 1024
LONG_CHUNK_TILE_TOKENS = 96
TILE_TOKENS_ENV = "TREEDEC_TILE_TOKENS"  # forces one tile size (benchmarks, A/B runs)
# The plan arrays the kernels read, by name.
KERNEL_ARRAYS = ("kv_slots", "chunk_kv_start", "entry_query", "entry_mask", "entry_direct", "query_entry_start",
                 "query_entries")


def default_query_tile(head_dim: int, group: int, rows: int | None = None) -> int:
    """Entries per work item that fill one unit's ``rows`` (default: sm_90a's, :data:`ROWS_PER_UNIT`): the planner's
    query tile for this backend."""
    return planner_query_tile(group, ROWS_PER_UNIT[head_dim] if rows is None else rows)


def cuda_plan_config(config: PlanConfig, device: torch.device, head_dim: int, group: int,
                     kernel_key: tuple[str, ...] = ()) -> PlanConfig:
    """``config`` with what the cuda kernels run best with filled in where it is None: the query tile
    (:func:`default_query_tile`), the persistent grid's CTAs (``persistent_grid_size``; fp16 and
    bf16 kernels have one shape, so one grid size) and, where the warp-specialized sm_90a kernel runs
    head dims 64 or 128 (where it was measured; head dim 256 keeps even chunks), :data:`LIGHT_TILE_COST`."""
    index = _device_index(device)
    fill = {}
    if config.query_tile is None:
        fill["query_tile"] = default_query_tile(head_dim, group,
                                                rows_per_unit(torch.cuda.get_device_capability(index), head_dim))
    if config.persistent_ctas is None:
        fill["persistent_ctas"] = kernels.persistent_grid_size(index, torch.float16, head_dim, kernel_key)
    if config.light_tile_cost is None and torch.cuda.get_device_capability(index) == (9, 0) and head_dim <= 128:
        fill["light_tile_cost"] = LIGHT_TILE_COST
    return dataclasses.replace(config, **fill)


def choose_tile_tokens(plan: TreePlan, dtype: torch.dtype, head_dim: int, ext) -> int:
    """Tokens per KV tile for ``plan``'s schedule: :data:`LONG_CHUNK_TILE_TOKENS` when its longest
    chunk has at least :data:`LONG_CHUNK_TOKENS` tokens and a kernel (``ext``, for ``dtype`` and
    ``head_dim``) takes that tile, else the 64 every kernel takes. ``TREEDEC_TILE_TOKENS`` (64 or 96)
    forces a size; ValueError when no kernel takes it."""
    forced = os.environ.get(TILE_TOKENS_ENV, "").strip()
    if forced:
        return kernels.check_tile_tokens(int(forced) if forced.isdigit() else forced, dtype, head_dim, ext,
                                         f"{TILE_TOKENS_ENV}={forced!r}")
    if plan.max_chunk_len >= LONG_CHUNK_TOKENS and ext.takes_tile(dtype == torch.bfloat16, head_dim,
                                                                   LONG_CHUNK_TILE_TOKENS):
        return LONG_CHUNK_TILE_TOKENS
    return TILE_TOKENS


@dataclass(frozen=True)
class CudaOpSizes(OpSizes):
    """What a cuda launch is made for, as the custom op carries it (see :class:`CudaPrepared`)."""

    partials: int            # rows of the partial-state workspace
    merge: bool              # the merge kernel runs
    tile_tokens: int         # the KV tile: which stage-1 kernel runs
    max_query_entries: int   # picks the merge kernel


@dataclass
class CudaPrepared:
    """A plan's launch on the cuda kernels, made at plan time and reused by every layer.

    For a static plan it is made once at the bounds and its schedule sections are rewritten
    for every plan (``schedule`` is then the last plan's).
    """

    arrays: dict                  # the plan's int32 tensors the kernels read, by name
    cta_unit_start: torch.Tensor  # [used CTAs + 1] int32 (static: [num_ctas + 1])
    unit_info: torch.Tensor       # the schedule's device array (PersistentSchedule.device_array)
    o_ws: torch.Tensor            # [max(E, 1), Hq, D] float32 partial outputs
    lse_ws: torch.Tensor          # [max(E, 1), Hq] float32 partial LSEs
    merge: bool                   # some query has several partials (static: always launched)
    max_query_entries: int        # the most partial entries of any query, or a bound (picks the merge kernel)
    tile_tokens: int              # the KV tile: which stage-1 kernel runs
    schedule: PersistentSchedule | None  # for reports
    dtype: torch.dtype            # of q, K and V

    def op_args(self) -> OpArgs:
        """The plan as ``torch.ops.treedec.tree_attention`` takes it: the kernels' arrays, then the schedule's
        (``cta_unit_start``, ``unit_info``), and its sizes."""
        tensors = [self.arrays[name] for name in KERNEL_ARRAYS] + [self.cta_unit_start, self.unit_info]
        return OpArgs(CudaBackend.name, tensors,
                      CudaOpSizes(self.o_ws.shape[0], self.merge, self.tile_tokens, self.max_query_entries))


class CudaBackend(Backend):
    """Prepares and runs plans on the cuda kernels for one head configuration and dtype on ``device``, with the
    extension of ``variant``'s logit hooks (:meth:`AttentionVariant.kernel_key`: one build per key used); a
    prepared launch serves every variant (the engine's layer groups of one window share it)."""

    name = "cuda"
    prepares_launch = True
    static_plans = True
    custom_op = True
    span_masking = SpanMasking.DEVICE

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 variant: AttentionVariant, device: torch.device):
        if dtype not in kernels.SUPPORTED_DTYPES:
            raise TypeError(f"the cuda backend takes {kernels.SUPPORTED_DTYPES}, got {dtype} "
                            f"(use 'triton' or 'torch' for fp32)")
        if head_dim not in kernels.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {kernels.SUPPORTED_HEAD_DIMS}, got {head_dim}")
        problem = kernels.variant_problem(variant.kernel_key(), head_dim, torch.cuda.get_device_capability(device))
        if problem is not None:
            raise BackendUnavailableError(f"backend 'cuda' cannot run this variant: {problem}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.dtype, self.variant, self.device = dtype, variant, device
        self.logit_args = variant.logit_args(head_dim)
        self.group = num_qo_heads // num_kv_heads
        self.ext = kernels.extension(device, variant.kernel_key())
        self.rows = rows_per_unit(torch.cuda.get_device_capability(device), head_dim)
        self.num_ctas = kernels.persistent_grid_size(_device_index(device), dtype, head_dim, variant.kernel_key())
        self.static_tile_tokens: int | None = None  # fixed tile of static plans (None: the rule, first plan)

    @classmethod
    def why_unavailable(cls, device: torch.device) -> str | None:
        """Nothing is compiled here: the extension is built (or loaded from its disk cache) on first use,
        and a build failure raises BackendUnavailableError then."""
        return build_problem(device)

    @classmethod
    def why_not_batch_invariant(cls) -> str | None:
        return ("the cuda backend's KV tile follows the longest chunk of the whole step (choose_tile_tokens), so a "
                "query's tiles change with the other queries; the triton backend runs the mode")

    @classmethod
    def why_not_dtype(cls, dtype: torch.dtype) -> str | None:
        if dtype not in kernels.SUPPORTED_DTYPES:
            return f"the cuda kernels take {kernels.SUPPORTED_DTYPES}, not {dtype} (triton and torch take fp32)"
        return None

    @classmethod
    def create(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               variant: AttentionVariant, device: torch.device) -> CudaBackend:
        return cls(num_qo_heads, num_kv_heads, head_dim, dtype, variant, device)

    @classmethod
    def without_kernels(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_ctas: int,
                        tile_tokens: int, device: torch.device | str = "cpu") -> "CudaBackend":
        """This backend's host work for static plans (their sections, the schedule written per plan) on any
        device, without building or loading the kernels: for CPU tests and benchmarks of that host work.
        ``num_ctas`` is the persistent grid, ``tile_tokens`` (one of ``TILE_SIZES``) the KV tile of every
        plan; :meth:`run` and :meth:`prepare` raise."""
        if tile_tokens not in kernels.TILE_SIZES:
            raise ValueError(f"tile_tokens must be one of {kernels.TILE_SIZES}, got {tile_tokens!r}")
        positive_int("num_ctas", num_ctas)
        backend = cls.__new__(cls)
        backend.num_qo_heads, backend.num_kv_heads, backend.head_dim = num_qo_heads, num_kv_heads, head_dim
        backend.dtype, backend.variant, backend.device = dtype, AttentionVariant(), torch.device(device)
        backend.logit_args = backend.variant.logit_args(head_dim)
        backend.group, backend.ext, backend.num_ctas = num_qo_heads // num_kv_heads, None, num_ctas
        backend.rows = ROWS_PER_UNIT[head_dim]   # sm_90a's units
        backend.static_tile_tokens = tile_tokens
        return backend

    def for_static_plans(self, tile_tokens: int | None) -> CudaBackend:
        """This backend whose static plans run ``tile_tokens``-token tiles (a graph holds one stage-1 kernel;
        None: the tile rule, applied to the first plan)."""
        if tile_tokens is None:
            return self
        other = copy.copy(self)
        other.static_tile_tokens = kernels.check_tile_tokens(tile_tokens, self.dtype, self.head_dim, self.ext)
        return other

    def plan_config(self, config: PlanConfig) -> PlanConfig:
        """``config`` with this backend's query tile, grid and tile cost filled in (see :func:`cuda_plan_config`):
        chunks that fill its 128-row units and its persistent grid."""
        return cuda_plan_config(config, self.device, self.head_dim, self.group, self.variant.kernel_key())

    def check_inputs(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The kernels' own requirements (``kernels.check_inputs``: CUDA tensors, 16-byte aligned rows)."""
        kernels.check_inputs(q, k_cache, v_cache, self.variant.fp8_kv)

    @classmethod
    def why_not_variant(cls, variant: AttentionVariant, head_dim: int | None = None) -> str | None:
        """fp8 K/V (:attr:`AttentionVariant.fp8_kv`) are read by the sm_90a kernels of head dims 64 and 128, without
        a soft-cap (:func:`~treedec.kernels.cuda_tree_attention.variant_problem`)."""
        return kernels.variant_problem(variant.kernel_key(), head_dim)

    def prepare(self, plan: DeviceTreePlan) -> CudaPrepared:
        """Schedule ``plan``'s units over the persistent grid and copy the schedule to the device."""
        self._check_kernels()
        host, device = plan.plan, plan.kv_slots.device
        tile = choose_tile_tokens(host, self.dtype, self.head_dim, self.ext)
        schedule = schedule_units(host, self.group, self.num_kv_heads, self.num_ctas, self.rows,
                                  tile)
        logger.debug("cuda schedule: %d units on %d CTAs, %d-token KV tiles (longest chunk %d tokens)",
                     schedule.num_units, self.num_ctas, tile, host.max_chunk_len)
        used = int((schedule.cta_unit_start[1:] > schedule.cta_unit_start[:-1]).sum())
        starts = schedule.cta_unit_start[:max(used, 1) + 1]  # CTAs are filled in order: trailing ones are empty
        flat = torch.from_numpy(np.concatenate([starts, schedule.device_array()])).to(device)
        merge = host.num_entries > host.num_queries
        partials = max(host.num_entries if merge else 0, 1)
        hq, d = self.num_qo_heads, self.head_dim
        return CudaPrepared(
            arrays={name: getattr(plan, name) for name in KERNEL_ARRAYS},
            cta_unit_start=flat[:len(starts)], unit_info=flat[len(starts):],
            o_ws=torch.empty(partials, hq, d, dtype=torch.float32, device=device),
            lse_ws=torch.empty(partials, hq, dtype=torch.float32, device=device), merge=merge,
            max_query_entries=int(np.diff(host.query_entry_start).max(initial=0)), tile_tokens=tile,
            schedule=schedule, dtype=self.dtype)

    # Static plans (CUDA graphs): the grid is persistent anyway; the schedule of each plan is
    # written into fixed sections, the workspace is sized by the bounds' entries, the merge
    # always runs (with the kernel for the bound on partials per query, a query's chunks).

    def static_sections(self, bounds: PlanBounds) -> dict[str, int]:
        e = bounds.entries
        max_units = self.num_kv_heads * (e + -(-e * self.group // self.rows))
        max_tiles = bounds.items * -(-bounds.max_chunk_tokens // TILE_TOKENS)  # live-tile lists, per item
        return {"cta_unit_start": self.num_ctas + 1,
                "unit_info": SCHEDULE_HEADER + len(UNIT_FIELDS) * max_units + max_tiles}

    def prepare_static(self, plan: DeviceTreePlan, bounds: PlanBounds, sections: dict[str, torch.Tensor]
                       ) -> CudaPrepared:
        tile = self.static_tile_tokens or choose_tile_tokens(plan.plan, self.dtype, self.head_dim, self.ext)
        hq, d, device = self.num_qo_heads, self.head_dim, plan.kv_slots.device
        return CudaPrepared(
            arrays={name: getattr(plan, name) for name in KERNEL_ARRAYS}, cta_unit_start=sections["cta_unit_start"],
            unit_info=sections["unit_info"],
            o_ws=torch.empty(bounds.entries, hq, d, dtype=torch.float32, device=device),
            lse_ws=torch.empty(bounds.entries, hq, dtype=torch.float32, device=device), merge=True,
            max_query_entries=bounds.chunks, tile_tokens=tile, schedule=None, dtype=self.dtype)

    def static_values(self, plan: TreePlan, prepared: CudaPrepared) -> dict[str, np.ndarray]:
        schedule = schedule_units(plan, self.group, self.num_kv_heads, self.num_ctas, self.rows,
                                  prepared.tile_tokens)
        units = schedule.device_array()
        if units.size > prepared.unit_info.numel():
            raise PlanError(f"the schedule has {schedule.num_units} units and {schedule.tiles.size} live tiles, more "
                            f"than the static plan holds ({prepared.unit_info.numel()} words); raise "
                            f"PlanBounds.max_entries")
        prepared.schedule = schedule
        return {"cta_unit_start": schedule.cta_unit_start, "unit_info": units}

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
            kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch only, with ``plan.prepared``: ``out [Q, Hq, D]`` in q's dtype and ``lse [Q, Hq]``
        float32 (natural log)."""
        self._check_kernels()
        p: CudaPrepared = plan.prepared
        return launch_prepared(q, k_cache, v_cache, p.arrays, p.cta_unit_start, p.unit_info, p.o_ws, p.lse_ws, p.merge,
                               p.tile_tokens, p.max_query_entries, self.logit_args, self.ext, kv_scale)

    @classmethod
    def run_op(cls, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tensors: list[torch.Tensor],
               sizes: list[int], variant: AttentionVariant, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The launch of :meth:`CudaPrepared.op_args`' plan (its workspace allocated here, from a CUDA graph's
        private pool when captured)."""
        s = CudaOpSizes.from_list(sizes)
        hq, d = q.shape[1], q.shape[2]
        o_ws = torch.empty(s.partials, hq, d, dtype=torch.float32, device=q.device)
        lse_ws = torch.empty(s.partials, hq, dtype=torch.float32, device=q.device)
        *arrays, cta_unit_start, unit_info = tensors
        return launch_prepared(q, k_cache, v_cache, dict(zip(KERNEL_ARRAYS, arrays)), cta_unit_start, unit_info, o_ws,
                               lse_ws, s.merge, s.tile_tokens, s.max_query_entries, variant.logit_args(d),
                               kernels.extension(q.device, variant.kernel_key()), kv_scale)[0]

    def _check_kernels(self) -> None:
        if self.ext is None:
            raise BackendUnavailableError("this CudaBackend was made without_kernels: it writes static plans' host "
                                          "side only")


def launch_prepared(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, arrays: dict,
                    cta_unit_start: torch.Tensor, unit_info: torch.Tensor, o_ws: torch.Tensor, lse_ws: torch.Tensor,
                    merge: bool, tile_tokens: int, max_query_entries: int, logit_args, ext,
                    kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernels of a prepared plan (its arrays, schedule, workspace and launch choices, as
    :class:`CudaPrepared` holds them) over the paged caches (fp8 ones with their ``kv_scale`` [2, Hkv]) with a
    variant's :class:`~treedec.attention.variant.LogitArgs` and the extension of its key: ``out [Q, Hq, D]`` in q's
    dtype and ``lse [Q, Hq]`` float32 (natural log)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    kernels.launch(q, k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d), out, lse, o_ws, lse_ws, arrays,
                   cta_unit_start, unit_info, arrays["entry_mask"].stride(0), logit_args.scale_log2,
                   logit_args.softcap_scale, merge, tile_tokens, max_query_entries, ext, kv_scale)
    return out, lse


def run_plan_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
                  variant: AttentionVariant, validate: bool = True, prepared: CudaPrepared | None = None,
                  kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepare (unless ``prepared`` is given) and run one plan: for tests and benchmarks.

    q : [Q, Hq, D] fp16/bf16, D in (64, 128, 256); k_cache, v_cache : [num_pages, page_size, Hkv, D],
    q's dtype (e4m3 for the variant's fp8 ``kv_dtype``, with ``kv_scale`` [2, Hkv] float32), contiguous; plan :
    DeviceTreePlan on q's device. Returns ``(out, lse)``.
    """
    if validate:
        kernels.check_inputs(q, k_cache, v_cache, variant.fp8_kv)
    backend = CudaBackend(q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, variant, q.device)
    prepared = prepared or backend.prepare(plan)
    return backend.run(q, k_cache, v_cache, dataclasses.replace(plan, backend=backend.name, prepared=prepared),
                       kv_scale)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def plan_schedule(plan: DeviceTreePlan) -> PersistentSchedule | None:
    """The persistent schedule prepared for ``plan`` (its KV tile is ``tile_tokens``), None unless a cuda plan."""
    return plan.prepared.schedule if isinstance(plan.prepared, CudaPrepared) else None
