"""A Triton RMSNorm whose every row is reduced in one order whatever the number of rows.

One program per row; the row's sum of squares runs over the hidden dim in ``BLOCK``-wide steps from 0 upwards
into a ``[BLOCK]`` fp32 accumulator, then one ``tl.sum`` of it. ``BLOCK`` depends on the hidden size only, so a
row's bits are those it gets alone, in any batch (torch's CUDA reduction picks its block shape from the number
of rows too, which changes the order of a row's sum). Math follows :func:`treedec.models.layers.rms_norm`:
normalise in fp32, then ``weight * cast(h)`` (``offset`` 0, Llama's) or ``cast(h * (offset + weight))``
(Gemma's ``1 + w``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["batch_invariant_rms_norm", "rms_norm_block"]


def rms_norm_block(hidden: int) -> int:
    """The reduction step of a row of ``hidden`` values (a function of ``hidden`` only)."""
    return min(1024, triton.next_power_of_2(hidden))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps, offset, OFFSET: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        x = tl.load(x_ptr + row * stride_x + h0 + cols, mask=h0 + cols < H, other=0.0).to(tl.float32)
        acc += x * x
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    for h0 in range(0, H, BLOCK):
        mask = h0 + cols < H
        h = tl.load(x_ptr + row * stride_x + h0 + cols, mask=mask, other=0.0).to(tl.float32) * inv
        w = tl.load(w_ptr + h0 + cols, mask=mask, other=0.0)
        if OFFSET:
            y = h * (offset + w.to(tl.float32))
        else:   # (the 16-bit product is exact in fp32: rounding it once is the 16-bit multiply torch does)
            y = w.to(tl.float32) * h.to(w.dtype).to(tl.float32)
        tl.store(y_ptr + row * stride_y + h0 + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def batch_invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` by ``weight [H]`` -> ``[..., H]`` in ``x``'s dtype, each row's bits independent of
    the other rows (see the module docstring). ``x`` and ``weight`` on one device (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``)."""
    hidden = x.shape[-1]
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight must be [{hidden}] (x's last dim), got {tuple(weight.shape)}")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, hidden, x2.stride(0), y.stride(0), float(eps), float(offset),
                                         OFFSET=bool(offset), BLOCK=rms_norm_block(hidden), num_warps=4)
    return y.reshape(x.shape)
