"""LayoutCache: the :class:`~treedec.tree.TreeLayout` of an array :class:`~treedec.tree.SequenceTree`, built from
its node table, and the last layout's KV part kept so that the next one is made from it.

A layout's queries are cheap (one entry per node and per pending token). Its KV part, ``kv_slots``, is
one entry per token of the whole forest: what the planners read (each chunk's physical slots) and what
a plan copies to the device. No edit moves a kept token's slot (a truncation drops a node's tail, which
may be refilled: the cache is told) nor reorders the nodes that stay (edits insert and remove nodes in the
depth-first order), so the next ``kv_slots`` is the last one with the removed nodes' and cut tails' slots
dropped and the new slots (appended tokens, new nodes) put in their places: two masked copies of
``kv_slots`` and a gather of the new slots only, whatever the edits. Between two layouts of a decode step only
appends happen (one token per lane, or a prompt chunk), and the node order is the same object: one masked copy (a
speculative step's token trees advanced behind their grown leaves move too: their first positions are read again).
A forest under ``FEW_TOKENS`` tokens (or one without a last layout) gathers every slot from the token buffer, in
fewer numpy calls. A layout is a snapshot its readers keep, so its arrays are never written once made.
"""
from __future__ import annotations

import numpy as np

from treedec.tree.layout import TreeLayout
from treedec.tree.node_table import ROW_MASK, NodeTable, ranges
from treedec.tree.preorder import Preorder

NONE = np.zeros(0, dtype=np.int64)
NONE.setflags(write=False)
FEW_TOKENS = 16384   # below this many KV tokens a layout gathers its slots afresh: fewer numpy calls than merging


class LayoutCache:
    """Builds layouts of one tree's table; keeps the last one's order, per-node lengths and KV arrays."""

    def __init__(self, few_tokens: int = FEW_TOKENS):
        self.few_tokens = few_tokens
        self._order: Preorder | None = None
        self._rows = self._lens = self._prefix = self._kv_start = self._kv_slots = NONE
        self._cut: dict[int, int] = {}   # node id -> tokens of it whose slots are still the last layout's
        self._moved = False               # some node's first position changed since the last layout

    def forget_slots(self) -> None:
        """Forget the last layout: the next one gathers every slot from the token buffer."""
        self._order = None

    def moved(self) -> None:
        """Some nodes' first positions changed (token trees advanced behind their grown leaves,
        :meth:`~treedec.tree.SequenceTree.advance_token_trees`): the next layout reads every node's afresh."""
        self._moved = True

    def truncated(self, node_id: int, length: int) -> None:
        """Node ``node_id`` was cut to ``length`` tokens: its slots past them (maybe refilled since) are no longer
        the last layout's."""
        self._cut[node_id] = min(length, self._cut.get(node_id, length))

    def truncated_many(self, node_ids: np.ndarray, lengths: np.ndarray) -> None:
        """:meth:`truncated` of each of ``node_ids`` (``[k]`` int64, distinct) to ``lengths`` (``[k]`` int64)."""
        cut = self._cut
        if cut:
            lengths = np.minimum(lengths, [cut.get(n, k) for n, k in zip(node_ids.tolist(), lengths.tolist())])
        cut.update(zip(node_ids.tolist(), lengths.tolist()))

    def layout(self, table: NodeTable, order: Preorder) -> TreeLayout:
        """The layout of ``table``'s nodes in ``order``, the queries its pending tokens."""
        if order is self._order and not self._cut:
            rows = self._rows
            lens = table.length[rows]
            grown = (lens != self._lens).nonzero()[0]
            if len(grown):   # appends only: each grown node's new slots go at the end of its range
                old = self._lens[grown]
                added = lens[grown] - old
                new_slots = table.slots[ranges(table.start[rows[grown]] + old, added)]
                self._keep(lens, _insert(self._kv_slots, self._kv_start[grown + 1].repeat(added), new_slots))
            if self._moved:
                self._prefix = _frozen(table.prefix[rows])
        else:
            rows = order.ids & ROW_MASK
            lens = table.length[rows]
            if self._order is None or len(self._kv_slots) < self.few_tokens or not len(rows) * len(self._rows):
                kv_slots = table.slots[ranges(table.start[rows], lens)] if len(rows) else NONE
            else:
                kv_slots = self._merged(table, order.ids, rows, lens)
            self._order, self._rows, self._prefix = order, rows, _frozen(table.prefix[rows])
            self._cut = {}
            self._keep(lens, kv_slots)
        self._moved = False
        query_node, query_offset = _queries(self._lens, table.pending[rows])
        return TreeLayout(order.ids, order.parent, self._kv_start, self._kv_slots, query_node, query_offset,
                          _prefix=self._prefix)

    def _merged(self, table: NodeTable, ids: np.ndarray, rows: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """The slots of the nodes ``ids`` (``[N]`` int64, in the new order; their ``rows`` and ``lens``) from the
        last layout's: the slots of the nodes that stay, in their order (less the tails cut since), their
        appended and the new nodes' slots read from the token buffer and put in their places."""
        old_ids, old_lens = self._order.ids, self._lens
        by_id = old_ids.argsort()
        at = by_id[np.minimum(old_ids.searchsorted(ids, sorter=by_id), len(old_ids) - 1)]
        stays = old_ids[at] == ids                       # a node of the last layout (ids are never reused)
        kept = np.where(stays, old_lens[at], 0)          # its slots then: a prefix of its slots now
        if self._cut:
            cut = np.fromiter(self._cut.items(), dtype=np.dtype((np.int64, 2)), count=len(self._cut))
            by_new = ids.argsort()
            where = by_new[np.minimum(ids.searchsorted(cut[:, 0], sorter=by_new), len(ids) - 1)]
            hit = ids[where] == cut[:, 0]                # (a cut node may be pruned since)
            kept[where[hit]] = np.minimum(kept[where[hit]], cut[hit, 1])
        keep = np.zeros(len(old_ids), dtype=np.int64)   # per node of the last layout: its slots that stay
        keep[at[stays]] = kept[stays]
        drop = (old_lens - keep).nonzero()[0]
        old_slots = self._kv_slots
        if len(drop):   # the removed nodes' slots and the cut tails'
            stay = np.ones(len(old_slots), dtype=bool)
            stay[ranges(self._kv_start[drop] + keep[drop], old_lens[drop] - keep[drop])] = False
            old_slots = old_slots[stay]
        added = lens - kept
        if not added.any():   # nodes removed (a prune), or the shape changed without tokens (a branch of k)
            return old_slots
        starts = lens.cumsum() - lens
        out = np.empty(int(lens.sum()), dtype=np.int64)
        fresh = np.zeros(len(out), dtype=bool)
        new_at = ranges(starts + kept, added)
        fresh[new_at] = True
        out[new_at] = table.slots[ranges(table.start[rows] + kept, added)]
        out[~fresh] = old_slots
        return out

    def _keep(self, lens: np.ndarray, kv_slots: np.ndarray) -> None:
        kv_start = np.zeros(len(lens) + 1, dtype=np.int64)
        lens.cumsum(out=kv_start[1:])
        for a in (lens, kv_start, kv_slots):   # (shared by every reader of the layout until the forest changes)
            a.setflags(write=False)
        self._lens, self._kv_start, self._kv_slots = lens, kv_start, kv_slots


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
    if np.maximum.reduce(pend) == 1:   # a decode step or a token tree: one query a node, its last token
        return _frozen(with_queries), _frozen(last - 1)
    query_node = with_queries.repeat(pend)
    # query q of node i is its token lens[i] - pend[i] + (q - the node's first query)
    query_offset = np.arange(len(query_node), dtype=np.int64)
    query_offset += (last - pend.cumsum()).repeat(pend)
    return _frozen(query_node), _frozen(query_offset)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)   # shared by every reader of the layout until the forest changes
    return a
