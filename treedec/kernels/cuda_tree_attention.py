"""The ``cuda`` backend: CuTe tree attention (wgmma on sm_90a, mma.sync on sm_80+) on a
persistent, load-balanced grid.

Stage 1 (``tree_attention.cuh``) runs a fixed grid of CTAs, each looping over the units a
:class:`~treedec.attention.persistent_schedule.PersistentSchedule` gave it: one work item's
chunk x one KV head x up to :data:`ROWS_PER_UNIT` rows (queries x heads of the GQA group;
128 for head dims 64/128: two consumer warpgroups of the warp-specialized wgmma kernel on sm_90a,
8 warps of mma.sync elsewhere). Dead tiles
(no row reads them) are neither loaded nor computed; entries that are their query's only
partial write the output directly, the rest write fp32 partial states. Stage 2 merges each
query's partials in the plan's CSR order (deterministic, no atomics). The KV tile is chosen per
plan (:func:`choose_tile_tokens`: 96 tokens for long chunks on sm_90a, else 64; each size has its
own stage-1 kernel).

Two ways in:

- :func:`run_plan_cuda` executes a :class:`DeviceTreePlan` (what ``TreeAttention(backend="cuda")``
  does); the schedule and workspace are derived once per plan and cached on it.
- :class:`~treedec.attention.static_tree_attention.StaticTreeAttention` keeps every plan array
  in buffers of fixed address and size (from stated bounds), so a captured CUDA graph of
  ``run()`` replays correctly for any new tree within the bounds.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from treedec.attention.persistent_schedule import TILE_SIZES, TILE_TOKENS, PersistentSchedule, schedule_units
from treedec.attention.planners import PlanConfig, default_query_tile as planner_query_tile
from treedec.attention.tree_plan import DeviceTreePlan, TreePlan
from treedec.kernels.cuda_build import load_extension

logger = logging.getLogger("treedec")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Rows (query x head pairs) of one stage-1 unit per head dim: the kernel's warps x 16
# (PartialConfig in tree_attention.cuh; a GPU test checks the two agree).
ROWS_PER_UNIT = {64: 128, 128: 128, 256: 64}


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


def default_query_tile(head_dim: int, group: int) -> int:
    """Entries per work item that fill one unit's rows: the planner's query tile for this backend."""
    return planner_query_tile(group, ROWS_PER_UNIT[head_dim])


def cuda_plan_config(config: PlanConfig, device: torch.device, head_dim: int, group: int) -> PlanConfig:
    """``config`` with what the cuda kernels run best with filled in where it is None: the query tile
    (:func:`default_query_tile`), the persistent grid's CTAs (:func:`persistent_grid_size`; fp16 and
    bf16 kernels have one shape, so one grid size) and, where the warp-specialized sm_90a kernel runs
    (head dims 64 and 128), :data:`LIGHT_TILE_COST`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    fill = {}
    if config.query_tile is None:
        fill["query_tile"] = default_query_tile(head_dim, group)
    if config.persistent_ctas is None:
        fill["persistent_ctas"] = persistent_grid_size(index, torch.float16, head_dim)
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
        return check_tile_tokens(int(forced) if forced.isdigit() else forced, dtype, head_dim, ext,
                                 f"{TILE_TOKENS_ENV}={forced!r}")
    if plan.max_chunk_len >= LONG_CHUNK_TOKENS and ext.takes_tile(dtype == torch.bfloat16, head_dim,
                                                                   LONG_CHUNK_TILE_TOKENS):
        return LONG_CHUNK_TILE_TOKENS
    return TILE_TOKENS


def check_tile_tokens(tile_tokens, dtype: torch.dtype, head_dim: int, ext, what: str = "tile_tokens") -> int:
    """``tile_tokens`` if a stage-1 kernel of ``ext`` takes tiles of that size for ``dtype`` and
    ``head_dim``, else ValueError naming ``what`` and the sizes it takes."""
    bf16 = dtype == torch.bfloat16
    if tile_tokens not in TILE_SIZES or not ext.takes_tile(bf16, head_dim, tile_tokens):
        supported = [t for t in TILE_SIZES if ext.takes_tile(bf16, head_dim, t)]
        raise ValueError(f"{what}: the cuda kernels for {dtype}, head_dim={head_dim} on this GPU take tiles of "
                         f"{supported} tokens")
    return int(tile_tokens)


def extension(device: torch.device):
    """The compiled extension for ``device``'s arch (built on first use)."""
    return load_extension(torch.cuda.get_device_capability(device))


@functools.lru_cache(maxsize=None)
def persistent_grid_size(device_index: int, dtype: torch.dtype, head_dim: int) -> int:
    """CTAs of the persistent stage-1 grid: SMs x resident CTAs per SM."""
    device = torch.device("cuda", device_index)
    per_sm = extension(device).ctas_per_sm(dtype == torch.bfloat16, head_dim)
    if per_sm < 1:
        raise RuntimeError(f"the cuda stage-1 kernel cannot be resident on {torch.cuda.get_device_name(device)} "
                           f"for {dtype}, head_dim={head_dim} (shared memory or registers)")
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm


def check_dtype(q: torch.Tensor) -> None:
    """TypeError unless q's dtype is one the cuda kernels take."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the cuda backend takes {SUPPORTED_DTYPES}, got {q.dtype} (use 'triton' or 'torch' for fp32)")


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise a clear error for inputs the cuda kernels cannot take (beyond TreeAttention's checks)."""
    if q.device.type != "cuda":
        raise ValueError(f"the cuda backend needs CUDA tensors, got q on {q.device}")
    check_dtype(q)
    if q.dim() != 3 or q.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the cuda backend needs q [Q, Hq, D] with D in {SUPPORTED_HEAD_DIMS}, got {tuple(q.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            raise ValueError(f"the cuda backend needs 16-byte aligned rows: {name} must have a contiguous last dim, "
                             f"a 16-byte aligned data pointer and strides that are multiples of 8, "
                             f"got strides {t.stride()}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device}, got {t.dtype} on {t.device}")


def launch(q, k_flat, v_flat, out, lse, o_ws, lse_ws, arrays: dict, cta_unit_start, unit_info, mask_stride: int,
           sm_scale: float, merge: bool, tile_tokens: int, max_query_entries: int, ext=None) -> None:
    """Launch stage 1 (and stage 2 when ``merge``) on the current stream.

    ``arrays`` holds the plan's int32 tensors by :class:`DeviceTreePlan` field name;
    ``q`` [>=Q, Hq, D], ``k_flat``/``v_flat`` [slots, Hkv, D], ``out`` like q, ``lse`` [rows of q, Hq];
    ``unit_info`` a schedule's device array of ``tile_tokens``-token tiles (the kernel of that tile runs);
    ``max_query_entries`` the most partial entries of any query, or a bound on it (it picks the merge
    kernel: partial rows loaded 4, 8 or 16 at a time; the result is the same);
    ``ext`` the compiled extension when the caller holds it (else looked up for q's device).
    """
    ext = ext or extension(q.device)
    group = q.shape[1] // k_flat.shape[1]
    ext.attend(q, k_flat, v_flat, out, lse, o_ws, lse_ws, arrays["kv_slots"], arrays["chunk_kv_start"],
               arrays["entry_query"], arrays["entry_mask"], arrays["entry_direct"], arrays["query_entry_start"],
               arrays["query_entries"], cta_unit_start, unit_info, group, mask_stride, sm_scale * math.log2(math.e),
               merge, tile_tokens, max_query_entries)


@dataclass(frozen=True)
class _EagerLaunch:
    """What run_plan_cuda derives from a plan once, reused by every layer of the step."""

    ext: object   # the compiled extension for the plan's device
    arrays: dict  # the plan's int32 tensors by DeviceTreePlan field name (what launch() takes)
    cta_unit_start: torch.Tensor
    unit_info: torch.Tensor
    o_ws: torch.Tensor
    lse_ws: torch.Tensor
    merge: bool
    max_query_entries: int  # the most partial entries of any query (picks the merge kernel)
    schedule: PersistentSchedule  # for reports


def run_plan_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
                  sm_scale: float, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree attention by executing ``plan`` with the cuda kernels.

    Parameters
    ----------
    q : [Q, Hq, D] fp16/bf16, D in (64, 128, 256)
    k_cache, v_cache : [num_pages, page_size, Hkv, D], q's dtype, contiguous
    plan : DeviceTreePlan on q's device (int32 arrays)
    sm_scale : float

    Returns
    -------
    out : [Q, Hq, D] in q's dtype
    lse : [Q, Hq] float32, natural log
    """
    if validate:
        check_inputs(q, k_cache, v_cache)
    num_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    key = ("cuda", q.dtype, hq, hkv, d)
    prepared = plan.cache.get(key)
    if prepared is None:
        prepared = plan.cache[key] = _prepare(plan, q.dtype, hq, hkv, d, q.device)
    out = torch.empty_like(q)
    lse = torch.empty(num_q, hq, dtype=torch.float32, device=q.device)
    launch(q, k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d), out, lse, prepared.o_ws, prepared.lse_ws,
           prepared.arrays, prepared.cta_unit_start, prepared.unit_info, plan.entry_mask.stride(0), sm_scale,
           prepared.merge, prepared.schedule.tile_tokens, prepared.max_query_entries, prepared.ext)
    return out, lse


def plan_schedule(plan: DeviceTreePlan) -> PersistentSchedule | None:
    """The persistent schedule :func:`run_plan_cuda` derived for ``plan`` (its KV tile is
    ``tile_tokens``), None before the plan's first cuda run."""
    prepared = [v for key, v in plan.cache.items() if isinstance(key, tuple) and key[0] == "cuda"]
    return prepared[0].schedule if prepared else None


def _prepare(plan: DeviceTreePlan, dtype, hq: int, hkv: int, d: int, device: torch.device) -> _EagerLaunch:
    host = plan.plan
    grid = persistent_grid_size(device.index if device.index is not None else torch.cuda.current_device(), dtype, d)
    ext = extension(device)
    tile = choose_tile_tokens(host, dtype, d, ext)
    schedule = schedule_units(host, hq // hkv, hkv, grid, ROWS_PER_UNIT[d], tile)
    logger.debug("cuda schedule: %d units on %d CTAs, %d-token KV tiles (longest chunk %d tokens)",
                 schedule.num_units, grid, tile, host.max_chunk_len)
    used = int((schedule.cta_unit_start[1:] > schedule.cta_unit_start[:-1]).sum())
    starts = schedule.cta_unit_start[:max(used, 1) + 1]  # CTAs are filled in order: trailing ones are empty
    flat = torch.from_numpy(np.concatenate([starts, schedule.device_array()])).to(device)
    needs_merge = host.num_entries > host.num_queries
    partials = host.num_entries if needs_merge else 0
    arrays = {name: getattr(plan, name) for name in ("kv_slots", "chunk_kv_start", "entry_query", "entry_mask",
                                                     "entry_direct", "query_entry_start", "query_entries")}
    return _EagerLaunch(
        ext=ext, arrays=arrays, cta_unit_start=flat[:len(starts)], unit_info=flat[len(starts):],
        o_ws=torch.empty(max(partials, 1), hq, d, dtype=torch.float32, device=device),
        lse_ws=torch.empty(max(partials, 1), hq, dtype=torch.float32, device=device),
        merge=needs_merge, max_query_entries=int(np.diff(host.query_entry_start).max(initial=0)), schedule=schedule)
