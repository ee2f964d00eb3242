"""SequenceTree's debugging helpers: a printout of the forest and a check of its invariants.

Kept apart from :mod:`treedec.tree.sequence_tree`, whose operations they do not take part in;
:class:`~treedec.tree.SequenceTree` inherits them.
"""
from __future__ import annotations

import numpy as np


class TreeDebugging:
    """:meth:`pretty_print` and :meth:`check_invariants` of a :class:`~treedec.tree.SequenceTree`
    (they read its nodes, roots, pool and kept preorder)."""

    def pretty_print(self) -> str:
        """One line per node, indented by depth."""
        lines = []
        depth: dict[int, int] = {}
        for i in self._order():
            n = self._nodes[i]
            depth[i] = 0 if n.parent is None else depth[n.parent] + 1
            flags = (" paused" if n.paused else "") + (f" pending={n.pending}" if n.pending else "")
            lines.append(f"{'  ' * depth[i]}node {i}: {n.length} tokens, pages {n.pages}{flags}")
        return "\n".join(lines)

    def check_invariants(self, held: np.ndarray | None = None) -> None:
        """Check slots are unique and in the pool, each node's pages match its slots, refcounts are exact,
        pending counts add up, and the preorder the edits keep is the one a fresh walk finds.

        ``held``: holders of each page outside the tree (``[num_pages]`` ints, e.g. the prefix cache's,
        :meth:`~treedec.runtime.prefix_cache.PrefixCache.held`), added to the nodes' holds. A shared root
        (:meth:`~treedec.tree.SequenceTree.add_shared_root`) reads slots other nodes hold too: its slots are
        left out of the uniqueness check.

        Raises RuntimeError naming the broken invariant and the values; real checks, not
        ``assert``, so they also run under ``python -O``.
        """
        ps, num_pages = self.pool.page_size, self.pool.num_pages
        pending = sum(n.pending for n in self._nodes.values())
        if pending != self._num_pending:
            raise _broken(f"{self._num_pending=} but the nodes have {pending} pending tokens")
        listed = {id(n) for n in self._pending_nodes}
        unlisted = [n.id for n in self._nodes.values() if n.pending and id(n) not in listed]
        if unlisted:
            raise _broken(f"nodes {unlisted[:10]} have pending tokens but are not in _pending_nodes")
        all_slots = [n.slots[: n.length] for n in self._nodes.values() if not n.shared]
        flat = np.concatenate(all_slots) if all_slots else np.zeros(0, np.int64)
        if np.any((flat < 0) | (flat >= self.pool.num_slots)):
            raise _broken(f"slots {flat[(flat < 0) | (flat >= self.pool.num_slots)][:10].tolist()} are outside "
                          f"the pool's [0, {self.pool.num_slots})")
        shared, times = np.unique(flat, return_counts=True)
        if np.any(times > 1):
            raise _broken(f"tokens share KV slots {shared[times > 1][:10].tolist()}")
        expected = np.zeros(num_pages, dtype=np.int64) if held is None else np.array(held, dtype=np.int64)
        for n in self._nodes.values():
            if any(not 0 <= p < num_pages for p in n.pages):
                raise _broken(f"node {n.id} holds pages {n.pages} outside [0, {num_pages})")
            if len(set(n.pages)) != len(n.pages):
                raise _broken(f"node {n.id} holds a page twice: {n.pages}")
            pages_from_slots = set((n.slots[: n.length] // ps).tolist())
            if not pages_from_slots <= set(n.pages):
                raise _broken(f"node {n.id} has slots in pages {sorted(pages_from_slots)} but holds {n.pages}")
            expected[n.pages] += 1
        if not np.array_equal(expected, self.pool.refcount):
            bad = np.flatnonzero(expected != self.pool.refcount)[:10]
            raise _broken(f"pages {bad.tolist()} have refcounts {self.pool.refcount[bad].tolist()} but are held by "
                          f"{expected[bad].tolist()} nodes")
        self.pool.check_invariants()
        fresh = self._fresh_preorder()
        if len(fresh) != len(self._nodes):
            unreachable = sorted(set(self._nodes) - set(fresh.ids.tolist()))
            raise _broken(f"nodes {unreachable[:10]} are unreachable from the roots {self._roots}")
        kept = self._preorder
        if kept is not None and kept != fresh:
            raise _broken(f"the kept preorder (ids {kept.ids[:10].tolist()}, parents {kept.parent[:10].tolist()}) "
                          f"is not the tree's (ids {fresh.ids[:10].tolist()}, parents {fresh.parent[:10].tolist()})")


def _broken(what: str) -> RuntimeError:
    return RuntimeError(f"SequenceTree invariant broken: {what}")
