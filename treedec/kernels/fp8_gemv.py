"""The weight-only fp8 GEMV: ``y = x @ (W * scale[:, None]).T (+ bias)`` for steps of few rows.

A decode step of one or a few requests multiplies a handful of rows by every weight: the step is the
weights' read. ``torch._scaled_mm`` (the many-row path of :class:`~treedec.models.fp8.Fp8Linear`) first
quantizes the activations (an amax, a division, a cast: small kernels per projection) and runs a GEMM tiled
for many rows. This kernel reads the e4m3 weights once, converts each tile to the activations' dtype in
registers, and multiplies on tensor cores with the rows padded to 16 (``tl.dot``'s least M): the
activations stay in the model dtype (no activation quantization error), the scale is applied per output
row in fp32 at the end.

Grid ``(cdiv(N, BLOCK_N), SPLIT_K)``: a program per ``BLOCK_N`` output features and K range, walking it in
``BLOCK_K`` tiles; with ``SPLIT_K > 1`` each writes an fp32 partial and a second kernel sums the partials in
a fixed order (no atomics: reproducible). A per-row schedule (``dot=False``: each row's product a broadcast
multiply summed over K, no padding) is there for the sweep; :func:`launch_config` picks the tile by shape.

:func:`fp8_gemv` is the torch op ``treedec::fp8_gemv`` (a custom op: ``torch.compile`` and CUDA graphs take
it whole). It runs where Triton runs: a CUDA device, or the CPU under ``TRITON_INTERPRET=1`` (the tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["MAX_ROWS", "GemvConfig", "fp8_gemv", "launch", "launch_config"]

#: The most rows the GEMV takes (one ``tl.dot`` tile of M): more rows go to ``torch._scaled_mm``.
MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    """Tile shape of one launch: ``split_k`` programs share each output tile's K range (their fp32 partials
    summed in a fixed order by the reduce kernel), ``dot`` multiplies on tensor cores (rows padded to 16),
    else each row is a broadcast product summed over K (rows padded to a power of two)."""

    block_n: int
    block_k: int
    split_k: int
    dot: bool
    num_warps: int
    num_stages: int
    #: with ``dot``: the weight tile as the MMA's A operand and the rows as B (``W x^T``: no transposed weight
    #: tile, the small-M GEMMs' "swap AB")
    swap_ab: bool = False


def launch_config(m: int, n: int, k: int, sms: int) -> GemvConfig:
    """The tile for ``m`` rows, ``N = n`` outputs over ``K = k`` on ``sms`` SMs, from the H200 sweep
    (``bench/fp8_gemv.py --sweep``, ``bench/results/2026-12-02-nvidia-h200-fp8-gemv-sweep.json``: Llama-3-8B's
    projections at 1 and 8 rows): 32-wide tensor-core tiles over the whole K, except a layer too small to fill
    the SMs with them (fewer than ``sms`` tiles and K <= 4096, e.g. o_proj), which takes 128-wide tiles with K
    split in four. The per-row (``dot=False``) schedule never won there."""
    if triton.cdiv(n, 32) < sms and k <= 4096 and k >= 4 * 256:
        return GemvConfig(block_n=128, block_k=256, split_k=4, dot=True, num_warps=4, num_stages=3)
    return GemvConfig(block_n=32, block_k=min(256, triton.next_power_of_2(max(k, 16))), split_k=1, dot=True,
                      num_warps=4, num_stages=3)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, DOT: tl.constexpr, SWAP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = offs_m < M
    cols = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    k_lo = split * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    if SWAP:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        inside = offs_k < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=rows[:, None] & inside[None, :],
                    other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=cols[:, None] & inside[None, :], other=0.0)
        if SWAP:
            acc_t += tl.dot(w.to(x.dtype), tl.trans(x))
        elif DOT:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:   # [M, 1, K] x [1, N, K] summed over K: a GEMV per row, no padding to 16 rows
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if SWAP:
        acc = tl.trans(acc_t)
    if DIRECT:
        acc *= tl.load(s_ptr + offs_n, mask=cols, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=cols, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rows[:, None] & cols[None, :])
    else:
        tl.store(ws_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :], acc,
                 mask=rows[:, None] & cols[None, :])


@triton.jit
def _reduce_kernel(ws_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """``y[m] = sum_s ws[s, m] * scale (+ bias)``, the splits summed in order (reproducible)."""
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + (s * M + m) * N + offs, mask=inside, other=0.0)
    acc *= tl.load(s_ptr + offs, mask=inside, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=inside)


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           config: GemvConfig | None = None) -> torch.Tensor:
    """The kernels on ``x``'s rows (``config``: :func:`launch_config`'s unless given: the sweep's)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return out.view(*x.shape[:-1], n)
    cfg = config or launch_config(m, n, k, _sm_count(x.device))
    block_m = 16 if cfg.dot else triton.next_power_of_2(m)
    k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per)
    ws = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else scale
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        rows, weight, scale, b, out, ws, m, n, k, k_per, rows.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, DIRECT=splits == 1, DOT=cfg.dot, SWAP=cfg.dot and cfg.swap_ab,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        _reduce_kernel[(triton.cdiv(n, 1024), m)](ws, scale, b, out, m, n, out.stride(0), SPLIT=splits,
                                                  HAS_BIAS=bias is not None, BLOCK=1024)
    return out.view(*x.shape[:-1], n)


@torch.library.custom_op("treedec::fp8_gemv", mutates_args=())
def _fp8_gemv_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    return launch(x, weight, scale, bias)


@_fp8_gemv_op.register_fake
def _(x, weight, scale, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``x [..., K]`` (bf16 / fp16 / fp32, at most :data:`MAX_ROWS` rows) times the e4m3 ``weight [N, K]``
    with one float32 ``scale [N]`` per output row, ``+ bias [N]``: ``[..., N]`` in ``x``'s dtype."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {MAX_ROWS} rows, got {rows} (more rows: torch._scaled_mm)")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"fp8_gemv needs a contiguous 2-D float8_e4m3fn weight, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1] or scale.shape != (weight.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemv: x [..., {x.shape[-1]}], weight {tuple(weight.shape)} and scale "
                         f"{tuple(scale.shape)} {scale.dtype} do not fit (scale: float32 [N])")
    return _fp8_gemv_op(x, weight, scale, bias)
