"""SequenceTree's edits of computed tokens: record the real ids of placeholder tokens, append tokens whose K/V
the caller writes, and cut a leaf's computed tail.

Pipelined decoding plans step n+1 before step n's tokens reach the host: the step's tokens are placeholders
until read back (:meth:`set_tokens`), a speculative step's accepted tokens' K/V are moved on the device into
slots reserved for them (:meth:`extend_computed`), and a step run past a stop is rolled back
(:meth:`truncate`). :class:`~treedec.tree.SequenceTree` inherits them; they read its table, pool and layout
cache.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treedec.errors import TreeError
from treedec.tree.validate import int_array, int_value


class ComputedTokenEdits:
    """:meth:`set_tokens`, :meth:`extend_computed` and :meth:`truncate` of a :class:`~treedec.tree.SequenceTree`."""

    def set_tokens(self, node_id: int, start: int, tokens: Sequence[int]) -> None:
        """Overwrite the ids of ``node_id``'s tokens ``start .. start + len(tokens) - 1`` (``[n]`` ints >= 0).

        Slots and K/V stay as they are. For pipelined decoding: a step is planned with a
        placeholder token while the previous step still runs, its forward reads the real token on
        the device (``Engine.step(tokens=...)``), and the real id is recorded here once it is
        read back. (The last token of each of many nodes: :meth:`set_last_tokens`.)
        """
        t = self._table
        row = self._row(node_id)
        tokens = int_array(tokens, "tokens", low=0)
        start = int_value(start, "start", low=0)
        length = t.length.item(row)
        if start + len(tokens) > length:
            raise TreeError(f"node {node_id} has {length} tokens; cannot set tokens {start}.."
                            f"{start + len(tokens) - 1}")
        begin = t.start.item(row) + start
        t.tokens[begin:begin + len(tokens)] = tokens

    def extend_computed(self, node_id: int, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` (``[n]`` ints >= 0) to leaf ``node_id`` as computed tokens: no step computes them,
        the caller writes their K/V into the returned ``[n]`` slots (e.g. a pipelined speculative step moving
        the accepted tokens' K/V on the device before their ids reach the host; :meth:`set_tokens` records
        the ids later, :meth:`truncate` drops the ones not accepted). Checks first, changes nothing when it
        raises."""
        row = self._computed_leaf(node_id, "append computed tokens to")
        tokens = int_array(tokens, "tokens", low=0)
        slots = self._fill(row, tokens)   # raises before any change when the pool is short
        self._table.pending[row] -= len(tokens)
        self._num_pending -= len(tokens)
        return slots

    def truncate(self, node_id: int, length: int) -> np.ndarray:
        """Keep the first ``length`` (>= 1) tokens of leaf ``node_id``; free the pages only the rest held.

        The dropped tokens must be computed (no pending tokens): e.g. a step run past an EOS by
        pipelined decoding. Returns the pages freed.
        """
        row = self._computed_leaf(node_id, "truncate")
        length = int_value(length, "length", low=1)
        t = self._table
        have = t.length.item(row)
        if length > have:
            raise TreeError(f"cannot truncate node {node_id} of {have} tokens to {length}")
        self._check_truncation(np.array([row]), np.array([length]))
        start = t.start.item(row)
        ps = self.pool.page_size
        page_of = t.slots[start:start + have] // ps
        first = np.flatnonzero(np.diff(page_of, prepend=-1))   # where each of the node's pages begins
        freed = self.pool.decref(page_of[first[first >= length]])   # a page stays when a kept token is in it
        t.length[row] = length
        # The kept last page's free slots are refilled only when no other node holds that page (a page held by
        # others, e.g. a shared prefix's, may have their tokens after this node's).
        last = t.slots.item(start + length - 1)
        alone = self.pool.refcount[last // ps] == 1
        t.tail_room[row] = ps - 1 - last % ps if alone else 0
        self._cache.truncated(int(node_id), length)   # its slots past length may be refilled with others
        self._layout = None
        return freed

    # ================================================================ private

    def _computed_leaf(self, node_id: int, doing: str) -> int:
        """The node's row, checked to be a leaf without pending tokens (what ``doing`` needs)."""
        row = self._row(node_id)
        t = self._table
        if t.num_children.item(row):
            raise TreeError(f"cannot {doing} node {node_id}: it has children {self.children(node_id)[:5]}")
        if t.pending.item(row):
            raise TreeError(f"cannot {doing} node {node_id}: it has {t.pending.item(row)} pending token(s); "
                            f"call commit_step() first")
        return row
