"""SequenceTree's debugging helpers: a printout of the forest and a check of its invariants.

Kept apart from :mod:`treedec.tree.sequence_tree`, whose operations they do not take part in;
:class:`~treedec.tree.SequenceTree` inherits them. They walk the node table in Python: they are for tests
and debugging, not for the step path.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from treedec.tree.node_table import ROW_BITS, ROW_MASK
from treedec.tree.preorder import Preorder


class TreeDebugging:
    """:meth:`pretty_print` and :meth:`check_invariants` of a :class:`~treedec.tree.SequenceTree`
    (they read its table, pool and kept preorder)."""

    def pretty_print(self) -> str:
        """One line per node, indented by depth."""
        t = self._table
        lines = []
        depth: dict[int, int] = {}
        for i, up in zip(self._order.ids.tolist(), self._order.parent.tolist()):
            row = i & ROW_MASK
            depth[i] = 0 if up < 0 else depth[int(self._order.ids[up])] + 1
            pending = t.pending.item(row)
            flags = (" paused" if t.paused.item(row) else "") + (f" pending={pending}" if pending else "")
            lines.append(f"{'  ' * depth[i]}node {i}: {t.length.item(row)} tokens, pages {self._node_pages(row)}"
                         f"{flags}")
        return "\n".join(lines)

    def check_invariants(self, held: np.ndarray | None = None) -> None:
        """Check slots are unique and in the pool, each node holds each of its pages once, refcounts are exact,
        pending counts add up, the node table is consistent (ids, child counts, positions, regions of the
        token buffer, tail room) and the preorder the edits keep is the one a fresh walk finds.

        ``held``: holders of each page outside the tree (``[num_pages]`` ints, e.g. the prefix cache's,
        :meth:`~treedec.runtime.prefix_cache.PrefixCache.held`), added to the nodes' holds. A shared root
        (:meth:`~treedec.tree.SequenceTree.add_shared_root`) reads slots other nodes hold too: its slots are
        left out of the uniqueness check.

        Raises RuntimeError naming the broken invariant and the values; real checks, not
        ``assert``, so they also run under ``python -O``.
        """
        t = self._table
        num_pages = self.pool.num_pages
        rows = t.live_rows()
        pending = int(t.pending[rows].sum())
        if pending != self._num_pending or t.pending[:t.hi][t.node_id[:t.hi] < 0].any():
            raise _broken(f"{self._num_pending=} but the nodes have {pending} pending tokens")
        released = t.released[rows]
        if ((released < 0) | ((released > 0) & (released >= t.length[rows]))).any():
            bad = rows[(released < 0) | ((released > 0) & (released >= t.length[rows]))][:5]
            raise _broken(f"nodes {t.node_id[bad].tolist()} released {t.released[bad].tolist()} of their "
                          f"{t.length[bad].tolist()} tokens (their last page stays held)")
        own = rows[t.shared[rows] == 0]
        flat = t.slots[t.held_index(own)]   # (released slots may serve other tokens now)
        if np.any((flat < 0) | (flat >= self.pool.num_slots)):
            raise _broken(f"slots {flat[(flat < 0) | (flat >= self.pool.num_slots)][:10].tolist()} are outside "
                          f"the pool's [0, {self.pool.num_slots})")
        shared, times = np.unique(flat, return_counts=True)
        if np.any(times > 1):
            raise _broken(f"tokens share KV slots {shared[times > 1][:10].tolist()}")
        self._check_rows(rows)
        expected = np.zeros(num_pages, dtype=np.int64) if held is None else np.array(held, dtype=np.int64)
        for row in rows.tolist():
            pages = self._node_pages(row)
            if any(not 0 <= p < num_pages for p in pages):
                raise _broken(f"node {t.node_id.item(row)} holds pages {pages} outside [0, {num_pages})")
            if len(set(pages)) != len(pages):
                raise _broken(f"node {t.node_id.item(row)} holds a page twice: {pages}")
            expected[pages] += 1
        if not np.array_equal(expected, self.pool.refcount):
            bad = np.flatnonzero(expected != self.pool.refcount)[:10]
            raise _broken(f"pages {bad.tolist()} have refcounts {self.pool.refcount[bad].tolist()} but are held by "
                          f"{expected[bad].tolist()} nodes")
        self.pool.check_invariants()
        fresh = self._fresh_preorder(rows)
        if len(fresh) != len(rows):
            unreachable = sorted(set(t.node_id[rows].tolist()) - set(fresh.ids.tolist()))
            raise _broken(f"nodes {unreachable[:10]} are unreachable from the roots {self.roots}")
        kept = self._order
        if kept != fresh:
            raise _broken(f"the kept preorder (ids {kept.ids[:10].tolist()}, parents {kept.parent[:10].tolist()}) "
                          f"is not the tree's (ids {fresh.ids[:10].tolist()}, parents {fresh.parent[:10].tolist()})")
        self._check_columns(rows)

    # ================================================================ private

    def _node_pages(self, row: int) -> list[int]:
        """The pages node ``row`` holds, in the order its slots reach them (one run of slots per page; none of
        its ``released`` leading tokens')."""
        t = self._table
        start = t.start.item(row) + t.released.item(row)
        page_of = t.slots[start:t.start.item(row) + t.length.item(row)] // self.pool.page_size
        return page_of[np.flatnonzero(np.diff(page_of, prepend=-1))].tolist()

    def _check_rows(self, rows: np.ndarray) -> None:
        """The node table's rows: as many as nodes, ids that name them, free rows not live, live parents."""
        t = self._table
        if len(rows) != t.num_nodes or len(rows) != len(self._order):
            raise _broken(f"{len(rows)} live rows, but num_nodes is {t.num_nodes} and the preorder has "
                          f"{len(self._order)} nodes")
        if not np.array_equal(t.node_id[rows], (t.gen[rows] << ROW_BITS) | rows):
            raise _broken("node ids that are not their rows' (generation, row)")
        free = t.free_row_list()
        if len(free) and (t.node_id[free] >= 0).any():
            raise _broken(f"rows {free[t.node_id[free] >= 0][:10].tolist()} are live and on the free list")
        up = t.parent[rows]
        dead = (up >= 0) & (t.node_id[np.maximum(up, 0)] < 0)
        if dead.any():
            raise _broken(f"nodes {t.node_id[rows[dead]][:10].tolist()} have pruned parents")

    def _check_columns(self, rows: np.ndarray) -> None:
        """The columns kept beside the topology: child counts, tokens above each node, regions, tail room."""
        t = self._table
        up = t.parent[rows]
        kids = np.bincount(up[up >= 0], minlength=t.hi)[rows] if len(rows) else up
        if not np.array_equal(kids, t.num_children[rows]):
            bad = rows[kids != t.num_children[rows]][:10]
            raise _broken(f"nodes {t.node_id[bad].tolist()} count {t.num_children[bad].tolist()} children, have "
                          f"{kids[kids != t.num_children[rows]][:10].tolist()}")
        prefix = np.where(up >= 0, t.prefix[np.maximum(up, 0)] + t.length[np.maximum(up, 0)], 0)
        if not np.array_equal(prefix, t.prefix[rows]):
            bad = rows[prefix != t.prefix[rows]][:10]
            raise _broken(f"nodes {t.node_id[bad].tolist()} have {t.prefix[bad].tolist()} tokens above them "
                          f"recorded, not their path's")
        start, cap, length = t.start[rows], t.cap[rows], t.length[rows]
        placed = np.argsort(np.where(cap > 0, start, -1), kind="stable")[int((cap == 0).sum()):]   # by start
        ends = (start + cap)[placed]
        if (length > cap).any() or (start < 0).any() or (len(placed) and ends.max() > t.end) or \
                (ends[:-1] > start[placed][1:]).any():
            raise _broken("node regions of the token buffer overlap, or hold more tokens than they have room for")
        room = t.tail_room[rows]
        last = t.slots[np.where(length > 0, start + length - 1, 0)]   # (an empty node's region may be past the end)
        over = (room > 0) & ((length == 0) | (last % self.pool.page_size + room >= self.pool.page_size))
        if (room < 0).any() or over.any():
            raise _broken(f"nodes {t.node_id[rows[over | (room < 0)]][:10].tolist()} have tail room past their "
                          f"last page")

    def _fresh_preorder(self, rows: np.ndarray) -> Preorder:
        """The forest walked from the node table alone: roots and children in creation order."""
        t = self._table
        rows = rows[np.argsort(t.born[rows], kind="stable")]
        children: dict[int, list[int]] = defaultdict(list)
        for row, up in zip(rows.tolist(), t.parent[rows].tolist()):
            children[up].append(t.node_id.item(row))
        return Preorder.build(children[-1], {t.node_id.item(r): children[r] for r in rows.tolist()})


def _broken(what: str) -> RuntimeError:
    return RuntimeError(f"SequenceTree invariant broken: {what}")
