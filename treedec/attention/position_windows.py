"""The chunks of a batch-invariant plan (``PlanConfig("path", C, batch_invariant=True)``): each query's keys cut at
absolute positions, a window's chunk read once by every query that reads exactly its keys.

Why absolute windows: the kernels fix a query's reduction order by the chunk each of its keys sits in, and within
a chunk by the key's tile (``BLOCK_N`` keys from the chunk's start); the per-query merge then adds the chunk
partials in chunk order. A query's chunk borders must therefore follow from its own root path alone. Windows
``[k*C, (k+1)*C)`` of root-path positions (the last one short, the first one clipped where a sliding window hides
the keys before it) do, and unlike even pieces of each path (the plain ``path`` planner's 600 tokens ->
0/200/400), they are the same windows for every query whose path holds them whole: a shared prefix is the same
chunks for all its readers.

Grouping (KV-guided): window ``k`` of a query is keyed by ``(k, the flattened index of its last key, its key
count)``. In a tree a token's root path is unique, so the last key fixes every key before it, and the count fixes
where the window starts (a sliding window clips only a query's first window). Queries of one key read the same
slots in the same order: they share ONE chunk, each entry's mask the whole chunk, so each query's arithmetic is
what it would be over its own copy (a backend computes each row of a chunk on its own:
:meth:`~treedec.attention.backends.Backend.why_not_batch_invariant`). Chunks are ordered by key, ``k`` first: a
query's entries, hence its merge, run window by window whatever the layout's node order.

Not shared: queries that read only a prefix of another's window (a verify tree's queries ending inside the window
at different depths, a prompt chunk's causal rows). A bit mask over the longer chunk would leave the triton
kernel's row bit-identical only through facts that are not guarantees: that ``0 * v`` is an exact zero for keys
only other queries read (an inf or NaN there would poison the row), and that the tensor cores add those zero
products and the extra all-masked tiles (``alpha = exp2(0)``) without changing a bit; and the torch backend sums
and multiplies over the chunk's length, whose order changes with that length. So each such query keeps its own
copy of that window (at most C keys, the window holding its own tokens), and every window that holds a shared
prefix whole is read once (per query tile of a work item).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["PositionWindows", "position_windows"]


class PositionWindows(NamedTuple):
    """A batch-invariant plan's chunks: ``kv_slots [T]`` int64 their slots, chunk by chunk; ``bounds [C + 1]`` int64
    their borders in ``kv_slots``; and the entries' reads ``q_idx``, ``lo``, ``hi`` ``[E]`` int64 (each a whole
    chunk, ``[bounds[c], bounds[c + 1])``), sorted by query, then window (so by ``lo``)."""

    q_idx: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    kv_slots: np.ndarray
    bounds: np.ndarray


def position_windows(q_idx: np.ndarray, lo: np.ndarray, hi: np.ndarray, kv_slots: np.ndarray, first: np.ndarray,
                     chunk_size: int) -> PositionWindows:
    """The :class:`PositionWindows` of ``chunk_size`` (C) for the step's reads.

    Parameters
    ----------
    q_idx, lo, hi : [R] int64
        The read intervals (:func:`~treedec.attention.read_intervals.read_intervals`): query ``q_idx[i]`` reads
        flattened tokens ``[lo[i], hi[i])``; a query's intervals are disjoint and, sorted by ``lo``, its keys in
        root-path order.
    kv_slots : [T] int64
        The flattened tokens' pool slots.
    first : [Q] int64
        The root-path position of each query's first key (0, or where a sliding window starts).
    chunk_size : int
        C, the window length.

    Array operations over the intervals, the windows (Q x path / C) and the chunks' tokens: no loop per query or
    per chunk.
    """
    num_q, c = len(first), chunk_size
    order = np.lexsort((lo, q_idx))                      # per query, root first
    q_idx, lo, hi = q_idx[order], lo[order], hi[order]
    span = hi - lo
    ends = np.cumsum(span)                               # each interval's end among all queries' keys, in a row
    begins = ends - span
    count = np.bincount(q_idx, weights=span, minlength=num_q).astype(np.int64)   # keys per query
    key_start = np.cumsum(count) - count                 # its first key in that row
    last = first + count - 1                             # its own position

    # Windows, query by query, k from the first key's window to its own.
    k0 = first // c
    per_query = last // c - k0 + 1
    w_q = np.repeat(np.arange(num_q), per_query)
    w_end = np.cumsum(per_query)
    k = np.arange(int(w_end[-1])) - np.repeat(w_end - per_query - k0, per_query)
    w_first = np.maximum(k * c, first[w_q])
    length = np.minimum(k * c + c, last[w_q] + 1) - w_first
    w_key0 = key_start[w_q] + w_first - first[w_q]       # the window's first key in the row
    at_last = w_key0 + length - 1
    interval = np.searchsorted(ends, at_last, side="right")
    last_flat = lo[interval] + at_last - begins[interval]

    # One chunk per distinct (k, last key, count), in that order; the first window of each is its copy.
    key = (k * len(kv_slots) + last_flat) * (c + 1) + length
    by_key = np.argsort(key, kind="stable")
    ordered = key[by_key]
    new = np.empty(len(key), dtype=bool)
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    chunk_of = np.empty(len(key), dtype=np.int64)
    chunk_of[by_key] = np.cumsum(new) - 1
    copy = by_key[new]
    chunk_len = length[copy]
    bounds = np.zeros(len(copy) + 1, dtype=np.int64)
    np.cumsum(chunk_len, out=bounds[1:])

    # The copies' tokens: each chunk's pieces of the intervals its keys lie in, then the pieces' tokens.
    g0, g1 = w_key0[copy], w_key0[copy] + chunk_len
    i0 = np.searchsorted(ends, g0, side="right")
    pieces = np.searchsorted(ends, g1 - 1, side="right") - i0 + 1
    p_end = np.cumsum(pieces)
    piece = np.repeat(i0 - p_end + pieces, pieces) + np.arange(int(p_end[-1]))
    p_chunk = np.repeat(np.arange(len(copy)), pieces)
    p_g0 = np.maximum(begins[piece], g0[p_chunk])
    p_len = np.minimum(ends[piece], g1[p_chunk]) - p_g0
    p_out = np.cumsum(p_len) - p_len
    flat = np.repeat(lo[piece] + p_g0 - begins[piece] - p_out, p_len) + np.arange(int(bounds[-1]))
    return PositionWindows(w_q, bounds[chunk_of], bounds[chunk_of + 1], kv_slots[flat], bounds)
