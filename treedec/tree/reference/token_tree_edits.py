"""SequenceTree's speculative edits: hang a draft token tree (or one layer of draft nodes) under the
sequence, then keep the verified path and free the rest.

They run on every speculative step over tens to hundreds of one-token nodes, so they do per node only
what a node needs (its object, its slot, its parent's child list): the pages are taken in one call, the
preorder is updated by a few numpy calls, and a token tree's shape is checked and ordered once per
distinct ``parents`` (a Medusa tree's is the same every step). :class:`~treedec.tree.SequenceTree`
inherits them; they read its nodes, pool and preorder.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treedec.errors import PoolExhaustedError, TreeError
from treedec.tree.reference.tree_node import TreeNode
from treedec.tree.validate import int_list, on_cycle

KNOWN_SHAPES = 8   # token-tree shapes whose checked order a tree keeps (a program uses one or a few)


class TokenTreeEdits:
    """:meth:`add_token_tree`, :meth:`add_children`, :meth:`accept` and :meth:`advance_token_trees` of a
    :class:`~treedec.tree.SequenceTree`."""

    def add_token_tree(self, node_id: int, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """Hang a token tree (e.g. Medusa/EAGLE candidates) under ``node_id``, one node per token.

        ``tokens`` is ``[m]`` ints >= 0; ``parents[i]`` is the index of token i's parent
        token, or -1 for a child of ``node_id``: ints in ``[-1, i)``, so parents come
        before their children. The tokens are packed into ``ceil(m / page_size)`` fresh
        pages, shared by refcount. Returns node ids in token order.
        """
        anchor = self._get(node_id)
        tokens = int_list(tokens, "tokens", low=0)
        parents = int_list(parents, "parents", low=-1)
        m = len(tokens)
        if m == 0 or len(parents) != m:
            raise TreeError(f"need one parent per token and at least one token, got {m} tokens and {len(parents)} "
                            f"parents")
        perm, inner = self._token_tree_order(parents)
        first = self._next_id
        order = self._preorder
        if order is not None:   # the tree goes after the anchor's subtree, in its own preorder
            at = order.position(anchor.id)
            end = order.subtree_end(at) if anchor.children else at + 1
        self._hang([anchor] * m, tokens, parents)
        if order is not None:
            self._preorder = order.splice(end, perm + first, np.where(inner < 0, at, inner + end))
        return list(range(first, first + m))

    def add_children(self, node_ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """Give each node ``node_ids[i]`` a new child holding the one token ``tokens[i]`` (a node may be
        named several times: several children), pending; e.g. one layer of a draft tree whose nodes
        have different parents. The tokens are packed into ``ceil(m / page_size)`` fresh pages, as
        :meth:`add_token_tree` packs its tokens. Returns the new node ids in order; checks everything
        first and changes nothing when it raises."""
        tokens = int_list(tokens, "tokens", low=0)
        anchors = [self._get(n) for n in int_list(node_ids, "node_ids", low=0)]
        m = len(tokens)
        if not tokens or len(anchors) != m:
            raise TreeError(f"need one node per token and at least one token, got {m} tokens and "
                            f"{len(anchors)} nodes")
        first = self._next_id
        order = self._preorder
        if order is not None:   # each child goes after its anchor's subtree (as it was), children in order
            at = order.positions(np.array([a.id for a in anchors], dtype=np.int64))
            if any(a.children for a in anchors):
                end = order.subtree_ends(at)
                rank = np.lexsort((np.arange(m), -at, end))   # where subtrees end together, the deeper anchor's first
            else:   # leaves: each child right after its anchor
                end = at + 1
                rank = end.argsort(kind="stable")
        self._hang(anchors, tokens, [-1] * m)
        if order is not None:
            self._preorder = order.insert(end[rank], rank + first, at[rank], np.full(m, -1))
        return list(range(first, first + m))

    def accept(self, anchor: int, path: Sequence[int]) -> np.ndarray:
        """Keep a verified path of a speculative tree under leaf ``anchor``; free the rest.

        ``path`` lists committed nodes from a child of ``anchor`` downwards, each the parent
        of the next (e.g. the accepted tokens of a verified token tree). Their tokens are
        appended to ``anchor`` with their K/V moved along (no recompute, nothing pending),
        then every child subtree of ``anchor`` is pruned, pages freed. Checks everything first
        and changes nothing when it raises. Returns the ``[n]`` slots the tokens now hold.
        """
        node = self._get(anchor)
        path = int_list(path, "path", low=0)
        chain = [self._get(n) for n in path]
        for parent, child in zip([node] + chain, chain):
            if child.parent != parent.id:
                raise TreeError(f"path must be a chain under node {anchor}: node {child.id}'s parent is "
                                f"{child.parent}, not {parent.id}")
        order = self._structure()
        start = order.position(node.id) + 1   # the anchor's descendants: the rest of its subtree's range
        stop = order.subtree_end(start - 1)
        doomed = list(map(self._nodes.__getitem__, order.ids[start:stop].tolist()))
        busy = [n.id for n in doomed if n.pending]
        if busy:
            raise TreeError(f"cannot accept under node {anchor}: node(s) {busy[:5]} below it have pending tokens "
                            f"of the current step; call commit_step() first")
        tokens = [t for c in chain for t in c.tokens]
        holds = self._holds(doomed)
        need = self._pages_to_extend(node, len(tokens))
        if need > self.pool.num_free_pages and need > self.pool.num_free_pages + self._pages_freed(holds):
            raise PoolExhaustedError(f"KV pool exhausted: keeping {len(tokens)} accepted token(s) needs {need} "
                                     f"page(s); nothing was changed")
        moved = np.concatenate([c.slots[:len(c.tokens)] for c in chain]) if tokens else None
        if doomed:
            self._cut(start, stop, doomed, holds)
            node.children.clear()
        slots = self._fill(node, tokens)
        node.pending -= len(tokens)   # their K/V are in place: nothing to compute
        self._num_pending -= len(tokens)
        if moved is not None and self.pool.has_storage:
            # Freed pages keep their K/V until a step writes them, and none runs in between; the copy reads
            # every source slot before it writes, so the new slots may reuse the freed ones.
            self.pool.copy_slots(moved, slots)
        return slots

    def advance_token_trees(self, trees: Sequence[Sequence[int]], cuts: Sequence[int], count: int) -> np.ndarray:
        """The array tree's :meth:`~treedec.tree.SequenceTree.advance_token_trees` node by node, for the trees, cuts
        and count it took (this reference checks nothing): each tree's leaf truncated by its cut (as
        :meth:`truncate`; the pages they drop back in one decref, as a batch's), then ``count`` rounds of one computed
        token for each leaf in order (as :meth:`extend_computed`), then every node of the trees pending again as a
        placeholder (token 0). Returns ``[R, count]``: the leaves' new slots."""
        nodes = [[self._nodes[int(n)] for n in row] for row in trees]
        leaves = [self._nodes[row[0].parent] for row in nodes]
        dropped = [self._cut_tail(leaf, leaf.length - int(cut)) for leaf, cut in zip(leaves, cuts) if cut]
        if dropped:
            self.pool.decref(np.concatenate(dropped))
        slots = np.zeros((len(leaves), count), dtype=np.int64)
        for k in range(count):
            for i, leaf in enumerate(leaves):
                slots[i, k] = self._fill(leaf, [0])[0]
                leaf.pending -= 1
                self._num_pending -= 1
        for node in (n for row in nodes for n in row):
            node.tokens[0] = 0
            if not node.pending:
                self._pending_nodes.append(node)
            node.pending = 1
            self._num_pending += 1
        self._layout = None
        return slots

    # ================================================================ private

    def _token_tree_order(self, parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Check ``parents`` (ints >= -1, one per token) as :meth:`add_token_tree` documents; the tree's
        preorder ``[m]`` (token indices) and each of its tokens' parent position in it (-1: the anchor),
        both in preorder. Kept for the last few shapes: checked and ordered once per shape."""
        key = tuple(parents)
        known = self._token_trees.get(key)
        if known is not None:
            return known
        m = len(parents)
        array = np.array(parents, dtype=np.int64)
        outside = np.flatnonzero(array >= m)
        if len(outside):   # before the cycle check, which follows parents
            i = int(outside[0])
            raise TreeError(f"parents[{i}] = {parents[i]} is not a token index in [-1, {m})")
        late = np.flatnonzero(array >= np.arange(m))
        if len(late):
            i, p = int(late[0]), parents[late[0]]
            kind = "a cycle" if on_cycle(array, i) else "a forward reference"
            raise TreeError(f"parents[{i}] = {p}: parents must come before children ({kind})")
        children: list[list[int]] = [[] for _ in range(m)]
        tops = []
        for i, p in enumerate(parents):
            (tops if p < 0 else children[p]).append(i)
        order, stack = [], tops[::-1]
        while stack:
            i = stack.pop()
            order.append(i)
            stack += children[i][::-1]
        perm = np.array(order, dtype=np.int64)
        rank = np.empty(m, dtype=np.int64)
        rank[perm] = np.arange(m)
        up = array[perm]
        inner = np.where(up >= 0, rank[up], -1)
        perm.setflags(write=False)
        inner.setflags(write=False)
        if len(self._token_trees) >= KNOWN_SHAPES:
            del self._token_trees[next(iter(self._token_trees))]
        self._token_trees[key] = (perm, inner)
        return perm, inner

    def _hang(self, anchors: list[TreeNode], tokens: list[int], parents: list[int]) -> None:
        """New one-token pending nodes ``_next_id ..``: token ``i`` under ``anchors[i]`` when ``parents[i] < 0``,
        else under new node ``parents[i]``; packed into fresh shared pages (checked input)."""
        m = len(tokens)
        slots = self.pool.allocate_slots(m)   # raises before any change
        pages = (slots // self.pool.page_size).tolist()
        own = list(slots.reshape(m, 1))        # each node's slot buffer: a view of one slot
        first = self._next_id
        made: list[TreeNode] = []
        for i in range(m):
            p = parents[i]
            up = anchors[i] if p < 0 else made[p]
            made.append(TreeNode(first + i, up.id, [tokens[i]], own[i], [pages[i]], 0, 1))
            up.children.append(first + i)
        self._nodes.update(zip(range(first, first + m), made))
        self._pending_nodes += made
        self._next_id += m
        self._num_pending += m
        self._layout = None
