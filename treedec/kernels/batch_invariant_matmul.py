"""A Triton matmul whose every output row has one reduction order whatever the number of rows.

``y = x @ w.T`` with ``x [M, K]``, ``w [N, K]``: one program per (BLOCK_M rows, BLOCK_N columns) tile on a
plain grid, the K loop in BLOCK_K steps from 0 upwards, no split-K. The tile sizes are chosen from (N, K)
only (:func:`batch_invariant_tiles`), so a row's sums over K run in the same order and the same MMA shape
for any M: a request's projections give the same bits alone or in a batch (rows past M are masked to 0 and
never mix into a real row's sums). Accumulation is fp32; the output is in ``x``'s dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["MatmulTiles", "batch_invariant_matmul", "batch_invariant_tiles"]


@dataclass(frozen=True)
class MatmulTiles:
    """The fixed tiling of one (N, K): ``block_m``, ``block_n``, ``block_k``, ``num_warps``."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def batch_invariant_tiles(n: int, k: int) -> MatmulTiles:
    """The tiling of ``[*, K] @ [N, K].T``: a function of N and K only (never of M)."""
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    block_n = 128 if n >= 128 else max(16, triton.next_power_of_2(n))
    return MatmulTiles(block_m=64, block_n=block_n, block_k=block_k, num_warps=4)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                   stride_ym, stride_yn, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def batch_invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N]`` in ``x``'s dtype, each row's bits independent
    of the other rows (see the module docstring). ``x`` and ``weight`` share a dtype and a device (CUDA, or the
    CPU under ``TRITON_INTERPRET=1``)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] must share K: x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    t = batch_invariant_tiles(n, k)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))
    _matmul_kernel[grid](x2, weight, bias if bias is not None else y, y, m, n, k, x2.stride(0), x2.stride(1),
                         weight.stride(0), weight.stride(1), y.stride(0), y.stride(1), HAS_BIAS=bias is not None,
                         BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                         # fp32 operands multiplied in full precision (Triton's default is tf32, which missed
                         # F.linear by more than 1e-4 on the H200); 16-bit operands take the tensor cores as they are
                         DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=t.num_warps)
    return y.reshape(*lead, n)
