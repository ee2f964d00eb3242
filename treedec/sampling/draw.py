"""Drawing a token from a row's weights by inverse CDF, and the prefix sums it needs, fast on a GPU.

Every sampled token of the project is drawn here (:func:`inverse_cdf`): the batched sampler, the per-request
picker (:func:`~treedec.sampling.params.sample_tokens` with a caller's uniform numbers) and the speculative
acceptance's bonus token. The draw is the first token whose cumulative weight passes ``u * total``.

torch's ``cumsum`` along the last dimension of a few long rows runs one thread block per row: in a graphed step
of 64 sampled rows over a 128k-token vocabulary the float64 and float32 scans took 0.28 and 0.24 ms on an H200
(``bench/results/2026-12-02-nvidia-h200-batch-s19-sampled-prof.json``; the step 7.26 ms, 7.06 with the blocked
scans, ``...-batch-s19-sampled.json``). :func:`row_cumsum` cuts each row into blocks of :data:`BLOCK` values, sums
within every block at once (many short rows: the whole GPU), then adds each block's offset (the prefix sums of the
block totals): the same sums, in another order of additions.

The draw and the top-p cut (:func:`~treedec.sampling.sampler.warp`) sum a row's weights in fixed point
(:func:`exact_prefix_sums`: int64 multiples of a fraction of the row's largest weight), not in float: integer sums are
exact, so they are the same bits in any order of additions. torch's CUDA ``cumsum`` adds a row in an order that
follows the number of rows (ATen's ``scan_innermost_dim`` sizes its tiles by rows and row length; one row goes to
cub's scan), so float prefix sums of a row round otherwise alone than in a batch, and a top-p boundary or a draw
that falls between the two roundings flips (issue #53: a seeded request batched != alone on the 8B shape).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["BLOCK", "ExactPrefixSums", "exact_prefix_sums", "inverse_cdf", "row_cumsum"]

#: values a block of :func:`row_cumsum` (rows no longer than this take torch's cumsum as it is)
BLOCK = 1024


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums along the last dimension of ``x`` ([..., n]), in ``x``'s dtype, as
    ``x.cumsum(-1)`` (another order of additions past :data:`BLOCK` values). Non-decreasing where ``x`` is
    non-negative, and a zero leaves the sum as it was (both orders keep that)."""
    return _padded_cumsum(x)[..., :x.shape[-1]]


def _padded_cumsum(x: torch.Tensor) -> torch.Tensor:
    """:func:`row_cumsum` of ``x`` padded with zeros to whole blocks (contiguous; past ``n`` every sum is the
    row's total)."""
    n = x.shape[-1]
    if n <= BLOCK:
        return x.cumsum(dim=-1)
    blocks = -(-n // BLOCK)
    within = F.pad(x, (0, blocks * BLOCK - n)).reshape(*x.shape[:-1], blocks, BLOCK).cumsum(dim=-1)
    # each block's offset: the sum of the blocks before it, the inclusive scan of the block totals shifted by
    # one (not the scan less the total, which rounds): a block's first sum is then >= the previous block's last,
    # which is that offset exactly
    offsets = F.pad(within[..., -1].cumsum(dim=-1)[..., :-1], (1, 0))
    return (within + offsets.unsqueeze(-1)).reshape(*x.shape[:-1], blocks * BLOCK)


@dataclass(frozen=True)
class ExactPrefixSums:
    """A row's weights in fixed point and their prefix sums (:func:`exact_prefix_sums`), int64 on the weights' device.

    Attributes
    ----------
    units : [m, V] int64, each weight as a multiple of the row's unit.
    sums : [m, P] int64, the inclusive prefix sums of ``units``, padded with zeros to whole blocks (``P >= V``;
        past ``V`` every sum is the total).
    total : [m] int64, each row's sum (below 2**53: exact in float64).
    """

    units: torch.Tensor
    sums: torch.Tensor
    total: torch.Tensor


def exact_prefix_sums(weights: torch.Tensor) -> ExactPrefixSums:
    """``weights`` ([m, V] non-negative, any float dtype) in fixed point, and their prefix sums, exact: each weight
    times a power of two that puts the row's largest below ``2**(52 - ceil_log2(V))``, truncated (a weight below
    its row's unit counts as 0; the row's sums stay below 2**53), so the sums are the same bits whatever order a
    device adds them in (the module docstring). A row with no distribution (a NaN or an infinite weight, or every
    weight 0) is all zeros. Elementwise work in the weights' dtype (float32 for a 16-bit one)."""
    vocab = weights.shape[-1]
    if weights.dtype != torch.float64:
        weights = weights.float()
    top = weights.amax(dim=-1, keepdim=True)
    # (the shift kept within the dtype's exponents: a row whose largest weight is tiny gets fewer units, none
    # below 2**-127 in float32)
    low, high = math.frexp(torch.finfo(weights.dtype).tiny)[1], math.frexp(torch.finfo(weights.dtype).max)[1] - 1
    shift = (52 - max(vocab - 1, 1).bit_length() - torch.frexp(top).exponent).clamp_(low, high)
    scale = torch.where(torch.isfinite(top) & (top > 0), torch.exp2(shift.to(weights.dtype)), 0.0)
    units = (weights * scale).nan_to_num_(nan=0.0).long()
    sums = _padded_cumsum(units)
    return ExactPrefixSums(units, sums, sums[:, vocab - 1])


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` ([m, V] non-negative, any float dtype; need not sum to 1): the first
    whose cumulative weight passes ``uniform * total`` (``uniform``: [m] in [0, 1), float32 or float64).

    The cumulative weights are :func:`exact_prefix_sums`' (the same token alone or in any batch, on any device); a
    token of zero weight (or below the row's unit) never is the first (its sum equals its predecessor's). A row with
    no distribution (NaN weights: a broken model or an unchecked processor) gives the last id, clamped on the device
    (no host sync), never an id past the vocabulary. Returns [m] int64."""
    vocab = weights.shape[-1]
    exact = exact_prefix_sums(weights)
    # u * total rounded down, below the total (a u < 1 times it can round up to it); 0 for an empty row, which no
    # sum passes: the padding's sums are the total, so the search gives P >= V and the clamp V - 1
    target = torch.minimum((uniform.double() * exact.total.double()).long(), exact.total - 1).clamp_(min=0)
    drawn = torch.searchsorted(exact.sums, target.unsqueeze(-1), right=True).reshape(-1)
    return drawn.clamp_(max=vocab - 1)
