"""SequenceTree's batch operations over many leaves at once: what the lanes (one row per growing leaf
across all requests, issue 49) do every decode step, each a few numpy calls for the whole batch whatever
its size, none a Python loop over the leaves.

A decode step of ``L`` lanes::

    need = tree.pages_to_append(leaves)          # pages the step takes: one per leaf whose last page is full
    slots = tree.append_tokens(leaves, tokens)   # one token each (None: placeholders), pending; [L] slots
    q = tree.pending_queries()                   # every query's node, slot, token id and position, in one call
    ...                                          # the forward writes K/V at q.slots, reads q.tokens, q.positions
    tree.commit_step()
    tree.set_last_tokens(leaves, sampled)        # when the tokens were placeholders (sampled on the device)

and :meth:`~treedec.tree.SequenceTree.prune_many` removes the requests (or branches) a step finished.
:class:`~treedec.tree.SequenceTree` inherits them; they read its table, pool and layout.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from treedec.errors import TreeError
from treedec.tree.node_table import FIELD, ROW_MASK
from treedec.tree.validate import int_array


TAIL, LENGTH, PENDING, START, CAP = (FIELD[c] for c in ("tail_room", "length", "pending", "start", "cap"))


@dataclass(frozen=True)
class PendingQueries:
    """The step's queries (the pending tokens) in :meth:`~treedec.tree.SequenceTree.layout` order, as
    :meth:`~treedec.tree.SequenceTree.pending_queries` gives them.

    Attributes
    ----------
    nodes : [Q] int64
        The node id of each query.
    slots : [Q] int64
        Its KV-pool slot (where the step writes its K/V): the layout's ``query_slot``.
    tokens : [Q] int64
        Its token id (a placeholder until :meth:`~treedec.tree.SequenceTree.set_last_tokens` sets it).
    positions : [Q] int64
        Its position in its own sequence (root to it; for RoPE): the layout's ``query_position``.
    """

    nodes: np.ndarray
    slots: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return len(self.nodes)


class LaneEdits:
    """:meth:`append_tokens`, :meth:`pages_to_append`, :meth:`set_last_tokens` and :meth:`pending_queries` of
    a :class:`~treedec.tree.SequenceTree`."""

    def append_tokens(self, node_ids: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray | None = None,
                      checked: bool = True) -> np.ndarray:
        """Append one token to each of many leaves at once (all or nothing), pending: what
        ``extend_many({n: [t] for n, t in zip(node_ids, tokens)})`` does, in a few numpy calls.

        Each token goes into its leaf's last page while it has room; the leaves whose last page is full
        (:meth:`pages_to_append` of them) get one fresh page each, taken in one call, in the order of
        ``node_ids``.

        Parameters
        ----------
        node_ids : [L] ints
            Distinct leaves (nodes without children).
        tokens : [L] ints >= 0, optional
            Their new tokens; None appends placeholders (0) whose ids :meth:`set_last_tokens` records later
            (the step reads the real ones on the device: ``Engine.step(tokens=...)``).
        checked : False for a caller that holds the leaves and made the tokens itself (the lane table: ``[L]``
            int64 arrays of distinct live leaves by construction, every step): the checks are skipped.

        Returns
        -------
        [L] int64: the slot of each new token (where the step writes its K/V).

        Raises
        ------
        TypeError / ValueError : ``node_ids`` or ``tokens`` is not a 1-D collection of ints (ValueError: of the
            wrong length, or a token < 0).
        TreeError : an unknown node, one named twice, or one with children.
        PoolExhaustedError : fewer free pages than the append needs. Nothing is changed when it raises.
        """
        if not checked:
            return self._append_rows(node_ids & ROW_MASK, np.zeros(len(node_ids), dtype=np.int64)
                                     if tokens is None else tokens)
        ids, rows = self._leaf_rows(node_ids)
        return self._append_rows(rows, self._one_per_node(tokens, len(rows), placeholder=True))

    def pages_to_append(self, node_ids: Sequence[int] | np.ndarray, checked: bool = True) -> int:
        """The fresh pages :meth:`append_tokens` of ``node_ids`` (``[L]`` ints: distinct leaves) would take: one
        per leaf whose last page is full. Changes nothing; raises as :meth:`append_tokens` would for bad
        ``node_ids`` (``checked``: as :meth:`append_tokens`)."""
        rows = node_ids & ROW_MASK if not checked else self._leaf_rows(node_ids)[1]
        return int(np.count_nonzero(self._table.tail_room[rows] == 0))

    def set_last_tokens(self, node_ids: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                        checked: bool = True) -> None:
        """Record the id of the last token of each of many nodes: what ``set_tokens(n, node_length(n) - 1, [t])``
        does for each, in one call (e.g. the tokens a pipelined step sampled on the device, once read back,
        for the placeholders :meth:`append_tokens` appended). Slots and K/V stay as they are.

        Parameters
        ----------
        node_ids : [L] ints
            Distinct nodes holding at least one token.
        tokens : [L] ints >= 0

        Raises
        ------
        TypeError / ValueError : as :meth:`append_tokens`; TreeError : an unknown node, one named twice, or
            one without tokens. Nothing is changed when it raises. ``checked``: as :meth:`append_tokens` (nodes
            holding tokens).
        """
        t = self._table
        if not checked:
            rows = node_ids & ROW_MASK
            t.tokens[t.start[rows] + t.length[rows] - 1] = tokens
            return
        ids, rows = self._lane_rows(node_ids, "node_ids")
        self._distinct(ids, rows)
        tokens = self._one_per_node(tokens, len(rows))
        lens = t.length[rows]
        empty = lens == 0
        if empty.any():
            raise TreeError(f"node(s) {ids[empty][:5].tolist()} hold no tokens: no last token to set")
        t.tokens[t.start[rows] + lens - 1] = tokens

    def pending_queries(self) -> PendingQueries:
        """The step's queries in one call: each pending token's node, slot, token id and position (``[Q]``
        int64 each, read-only), in :meth:`layout` order (what ``layout().query_slot``, :meth:`pending_tokens`,
        ``layout().query_position`` and the node of each query give one by one)."""
        layout = self.layout()
        out = [layout.node_ids[layout.query_node], layout.query_slot, self.pending_tokens(), layout.query_position]
        for a in out:
            a.setflags(write=False)
        return PendingQueries(*out)

    # ================================================================ private

    def _append_rows(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """:meth:`append_tokens` of checked input: ``rows`` distinct leaves, ``tokens`` one each (``[L]`` int64).
        The rows' fields are read in one gather and written back in one scatter."""
        t = self._table
        ps = self.pool.page_size
        f = t.fields(rows)
        room, lens = f[:, TAIL], f[:, LENGTH]
        full = room == 0
        num_pages = int(full.sum())
        self._check_free(num_pages)
        pages = self.pool.allocate(num_pages)
        if (f[:, CAP] <= lens).any():   # some regions are full: those rows move (now and then)
            t.make_room(rows, lens + 1)
            f = t.fields(rows)
            room, lens = f[:, TAIL], f[:, LENGTH]
        at = f[:, START] + lens
        slots = t.slots[at - 1] + 1   # the slot after the last; a leaf without room (or tokens) gets a page's first
        slots[full] = pages * ps
        t.slots[at] = slots
        t.tokens[at] = tokens
        f[:, TAIL] = np.where(full, ps - 1, room - 1)
        f[:, LENGTH] += 1
        f[:, PENDING] += 1
        t.set_fields(rows, f)
        self._num_pending += len(rows)
        self._layout = None
        return slots

    def _lane_rows(self, node_ids, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``node_ids`` checked (a 1-D collection of ints, each a live node) as ``(ids, rows)``, ``[L]`` int64 each."""
        ids = int_array(node_ids, name)
        rows = ids & ROW_MASK
        t = self._table
        if len(rows) and (rows.max() >= t.hi or (t.node_id[rows] != ids).any()):
            known = rows < t.hi
            known[known] = t.node_id[rows[known]] == ids[known]
            raise TreeError(f"{name}: unknown node id(s) {ids[~known][:5].tolist()} (pruned, or never created)")
        return ids, rows

    def _leaf_rows(self, node_ids) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_lane_rows`, checked to be distinct leaves."""
        ids, rows = self._lane_rows(node_ids, "node_ids")
        self._distinct(ids, rows)
        inner = self._table.num_children[rows] > 0
        if inner.any():
            nid = int(ids[inner][0])
            raise TreeError(f"cannot extend node {nid}: it has children {self.children(nid)}; only leaves grow")
        return ids, rows

    @staticmethod
    def _distinct(ids: np.ndarray, rows: np.ndarray) -> None:
        ordered = rows.copy()
        ordered.sort()
        if (ordered[1:] == ordered[:-1]).any():
            twice = ordered[1:][ordered[1:] == ordered[:-1]]
            raise TreeError(f"node_ids must be distinct, got node(s) {ids[np.isin(rows, twice)][:5].tolist()} "
                            f"more than once")

    @staticmethod
    def _one_per_node(tokens, count: int, placeholder: bool = False) -> np.ndarray:
        if tokens is None and placeholder:
            return np.zeros(count, dtype=np.int64)
        tokens = int_array(tokens, "tokens", low=0)
        if len(tokens) != count:
            raise ValueError(f"tokens must hold one token per node ({count}), got {len(tokens)}")
        return tokens
