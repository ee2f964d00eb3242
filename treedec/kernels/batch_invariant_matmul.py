"""A Triton matmul whose every output row has one reduction order whatever the number of rows.

``y = x @ w.T`` with ``x [M, K]``, ``w [N, K]``: one program per (BLOCK_M rows, BLOCK_N columns, K split) tile
on a plain grid, each split's K loop in BLOCK_K steps from its start upwards. The tiling — block sizes, warps,
pipeline stages and the number of K splits — is chosen from (N, K), the dtype's size and the device's SM count only
(:func:`batch_invariant_tiles`), never from M, so a row's sums over K run in the same order and the same MMA
shape for any M: a request's projections give the same bits alone or in a batch (rows past M are masked to 0 and
never mix into a real row's sums). With several splits each writes its fp32 partial sums into a workspace and a
second launch adds them in split order (no atomics), adds the bias and casts.

Why split K at all: at decode sizes (M up to a few hundred rows) a GEMM reads its weights once, and a grid of
``cdiv(N, BLOCK_N)`` programs is too few to stream them at the device's bandwidth when N is small and K long (an
8B model's ``down_proj``: N = 4096, K = 14336, 32 column tiles on a 132-SM H200). A long K is split (one split per
4096, at most as many as bring the grid to about one program per SM per M tile, at most :data:`MAX_SPLITS`), the
same for every M; the partials' traffic (``splits * M * N`` fp32 written and read) is small against the weights' at
decode sizes. Accumulation is fp32; the output is in ``x``'s dtype.

The product is the torch custom op ``treedec::batch_invariant_matmul`` (with a fake impl), so ``torch.compile``
keeps it whole: Inductor fuses the pointwise code around it and never re-tiles it by M. Outside a compile
:func:`batch_invariant_matmul` launches the kernels directly (a call through the op dispatcher costs more host
time than the launch).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["MAX_SPLITS", "MatmulTiles", "batch_invariant_matmul", "batch_invariant_tiles", "launch_matmul", "sm_count"]

#: most K splits of one GEMM
MAX_SPLITS = 8


@dataclass(frozen=True)
class MatmulTiles:
    """The fixed tiling of one (N, K) on one device: ``block_m``, ``block_n``, ``block_k``, ``num_warps``,
    ``num_stages`` (software pipeline depth) and ``splits`` (K ranges of ``split_k`` elements, a multiple of
    ``block_k``, reduced in order)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3
    splits: int = 1
    split_k: int = 0


def batch_invariant_tiles(n: int, k: int, sms: int = 0, itemsize: int = 2) -> MatmulTiles:
    """The tiling of ``[*, K] @ [N, K].T``: a function of N, K, the device's ``sms`` (streaming multiprocessors;
    0: no split) and the operands' ``itemsize`` (bytes; 4-byte operands take half the K block, to fit the same
    pipeline in shared memory) only, never of M.

    The rule, chosen from a sweep of 66 tilings on an H200 at M = 1, 64 and 256 over Llama-3-8B's projections
    (``bench/invariant_gemm.py --sweep``, bench/results/2026-12-04-nvidia-h200-invariant-gemm-s21-sweep.json):
    K is split only when it is long (one split per 4096 of K, at most as many as bring the grid to one program
    per SM per M tile): down_proj's K = 14336 over 32 column tiles, 4 splits. A wide N (a column tile per SM or
    more: gate_up, the LM head) or a split K takes 128 x 128 blocks in 4 stages; a narrow, short one (qkv, o) takes
    64-column blocks over 256-long K steps in 3 stages (twice the programs, the same bytes in flight). At decode
    sizes (M <= 64) the sweep's own timings of these tilings sum to 1.01-1.03x cuBLAS for a forward's GEMMs (the
    first rule: 1.31-1.33x); a rerun in another call measured 1.13x / 1.27x at 1 / 64 rows (...-s21-rule.json: these
    kernels' medians vary that much between calls)."""
    column_tiles = triton.cdiv(n, 128)
    splits = max(1, min(MAX_SPLITS, sms // column_tiles, triton.cdiv(k, 4096))) if sms else 1
    if splits > 1 or column_tiles >= sms:
        block_n, block_k, stages = 128, 128, 4
    else:
        block_n, block_k, stages = 64, 256, 3
    if itemsize == 1 and splits > 1:   # (e4m3: the fp8 sweep's split tilings took 256-long K steps in 3 stages)
        block_k, stages = 256, 3
    block_k //= 2 if itemsize > 2 else 1
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    k_blocks = triton.cdiv(k, block_k)
    splits = max(1, min(splits, k_blocks))
    split_k = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(k, split_k)   # (the last split may be short; none is empty)
    return MatmulTiles(block_m=64, block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages, splits=splits,
                       split_k=split_k)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The device's SM count (0 off CUDA: the interpreter gains nothing from splits)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, SPLIT_K, stride_xm, stride_xk, stride_wn,
                   stride_wk, stride_ys, stride_ym, stride_yn, HAS_BIAS: tl.constexpr, HAS_SCALES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * SPLIT_K
    k_end = tl.minimum(k_start + SPLIT_K, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < k_end), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_SCALES:   # (one split: the product's scales here; several: in the reduction)
        acc *= tl.load(xs_ptr + rm, mask=rm < M, other=0.0)[:, None] * tl.load(ws_ptr + rn, mask=rn < N,
                                                                               other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + pid_s * stride_ys + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _reduce_splits(p_ptr, b_ptr, xs_ptr, ws_ptr, y_ptr, total, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_SCALES: tl.constexpr, BLOCK: tl.constexpr):
    """``y = (sum over s of p[s]) (* x_scale[row] * w_scale[col]) (+ bias)``, the splits added in order 0, 1, ...,
    in fp32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_SCALES:
        acc *= tl.load(xs_ptr + offs // N, mask=mask, other=0.0) * tl.load(ws_ptr + offs % N, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def launch_matmul(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: MatmulTiles,
                  out_dtype: torch.dtype, x_scale: torch.Tensor | None = None,
                  w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels on checked operands: ``x2 [M, K] @ weight [N, K].T`` with ``tiles``, times ``x_scale [M]`` and
    ``w_scale [N]`` (float32, both or neither: an fp8 product's dequantization), ``+ bias``, as ``out_dtype``
    ``[M, N]``. :func:`batch_invariant_matmul` and :func:`~treedec.kernels.fp8_matmul.fp8_matmul` check and call
    it."""
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    if m == 0:
        return y
    t = tiles
    split_k = t.split_k or triton.cdiv(k, t.block_k) * t.block_k
    splits = triton.cdiv(k, split_k)
    scales = x_scale is not None
    xs, ws = (x_scale, w_scale) if scales else (y, y)
    # one split writes y; several write fp32 partials [splits, m, n] for the ordered reduction
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), splits)
    _matmul_kernel[grid](x2, weight, bias if bias is not None and splits == 1 else y, xs, ws, out, m, n, k, split_k,
                         x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                         m * n if splits > 1 else 0, n, 1, HAS_BIAS=bias is not None and splits == 1,
                         HAS_SCALES=scales and splits == 1, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                         # fp32 operands multiplied in full precision (Triton's default is tf32, which missed
                         # F.linear by more than 1e-4 on the H200); 16-bit operands take the tensor cores as they are
                         DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", num_warps=t.num_warps,
                         num_stages=t.num_stages)
    if splits > 1:
        block = 1024
        _reduce_splits[(triton.cdiv(m * n, block),)](out, bias if bias is not None else y, xs, ws, y, m * n, n,
                                                      SPLITS=splits, HAS_BIAS=bias is not None, HAS_SCALES=scales,
                                                      BLOCK=block)
    return y


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: MatmulTiles | None
             ) -> torch.Tensor:
    n, k = weight.shape
    t = tiles or batch_invariant_tiles(n, k, sm_count(x.device), x.element_size())
    return launch_matmul(x.reshape(-1, k), weight, bias, t, x.dtype).view(*x.shape[:-1], n)


@torch.library.custom_op("treedec::batch_invariant_matmul", mutates_args=())
def _matmul_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _product(x, weight, bias, None)


@_matmul_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def batch_invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           tiles: MatmulTiles | None = None) -> torch.Tensor:
    """``x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N]`` in ``x``'s dtype, each row's bits independent
    of the other rows (see the module docstring). ``x`` and ``weight`` share a dtype and a device (CUDA, or the
    CPU under ``TRITON_INTERPRET=1``). ``tiles``: a tiling in place of :func:`batch_invariant_tiles`' (for
    benchmarks and tests; any fixed tiling keeps the rows invariant)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] must share K: x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if tiles is None and torch.compiler.is_compiling():
        return _matmul_op(x, weight, bias)
    return _product(x, weight, bias, tiles)
