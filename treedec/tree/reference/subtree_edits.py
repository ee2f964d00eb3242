"""SequenceTree's subtree walks and removals: a node's subtree, the pages pruning it would free, pruning
it, and pruning a dead end (a leaf with the ancestors that lead only to it).

Every program that drops branches (a branch controller's Prune ops, beam search's dropped beams, ToT's
thoughts not kept) walks and prunes through these. A subtree is a range of the forest's depth-first order
that the tree keeps up to date (:class:`~treedec.tree.preorder.Preorder`), so finding one costs no walk
over Python objects. :class:`~treedec.tree.SequenceTree` inherits them; they read its nodes, roots, pool and
preorder.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from treedec.errors import TreeError


class SubtreeEdits:
    """:meth:`subtree`, :meth:`pages_freed_by_prune`, :meth:`prune` and :meth:`prune_dead_end` of a
    :class:`~treedec.tree.SequenceTree`."""

    def subtree(self, node_id: int) -> list[int]:
        """``node_id`` and all its descendants, in depth-first preorder (``node_id`` first).

        Raises ``TypeError`` for a node id that is not an int, :class:`~treedec.errors.TreeError` for an
        unknown one.
        """
        order = self._structure()
        start = order.position(self._get(node_id).id)
        return order.ids[start:order.subtree_end(start)].tolist()

    def pages_freed_by_prune(self, node_ids: Iterable[int]) -> int:
        """Pages that pruning the subtrees of ``node_ids`` would return to the pool (changes nothing).

        A page is freed when every node holding it is in one of those subtrees.
        """
        nodes = {i: self._nodes[i] for nid in node_ids for i in self.subtree(nid)}
        return self._pages_freed(self._holds(nodes.values()))

    def prune(self, node_id: int) -> np.ndarray:
        """Remove ``node_id`` and its whole subtree; returns the pages freed.

        Pruning a root removes that request. A subtree that still has pending tokens
        (queries of the step in flight) cannot be pruned until :meth:`commit_step`.
        """
        top = self._get(node_id)
        order = self._structure()
        start = order.position(top.id)
        stop = order.subtree_end(start)
        subtree = list(map(self._nodes.__getitem__, order.ids[start:stop].tolist()))
        pending = [n.id for n in subtree if n.pending]
        if pending:
            raise TreeError(f"cannot prune node {node_id}: node(s) {pending[:5]} in its subtree have pending "
                            f"tokens of the current step; call commit_step() first")
        freed = self._cut(start, stop, subtree)
        if top.parent is None:
            self._roots.remove(top.id)
        else:
            self._nodes[top.parent].children.remove(top.id)
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
        self._get(root)
        if root == leaf or root not in path:
            raise TreeError(f"cannot prune the dead end of node {leaf} below node {root}: {root} is not a proper "
                            f"ancestor of it (its path: {path[-8:]})")
        at = len(path) - 1
        while path[at - 1] != root and len(self._nodes[path[at - 1]].children) == 1:
            at -= 1
        self.prune(path[at])
        return path[at]
