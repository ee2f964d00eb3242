"""The weight-only fp8 GEMV: ``y = x @ (W * scale[:, None]).T (+ bias)`` for steps of few rows.

A decode step of one or a few requests multiplies a handful of rows by every weight: the step is the
weights' read. ``torch._scaled_mm`` (the many-row path of :class:`~treedec.models.fp8.Fp8Linear`) first
quantizes the activations (an amax, a division, a cast: small kernels per projection) and runs a GEMM tiled
for many rows. This kernel reads the e4m3 weights once, converts each tile to the activations' dtype in
registers, and multiplies on tensor cores with the rows padded to 16 (``tl.dot``'s least M): the
activations stay in the model dtype (no activation quantization error), the scale is applied per output
row in fp32 at the end.

Grid ``(cdiv(N, BLOCK_N),)``: one program per ``BLOCK_N`` output features, walking K in ``BLOCK_K`` tiles
(no split-K: each output's sum has one fixed order, whatever the number of rows). ``BLOCK_N`` is chosen so
that the grid covers the device's SMs at the model's widths (:func:`launch_config`).

:func:`fp8_gemv` is the torch op ``treedec::fp8_gemv`` (a custom op: ``torch.compile`` and CUDA graphs take
it whole). It runs where Triton runs: a CUDA device, or the CPU under ``TRITON_INTERPRET=1`` (the tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["MAX_ROWS", "GemvConfig", "fp8_gemv", "launch_config"]

#: The most rows the GEMV takes (one ``tl.dot`` tile of M): more rows go to ``torch._scaled_mm``.
MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    """Tile shape of one launch."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def launch_config(n: int, k: int, sms: int) -> GemvConfig:
    """The tile for ``N = n`` outputs over ``K = k``: the widest ``BLOCK_N`` (of 64, 32, 16) whose grid still
    gives every one of ``sms`` SMs two programs, else 16; ``BLOCK_K`` 256 (a 16 x 256 fp8 tile is 4 KB)."""
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= 2 * sms), 16)
    return GemvConfig(block_n=block_n, block_k=256 if k >= 256 else triton.next_power_of_2(max(k, 16)),
                      num_warps=4, num_stages=4)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = offs_m < M
    cols = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        inside = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=rows[:, None] & inside[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=cols[:, None] & inside[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc *= tl.load(s_ptr + offs_n, mask=cols, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=cols, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rows[:, None] & cols[None, :])


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        cfg = launch_config(n, k, _sm_count(x.device))
        _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            rows, weight, scale, bias if bias is not None else scale, out, m, n, k, rows.stride(0),
            weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(*x.shape[:-1], n)


@torch.library.custom_op("treedec::fp8_gemv", mutates_args=())
def _fp8_gemv_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    return _launch(x, weight, scale, bias)


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
