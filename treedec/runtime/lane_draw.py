"""The lanes' batched draw over a block of rows (:mod:`treedec.runtime.lanes`): one definition for the eager draw
of every lane and for the draw recorded in a step's CUDA graph (:class:`~treedec.engine.step_tail.StepTail`).

A graphed step's draw covers a fixed block: the first :func:`lane_bucket` rows of the lane table (a power of two, at
most the table's capacity), its rows past the lanes padding. Every operation of the draw is row-wise (each row its own
logits, parameters, counters, EOS ids and token counts), so the padding rows, which read some real row's logits and
whatever the table holds past its lanes, cannot change a real row's token; what they write lands in rows past the
lanes, which :meth:`~treedec.runtime.lanes.Lanes.add` writes anew before a lane lives there.
"""
from __future__ import annotations

import torch

from treedec.sampling.logits import drawable_rows
from treedec.sampling.sampler import SamplingRows, sample_rows

__all__ = ["draw_block", "lane_bucket", "store_draws"]


def lane_bucket(lanes: int, capacity: int) -> int:
    """The rows a graphed draw of ``lanes`` lanes covers: the next power of two, at most the table's ``capacity``
    (>= ``lanes``): a graph per bucket, not per batch size."""
    if not 0 < lanes <= capacity:
        raise ValueError(f"a draw covers 1 .. capacity ({capacity}) lanes, got {lanes}")
    return min(1 << (lanes - 1).bit_length(), capacity)


def draw_block(table, raw: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Draw the next token of the table's first ``n = raw.shape[0]`` rows from ``raw`` ([n, V] logits, row ``i``
    lane ``i``'s) under ``rows`` (their :class:`SamplingRows`, ``n`` rows): the tokens, their stop flags (EOS / stop
    ids on the device), draw counters, penalties' counts and (penalized rows) whether a row had anything to draw
    from, written into the table's device columns; returns the [n] int64 tokens. Device work only."""
    n = raw.shape[0]
    if rows.penalized:   # (read back with the tokens: a row with nothing to draw from fails alone)
        table.ok[:n] = drawable_rows(raw.float()).long()
    masks = counts = None
    if rows.penalized:
        masks, counts = table.prompt_mask[:n], table.counts[:n]
    tokens = sample_rows(raw, rows, table.drawn_count[:n], masks, counts)
    store_draws(table, slice(0, n), tokens)
    return tokens


def store_draws(table, at: slice | torch.Tensor, tokens: torch.Tensor) -> None:
    """Store drawn ``tokens`` ([m] int64 device) of the table's rows ``at`` (a slice, or [m] device indices): the
    tokens, their stop flags (EOS / stop ids), draw counters and penalties' counts."""
    table.drawn[at] = tokens
    table.stopped[at] = (tokens[:, None] == table.eos[at]).any(dim=1).long()
    table.drawn_count[at] += 1
    if table.counts is not None:   # (each row its own drawn token: a slice would pair every row with every token)
        ones = torch.ones_like(tokens, dtype=table.counts.dtype)
        if isinstance(at, slice):
            table.counts[at].scatter_add_(1, tokens[:, None], ones[:, None])
        else:
            table.counts.index_put_((at, tokens), ones, accumulate=True)
