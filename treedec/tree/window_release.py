"""Giving back the pages no query can read again: the mixin of :class:`~treedec.tree.SequenceTree` for models
whose every layer attends a sliding window (internal; the tree's methods are the API).

A query at position ``p`` reads the keys at positions ``> p - window`` only. Every future query of a node's
subtree sits at or after the node's committed end (its next token, a child's first token, a branch added at
its end; a child's positions follow its parent's), so the node's tokens before ``end - window + 1`` are read by
no one again, whatever its descendants do. The node then drops its hold on each page whose tokens *of this
node* all lie there (its ``released`` leading tokens); the pool frees a page when its last holder lets go, so a
page a shared prefix, another branch or the prefix cache still holds stays. The released slots stay in the
node's region (positions and the layout are unchanged) and are never read: the planners clip every query's
reads to its window. Released K/V cannot come back: a truncation whose end would see them again is refused,
and a prefix cached later stops before them (:meth:`WindowRelease.held_prefix`).
"""
from __future__ import annotations

import numpy as np

from treedec.errors import TreeError
from treedec.tree.node_table import count_distinct, ranges
from treedec.tree.validate import int_value


class WindowRelease:
    """``release_outside_window``, ``held_prefix`` and the truncation check of :class:`SequenceTree`."""

    def release_outside_window(self, window: int, margin: int = 0) -> np.ndarray:
        """Drop every node's holds on the pages that no query at or after its committed end can read through a
        sliding window of ``window`` keys, keeping ``margin`` tokens more (so a rollback of up to ``margin``
        tokens still finds its window's K/V). Only for models whose every layer has a window of at most
        ``window``: a layer without one reads everything. One window a tree: a second, different one raises
        ValueError (changing nothing). Returns the int64 pages that became free, ascending.

        Cheap whatever the number of nodes: one pass over the node columns; the nodes' slots are visited only
        for nodes whose window passed at least one more page since the last call (a page-boundary event).
        """
        window = int_value(window, "window", low=1)
        margin = int_value(margin, "margin", low=0)
        if self._release_window not in (None, (window, margin)):
            raise ValueError(f"release_outside_window: this tree releases for (window, margin) "
                             f"{self._release_window}, got {(window, margin)}")
        self._release_window = (window, margin)
        t, ps = self._table, self.pool.page_size
        released = t.released[:t.hi]
        # the node's first token index read again (its last token at most: the page it may grow into stays held)
        limit = np.minimum(t.length[:t.hi] - t.pending[:t.hi] - window + 1 - margin, t.length[:t.hi] - 1)
        # a node's runs of slots are a page each (at most ps tokens): ps more invisible tokens free one at least
        rows = np.flatnonzero((limit - released >= ps) & (t.node_id[:t.hi] >= 0))
        if not len(rows):
            return np.zeros(0, dtype=np.int64)
        # the tokens from each node's first held one up to its first visible one (included), pages of
        done, lens = released[rows], limit[rows] - released[rows] + 1
        page_of = t.slots[ranges(t.start[rows] + done, lens)] // ps
        begins = np.ones(len(page_of), dtype=bool)
        np.not_equal(page_of[1:], page_of[:-1], out=begins[1:])
        first = lens.cumsum() - lens
        begins[first] = True   # each node's first held run
        at = np.flatnonzero(begins)
        # each node's last run (the visible token's page) stays held: it is the run at or before its last entry
        last_run = at[np.searchsorted(at, first + lens - 1, side="right") - 1]
        drop = begins.copy()
        drop[last_run] = False
        freed = self.pool.release(*count_distinct(page_of[drop]))
        t.released[rows] = done + (last_run - first)
        return freed

    def held_prefix(self, node_id: int) -> int:
        """The tokens from the root to the end of ``node_id`` before the first one whose page some node on the
        path released: the root-path prefix whose K/V the tree still holds (what a prefix cache may keep)."""
        t = self._table
        path = self._path_rows(self._row(node_id))
        cut = np.flatnonzero(t.released[path] > 0)
        if len(cut):
            return int(t.prefix[path[cut[0]]])
        return int(t.prefix.item(path[-1]) + t.length.item(path[-1]))

    def _check_truncation(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        """Refuse (TreeError) truncating nodes ``rows`` to ``lengths`` tokens where the new end's window would
        reach tokens whose pages were released."""
        if self._release_window is None:
            return
        window = self._release_window[0]
        released = self._table.released[rows]
        bad = (released > 0) & (released > lengths - window + 1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TreeError(f"cannot truncate node {self._table.node_id.item(rows[i])} to {int(lengths[i])} tokens: "
                            f"its window of {window} keys would read its first {int(released[i])} tokens, whose "
                            f"pages were released (release_outside_window)")
