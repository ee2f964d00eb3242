"""The ``triton`` kernels: DeFT-Flatten tree attention over a plan's arrays (``TreePlan``).

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

Logit variants are ``tl.constexpr`` flags of stage 1 (``SOFTCAP``: a score ``s`` becomes
``tanh(s * softcap_scale)`` before the base-2 scale): each flag set compiles its own kernel, and
the plain kernel (no flag) is the code without them.

An fp8 KV cache (``KV_FP8``, FlashInfer's ``dtype_kv``): K/V are e4m3 in memory (half the bytes a tile loads),
converted to q's dtype in registers after each tile's load; the KV head's K scale is folded into ``qk_scale``
(into ``softcap_scale`` under the soft-cap, which comes first) and its V scale into the output
(``o = acc * (v_scale / l)``), so the tile loop does no extra multiply.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel


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
class TritonLaunch:
    """Grids, constexprs and options of the two kernels for one plan shape (from :func:`plan_launch`).

    ``runners`` caches each kernel's compiled runner per specialization guard (see :func:`attend`),
    so the layers of a step and the replays of a static plan skip the JIT's argument binding; ``flagged``
    the stage-1 constexprs with each set of logit flags (:meth:`stage1_constants`).
    """

    grid: tuple[int, int, int]
    merge_grid: tuple[int, int, int] | None  # None: every query has a single partial
    constants: dict                         # constexpr arguments of the stage-1 kernel, in order
    options: dict                           # num_warps, num_stages
    merge_constants: dict
    merge_options: dict
    runners: dict = field(default_factory=dict, compare=False)
    flagged: dict = field(default_factory=dict, compare=False)

    def stage1_constants(self, softcap: bool, kv_fp8: bool = False) -> dict:
        """:attr:`constants` with the variant flags (``SOFTCAP``, ``KV_FP8``), made once per flag set (every layer
        asks)."""
        constants = self.flagged.get((softcap, kv_fp8))
        if constants is None:
            constants = self.flagged[softcap, kv_fp8] = {**self.constants, "SOFTCAP": softcap, "KV_FP8": kv_fp8}
        return constants


def plan_launch(num_items: int, num_queries: int, num_entries: int, query_tile: int, num_qo_heads: int,
                num_kv_heads: int, head_dim: int, dtype: torch.dtype, cpu: bool,
                override: LaunchConfig | None = None) -> TritonLaunch:
    """The launch of a plan of these sizes: ``num_items`` work items of at most ``query_tile``
    entries, ``num_entries`` entries over ``num_queries`` queries; ``cpu`` when the kernels run
    in Triton's interpreter. ``override`` replaces the stage-1 table entry (tuning)."""
    group = num_qo_heads // num_kv_heads
    limit = max_block_m(head_dim, dtype)
    block_m = min(max(16, triton.next_power_of_2(query_tile * group)), limit)
    entries_per_prog = block_m // group
    if entries_per_prog < 1:
        raise ValueError(f"GQA group size {group} (= {num_qo_heads} / {num_kv_heads} heads) exceeds the {limit} "
                         f"rows of one program for {dtype}")
    subtiles = -(-query_tile // entries_per_prog)
    cfg = override or launch_config(head_dim, block_m, dtype)
    # On the CPU the kernels run in Triton's interpreter, whose dot multiplies bfloat16 bit
    # patterns as integers (triton-lang/triton#11584): widening to fp32 there is exact, as the
    # GPU's bf16 products are exact in fp32 too. On a GPU the constexpr compiles it away.
    widen_dot = cpu and dtype == torch.bfloat16
    return TritonLaunch(
        grid=(num_items * subtiles, num_kv_heads, 1),  # 3-D: the compiled runner reads grid[2]
        merge_grid=(num_queries, num_qo_heads, 1) if num_entries > num_queries else None,
        constants=dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
                       ENTRIES_PER_PROG=entries_per_prog, SUBTILES=subtiles,
                       # tf32 is moot for 16-bit operands; fp32 inputs take the exact dot
                       DOT_PRECISION="ieee" if dtype == torch.float32 or widen_dot else "tf32",
                       WIDEN_DOT=widen_dot),
        options=cfg.options(),
        merge_constants=dict(HEAD_DIM=head_dim, BLOCK_P=_MERGE_BLOCK_P),
        merge_options=dict(num_warps=2 if head_dim <= 128 else 4),
    )


def attend(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
           o_ws: torch.Tensor, lse_ws: torch.Tensor, arrays: dict, scale_log2: float, softcap_scale: float,
           launch: TritonLaunch, kv_scale: torch.Tensor | None = None) -> None:
    """Launch stage 1 (and the merge where ``launch`` has one) on the current stream.

    Parameters
    ----------
    q : [Q, Hq, D] fp16, bf16 or fp32, last dim contiguous
    k_flat, v_flat : [num_slots, Hkv, D], q's dtype (the paged cache viewed slot by slot), or float8_e4m3fn with
        ``kv_scale`` [2, Hkv] float32 contiguous (K's scales, then V's: the stored value times its scale)
    out : [Q, Hq, D] q's dtype; lse : [Q, Hq] float32 (natural log)
    o_ws, lse_ws : [E, Hq, D] (fp16 or float32) and [E, Hq] float32 partial states (E >= the plan's entries)
    arrays : the plan's int32 tensors by name (``kv_slots``, ``chunk_kv_start``, ``entry_query``,
        ``entry_mask`` [E, W], ``entry_direct``, ``item_chunk``, ``item_entry_start``,
        ``item_num_entries``, ``query_entry_start``, ``query_entries``; see ``TreePlan``)
    scale_log2, softcap_scale : the logit arguments: a score ``s`` becomes ``t * scale_log2`` (base 2) with
        ``t = tanh(s * softcap_scale)`` where ``softcap_scale > 0`` (the soft-capped kernel), else ``t = s``
    """
    q_strides, k_strides, v_strides, out_strides = q.stride(), k_flat.stride(), v_flat.stride(), out.stride()
    guard = (q.data_ptr() % 16, k_flat.data_ptr() % 16, v_flat.data_ptr() % 16, out.data_ptr() % 16,
             q_strides, k_strides, v_strides, out_strides)
    hq, d = q.shape[1], q.shape[2]
    mask = arrays["entry_mask"]
    softcap = softcap_scale > 0
    kv_fp8 = kv_scale is not None
    constants = launch.stage1_constants(softcap, kv_fp8)
    _launch(_tree_attn_partial_kernel, launch.grid, launch.runners, (guard, softcap, kv_fp8), (
        q, k_flat, v_flat, out, lse, o_ws, lse_ws, kv_scale if kv_fp8 else lse,   # (lse: never read without fp8)
        arrays["kv_slots"], arrays["chunk_kv_start"], arrays["entry_query"], mask, arrays["entry_direct"],
        arrays["item_chunk"], arrays["item_entry_start"], arrays["item_num_entries"],
        q_strides[0], q_strides[1], k_strides[0], k_strides[1], v_strides[0], v_strides[1],
        out_strides[0], out_strides[1], hq, hq * d, d, hq, mask.stride(0),
        scale_log2, softcap_scale,
    ), constants, launch.options)
    if launch.merge_grid is not None:
        _launch(_merge_partials_kernel, launch.merge_grid, launch.runners, guard, (
            out, lse, o_ws, lse_ws, arrays["query_entry_start"], arrays["query_entries"],
            out_strides[0], out_strides[1], hq, hq * d, d, hq,
        ), launch.merge_constants, launch.merge_options)


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


@triton.jit
def _tanh(x):
    """tanh in fp32 by one exp2: exact to ~1e-7 in absolute terms (what a soft-capped logit's error is), and
    -1 / 1 (no NaN) where the exp2 underflows / overflows."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * _LOG2E)) + 1.0)


@triton.jit
def _attend_kv_tile(acc, l_i, m_i, q, n0, chunk_len, slots_base, k_base, v_base, stride_ks, stride_vs,
                    mask_rows, row_len, qk_scale, softcap_scale, offs_n, offs_d,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    WIDEN_DOT: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr):
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
    if KV_FP8:
        k = k.to(q.dtype)   # e4m3 -> q's dtype in registers (the K scale is in qk_scale)
    if WIDEN_DOT:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:
        qk = _tanh(qk * softcap_scale)
    reads = ((words >> (offs_n & 31)[None, :]) & 1) != 0
    qk = tl.where(reads, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing read yet
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask[:, None], other=0.0)
    if KV_FP8:
        v = v.to(q.dtype)   # (the V scale is applied to the output)
    if WIDEN_DOT:
        v = v.to(tl.float32)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_chunk(q, chunk_len, slots_base, k_base, v_base, stride_ks, stride_vs, mask_rows, row_len, qk_scale,
                  softcap_scale, offs_n, offs_d, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
                  KV_FP8: tl.constexpr):
    """Online softmax over the whole chunk; returns (acc, l, m) in base 2."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n0 in range(0, chunk_len, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(acc, l_i, m_i, q, n0, chunk_len, slots_base, k_base, v_base,
                                        stride_ks, stride_vs, mask_rows, row_len, qk_scale, softcap_scale, offs_n,
                                        offs_d, BLOCK_M, BLOCK_N, DOT_PRECISION, WIDEN_DOT, SOFTCAP, KV_FP8)
    return acc, l_i, m_i


# The plan's tensors are slices of one buffer whose sizes change every step: specializing
# on their alignment (or on the mask row length) would recompile the kernels step after step.
_PLAN_POINTERS = ("kv_slots_ptr", "chunk_kv_start_ptr", "entry_query_ptr", "entry_mask_ptr", "entry_direct_ptr",
                  "item_chunk_ptr", "item_entry_start_ptr", "item_num_entries_ptr")


@triton.jit(do_not_specialize=["stride_me"], do_not_specialize_on_alignment=_PLAN_POINTERS)
def _tree_attn_partial_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, o_ws_ptr, lse_ws_ptr, kv_scale_ptr,
    kv_slots_ptr, chunk_kv_start_ptr, entry_query_ptr, entry_mask_ptr, entry_direct_ptr,
    item_chunk_ptr, item_entry_start_ptr, item_num_entries_ptr,
    stride_qq, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_oq, stride_oh, stride_lq, stride_we, stride_wh, stride_le, stride_me,
    qk_scale, softcap_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ENTRIES_PER_PROG: tl.constexpr, SUBTILES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
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
    if KV_FP8:   # the KV head's K scale multiplies the raw score: folded into the first scale applied to it
        if SOFTCAP:
            softcap_scale = softcap_scale * tl.load(kv_scale_ptr + kv_head)
        else:
            qk_scale = qk_scale * tl.load(kv_scale_ptr + kv_head)
    acc, l_i, m_i = _attend_chunk(q, chunk_len, slots_base, k_base, v_base, stride_ks, stride_vs, mask_rows,
                                  row_len, qk_scale, softcap_scale, offs_n, offs_d, BLOCK_M, BLOCK_N, HEAD_DIM,
                                  DOT_PRECISION, WIDEN_DOT, SOFTCAP, KV_FP8)

    # Every real entry reads >= 1 token of its chunk, so l_i > 0 on valid rows.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if KV_FP8:   # ... and its V scale the output
        o = acc * (tl.load(kv_scale_ptr + tl.num_programs(1) + kv_head) / l_safe)[:, None]
    else:
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
