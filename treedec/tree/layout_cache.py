"""LayoutCache: the :class:`~treedec.tree.TreeLayout` of an array :class:`~treedec.tree.SequenceTree`, gathered
from its node table, and the last layout's KV part kept so that the next one grows from it.

A layout's queries are cheap (one entry per node and per pending token). Its KV part, ``kv_slots``, is
one entry per token of the whole forest: what the planners read (each chunk's physical slots) and what
a plan copies to the device. Between two layouts of a decode step only appends happen (one token per
lane, or a prompt chunk); the node order is then the same object and the new slots are inserted into
the last ``kv_slots`` (one masked copy; below ``FEW_TOKENS`` tokens, gathering them costs less); any other edit (a branch, a token tree, a prune, an accept: a
new node order; a truncation) gathers ``kv_slots`` from the token buffer again. Both are a few numpy
calls and a copy of ``kv_slots``: a layout is a snapshot its readers keep, so its arrays are never
written once made.
"""
from __future__ import annotations

import numpy as np

from treedec.tree.layout import TreeLayout
from treedec.tree.node_table import ROW_MASK, NodeTable, ranges
from treedec.tree.preorder import Preorder

NONE = np.zeros(0, dtype=np.int64)
NONE.setflags(write=False)
FEW_TOKENS = 16384   # below this many KV tokens a layout gathers its slots afresh: fewer numpy calls than growing


class LayoutCache:
    """Builds layouts of one tree's table; keeps the last one's order, per-node lengths and KV arrays."""

    def __init__(self, few_tokens: int = FEW_TOKENS):
        self.few_tokens = few_tokens
        self._order: Preorder | None = None
        self._rows = self._lens = self._prefix = self._kv_start = self._kv_slots = NONE

    def forget_slots(self) -> None:
        """Some node's kept slots changed (not only appended to): the next layout gathers every slot."""
        self._order = None

    def layout(self, table: NodeTable, order: Preorder) -> TreeLayout:
        """The layout of ``table``'s nodes in ``order``, the queries its pending tokens."""
        if order is not self._order or len(self._kv_slots) < self.few_tokens:   # (a small forest: gathering costs less)
            rows = order.ids & ROW_MASK
            lens = table.length[rows]
            kv_slots = table.slots[ranges(table.start[rows], lens)] if len(rows) else NONE
            self._order, self._rows, self._prefix = order, rows, _frozen(table.prefix[rows])
            self._keep(lens, kv_slots)
        else:
            rows = self._rows
            lens = table.length[rows]
            grown = (lens != self._lens).nonzero()[0]
            if len(grown):   # appends only: each grown node's new slots go at the end of its range
                old = self._lens[grown]
                added = lens[grown] - old
                new_slots = table.slots[ranges(table.start[rows[grown]] + old, added)]
                self._keep(lens, _insert(self._kv_slots, self._kv_start[grown + 1].repeat(added), new_slots))
        query_node, query_offset = _queries(self._lens, table.pending[rows])
        return TreeLayout(order.ids, order.parent, self._kv_start, self._kv_slots, query_node, query_offset,
                          _prefix=self._prefix)

    def _keep(self, lens: np.ndarray, kv_slots: np.ndarray) -> None:
        kv_start = np.zeros(len(lens) + 1, dtype=np.int64)
        lens.cumsum(out=kv_start[1:])
        self._lens, self._kv_start, self._kv_slots = _frozen(lens), _frozen(kv_start), _frozen(kv_slots)


def _insert(values: np.ndarray, at: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``np.insert(values, at, new)`` for ``at`` non-decreasing (``[k]`` int64), without its fixed cost."""
    dst = at + np.arange(len(at), dtype=np.int64)   # where the new values land
    out = np.empty(len(values) + len(at), dtype=np.int64)
    old = np.ones(len(out), dtype=bool)
    old[dst] = False
    out[old] = values
    out[dst] = new
    return out


def _queries(lens: np.ndarray, pending: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The layout's ``query_node`` and ``query_offset`` (``[Q]`` int64, read-only): every node's pending
    tokens, node after node."""
    with_queries = pending.nonzero()[0]
    if not len(with_queries):
        return NONE, NONE
    pend = pending[with_queries]
    last = lens[with_queries]
    if pend.max() == 1:   # a decode step or a token tree: one query a node, its last token
        return _frozen(with_queries), _frozen(last - 1)
    query_node = with_queries.repeat(pend)
    # query q of node i is its token lens[i] - pend[i] + (q - the node's first query)
    query_offset = np.arange(len(query_node), dtype=np.int64)
    query_offset += (last - pend.cumsum()).repeat(pend)
    return _frozen(query_node), _frozen(query_offset)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)   # shared by every reader of the layout until the forest changes
    return a
