"""Chunks for steps whose queries share no KV: each query's own tokens, cut only as the grid needs.

In an unshared decode step (a batch of independent sequences, one query each, or one long
sequence) ``flatten``'s even chunks cut across sequences: a unit then holds the rows of two or
three sequences, every KV tile carries mask words, every sequence is split and merged, and the
one-round rule cannot hold (32 sequences of ~2k tokens made 136 units for 132 CTAs: one CTA in
thirty ran two). Here every run of tokens that a single query reads is a *segment*; a chunk
never crosses a segment's border, and segments are cut into even pieces (split-KV, as
flash-decoding) only as far as the persistent grid needs. The candidates: every segment whole
(cut at ``max_piece`` tokens), and the finest cuts whose units fit one and two rounds of the
CTAs; the one whose longest CTA is shortest under the schedule's cost model and greedy
(:mod:`~treedec.attention.persistent_schedule`) is taken, the coarser on a tie.

Measured on an H100 against FlashInfer's batch decode (us, graphed; whole sequences against
flatten's chunks, bench/results/2026-11-24-nvidia-h100-unshared-planner-diag.json): 32 x 2k
tokens 98.1 against 146.5 (FlashInfer 104.8), 128 x 2k 369.6 against 415.7 (381.6); with few
sequences the one-round cut (8 x 2k: 31.3, FlashInfer 35.0).
"""
from __future__ import annotations

import numpy as np

from treedec.attention.persistent_schedule import COST_PER_KV_TOKEN, COST_PER_ROW, COST_PER_UNIT, assign_units


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
                    max_piece: int) -> np.ndarray:
    """[C + 1] chunk bounds: each segment of ``segments`` cut into even pieces of the candidate (see the
    module docstring) whose modeled longest CTA is shortest. ``rows``: query rows per unit (the GQA
    group); pieces are cut no finer than ``min_piece`` tokens unless a segment is shorter, never
    coarser than ``max_piece``."""
    lengths = np.diff(segments)

    def pieces(cap: int) -> np.ndarray:
        return -(-lengths // cap)

    def units(cap: int) -> int:
        return num_kv_heads * int(pieces(cap).sum())

    candidates = [pieces(max_piece)]
    for rounds in (1, 2):
        limit = rounds * num_ctas
        if units(max_piece) > limit:
            continue  # even whole segments take more rounds
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
        cost = COST_PER_UNIT + COST_PER_ROW * rows + COST_PER_KV_TOKEN * piece_len
        return float(assign_units(np.tile(cost, num_kv_heads), num_ctas)[2].max())

    counts = min(candidates, key=longest_cta)  # min keeps the first (coarsest) of equal ones
    segment = np.repeat(np.arange(len(lengths)), counts)
    k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = segments[:-1][segment] + lengths[segment] * k // counts[segment]
    return np.concatenate([starts, [segments[-1]]]).astype(np.int64)
