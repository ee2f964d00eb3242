"""Preorder: a forest's depth-first order and parent positions, updated by each edit rather than rebuilt.

:class:`~treedec.tree.SequenceTree` keeps one for :meth:`~treedec.tree.SequenceTree.layout` (its
``node_ids`` and ``parent`` arrays) and to find subtrees: in preorder a subtree is the contiguous
range from its top to the first later node whose parent lies before the top. A speculative step
hangs a token tree under a leaf and then cuts it off again; updating the order costs a few numpy
calls per edit, where a rebuild walks every node of the forest in Python.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Preorder:
    """The nodes of a forest in depth-first preorder (children in list order).

    Attributes
    ----------
    ids : [N] int64, read-only
        Node ids in preorder.
    parent : [N] int64, read-only
        Position (in ``ids``) of each node's parent; -1 for roots. Always smaller than the node's own.

    Every update returns a new object with new arrays, so a snapshot holding these arrays
    (a :class:`~treedec.tree.TreeLayout`) never changes under its reader.
    """

    ids: np.ndarray
    parent: np.ndarray

    def __post_init__(self):
        self.ids.setflags(write=False)
        self.parent.setflags(write=False)

    @classmethod
    def build(cls, roots: Sequence[int], children: Mapping[int, Sequence[int]]) -> Preorder:
        """Walk the forest from ``roots``; ``children[i]`` lists node ``i``'s children in order.

        Nodes on a cycle or not reachable from a root are left out (the caller compares counts).
        """
        ids: list[int] = []
        parent: list[int] = []
        stack = [(r, -1) for r in reversed(roots)]
        seen = set()
        while stack:
            i, p = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            kids = children[i]
            if kids:
                at = len(ids)
                stack += [(c, at) for c in reversed(kids)]
            ids.append(i)
            parent.append(p)
        return cls(np.array(ids, dtype=np.int64), np.array(parent, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.ids)

    def __eq__(self, other) -> bool:
        return (isinstance(other, Preorder) and np.array_equal(self.ids, other.ids)
                and np.array_equal(self.parent, other.parent))

    def position(self, node_id: int) -> int:
        """Where ``node_id`` (a node of the forest) is in the order."""
        at = int((self.ids == node_id).argmax())
        assert self.ids[at] == node_id, f"node {node_id} is not in the preorder"
        return at

    def positions(self, node_ids: Sequence[int]) -> np.ndarray:
        """[k] int64 positions of ``node_ids`` (nodes of the forest)."""
        by_id = self.ids.argsort()
        return by_id[self.ids.searchsorted(node_ids, sorter=by_id)]

    def subtree_end(self, at: int) -> int:
        """One past the last position of the subtree whose top is at position ``at``."""
        outside = self.parent[at + 1:] < at
        if not len(outside):
            return at + 1
        j = int(outside.argmax())
        return at + 1 + j if outside[j] else len(self.ids)

    def subtree_ends(self, at: np.ndarray) -> np.ndarray:
        """[k] int64: :meth:`subtree_end` of each position in ``at`` (``[k]`` int64), in a few numpy calls for tops
        none of which lies in another's subtree (the speculative step prunes one tree a request)."""
        n, k = len(self.ids), len(at)
        if not k:
            return at + 1
        by_position = at.argsort(kind="stable")
        tops = at[by_position]
        first = int(tops[0]) + 1
        # With the tops in order, top i's subtree ends at the first position p in (tops[i], tops[i + 1]] whose
        # parent lies before tops[i], unless tops[i + 1] is in it (that one is then walked alone).
        owner = tops.searchsorted(np.arange(first, n, dtype=np.int64)) - 1   # the last top before each position
        out = self.parent[first:] < tops[owner]
        hit = out.nonzero()[0]
        hit_owner = owner[hit]
        opens = np.ones(len(hit), dtype=bool)
        np.not_equal(hit_owner[1:], hit_owner[:-1], out=opens[1:])
        end = np.full(k, -1, dtype=np.int64)
        end[-1] = n
        end[hit_owner[opens]] = hit[opens] + first
        for j in (end < 0).nonzero()[0].tolist():   # (a top with another top in its subtree)
            end[j] = self.subtree_end(int(tops[j]))
        out_end = np.empty(k, dtype=np.int64)
        out_end[by_position] = end
        return out_end

    def splice(self, at: int, ids: np.ndarray, parent: np.ndarray) -> Preorder:
        """The order with new nodes ``ids`` (``[m]`` int64, in their order) inserted right before position
        ``at`` (``N``: at the end); ``parent`` (``[m]`` int64) gives their parents' positions in the result:
        before ``at`` (it does not move), or ``at + j`` for the new node ``j``, or -1 for a new root."""
        m = len(ids)
        out = np.concatenate((self.parent[:at], parent, self.parent[at:]))
        after = out[at + m:]
        after[after >= at] += m
        return Preorder(np.concatenate((self.ids[:at], ids, self.ids[at:])), out)

    def insert(self, at: np.ndarray, ids: np.ndarray, old_parent: np.ndarray, new_parent: np.ndarray) -> Preorder:
        """The order with new nodes inserted in several places.

        Parameters
        ----------
        at : [m] int64, non-decreasing
            New node ``j`` goes right before the old node at position ``at[j]`` (``N``: at the end).
        ids : [m] int64
            The new nodes' ids, in the order they take among themselves.
        old_parent, new_parent : [m] int64
            Each new node's parent: the old position ``old_parent[j]``, or the new node
            ``new_parent[j]`` (< j), the other -1; both -1 for a new root.
        """
        if at[0] == at[-1]:
            q = int(at[0])
            return self.splice(q, ids, np.where(new_parent >= 0, new_parent + q, old_parent))
        n, m = len(self.ids), len(ids)
        # The maps of old and new positions end in -1, so that indexing them with -1 gives -1.
        old_to = np.empty(n + 1, dtype=np.int64)
        old = np.arange(n)
        old_to[:n] = old + at.searchsorted(old, side="right")
        old_to[n] = -1
        new_to = np.empty(m + 1, dtype=np.int64)
        new_to[:m] = at + np.arange(m)
        new_to[m] = -1
        out_ids = np.empty(n + m, dtype=np.int64)
        out_ids[old_to[:n]] = self.ids
        out_ids[new_to[:m]] = ids
        out_parent = np.empty(n + m, dtype=np.int64)
        out_parent[old_to[:n]] = old_to[self.parent]
        out_parent[new_to[:m]] = np.where(new_parent >= 0, new_to[new_parent], old_to[old_parent])
        return Preorder(out_ids, out_parent)

    def cut(self, start: int, stop: int) -> Preorder:
        """The order without positions ``start .. stop - 1``, which must be whole subtrees."""
        ids = np.concatenate((self.ids[:start], self.ids[stop:]))
        parent = np.concatenate((self.parent[:start], self.parent[stop:]))
        after = parent[start:]
        after[after >= stop] -= stop - start   # no node left has its parent inside the cut
        return Preorder(ids, parent)

    def remove(self, positions: np.ndarray) -> Preorder:
        """The order without the nodes at ``positions`` (``[k]`` int64, distinct), which must be whole subtrees
        (several, anywhere: :meth:`cut` for one range)."""
        keep = np.ones(len(self.ids), dtype=bool)
        keep[positions] = False
        new_position = keep.cumsum() - 1
        parent = self.parent[keep]
        return Preorder(self.ids[keep], np.where(parent >= 0, new_position[parent], -1))
