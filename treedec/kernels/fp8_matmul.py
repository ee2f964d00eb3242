"""The fp8 x fp8 GEMM for decode-size steps: ``y = (x_q * x_scale) @ (W * w_scale[:, None]).T (+ bias)``.

:class:`~treedec.models.fp8.Fp8Linear`'s dynamic scheme quantizes each row of the activations to e4m3 with its own
scale (``amax / 448``) and multiplies on fp8 tensor cores. ``torch._scaled_mm`` does that with a GEMM tiled for
many rows (83-290 us a projection at 1-64 rows on an H200, more than bf16's cuBLAS: bench/results/
2026-12-02-nvidia-h200-fp8-gemv*.json). At decode sizes the product is the weights' read, so this module runs the
tiled matmul of :mod:`~treedec.kernels.batch_invariant_matmul` over the e4m3 operands (the rows quantized by the
caller), fp32 accumulation, both scales applied per element at the end (or in the ordered reduction of its K
splits). The tiling is a function of (N, K) and the SM count (:func:`fp8_matmul_tiles`), so the rows stay
independent of one another here too.

:func:`fp8_matmul` is the torch op ``treedec::fp8_matmul`` (a custom op: ``torch.compile`` and CUDA graphs take
it whole). It runs where Triton runs: a CUDA device of compute capability >= 8.9 (fp8 tensor cores), or the CPU
under ``TRITON_INTERPRET=1`` (the tests).
"""
from __future__ import annotations

import torch

from treedec.kernels.batch_invariant_matmul import MatmulTiles, sm_count, batch_invariant_tiles, launch_matmul

__all__ = ["MAX_ROWS", "fp8_matmul", "fp8_matmul_tiles", "launch"]

#: The most rows :class:`~treedec.models.fp8.Fp8Linear` sends here (the sizes its tiling was swept at: decode
#: batches and verify trees); longer steps take ``torch._scaled_mm``.
MAX_ROWS = 256


def fp8_matmul_tiles(n: int, k: int, sms: int = 0) -> MatmulTiles:
    """The tiling of the e4m3 product: the batch-invariant matmul's rule for 1-byte operands (its split K in
    256-long steps: bench/results/2026-12-04-nvidia-h200-fp8-matmul-sweep-s21.json)."""
    return batch_invariant_tiles(n, k, sms, 1)


def launch(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype, tiles: MatmulTiles | None = None) -> torch.Tensor:
    """The kernels on ``xq``'s rows (``tiles``: :func:`fp8_matmul_tiles`' unless given: the sweep's)."""
    x2 = xq.reshape(-1, xq.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n, k = weight.shape
    t = tiles or fp8_matmul_tiles(n, k, sm_count(xq.device))
    return launch_matmul(x2, weight, bias, t, out_dtype, x_scale.reshape(-1), scale).view(*xq.shape[:-1], n)


@torch.library.custom_op("treedec::fp8_matmul", mutates_args=())
def _fp8_matmul_op(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return launch(xq, x_scale, weight, scale, bias, out_dtype)


@_fp8_matmul_op.register_fake
def _(xq, x_scale, weight, scale, bias, out_dtype):
    return xq.new_empty(*xq.shape[:-1], weight.shape[0], dtype=out_dtype)


def fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The e4m3 rows ``xq [..., K]`` with their float32 scales ``x_scale`` (``[...]`` or ``[..., 1]``: one a row)
    times the e4m3 ``weight [N, K]`` with one float32 ``scale [N]`` per output row, ``+ bias [N]``: ``[..., N]``
    in ``out_dtype``. The rows come quantized (:func:`treedec.models.fp8.quantize_rows`: torch ops, which
    ``torch.compile`` fuses into the step's neighbouring kernels)."""
    fp8 = torch.float8_e4m3fn
    if weight.dtype != fp8 or xq.dtype != fp8 or weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"fp8_matmul needs float8_e4m3fn rows and a contiguous 2-D float8_e4m3fn weight, got "
                         f"{xq.dtype} rows and a {weight.dtype} {tuple(weight.shape)} weight")
    rows = xq.numel() // max(xq.shape[-1], 1)
    if xq.shape[-1] != weight.shape[1] or scale.shape != (weight.shape[0],) or scale.dtype != torch.float32 \
            or x_scale.numel() != rows or x_scale.dtype != torch.float32:
        raise ValueError(f"fp8_matmul: rows [..., {xq.shape[-1]}] with scales {tuple(x_scale.shape)} "
                         f"{x_scale.dtype}, weight {tuple(weight.shape)} and scale {tuple(scale.shape)} {scale.dtype} "
                         f"do not fit (scales: float32, one a row and one an output)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    return _fp8_matmul_op(xq, x_scale.contiguous(), weight, scale, bias, out_dtype)
