"""A Triton RMSNorm, alone or after a residual add, whose every row is reduced in one order whatever the number of
rows.

One program per row; the row's sum of squares runs over the hidden dim in ``BLOCK``-wide steps from 0 upwards
into a ``[BLOCK]`` fp32 accumulator, then one ``tl.sum`` of it. ``BLOCK`` depends on the hidden size only, so a
row's bits are those it gets alone, in any batch (torch's CUDA reduction picks its block shape from the number
of rows too, which changes the order of a row's sum). Math follows :func:`treedec.models.layers.rms_norm`:
normalise in fp32, then ``weight * cast(h)`` (``offset`` 0, Llama's) or ``cast(h * (offset + weight))``
(Gemma's ``1 + w``). The fused form (:func:`batch_invariant_add_rms_norm`) first writes ``s = x + y`` rounded to
``x``'s dtype and norms that ``s``: the bits of an add followed by :func:`batch_invariant_rms_norm`, one launch.

Both are torch custom ops (``treedec::batch_invariant_rms_norm``, ``treedec::batch_invariant_add_rms_norm``)
with fake impls, so ``torch.compile`` keeps each whole (Inductor fuses the pointwise code around it, never
re-plans its reduction by the row count). Outside a compile the functions launch the kernel directly: a call
through the op dispatcher costs more host time than the launch itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["batch_invariant_add_rms_norm", "batch_invariant_rms_norm", "rms_norm_block"]


def rms_norm_block(hidden: int) -> int:
    """The reduction step of a row of ``hidden`` values (a function of ``hidden`` only)."""
    return min(1024, triton.next_power_of_2(hidden))


@triton.jit
def _load_row(x_ptr, r_ptr, s_ptr, offs, mask, ADD: tl.constexpr, STORE: tl.constexpr):
    """``x`` (or ``x + r`` rounded to x's dtype, stored at ``s_ptr`` when ``STORE``) as fp32."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        if STORE:
            tl.store(s_ptr + offs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, s_ptr, w_ptr, y_ptr, H, stride_x, stride_r, stride_y, eps, offset,
                     OFFSET: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        mask = h0 + cols < H
        x = _load_row(x_ptr + row * stride_x, r_ptr + row * stride_r, s_ptr + row * stride_y, h0 + cols, mask,
                      ADD, True)
        acc += x * x
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    for h0 in range(0, H, BLOCK):
        mask = h0 + cols < H
        # (the sum is recomputed, not read back: this program's stores need not be visible to its own loads)
        h = _load_row(x_ptr + row * stride_x, r_ptr + row * stride_r, s_ptr, h0 + cols, mask, ADD, False) * inv
        w = tl.load(w_ptr + h0 + cols, mask=mask, other=0.0)
        if OFFSET:
            y = h * (offset + w.to(tl.float32))
        else:   # (the 16-bit product is exact in fp32: rounding it once is the 16-bit multiply torch does)
            y = w.to(tl.float32) * h.to(w.dtype).to(tl.float32)
        tl.store(y_ptr + row * stride_y + h0 + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel on checked operands: ``(norm, sum)`` (``sum`` None without ``residual``), shaped as ``x``."""
    hidden = x.shape[-1]
    x2 = _rows(x, hidden)
    r2 = x2 if residual is None else _rows(residual, hidden)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    s = y if residual is None else torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, s, weight, y, hidden, x2.stride(0), r2.stride(0), y.stride(0),
                                         float(eps), float(offset), OFFSET=bool(offset), ADD=residual is not None,
                                         BLOCK=rms_norm_block(hidden), num_warps=4)
    return y.view(x.shape), None if residual is None else s.view(x.shape)


@torch.library.custom_op("treedec::batch_invariant_rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return _launch(x, None, weight, eps, offset)[0]


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("treedec::batch_invariant_add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    norm, s = _launch(x, y, weight, eps, offset)
    return s, norm


@_add_rms_norm_op.register_fake
def _(x, y, weight, eps, offset):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _check(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor | None = None) -> None:
    hidden = x.shape[-1]
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight must be [{hidden}] (x's last dim), got {tuple(weight.shape)}")
    if y is not None and (y.shape != x.shape or y.dtype != x.dtype):
        raise ValueError(f"x and y must share a shape and a dtype, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(y.shape)} {y.dtype}")


def batch_invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` by ``weight [H]`` -> ``[..., H]`` in ``x``'s dtype, each row's bits independent of
    the other rows (see the module docstring). ``x`` and ``weight`` on one device (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``)."""
    _check(x, weight)
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, float(eps), float(offset))
    return _launch(x, None, weight, eps, offset)[0]


def batch_invariant_add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it, one launch: ``(s, batch_invariant_rms_norm(s))`` with
    ``s = x + y`` (``x``, ``y`` ``[..., H]`` of one dtype; ``weight [H]``), the same bits as the two steps apart."""
    _check(x, weight, y)
    if torch.compiler.is_compiling():
        return _add_rms_norm_op(x, y, weight, float(eps), float(offset))
    norm, s = _launch(x, y, weight, eps, offset)
    return s, norm
