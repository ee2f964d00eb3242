"""Each query's read set as intervals over the flattened KV: what every planner cuts into chunks.

A query reads its root path: every token of its node's ancestors and its own node up to itself. With a sliding
window (``AttentionVariant.window``) only the positions from :meth:`AttentionVariant.first_visible` on, a
token's position being its index on its root path. Only tokens that some query reads stay in the flattened
order (the *compacted* KV): nodes nobody reads, and the tokens of a node before every reader's window.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from treedec.attention.variant import AttentionVariant
from treedec.tree.layout import TreeLayout

__all__ = ["ReadIntervals", "read_intervals"]


class ReadIntervals(NamedTuple):
    """The step's reads: query ``q_idx[i]`` reads compacted tokens ``[lo[i], hi[i])`` (one row per query and node of
    its path it reads; rows of a query disjoint, in no particular order), all ``[R]`` int64; ``kv_slots [T]`` the
    compacted tokens' pool slots; ``node_start``, ``node_len`` ``[N]`` int64 each node's kept tokens there (0 for
    nodes nobody reads)."""

    q_idx: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    kv_slots: np.ndarray
    node_start: np.ndarray
    node_len: np.ndarray


def read_intervals(layout: TreeLayout, variant: AttentionVariant = AttentionVariant()) -> ReadIntervals:
    """The :class:`ReadIntervals` of ``layout``'s queries under ``variant``'s mask fields (its window)."""
    return _whole_paths(layout) if variant.window is None else _windowed(layout, variant)


def _whole_paths(layout: TreeLayout) -> ReadIntervals:
    """Each query's read set as token intervals over the compacted flattened KV.

    Returns ``q_idx, lo, hi`` (one row per (query, node on its path), empty ones dropped),
    the compacted ``kv_slots`` and per-node compacted ``node_start``, ``node_len``
    (0 for nodes no query reads).
    """
    kv_start, parent = layout.kv_start, layout.parent
    num_q = layout.num_queries
    q_parts, n_parts = [np.arange(num_q, dtype=np.int64)], [layout.query_node]
    qs, cur = q_parts[0], parent[layout.query_node]
    while len(cur):
        alive = cur >= 0
        qs, cur = qs[alive], cur[alive]
        q_parts.append(qs)
        n_parts.append(cur)
        cur = parent[cur]
    q_idx = np.concatenate(q_parts)
    nodes = np.concatenate(n_parts)

    lens = np.diff(kv_start)
    needed = np.zeros(layout.num_nodes, dtype=bool)
    needed[nodes] = True
    if needed.all():  # the common case: nothing to drop
        node_len, node_start, kv_slots = lens, kv_start[:-1], layout.kv_slots
    else:
        node_len = np.where(needed, lens, 0)
        node_start = np.concatenate([[0], np.cumsum(node_len)[:-1]])
        kv_slots = layout.kv_slots[np.repeat(needed, lens)]

    own = np.zeros(len(q_idx), dtype=bool)
    own[:num_q] = True
    read = np.where(own, np.concatenate([layout.query_offset + 1, np.zeros(len(q_idx) - num_q, np.int64)]),
                    node_len[nodes])
    keep = read > 0
    lo = node_start[nodes][keep]
    return ReadIntervals(q_idx[keep], lo, lo + read[keep], kv_slots, node_start, node_len)


def _windowed(layout: TreeLayout, variant: AttentionVariant) -> ReadIntervals:
    """:func:`_whole_paths` for a variant with a window: each query's intervals clipped to the positions
    it may read (:meth:`AttentionVariant.first_visible` of its position); a node's tokens before every
    reader's first visible one are dropped from the flattened KV (``node_start`` / ``node_len`` then count
    the kept tokens only), as are nodes no clipped interval reads."""
    kv_start, parent = layout.kv_start, layout.parent
    num_q = layout.num_queries
    lens = kv_start[1:] - kv_start[:-1]
    # The walk up from the queries, level by level (their own nodes first); each row's tokens read and the
    # tokens its query reads from it down to itself (its path below the row's first token).
    qs, nodes = np.arange(num_q, dtype=np.int64), layout.query_node
    read = layout.query_offset + 1
    below = read.copy()
    q_parts, n_parts, read_parts, below_parts = [qs], [nodes], [read], [below]
    cur = parent[nodes]
    while len(cur):
        alive = cur >= 0
        qs, cur, below = qs[alive], cur[alive], below[alive]
        read = lens[cur]
        below = below + read
        q_parts.append(qs), n_parts.append(cur), read_parts.append(read), below_parts.append(below)
        cur = parent[cur]
    q_idx, nodes = np.concatenate(q_parts), np.concatenate(n_parts)
    read, below = np.concatenate(read_parts), np.concatenate(below_parts)
    path_len = np.zeros(num_q, dtype=np.int64)
    np.maximum.at(path_len, q_idx, below)                 # the top row's: the whole root path
    first = variant.first_visible(path_len - 1)           # position path_len - 1: the query's own
    skip = np.maximum(first[q_idx] - (path_len[q_idx] - below), 0)   # (path_len - below: the row's first position)
    keep = read > skip
    q_idx, nodes, read, skip = q_idx[keep], nodes[keep], read[keep], skip[keep]

    num_nodes = layout.num_nodes
    node_skip = np.full(num_nodes, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(node_skip, nodes, skip)
    needed = node_skip < np.iinfo(np.int64).max
    node_skip = np.where(needed, node_skip, 0)
    node_len = np.where(needed, lens - node_skip, 0)
    if needed.all() and not node_skip.any():
        node_start, kv_slots = kv_start[:-1], layout.kv_slots
    else:
        node_start = np.concatenate([[0], np.cumsum(node_len)[:-1]])
        offset = np.arange(layout.num_tokens) - np.repeat(kv_start[:-1], lens)
        kv_slots = layout.kv_slots[np.repeat(needed, lens) & (offset >= np.repeat(node_skip, lens))]
    base = node_start[nodes] - node_skip[nodes]
    return ReadIntervals(q_idx, base + skip, base + read, kv_slots, node_start, node_len)
