"""SequenceTree's speculative edits: hang a draft token tree (or one layer of draft nodes) under the
sequence, then keep the verified path and free the rest; and new children of many nodes in one edit
(:meth:`~TokenTreeEdits.branch_many`: a step's new lanes, a ToT level's value prompts).

They run on every speculative step over tens to hundreds of one-token nodes, so a token tree is rows of the
node table made in one go: its rows, their regions of the token buffer, their slots (the pages taken in one
call) and the preorder's update are a few numpy calls, whatever the tree's size; a token tree's shape is
checked and ordered once per distinct ``parents`` (a Medusa tree's is the same every step).
:class:`~treedec.tree.SequenceTree` inherits them; they read its table, pool and preorder.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treedec.errors import PoolExhaustedError, TreeError
from treedec.tree.node_table import ROW_MASK
from treedec.tree.validate import int_array, int_list, on_cycle

KNOWN_SHAPES = 8   # token-tree shapes whose checked order a tree keeps (a program uses one or a few)


class TokenTreeEdits:
    """:meth:`add_token_tree`, :meth:`add_children`, :meth:`branch_many` and :meth:`accept` of a
    :class:`~treedec.tree.SequenceTree`."""

    def add_token_tree(self, node_id: int, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """Hang a token tree (e.g. Medusa/EAGLE candidates) under ``node_id``, one node per token.

        ``tokens`` is ``[m]`` ints >= 0; ``parents[i]`` is the index of token i's parent
        token, or -1 for a child of ``node_id``: ints in ``[-1, i)``, so parents come
        before their children. The tokens are packed into ``ceil(m / page_size)`` fresh
        pages, shared by refcount. Returns node ids in token order.
        """
        anchor = self._row(node_id)
        tokens = int_array(tokens, "tokens", low=0)
        parents = int_list(parents, "parents", low=-1)
        m = len(tokens)
        if m == 0 or len(parents) != m:
            raise TreeError(f"need one parent per token and at least one token, got {m} tokens and "
                            f"{len(parents)} parents")
        perm, inner, up, depth, kids = self._token_tree_order(parents)
        t = self._table
        had_children = t.num_children.item(anchor)
        made = self._hang(np.full(m, anchor, dtype=np.int64), tokens, None)   # rows in token order
        t.parent[made] = np.where(up < 0, anchor, made[up])
        t.prefix[made] = t.prefix.item(anchor) + t.length.item(anchor) + depth
        t.num_children[made] = kids
        t.num_children[anchor] += m - int(kids.sum())
        order = self._order   # the tree goes after the anchor's subtree, in its own preorder
        at = order.position(int(node_id))
        end = order.subtree_end(at) if had_children else at + 1
        ids = t.node_id[made]
        self._order = order.splice(end, ids[perm], np.where(inner < 0, at, inner + end))
        return ids.tolist()

    def add_children(self, node_ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """Give each node ``node_ids[i]`` a new child holding the one token ``tokens[i]`` (a node may be
        named several times: several children), pending; e.g. one layer of a draft tree whose nodes
        have different parents. The tokens are packed into ``ceil(m / page_size)`` fresh pages, as
        :meth:`add_token_tree` packs its tokens. Returns the new node ids in order; checks everything
        first and changes nothing when it raises."""
        tokens = int_array(tokens, "tokens", low=0)
        anchors = self._rows_of(int_list(node_ids, "node_ids", low=0))
        m = len(tokens)
        if not m or len(anchors) != m:
            raise TreeError(f"need one node per token and at least one token, got {m} tokens and "
                            f"{len(anchors)} nodes")
        t = self._table
        places = self._child_places(anchors)
        made = self._hang(anchors, tokens, t.prefix[anchors] + t.length[anchors])
        self._place_children(anchors, made, places)
        return t.node_id[made].tolist()

    def branch_many(self, node_ids: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                    counts: Sequence[int] | np.ndarray | None = None, checked: bool = True) -> np.ndarray:
        """Give each node ``node_ids[i]`` a new child holding ``counts[i]`` of ``tokens`` (node after node; default
        one each), pending, on fresh pages of its own: :meth:`branch` of each ``(node_ids[i], [its tokens])`` in
        order, in one call (a node may be named several times: its children in order); e.g. the lanes' first
        tokens, or a ToT level's value prompts. Returns the ``[m]`` int64 new node ids, in order. Checks first and
        changes nothing when it raises; ``checked`` False: ``node_ids`` (``[m]`` int64 live nodes), ``tokens`` and
        ``counts`` (int64 arrays) are the caller's own, not checked (the lanes', every step with new lanes)."""
        if checked:
            anchors = self._rows_of(int_list(node_ids, "node_ids", low=0))
            tokens = int_array(tokens, "tokens", low=0)
            counts = np.ones(len(anchors), dtype=np.int64) if counts is None else int_array(counts, "counts", low=0)
            if not len(anchors) or len(counts) != len(anchors) or len(tokens) != int(counts.sum()):
                raise TreeError(f"branch_many needs at least one node, one count per node and sum(counts) tokens, "
                                f"got {len(anchors)} nodes, {len(counts)} counts, {len(tokens)} tokens")
        else:
            anchors = node_ids & ROW_MASK
            counts = np.ones(len(anchors), dtype=np.int64) if counts is None else counts
        need = int((-(-counts // self.pool.page_size)).sum())
        self._check_free(need)
        t = self._table
        places = self._child_places(anchors)
        made = self._new_nodes(counts, tokens, self.pool.allocate(need), anchors, t.prefix[anchors] + t.length[anchors])
        self._place_children(anchors, made, places)
        return t.node_id[made]

    def accept(self, anchor: int, path: Sequence[int]) -> np.ndarray:
        """Keep a verified path of a speculative tree under leaf ``anchor``; free the rest.

        ``path`` lists committed nodes from a child of ``anchor`` downwards, each the parent
        of the next (e.g. the accepted tokens of a verified token tree). Their tokens are
        appended to ``anchor`` with their K/V moved along (no recompute, nothing pending),
        then every child subtree of ``anchor`` is pruned, pages freed. Checks everything first
        and changes nothing when it raises. Returns the ``[n]`` slots the tokens now hold.
        """
        row = self._row(anchor)
        path = int_list(path, "path", low=0)
        chain = self._rows_of(path)
        t = self._table
        above = np.concatenate(([row], chain))[:-1]   # each path node's expected parent
        wrong = np.flatnonzero(t.parent[chain] != above) if path else chain
        if len(wrong):
            i = int(wrong[0])
            raise TreeError(f"path must be a chain under node {anchor}: node {path[i]}'s parent is "
                            f"{self.parent(path[i])}, not {t.node_id.item(above[i])}")
        order = self._order
        start = order.position(int(anchor)) + 1   # the anchor's descendants: the rest of its subtree's range
        stop = order.subtree_end(start - 1)
        doomed = order.ids[start:stop] & ROW_MASK
        busy = t.pending[doomed] > 0
        if busy.any():
            raise TreeError(f"cannot accept under node {anchor}: node(s) {t.node_id[doomed[busy]][:5].tolist()} "
                            f"below it have pending tokens of the current step; call commit_step() first")
        at = t.token_index(chain) if path else chain
        tokens, moved = t.tokens[at], t.slots[at]   # copies, read before the cut frees the chain's rows
        holds = self._holds(doomed)
        need = self._pages_to_extend(row, len(tokens))
        if need > self.pool.num_free_pages and need > self.pool.num_free_pages + self._pages_freed(holds):
            raise PoolExhaustedError(f"KV pool exhausted: keeping {len(tokens)} accepted token(s) needs {need} "
                                     f"page(s); nothing was changed")
        if len(doomed):
            self._cut(doomed, order.cut(start, stop), holds)
            t.num_children[row] = 0
        slots = self._fill(row, tokens)
        t.pending[row] -= len(tokens)   # their K/V are in place: nothing to compute
        self._num_pending -= len(tokens)
        if len(tokens) and self.pool.has_storage:
            # Freed pages keep their K/V until a step writes them, and none runs in between; the copy reads
            # every source slot before it writes, so the new slots may reuse the freed ones.
            self.pool.copy_slots(moved, slots)
        return slots

    # ================================================================ private

    def _child_places(self, anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where one new child of each of ``anchors`` (``[m]`` rows, in order) goes in the preorder, read before the
        children are made: after its anchor's subtree as it is, an anchor's children in order. ``(at, end, rank)``:
        the anchors' positions, the positions the children go before, and the children's order among themselves."""
        order, m = self._order, len(anchors)
        at = order.positions(self._table.node_id[anchors])
        if self._table.num_children[anchors].any():
            end = order.subtree_ends(at)
            rank = np.lexsort((np.arange(m), -at, end))   # where subtrees end together, the deeper anchor's first
        else:   # leaves: each child right after its anchor
            end = at + 1
            rank = end.argsort(kind="stable")
        return at, end, rank

    def _place_children(self, anchors: np.ndarray, made: np.ndarray,
                        places: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Count the new children ``made`` (rows, one per anchor) and put them in the preorder at ``places``
        (:meth:`_child_places`)."""
        t, (at, end, rank) = self._table, places
        np.add.at(t.num_children, anchors, 1)
        self._order = self._order.insert(end[rank], t.node_id[made[rank]], at[rank], np.full(len(made), -1))


    def _token_tree_order(self, parents: list[int]):
        """Check ``parents`` (ints >= -1, one per token) as :meth:`add_token_tree` documents. Returns, for the
        shape: the tree's preorder ``perm`` (``[m]`` token indices), each of its tokens' parent position in it
        (``inner``, -1: the anchor; both in preorder), and in token order each token's parent index ``up``
        (-1: the anchor), depth below the anchor's children (``depth``) and number of children (``kids``).
        Kept for the last few shapes: checked and ordered once per shape."""
        key = tuple(parents)
        known = self._token_trees.get(key)
        if known is not None:
            return known
        m = len(parents)
        up = np.array(parents, dtype=np.int64)
        outside = np.flatnonzero(up >= m)
        if len(outside):   # before the cycle check, which follows parents
            i = int(outside[0])
            raise TreeError(f"parents[{i}] = {parents[i]} is not a token index in [-1, {m})")
        late = np.flatnonzero(up >= np.arange(m))
        if len(late):
            i, p = int(late[0]), parents[late[0]]
            kind = "a cycle" if on_cycle(up, i) else "a forward reference"
            raise TreeError(f"parents[{i}] = {p}: parents must come before children ({kind})")
        children: list[list[int]] = [[] for _ in range(m)]
        tops, depth = [], [0] * m
        for i, p in enumerate(parents):   # once per shape
            if p < 0:
                tops.append(i)
            else:
                children[p].append(i)
                depth[i] = depth[p] + 1
        perm, stack = [], tops[::-1]
        while stack:
            i = stack.pop()
            perm.append(i)
            stack += children[i][::-1]
        perm = np.array(perm, dtype=np.int64)
        rank = np.empty(m, dtype=np.int64)
        rank[perm] = np.arange(m)
        above = up[perm]
        inner = np.where(above >= 0, rank[above], -1)
        kids = np.bincount(up[up >= 0], minlength=m).astype(np.int64)
        shape = (perm, inner, up, np.array(depth, dtype=np.int64), kids)
        for a in shape:
            a.setflags(write=False)
        if len(self._token_trees) >= KNOWN_SHAPES:
            del self._token_trees[next(iter(self._token_trees))]
        self._token_trees[key] = shape
        return shape

    def _hang(self, anchors: np.ndarray, tokens: np.ndarray, prefix) -> np.ndarray:
        """New one-token pending rows (checked input), token ``i``'s under row ``anchors[i]`` with ``prefix``
        (None: set by the caller); packed into fresh shared pages. Returns the rows, in token order."""
        m = len(tokens)
        slots = self.pool.allocate_slots(m)   # raises before any change
        t = self._table
        made = t.new_rows(m, anchors, 0 if prefix is None else prefix, np.ones(m, dtype=np.int64), 1, 0, 1)
        at = t.start[made]
        t.slots[at] = slots
        t.tokens[at] = tokens
        self._num_pending += m
        self._layout = None
        return made
