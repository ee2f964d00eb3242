"""The ``triton`` backend: DeFT-Flatten tree attention executing a :class:`TreePlan`.

Algorithm
---------
Stage 1 (``_tree_attn_partial_kernel``), grid ``(num_items * subtiles, Hkv)``: one program
per (work item, KV head). A work item is a KV chunk with a tile of the entries (queries)
that read it. The query heads of the KV head are fused into the rows (GQA): row
``r = j * G + g`` is entry ``j`` of the tile, query head ``h * G + g``, so every K/V tile
is loaded once for all of them. The program walks the chunk's tokens in ``BLOCK_N``
tiles: it gathers the slots from ``kv_slots`` and the K/V rows of head ``h`` through them
(the cache viewed as ``[num_slots, Hkv, D]``, int64 offsets), expands each entry's bit
mask into the tile in registers and runs an fp32 online softmax (base 2, the scale
folded into ``qk_scale``) with ``tl.dot`` on fp16/bf16 operands. A tile no row of the
program reads has its K/V loads predicated off: no memory traffic, and the loop stays
straight-line code the software pipeliner can prefetch through. An entry that is its
query's only partial (``entry_direct``) writes the final output and LSE directly; the
others write a partial (O, LSE) to a workspace ``[E, Hq, D]`` / ``[E, Hq]``.

Stage 2 (``_merge_partials_kernel``), grid ``(Q, Hq)``, launched only when some query
has several partials: each (query, head) merges its partials in the plan's CSR order,
``BLOCK_P`` of them per step (independent loads in flight), with fp32 math and no
atomics, so results are bitwise reproducible. Queries with a single partial
have nothing to do (their program runs no iteration and stores nothing).

When the planner's ``query_tile * G`` exceeds the rows of one program (128 for fp16/bf16,
64 for fp32), a work item is split over ``subtiles`` programs (each a different slice of
its entries, the same chunk).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

from treedec.attention.tree_plan import DeviceTreePlan

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and schedule of the stage-1 kernel."""

    block_n: int      # KV tokens per tile (a multiple of 32: whole mask words)
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # register cap per thread: more programs resident per SM

    def options(self) -> dict:
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts


# fp16/bf16, keyed by (head_dim, BLOCK_M), sized for H100/H200: K+V tiles of BLOCK_N x D
# per stage in shared memory, the BLOCK_M x D fp32 accumulator in registers (no spills
# with ptxas for sm_90a).
_LAUNCH_TABLE = {
    **{(d, m): LaunchConfig(64, 4, 3) for d in (16, 32, 64, 128) for m in (16, 32, 64)},
    **{(d, 128): LaunchConfig(64, 4, 3) for d in (16, 32)},
    (64, 128): LaunchConfig(64, 8, 3), (128, 128): LaunchConfig(64, 8, 2),
    **{(d, 256): LaunchConfig(32, 8, 2) for d in (16, 32, 64, 128)},
    (256, 16): LaunchConfig(32, 4, 2), (256, 32): LaunchConfig(32, 4, 2),
    (256, 64): LaunchConfig(32, 8, 2), (256, 128): LaunchConfig(32, 8, 2),
}
# fp32 takes the exact ("ieee") dot, off the tensor cores: smaller tiles, so that it fits
# sm_80's shared memory and does not spill.
_FP32_CONFIG = LaunchConfig(32, 8, 2)
_MERGE_BLOCK_P = 8  # partials loaded per step of the merge: independent loads in flight


def max_block_m(head_dim: int, dtype: torch.dtype) -> int:
    """Most rows (queries x heads of a group) one stage-1 program takes."""
    if dtype == torch.float32:
        return 64
    return max((m for (d, m) in _LAUNCH_TABLE if d == head_dim), default=0)


def launch_config(head_dim: int, block_m: int, dtype: torch.dtype = torch.float16) -> LaunchConfig:
    """The stage-1 launch configuration for ``head_dim``, ``block_m`` rows and input ``dtype``."""
    limit = max_block_m(head_dim, dtype)
    if (head_dim, block_m) not in _LAUNCH_TABLE or block_m > limit:
        raise ValueError(f"no triton launch config for head_dim={head_dim}, block_m={block_m}, {dtype}; "
                         f"head_dim must be a power of two in [16, 256], block_m one in [16, {limit}]")
    return _FP32_CONFIG if dtype == torch.float32 else _LAUNCH_TABLE[(head_dim, block_m)]


@dataclass(frozen=True)
class _Launch:
    """What run_plan_triton derives from a plan once, reused for every layer of the step."""

    grid: tuple[int, int, int]
    merge_grid: tuple[int, int, int] | None  # None: every query has a single partial
    o_ws: torch.Tensor                      # [E, Hq, D] partial outputs
    lse_ws: torch.Tensor                    # [E, Hq] partial LSEs, float32
    constants: dict                         # constexpr arguments of the stage-1 kernel, in order
    options: dict                           # num_warps, num_stages
    merge_constants: dict
    merge_options: dict
    runners: dict = field(default_factory=dict)  # (kernel, specialization guard) -> compiled runner


def _launch(kernel, grid, runners: dict, guard: tuple, args: tuple, constants: dict, options: dict) -> None:
    """Launch ``kernel[grid](*args, **constants, **options)``, through its compiled runner when cached.

    ``JITFunction`` re-binds and re-specializes every argument at each launch: tens of
    microseconds of Python per launch, more than the kernels take on small trees. For a
    fixed plan the grid, constexprs and options are fixed; what could select another
    compiled variant is the caller's tensors' alignment and strides, which ``guard``
    holds. The first launch under a guard takes the JIT path (compiling if needed) and
    caches the compiled kernel's runner, which takes every parameter positionally.
    """
    key = (kernel, guard)
    runner = runners.get(key)
    if runner is None:
        compiled = kernel[grid](*args, **constants, **options)
        if isinstance(compiled, CompiledKernel):  # the interpreter (TRITON_INTERPRET=1) returns none
            runners[key] = compiled[grid]
    else:
        runner(*args, *constants.values())


def run_plan_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DeviceTreePlan,
    sm_scale: float,
    workspace_dtype: torch.dtype | None = None,
    validate: bool = True,
    launch: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree attention by executing ``plan`` with the Triton kernels.

    Parameters
    ----------
    q : [Q, Hq, D] fp16, bf16 or fp32, last dim contiguous
        One row per query of the plan, in the plan's query order.
    k_cache, v_cache : [num_pages, page_size, Hkv, D], q's dtype and device
        Paged KV of one layer; slot ``s`` is ``cache.view(-1, Hkv, D)[s]``. Every slot of
        ``plan.kv_slots`` must be below ``num_pages * page_size`` (TreeAttention checks).
    plan : DeviceTreePlan
        int32 tensors on q's device. Launch parameters and the partial-state workspace
        are cached on it at the first call, so the layers of a step (run one after
        another on one stream) share them.
    sm_scale : float
        Softmax scale.
    workspace_dtype : torch.dtype, optional
        dtype of the partial outputs ``[E, Hq, D]``: default fp16 for fp16 inputs (half the
        traffic of float32), float32 for bf16 and fp32 inputs; partial LSEs are always float32.
    validate : bool
        Check the inputs (TreeAttention.run has checked them already and passes False).
    launch : LaunchConfig, optional
        Overrides the stage-1 table entry (for tuning: bench/triton_configs.py).

    Returns
    -------
    out : [Q, Hq, D] in q's dtype
    lse : [Q, Hq] float32, natural log
    """
    if validate:
        _check_inputs(q, k_cache, v_cache, plan)
    num_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    if workspace_dtype is None:  # bf16's 8-bit mantissa would round every partial: keep those in fp32
        workspace_dtype = torch.float32 if q.dtype == torch.bfloat16 else q.dtype
    key = (q.dtype, hq, hkv, d, workspace_dtype, q.device, launch)
    prepared = plan.cache.get(key)
    if prepared is None:
        prepared = plan.cache[key] = _prepare_launch(plan, q.dtype, hq, hkv, d, workspace_dtype, q.device, launch)
    k_flat = k_cache.view(-1, hkv, d)
    v_flat = v_cache.view(-1, hkv, d)
    out = torch.empty_like(q)
    lse = torch.empty(num_q, hq, dtype=torch.float32, device=q.device)
    o_ws, lse_ws = prepared.o_ws, prepared.lse_ws
    q_strides, k_strides, v_strides, out_strides = q.stride(), k_flat.stride(), v_flat.stride(), out.stride()
    guard = (q.data_ptr() % 16, k_flat.data_ptr() % 16, v_flat.data_ptr() % 16, out.data_ptr() % 16,
             q_strides, k_strides, v_strides, out_strides)
    _launch(_tree_attn_partial_kernel, prepared.grid, prepared.runners, guard, (
        q, k_flat, v_flat, out, lse, o_ws, lse_ws,
        plan.kv_slots, plan.chunk_kv_start, plan.entry_query, plan.entry_mask, plan.entry_direct,
        plan.item_chunk, plan.item_entry_start, plan.item_num_entries,
        q_strides[0], q_strides[1], k_strides[0], k_strides[1], v_strides[0], v_strides[1],
        out_strides[0], out_strides[1], hq, hq * d, d, hq, plan.entry_mask.stride(0),
        sm_scale * math.log2(math.e),
    ), prepared.constants, prepared.options)
    if prepared.merge_grid is not None:
        _launch(_merge_partials_kernel, prepared.merge_grid, prepared.runners, guard, (
            out, lse, o_ws, lse_ws, plan.query_entry_start, plan.query_entries,
            out_strides[0], out_strides[1], hq, hq * d, d, hq,
        ), prepared.merge_constants, prepared.merge_options)
    return out, lse


def _prepare_launch(plan: DeviceTreePlan, dtype, hq, hkv, d, workspace_dtype, device,
                    override: LaunchConfig | None) -> _Launch:
    if workspace_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"workspace_dtype must be one of {SUPPORTED_DTYPES}, got {workspace_dtype}")
    host = plan.plan
    group = hq // hkv
    limit = max_block_m(d, dtype)
    block_m = min(max(16, triton.next_power_of_2(host.query_tile * group)), limit)
    entries_per_prog = block_m // group
    if entries_per_prog < 1:
        raise ValueError(f"GQA group size {group} (= {hq} / {hkv} heads) exceeds the {limit} "
                         f"rows of one program for {dtype}")
    subtiles = -(-host.query_tile // entries_per_prog)
    cfg = override or launch_config(d, block_m, dtype)
    # On the CPU the kernels run in Triton's interpreter, whose dot multiplies bfloat16 bit
    # patterns as integers (triton-lang/triton#11584): widening to fp32 there is exact, as the
    # GPU's bf16 products are exact in fp32 too. On a GPU the constexpr compiles it away.
    widen_dot = device.type == "cpu" and dtype == torch.bfloat16
    return _Launch(
        grid=(host.num_items * subtiles, hkv, 1),  # 3-D: the compiled runner reads grid[2]
        merge_grid=(host.num_queries, hq, 1) if host.num_entries > host.num_queries else None,
        o_ws=torch.empty(host.num_entries, hq, d, dtype=workspace_dtype, device=device),
        lse_ws=torch.empty(host.num_entries, hq, dtype=torch.float32, device=device),
        constants=dict(GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
                       ENTRIES_PER_PROG=entries_per_prog, SUBTILES=subtiles,
                       # tf32 is moot for 16-bit operands; fp32 inputs take the exact dot
                       DOT_PRECISION="ieee" if dtype == torch.float32 or widen_dot else "tf32",
                       WIDEN_DOT=widen_dot),
        options=cfg.options(),
        merge_constants=dict(HEAD_DIM=d, BLOCK_P=_MERGE_BLOCK_P),
        merge_options=dict(num_warps=2 if d <= 128 else 4),
    )


# ===================================================================== private


def _check_inputs(q, k_cache, v_cache, plan: DeviceTreePlan) -> None:
    """Raise a clear error for inputs the kernels cannot take."""
    if not isinstance(plan, DeviceTreePlan):
        raise TypeError(f"plan must be a DeviceTreePlan (TreePlan.to(device)), got {type(plan).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape [num_queries, num_qo_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    num_q, hq, d = q.shape
    if num_q != plan.plan.num_queries:
        raise ValueError(f"q has {num_q} rows but the plan has {plan.plan.num_queries} queries")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be one of (16, 32, 64, 128, 256), got {d}")
    if q.stride(2) != 1:
        raise ValueError(f"q must be contiguous in its last dim, got strides {q.stride()}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[3] != d:
            raise ValueError(f"{name} must have shape [num_pages, page_size, num_kv_heads, {d}], "
                             f"got {tuple(cache.shape)}")
        if cache.dtype != q.dtype:
            raise TypeError(f"{name} dtype {cache.dtype} differs from q dtype {q.dtype}")
        if cache.device != q.device:
            raise ValueError(f"{name} is on {cache.device} but q is on {q.device}")
        _slot_view(name, cache)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"q's {hq} heads must be a multiple of the caches' {hkv} KV heads")
    # TreePlan.to makes all the index tensors in one transfer: checking one checks them all.
    if plan.kv_slots.dtype != torch.int32 or plan.kv_slots.device != q.device:
        raise ValueError(f"plan tensors must be int32 on q's device {q.device}, got "
                         f"{plan.kv_slots.dtype} on {plan.kv_slots.device} (use TreePlan.to(q.device))")


def _slot_view(name: str, cache: torch.Tensor) -> torch.Tensor:
    """``cache`` [num_pages, page_size, Hkv, D] as [num_slots, Hkv, D], without a copy."""
    if cache.stride(3) == 1:
        try:
            return cache.view(-1, cache.shape[2], cache.shape[3])
        except RuntimeError:
            pass
    raise ValueError(f"{name} must be viewable as [num_slots, num_kv_heads, head_dim] with a contiguous "
                     f"last dim, got strides {cache.stride()}")


@triton.jit
def _attend_kv_tile(acc, l_i, m_i, q, n0, chunk_len, slots_base, k_base, v_base, stride_ks, stride_vs,
                    mask_rows, row_len, qk_scale, offs_n, offs_d,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    WIDEN_DOT: tl.constexpr):
    """One BLOCK_N tile of the chunk: bit mask, QK^T, online softmax, PV. Returns the state.

    ``row_len`` [BLOCK_M] is the chunk's length for valid rows and 0 for padding rows.
    Masks are built from integer comparisons only, never ``vector & scalar`` of booleans:
    the Triton 3.9 interpreter widens such a broadcast to int32 and then rejects it as a
    load mask, while a comparison gives a boolean on every backend.
    """
    tok = n0 + offs_n
    # Expand the rows' mask words over the tile's columns (n0 is a multiple of 32).
    word_of_col = offs_n >> 5
    words = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    live = tl.zeros([BLOCK_M], dtype=tl.int32)
    for w in tl.static_range(BLOCK_N // 32):
        word = tl.load(mask_rows + ((n0 >> 5) + w), mask=n0 + 32 * w < row_len, other=0)
        words = tl.where(word_of_col[None, :] == w, word[:, None], words)
        live = live | word
    tile_live = tl.max((live != 0).to(tl.int32), axis=0) > 0
    kv_mask = tok < tl.where(tile_live, chunk_len, 0)
    slot = tl.load(slots_base + tok, mask=kv_mask, other=0).to(tl.int64)
    k = tl.load(k_base + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask[:, None], other=0.0)
    if WIDEN_DOT:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    reads = ((words >> (offs_n & 31)[None, :]) & 1) != 0
    qk = tl.where(reads, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing read yet
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask[:, None], other=0.0)
    if WIDEN_DOT:
        v = v.to(tl.float32)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_chunk(q, chunk_len, slots_base, k_base, v_base, stride_ks, stride_vs, mask_rows, row_len, qk_scale,
                  offs_n, offs_d, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr):
    """Online softmax over the whole chunk; returns (acc, l, m) in base 2."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n0 in range(0, chunk_len, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(acc, l_i, m_i, q, n0, chunk_len, slots_base, k_base, v_base,
                                        stride_ks, stride_vs, mask_rows, row_len, qk_scale, offs_n, offs_d,
                                        BLOCK_M, BLOCK_N, DOT_PRECISION, WIDEN_DOT)
    return acc, l_i, m_i


# The plan's tensors are slices of one buffer whose sizes change every step: specializing
# on their alignment (or on the mask row length) would recompile the kernels step after step.
_PLAN_POINTERS = ("kv_slots_ptr", "chunk_kv_start_ptr", "entry_query_ptr", "entry_mask_ptr", "entry_direct_ptr",
                  "item_chunk_ptr", "item_entry_start_ptr", "item_num_entries_ptr")


@triton.jit(do_not_specialize=["stride_me"], do_not_specialize_on_alignment=_PLAN_POINTERS)
def _tree_attn_partial_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, o_ws_ptr, lse_ws_ptr,
    kv_slots_ptr, chunk_kv_start_ptr, entry_query_ptr, entry_mask_ptr, entry_direct_ptr,
    item_chunk_ptr, item_entry_start_ptr, item_num_entries_ptr,
    stride_qq, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_oq, stride_oh, stride_lq, stride_we, stride_wh, stride_le, stride_me,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ENTRIES_PER_PROG: tl.constexpr, SUBTILES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    item = pid // SUBTILES
    first_local = (pid % SUBTILES) * ENTRIES_PER_PROG
    chunk = tl.load(item_chunk_ptr + item)
    first = tl.load(item_entry_start_ptr + item) + first_local
    count = tl.minimum(tl.load(item_num_entries_ptr + item) - first_local, ENTRIES_PER_PROG)
    kv_begin = tl.load(chunk_kv_start_ptr + chunk)
    chunk_len = tl.load(chunk_kv_start_ptr + chunk + 1) - kv_begin
    chunk_len = tl.where(count > 0, chunk_len, 0)  # an empty subtile runs no iteration

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    local = offs_m // GROUP
    row_valid = local < count
    entry = (first + local).to(tl.int64)
    head = kv_head * GROUP + offs_m % GROUP
    query = tl.load(entry_query_ptr + entry, mask=row_valid, other=0).to(tl.int64)
    q = tl.load(q_ptr + query[:, None] * stride_qq + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)
    if WIDEN_DOT:
        q = q.to(tl.float32)

    mask_rows = entry_mask_ptr + entry * stride_me
    slots_base = kv_slots_ptr + kv_begin
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    row_len = tl.where(row_valid, chunk_len, 0)
    acc, l_i, m_i = _attend_chunk(q, chunk_len, slots_base, k_base, v_base, stride_ks, stride_vs, mask_rows,
                                  row_len, qk_scale, offs_n, offs_d, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION,
                                  WIDEN_DOT)

    # Every real entry reads >= 1 token of its chunk, so l_i > 0 on valid rows.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * _LN2
    direct = tl.load(entry_direct_ptr + entry, mask=row_valid, other=0) != 0
    to_out = row_valid & direct
    to_ws = row_valid & (direct == 0)
    out_rows = out_ptr + query * stride_oq + head * stride_oh
    tl.store(out_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=to_out[:, None])
    tl.store(lse_ptr + query * stride_lq + head, lse, mask=to_out)
    ws_rows = o_ws_ptr + entry * stride_we + head * stride_wh
    tl.store(ws_rows[:, None] + offs_d[None, :], o.to(o_ws_ptr.dtype.element_ty), mask=to_ws[:, None])
    tl.store(lse_ws_ptr + entry * stride_le + head, lse, mask=to_ws)


@triton.jit(do_not_specialize_on_alignment=["query_entry_start_ptr", "query_entries_ptr"])
def _merge_partials_kernel(
    out_ptr, lse_ptr, o_ws_ptr, lse_ws_ptr, query_entry_start_ptr, query_entries_ptr,
    stride_oq, stride_oh, stride_lq, stride_we, stride_wh, stride_le,
    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Program (query, head): merge the query's partials, BLOCK_P of them per step, in CSR order."""
    query = tl.program_id(0)
    head = tl.program_id(1)
    begin = tl.load(query_entry_start_ptr + query)
    count = tl.load(query_entry_start_ptr + query + 1) - begin
    count = tl.where(count > 1, count, 0)  # a single partial was written by stage 1

    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    s = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for p0 in range(0, count, BLOCK_P):
        valid = p0 + offs_p < count
        e = tl.load(query_entries_ptr + begin + p0 + offs_p, mask=valid, other=0).to(tl.int64)
        lse_p = tl.load(lse_ws_ptr + e * stride_le + head, mask=valid, other=float("-inf")) * _LOG2E
        o_p = tl.load(o_ws_ptr + e[:, None] * stride_we + head * stride_wh + offs_d[None, :],
                      mask=valid[:, None], other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse_p, axis=0))          # finite: the block has a valid partial
        scale = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse_p - m_new)                       # 0 for padding
        acc = acc * scale + tl.sum(w[:, None] * o_p, axis=0)
        s = s * scale + tl.sum(w, axis=0)
        m = m_new

    s_safe = tl.where(s == 0.0, 1.0, s)
    # Store masks come from integer comparisons: a broadcast scalar boolean is int32 in the
    # Triton 3.9 interpreter, which then rejects it as a mask.
    stored = tl.where(count > 0, 1, 0)
    out_row = out_ptr + query.to(tl.int64) * stride_oq + head * stride_oh
    tl.store(out_row + offs_d, (acc / s_safe).to(out_ptr.dtype.element_ty), mask=offs_d < stored * HEAD_DIM)
    one = tl.arange(0, 1)
    tl.store(lse_ptr + query.to(tl.int64) * stride_lq + head + one, (m + tl.math.log2(s_safe)) * _LN2,
             mask=one < stored)
