"""SequenceTree's subtree walks and removals: a node's subtree, the pages pruning it would free, pruning
it (or many at once), and pruning a dead end (a leaf with the ancestors that lead only to it).

Every program that drops branches (a branch controller's Prune ops, beam search's dropped beams, ToT's
thoughts not kept, a finished request) walks and prunes through these. A subtree is a range of the forest's
depth-first order that the tree keeps up to date (:class:`~treedec.tree.preorder.Preorder`), and its nodes'
pages are read from their slots in the token buffer, so a prune is a few numpy calls however many nodes it
removes. :class:`~treedec.tree.SequenceTree` inherits them; they read its table, pool and preorder.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from treedec.errors import TreeError
from treedec.tree.node_table import ROW_MASK, count_distinct, ranges


class SubtreeEdits:
    """:meth:`subtree`, :meth:`pages_freed_by_prune`, :meth:`prune`, :meth:`prune_many`, :meth:`prune_dead_end`
    and :meth:`prune_dead_ends` of a :class:`~treedec.tree.SequenceTree`."""

    def subtree(self, node_id: int) -> list[int]:
        """``node_id`` and all its descendants, in depth-first preorder (``node_id`` first).

        Raises ``TypeError`` for a node id that is not an int, :class:`~treedec.errors.TreeError` for an
        unknown one.
        """
        self._row(node_id)
        order = self._order
        start = order.position(int(node_id))
        return order.ids[start:order.subtree_end(start)].tolist()

    def pages_freed_by_prune(self, node_ids: Iterable[int]) -> int:
        """Pages that pruning the subtrees of ``node_ids`` would return to the pool (changes nothing).

        A page is freed when every node holding it is in one of those subtrees.
        """
        doomed = np.unique(np.array([i for nid in node_ids for i in self.subtree(nid)], dtype=np.int64))
        return self._pages_freed(self._holds(doomed & ROW_MASK))

    def prune(self, node_id: int) -> np.ndarray:
        """Remove ``node_id`` and its whole subtree; returns the pages freed.

        Pruning a root removes that request. A subtree that still has pending tokens
        (queries of the step in flight) cannot be pruned until :meth:`commit_step`.
        """
        row = self._row(node_id)
        order = self._order
        start = order.position(int(node_id))
        stop = order.subtree_end(start)
        doomed = order.ids[start:stop] & ROW_MASK
        t = self._table
        busy = t.pending[doomed] > 0
        if busy.any():
            raise TreeError(f"cannot prune node {node_id}: node(s) {t.node_id[doomed[busy]][:5].tolist()} in its "
                            f"subtree have pending tokens of the current step; call commit_step() first")
        up = t.parent.item(row)
        freed = self._cut(doomed, order.cut(start, stop))
        if up >= 0:
            t.num_children[up] -= 1
        return freed

    def prune_many(self, node_ids: Sequence[int] | np.ndarray, checked: bool = True) -> np.ndarray:
        """Remove the subtrees of all ``node_ids`` at once (all or nothing); returns the pages freed.

        The same as pruning them one by one (:meth:`prune`), in a few numpy calls whatever their number:
        e.g. the requests that finished in a step, or the branches a step drops.

        Parameters
        ----------
        node_ids : [k] ints
            Distinct live nodes, none in another's subtree; their subtrees must have no pending tokens.
        checked : False for a caller that made ``node_ids`` itself (``[k]`` int64 live nodes: the verify group's
            trees, every step): their type and liveness are not checked (the rest is).

        Returns
        -------
        [f] int64, ascending: the pages that went back to the pool.

        Raises
        ------
        TypeError / ValueError : ``node_ids`` is not a 1-D collection of int64 ints.
        TreeError : an unknown id, an id named twice or inside another's subtree, or pending tokens below one;
            nothing is changed.
        """
        ids, rows = self._lane_rows(node_ids, "node_ids") if checked else (node_ids, node_ids & ROW_MASK)
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        order = self._order
        at = order.positions(ids)
        # (leaves, e.g. the outputs a step ended: each subtree is the node alone)
        ends = order.subtree_ends(at) if np.logical_or.reduce(self._table.num_children[rows]) else at + 1
        by_position = at.argsort(kind="stable")
        at, ends = at[by_position], ends[by_position]
        inside = (at[1:] < np.maximum.accumulate(ends)[:-1]).nonzero()[0]   # starts before an earlier one ends
        if len(inside):
            which = ids[by_position][inside[0] + 1]
            raise TreeError(f"prune_many: node {which} is named twice or lies in the subtree of another node of "
                            f"node_ids; name each subtree once")
        positions = ranges(at, ends - at)
        doomed = order.ids[positions] & ROW_MASK
        t = self._table
        busy = t.pending[doomed] > 0
        if np.logical_or.reduce(busy):
            raise TreeError(f"prune_many: node(s) {t.node_id[doomed[busy]][:5].tolist()} in the subtrees have "
                            f"pending tokens of the current step; call commit_step() first")
        ups = t.parent[rows]
        freed = self._cut(doomed, order.remove(positions))
        np.subtract.at(t.num_children, ups[ups >= 0], 1)
        return freed

    def prune_dead_end(self, leaf: int, root: int) -> int:
        """Prune ``leaf`` and each ancestor below ``root`` that leads only to it (a branch that was given up:
        a dropped beam, a thought not kept), so no childless node is left between ``root`` and the rest.

        The branch is cut once, at the highest such ancestor: the child of ``root`` or of the nearest
        ancestor with other children. ``leaf`` may have children (they go with it). Returns the node
        pruned (the top of what was removed).

        Raises :class:`~treedec.errors.TreeError`, having changed nothing, when either node is unknown, when
        ``root`` is not a proper ancestor of ``leaf``, or when what would be pruned has pending tokens
        (``TypeError`` for a node id that is not an int).
        """
        path = self.path(leaf)
        self._row(root)
        if root == leaf or root not in path:
            raise TreeError(f"cannot prune the dead end of node {leaf} below node {root}: {root} is not a proper "
                            f"ancestor of it (its path: {path[-8:]})")
        kids = self._table.num_children
        at = len(path) - 1
        while path[at - 1] != root and kids.item(path[at - 1] & ROW_MASK) == 1:
            at -= 1
        self.prune(path[at])
        return path[at]

    def prune_dead_ends(self, leaves: Sequence[int], root: int) -> list[int]:
        """:meth:`prune_dead_end` of each of ``leaves`` in order, below the same ``root``, in one prune (e.g. a ToT
        level's thoughts not kept): each leaf's branch is cut where the cuts before it leave it (a node whose other
        children those took leads only to it), and the cuts are pruned together. Returns the node each leaf's cut
        starts at, in order.

        Raises :class:`~treedec.errors.TreeError`, having changed nothing, as :meth:`prune_dead_end` would for a leaf,
        or for a leaf an earlier one's cut removes (``TypeError`` for a node id that is not an int).
        """
        self._row(root)
        kids = self._table.num_children
        left: dict[int, int] = {}   # node -> its children the cuts so far leave (the nodes they touched)
        tops, cut = [], set()
        for leaf in leaves:
            path = self.path(leaf)
            if root == leaf or root not in path:
                raise TreeError(f"cannot prune the dead end of node {leaf} below node {root}: {root} is not a proper "
                                f"ancestor of it (its path: {path[-8:]})")
            if not cut.isdisjoint(path):
                raise TreeError(f"cannot prune the dead end of node {leaf}: an earlier leaf's cut removes it")
            at = len(path) - 1
            while path[at - 1] != root:
                up = path[at - 1]
                if (left[up] if up in left else kids.item(up & ROW_MASK)) != 1:
                    break
                at -= 1
            up = path[at - 1]
            left[up] = (left[up] if up in left else kids.item(up & ROW_MASK)) - 1
            tops.append((path[at], path[:at]))
            cut.add(path[at])
        # (a cut that reached above earlier ones holds them)
        self.prune_many([top for top, above in tops if cut.isdisjoint(above)])
        return [top for top, _ in tops]

    # ================================================================ private

    def _holds(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pages the nodes ``rows`` (``[k]`` int64, distinct) hold (``[p]`` int64, distinct) and how many of
        them hold each (``[p]`` int64). A node holds one reference on each page its slots are in (but those of its
        ``released`` leading tokens), and its slots visit each of its pages in one run (it never writes into a
        page that another node started), so each run of equal pages along a node's slots is one hold."""
        t = self._table
        if len(rows) == 1:   # one node (a pruned leaf): its runs' pages, each held once
            start, released = t.start.item(rows[0]), t.released.item(rows[0])
            page_of = t.slots[start + released:start + t.length.item(rows[0])] // self.pool.page_size
            if len(page_of) and page_of.item(0) == page_of.item(-1):   # (runs: one page)
                return page_of[:1], np.ones(1, dtype=np.int64)
            run = np.ones(len(page_of), dtype=bool)
            np.not_equal(page_of[1:], page_of[:-1], out=run[1:])
            pages = page_of[run]
            return pages, np.ones(len(pages), dtype=np.int64)
        lens = t.length[rows] - t.released[rows]
        page_of = t.slots[t.held_index(rows)] // self.pool.page_size
        run = np.ones(len(page_of), dtype=bool)
        np.not_equal(page_of[1:], page_of[:-1], out=run[1:])
        run[(lens.cumsum() - lens)[lens > 0]] = True   # each node's first page
        return count_distinct(page_of[run])

    def _pages_freed(self, holds: tuple[np.ndarray, np.ndarray]) -> int:
        """Pages that dropping ``holds`` (as :meth:`_holds` gives them) would return to the pool."""
        pages, times = holds
        return int((self.pool.refcount[pages] == times).sum())

    def _cut(self, rows: np.ndarray, order, holds: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Remove the nodes ``rows`` (whole subtrees), freeing their pages in one
        :meth:`PagedKVPool.release`, which checks before it changes anything; ``order`` is the preorder without
        them. The caller updates the child counts of the subtrees' parents. Returns the pages freed."""
        freed = self.pool.release(*(self._holds(rows) if holds is None else holds))   # (the tree's own holds)
        self._table.free_rows(rows)
        self._order = order
        self._layout = None
        return freed
