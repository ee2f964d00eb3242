"""Chunks for steps whose queries share no KV: each query's own tokens, cut only as the grid needs.

In an unshared decode step (a batch of independent sequences, one query each, or one long
sequence) ``flatten``'s even chunks cut across sequences: a unit then holds the rows of two or
three sequences, every KV tile carries mask words, most sequences are split and merged, and the
one-round rule cannot hold (32 sequences of ~2k tokens made 136 units for 132 CTAs: four CTAs ran
two). Here every run of tokens that a single query reads is a *segment*; a chunk never crosses a
segment's border, and segments are cut into even pieces (split-KV, as flash-decoding) only as far
as the persistent grid needs. The candidates: every segment whole (cut at ``max_piece`` tokens),
and the finest cuts whose units fit as many rounds of the CTAs as whole segments take, and one
more; the one whose longest CTA is shortest under the schedule's greedy
(:func:`~treedec.attention.persistent_schedule.assign_units`) is taken, the coarser on a tie.
Where whole segments make fewer units than CTAs (a few sequences) there is nothing to keep whole:
``flatten``'s one round of even chunks balances better, and the planner keeps it.

Measured on an H100 against FlashInfer's batch decode (graphed, us; bench/results/
2026-11-24-nvidia-h100-families-split-kv.json, flatten's chunks from ...-unshared-planner-diag.json and
...-80gb-hbm3-families.json): 32 x 2k tokens 98.6 (flatten 146.5, FlashInfer 104.8), 128 x 2k 372.4
(415.7, 381.3), 4 x 96k 570.2 (587.8, 569.5); 8 x 2k cut into two rounds of pieces ran 34.1 against
flatten's one round 31.3 (...-split-kv-new.json), hence the rule above.
"""
from __future__ import annotations

import numpy as np

from treedec.attention.persistent_schedule import COST_PER_KV_TOKEN, COST_PER_ROW, assign_units

# What a unit costs beside its KV tokens, in tokens, when choosing how far to cut: the schedule's
# COST_PER_UNIT (64) made 32 x 2k and 8 x 2k prefer twice the units for a modeled 1-3% gain that
# measured 3-9% slower on an H100 (a unit of one sequence's query rows costs its start, a tile of
# pipeline fill and a partial state to merge: ~1-3 us, 40-120 tokens of one SM's HBM share).
SPLIT_UNIT_COST = 128.0


def unshared_segments(q_idx: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: int) -> np.ndarray | None:
    """[S + 1] token bounds of the segments of a step whose read intervals (``q_idx``, ``lo``, ``hi``
    over ``total`` flattened tokens) never overlap, else None (some token has several readers).

    A segment starts where the reading query changes; tokens nobody reads join the segment before
    them (the first segment starts at 0), so the bounds cover ``[0, total]``."""
    if len(lo) == 0:
        return None
    order = np.argsort(lo, kind="stable")
    lo, hi, q_idx = lo[order], hi[order], q_idx[order]
    if (lo[1:] < hi[:-1]).any():
        return None
    new_reader = np.flatnonzero(q_idx[1:] != q_idx[:-1]) + 1
    return np.concatenate([[0], lo[new_reader], [total]]).astype(np.int64)


def split_kv_bounds(segments: np.ndarray, num_kv_heads: int, num_ctas: int, rows: int, min_piece: int,
                    max_piece: int) -> np.ndarray | None:
    """[C + 1] chunk bounds: each segment of ``segments`` cut into even pieces of the candidate (see the
    module docstring) whose modeled longest CTA is shortest; None when whole segments (cut at
    ``max_piece``) make fewer units than ``num_ctas`` (few sequences: one round of flatten's even
    chunks across them balances better). ``rows``: query rows per unit (the GQA group); pieces are cut
    no finer than ``min_piece`` tokens unless a segment is shorter."""
    lengths = np.diff(segments)

    def pieces(cap: int) -> np.ndarray:
        return -(-lengths // cap)

    def units(cap: int) -> int:
        return num_kv_heads * int(pieces(cap).sum())

    if units(max_piece) < num_ctas:
        return None
    candidates = [pieces(max_piece)]
    whole_rounds = -(-units(max_piece) // num_ctas)
    for rounds in (whole_rounds, whole_rounds + 1):
        limit = rounds * num_ctas
        low, high = min(min_piece, max_piece), max_piece  # the smallest cap whose units fit: units fall as it grows
        while low < high:
            mid = (low + high) // 2
            if units(mid) <= limit:
                high = mid
            else:
                low = mid + 1
        candidates.append(pieces(low))

    def longest_cta(counts: np.ndarray) -> float:
        piece_len = np.repeat(lengths / counts, counts)
        cost = SPLIT_UNIT_COST + COST_PER_ROW * rows + COST_PER_KV_TOKEN * piece_len
        return float(assign_units(np.tile(cost, num_kv_heads), num_ctas)[2].max())

    counts = min(candidates, key=longest_cta)  # min keeps the first (coarsest) of equal ones
    segment = np.repeat(np.arange(len(lengths)), counts)
    k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = segments[:-1][segment] + lengths[segment] * k // counts[segment]
    return np.concatenate([starts, [segments[-1]]]).astype(np.int64)
