"""Drawing a token from a row's weights by inverse CDF, and the prefix sums it needs, fast on a GPU.

Every sampled token of the project is drawn here (:func:`inverse_cdf`): the batched sampler, the per-request
picker (:func:`~treedec.sampling.params.sample_tokens` with a caller's uniform numbers) and the speculative
acceptance's bonus token. The draw is the first token whose cumulative weight passes ``u * total``.

torch's ``cumsum`` along the last dimension of a few long rows runs one thread block per row: in a graphed step
of 64 sampled rows over a 128k-token vocabulary the float64 and float32 scans took 0.28 and 0.24 ms on an H200
(``bench/results/2026-12-02-nvidia-h200-batch-s19-sampled-prof.json``; the step 7.26 ms, 7.06 with the blocked
scans, ``...-batch-s19-sampled.json``). :func:`row_cumsum` cuts each row into blocks of :data:`BLOCK` values, sums within
every block at once (many short rows: the whole GPU), then adds each block's offset (the prefix sums of the
block totals): the same sums, in another order of additions (float64 for the draw: the difference is far
below any probability a token can have).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["BLOCK", "inverse_cdf", "row_cumsum"]

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


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` ([m, V] non-negative, any float dtype; need not sum to 1): the first
    whose cumulative weight passes ``uniform * total`` (``uniform``: [m] in [0, 1), float32 or float64).

    In float64 a ``u < 1`` times the total stays below it, so some token passes; a token of zero weight never
    is the first (its cumulative sum equals its predecessor's). A row with no distribution (NaN weights: a
    broken model or an unchecked processor) gives the last id, clamped on the device (no host sync), never an
    id past the vocabulary. Returns [m] int64."""
    vocab = weights.shape[-1]
    cdf = _padded_cumsum(weights.double())   # (the padding's sums are the total: never the first past u * total)
    drawn = torch.searchsorted(cdf, (uniform.double() * cdf[:, vocab - 1]).unsqueeze(-1), right=True).reshape(-1)
    return drawn.clamp_(max=vocab - 1)   # (NaN compares false: it would give V or more)
