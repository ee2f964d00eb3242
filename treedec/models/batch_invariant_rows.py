"""The batch-invariant mode's CPU ops (``kernel="rows"``): each row's product and norm computed as it is alone.

- :func:`linear_rows`: ``F.linear`` one row at a time (a matrix-vector product, the same call whatever the batch:
  MKL's GEMM takes another code path for one row than for many, which changes a row's bits with the row count);
  a CPU step costs about rows x projections calls.
- :func:`rms_norm_rows`, :func:`add_rms_norm_rows`: treedec's RMSNorm (:func:`~treedec.models.layers.rms_norm`)
  in torch's eager CPU reduction, which sums each row on its own in one order for rows of fewer than 32768 values
  (every model's hidden size; a longer row is split over threads by its length, then they are normed one by one).

Each is also a torch custom op (``treedec::linear_rows``, ``treedec::rms_norm_rows``,
``treedec::add_rms_norm_rows``) with a fake impl, so ``torch.compile`` keeps it whole: Inductor's CPU GEMMs and
reductions (its C++ kernels split a short batch's reductions over threads) never replace it. Outside a compile the
functions compute directly, without the dispatcher's cost.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from treedec.models.layers import rms_norm

__all__ = ["add_rms_norm_rows", "linear_rows", "rms_norm_rows"]

#: Rows this long or longer: torch's CPU reduction may split one row over threads (its grain size), so
#: :func:`rms_norm_rows` norms them one at a time.
_SPLIT_ROW = 32768


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.stack([F.linear(row, weight, bias) for row in rows.unbind(0)]).view(*x.shape[:-1], weight.shape[0])


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    if x.shape[-1] < _SPLIT_ROW or x.numel() == 0:
        return rms_norm(x, weight, eps, offset)
    rows = x.reshape(-1, x.shape[-1])
    return torch.stack([rms_norm(row, weight, eps, offset) for row in rows.unbind(0)]).view(x.shape)


@torch.library.custom_op("treedec::linear_rows", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _linear(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("treedec::rms_norm_rows", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return _norm(x, weight, eps, offset).contiguous()


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("treedec::add_rms_norm_rows", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x + y).contiguous()
    return s, _norm(s, weight, eps, offset).contiguous()


@_add_rms_norm_op.register_fake
def _(x, y, weight, eps, offset):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]``) one row at a
    time: each row's bits are those it gets alone."""
    if torch.compiler.is_compiling():
        return _linear_op(x, weight, bias)
    return _linear(x, weight, bias)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """:func:`~treedec.models.layers.rms_norm` of ``x [..., H]`` by ``weight [H]``, each row's bits independent of
    the other rows."""
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, float(eps), float(offset))
    return _norm(x, weight, eps, offset)


def add_rms_norm_rows(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm_rows(s))`` with ``s = x + y`` (``[..., H]``)."""
    if torch.compiler.is_compiling():
        return _add_rms_norm_op(x, y, weight, float(eps), float(offset))
    s = x + y
    return s, _norm(s, weight, eps, offset)
