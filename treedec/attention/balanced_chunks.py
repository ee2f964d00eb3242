"""Flatten chunk borders that balance a persistent grid's unit *time*, not its unit tokens.

The ``flatten`` planner cuts the flattened tree into even chunks; on the cuda backend's
persistent grid each chunk becomes one unit per KV head (per ``query_tile`` readers), all in
one round, so the longest unit sets the step's time. A KV tile does not cost every unit the
same, though: the sm_90a kernel computes a unit with two consumer warpgroups of 64 rows, and a
unit whose rows fill at most half of it runs on one, at about 0.75x the time per tile (H200,
``bench/results/2026-11-22-nvidia-h200-tile-pace*.json``: 0.84-0.94 against 1.10-1.16 us per
64-token tile with 16 CTAs busy). Regions that few queries read (a fan of branches) can so take
longer chunks than a prefix that many read, at the same unit time.

:func:`balanced_flatten_bounds` cuts tile-aligned chunks greedily under a time budget (a light
chunk may grow while its distinct readers stay at most ``query_tile // 2``) and bisects the
budget down to the smallest one whose units still fit the grid. The planner keeps the even
chunks unless the balanced ones have a shorter longest unit under the same cost model.
"""
from __future__ import annotations

import numpy as np

from treedec.attention.persistent_schedule import TILE_TOKENS

MAX_QUERY_TILE_PAIRS = 1 << 23  # (query, tile) table size above which chunks stay even (planning time)


def readers_per_chunk(bounds: np.ndarray, runs) -> np.ndarray:
    """[C] int64: distinct queries reading each chunk of ``bounds`` ([C + 1] token borders).

    ``runs`` are the read intervals ``(q, lo, hi)`` sorted by query, then start. O(intervals): each
    interval adds one reader to its chunks; one that starts in the chunk where its query's previous
    interval ended takes that chunk's reader back (a query's intervals are disjoint).
    """
    q, lo, hi = runs
    num_chunks = len(bounds) - 1
    first = np.searchsorted(bounds, lo, side="right") - 1
    last = np.searchsorted(bounds, hi - 1, side="right") - 1
    shared = np.zeros(len(q), dtype=bool)
    shared[1:] = (q[1:] == q[:-1]) & (first[1:] == last[:-1])
    taken = first[shared]
    bins = num_chunks + 1
    delta = (np.bincount(first, minlength=bins) - np.bincount(last + 1, minlength=bins)     # a difference array
             - np.bincount(taken, minlength=bins) + np.bincount(taken + 1, minlength=bins))
    return np.cumsum(delta[:num_chunks])


def units_per_kv_head(bounds: np.ndarray, runs, query_tile: int) -> int:
    """Work items (one persistent unit per KV head each) of chunks ``bounds``: ``query_tile`` readers to an item."""
    return int((-(-readers_per_chunk(bounds, runs) // query_tile)).sum())


def light_ends(runs, total: int, light_readers: int) -> np.ndarray:
    """[S] int64 over the S ``TILE_TOKENS``-token tiles: for a chunk starting at tile s, the first tile
    (exclusive end) up to which it has at most ``light_readers`` distinct readers; S when it never has more.
    """
    q, lo, hi = runs
    num_tiles = -(-total // TILE_TOKENS)
    queries, q_row = np.unique(q, return_inverse=True)
    if len(queries) <= light_readers:
        return np.full(num_tiles, num_tiles, dtype=np.int64)
    # next_read[q, s]: the first token >= s * TILE_TOKENS query q reads. An interval is its query's
    # first to end after tile start s for s in [ceil(previous end / T), ceil(hi / T)).
    prev_hi = np.where(np.r_[False, q[1:] == q[:-1]], np.r_[0, hi[:-1]], 0)
    s_begin, s_end = -(-prev_hi // TILE_TOKENS), -(-hi // TILE_TOKENS)
    span = np.maximum(s_end - s_begin, 0)
    src = np.repeat(np.arange(len(q)), span)
    s = s_begin[src] + np.arange(len(src)) - np.repeat(np.cumsum(span) - span, span)
    never = np.iinfo(np.int64).max
    next_read = np.full((len(queries), num_tiles), never, dtype=np.int64)
    next_read[q_row[src], s] = np.maximum(lo[src], s * TILE_TOKENS)
    first_over = np.partition(next_read, light_readers, axis=0)[light_readers]  # the (light_readers + 1)-th reader
    return np.where(first_over == never, num_tiles, first_over // TILE_TOKENS)


def balanced_flatten_bounds(runs, total: int, query_tile: int, num_kv_heads: int, ctas: int,
                            light_tile_cost: float, max_chunk: int) -> np.ndarray | None:
    """[C + 1] int64 token borders (multiples of ``TILE_TOKENS`` but the last) whose longest unit, with tiles
    of chunks read by at most ``query_tile // 2`` queries costing ``light_tile_cost`` and the others 1, is
    about the shortest with ``units_per_kv_head * num_kv_heads <= ctas`` and chunks of at most ``max_chunk``
    tokens; None when no cut fits (or the tree is over :data:`MAX_QUERY_TILE_PAIRS`)."""
    num_tiles = -(-total // TILE_TOKENS)
    num_queries = len(np.unique(runs[0]))
    if num_queries * num_tiles > MAX_QUERY_TILE_PAIRS:
        return None
    ends = light_ends(runs, total, query_tile // 2)
    max_tiles = max(max_chunk // TILE_TOKENS, 1)

    def cut(budget: float) -> np.ndarray:
        borders, start = [0], 0
        light_len, heavy_len = int(budget / light_tile_cost + 1e-9), int(budget + 1e-9)
        while start < num_tiles:
            end = start + light_len
            if end > ends[start]:  # the chunk would have more readers: a heavy one, or light up to there
                end = max(int(ends[start]), start + heavy_len)
            start = min(max(end, start + 1), start + max_tiles, num_tiles)
            borders.append(start)
        return np.minimum(np.array(borders, dtype=np.int64) * TILE_TOKENS, total)

    def fits(bounds: np.ndarray) -> bool:
        return units_per_kv_head(bounds, runs, query_tile) * num_kv_heads <= ctas

    # The budgets at which a cut changes (a light or a heavy chunk gains a tile), bisected for the
    # smallest that fits: more budget never makes more chunks, so fitting is monotone up to rounding.
    light = np.arange(1, int(max_tiles / light_tile_cost) + 1) * light_tile_cost
    budgets = np.unique(np.concatenate([np.arange(1, max_tiles + 1, dtype=np.float64), light[light <= max_tiles]]))
    floor = num_tiles * light_tile_cost / max(ctas // num_kv_heads, 1)  # fewer tiles per chunk make too many units
    budgets = budgets[budgets >= min(floor, max_tiles)]
    best = cut(budgets[-1])
    if not fits(best):
        return None
    low, high = 0, len(budgets) - 1  # invariant: budgets[high] fits
    while low < high:
        middle = (low + high) // 2
        bounds = cut(budgets[middle])
        if fits(bounds):
            best, high = bounds, middle
        else:
            low = middle + 1
    return best


def longest_unit_cost(bounds: np.ndarray, runs, query_tile: int, light_tile_cost: float,
                      readers: np.ndarray | None = None) -> float:
    """The cost model of :func:`balanced_flatten_bounds` for any chunks: the longest unit's tiles, weighted
    (``readers``: :func:`readers_per_chunk` of ``bounds`` when the caller has it)."""
    readers = readers_per_chunk(bounds, runs) if readers is None else readers
    tiles = -(-np.diff(bounds) // TILE_TOKENS)
    return float((tiles * np.where(readers <= query_tile // 2, light_tile_cost, 1.0)).max())
