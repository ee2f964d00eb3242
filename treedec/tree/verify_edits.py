"""SequenceTree's batch edits of batched speculative verification: what the verify table
(:mod:`treedec.programs.speculative.verify_table`) does every step for all its requests at once, each a few numpy
calls whatever their number, none a Python loop over the requests.

A pipelined verification of ``R`` requests whose trees share one shape of ``m`` tokens and depth ``D``::

    trees = tree.add_token_trees(nodes, parents)         # [R, m]: a request's first tree (placeholders)
    # every step after: the reserved slots step n - 2 did not use dropped, 1 + D slots reserved for step n's
    # root and path, the same trees' nodes pending again for step n + 1's draft
    slots = tree.advance_token_trees(trees, cuts, 1 + D)
    tree.set_tokens_many(nodes, starts, tokens, counts)  # step n's root and accepted tokens, read back
    tree.prune_many(trees[:, 0])                         # a request's end (or a tree of another shape)

Each equals the per-node operations applied to the nodes in order (the reference tree's; tested): the same
nodes, slots, pages and refcounts (:meth:`~VerifyEdits.advance_token_trees`, the reference's own: the trees keep
their nodes). ``truncate_many`` and ``extend_computed_many`` are the advance's leaf edits alone.
:class:`~treedec.tree.SequenceTree` inherits them.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treedec.errors import TreeError
from treedec.tree.node_table import FIELD, ROW_MASK, count_distinct, ranges
from treedec.tree.validate import int_array, int_list, int_value

__all__ = ["VerifyEdits"]

TAIL, LENGTH, START = (FIELD[c] for c in ("tail_room", "length", "start"))


class VerifyEdits:
    """:meth:`add_token_trees`, :meth:`extend_computed_many`, :meth:`truncate_many`, :meth:`set_tokens_many` and
    :meth:`advance_token_trees` of a :class:`~treedec.tree.SequenceTree`."""

    def add_token_trees(self, node_ids: Sequence[int] | np.ndarray, parents: Sequence[int], checked: bool = True
                        ) -> np.ndarray:
        """Hang one token tree of shape ``parents`` under each of many leaves, placeholders (token 0) pending:
        ``add_token_tree(n, [0] * m, parents)`` for each ``n`` of ``node_ids`` in order, in one go.

        Parameters
        ----------
        node_ids : [R] ints, distinct leaves.
        parents : [m] ints, as :meth:`add_token_tree`'s (-1: a child of the leaf).

        Returns
        -------
        [R, m] int64: the new node ids, one row per leaf, in token order. Each tree's tokens are packed into
        ``ceil(m / page_size)`` fresh pages of its own. Checks first, changes nothing when it raises; ``checked``:
        False for a caller that made ``node_ids`` itself (see :meth:`extend_computed_many`).
        """
        ids, rows = self._leaf_rows(node_ids) if checked else (node_ids, node_ids & ROW_MASK)
        parents = int_list(parents, "parents", low=-1)
        m, r = len(parents), len(rows)
        if m == 0:
            raise TreeError("a token tree needs at least one token, got an empty parents list")
        perm, inner, up, depth, kids = self._token_tree_order(parents)
        if r == 0:
            return np.zeros((0, m), dtype=np.int64)
        slots = self.pool.allocate_slot_groups(r, m)   # raises before any change
        t = self._table
        made = t.new_rows(r * m, rows.repeat(m), 0, np.ones(r * m, dtype=np.int64), 1, 0, 1)
        at = t.start[made]
        t.slots[at] = slots.reshape(-1)
        t.tokens[at] = 0
        self._num_pending += r * m
        self._layout = None
        grid = made.reshape(r, m)
        t.parent[made] = np.where(up[None, :] < 0, rows[:, None], grid[:, up]).reshape(-1)
        t.prefix[made] = ((t.prefix[rows] + t.length[rows])[:, None] + depth[None, :]).reshape(-1)
        t.num_children[made] = kids[None, :].repeat(r, axis=0).reshape(-1)
        t.num_children[rows] += m - int(np.add.reduce(kids))
        order = self._order   # each tree right after its leaf, in its own preorder
        where = order.positions(ids)
        rank = where.argsort(kind="stable")
        new_ids = t.node_id[grid[rank][:, perm]].reshape(-1)
        base = (np.arange(r, dtype=np.int64) * m)[:, None]
        self._order = order.insert((where[rank] + 1).repeat(m), new_ids,
                                   np.where(inner[None, :] < 0, where[rank][:, None], -1).reshape(-1),
                                   np.where(inner[None, :] < 0, -1, inner[None, :] + base).reshape(-1))
        return t.node_id[grid]

    def extend_computed_many(self, node_ids: Sequence[int] | np.ndarray, count: int, checked: bool = True
                             ) -> np.ndarray:
        """Append ``count`` computed placeholder tokens (0) to each of many leaves: ``count`` rounds of
        ``extend_computed(n, [0])`` over ``node_ids`` in order (the slots a pipelined step moves accepted K/V
        into; :meth:`set_tokens_many` records the ids later, :meth:`truncate_many` drops the unused).

        Parameters
        ----------
        node_ids : [R] ints, distinct leaves without pending tokens.
        count : int >= 0.
        checked : False for a caller that holds the leaves and made the arguments itself (the verify group: ``[R]``
            int64 arrays of distinct live leaves, by construction, every step; :meth:`truncate_many`,
            :meth:`set_tokens_many`, :meth:`add_token_trees` and :meth:`prune_many` take it too): the arguments'
            checks are skipped, the tree's state (pending tokens, lengths, pages) is still checked.

        Returns
        -------
        [R, count] int64: each leaf's new slots. Checks first, changes nothing when it raises.
        """
        if checked:
            ids, rows = self._leaf_rows(node_ids)
            count = int_value(count, "count", low=0)
        else:
            ids, rows = node_ids, node_ids & ROW_MASK
        t = self._table
        busy = t.pending[rows] > 0
        if np.logical_or.reduce(busy):
            raise TreeError(f"cannot append computed tokens to node(s) {ids[busy][:5].tolist()}: they have pending "
                            f"tokens; call commit_step() first")
        f = t.fields(rows)
        room, lens = f[:, TAIL], f[:, LENGTH]
        growth = self._growth(room, count)
        self._check_free(growth[2])
        return self._extend_leaves(rows, lens, room, t.slots[f[:, START] + lens - 1], count, growth)

    def truncate_many(self, node_ids: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray,
                      checked: bool = True) -> np.ndarray:
        """Keep the first ``lengths[i]`` (>= 1) tokens of each leaf ``node_ids[i]``: :meth:`truncate` of each, in
        one go. The leaves must be distinct and without pending tokens. Returns the pages freed (ascending).
        ``checked``: as :meth:`extend_computed_many`'s."""
        if checked:
            ids, rows = self._leaf_rows(node_ids)
            lengths = int_array(lengths, "lengths", low=1)
            if len(lengths) != len(rows):
                raise ValueError(f"lengths must hold one length per node ({len(rows)}), got {len(lengths)}")
        else:
            ids, rows = node_ids, node_ids & ROW_MASK
        t = self._table
        busy = t.pending[rows] > 0
        if np.logical_or.reduce(busy):
            raise TreeError(f"cannot truncate node(s) {ids[busy][:5].tolist()}: they have pending tokens; call "
                            f"commit_step() first")
        have = t.length[rows]
        long = lengths > have
        if np.logical_or.reduce(long):
            i = int(np.flatnonzero(long)[0])
            raise TreeError(f"cannot truncate node {ids[i]} of {have[i]} tokens to {lengths[i]}")
        self._check_truncation(rows, lengths)
        ps = self.pool.page_size
        start = t.start[rows]
        dropped = ranges(start + lengths, have - lengths)
        page_of = t.slots[dropped] // ps
        begins = page_of != t.slots[dropped - 1] // ps   # a page stays when a kept token is in it
        freed = self.pool.decref(page_of[begins]) if np.logical_or.reduce(begins) else np.zeros(0, dtype=np.int64)
        t.length[rows] = lengths
        last = t.slots[start + lengths - 1]
        alone = self.pool.refcount[last // ps] == 1
        t.tail_room[rows] = np.where(alone, ps - 1 - last % ps, 0)
        self._cache.truncated_many(ids, lengths)
        self._layout = None
        return freed

    def set_tokens_many(self, node_ids: Sequence[int] | np.ndarray, starts: Sequence[int] | np.ndarray,
                        tokens: Sequence[int] | np.ndarray, counts: Sequence[int] | np.ndarray, checked: bool = True
                        ) -> None:
        """Overwrite ``counts[i]`` token ids of each node ``node_ids[i]`` from its token ``starts[i]``:
        :meth:`set_tokens` of each, in one call. ``tokens`` holds them all, node after node (``[sum(counts)]``
        ints >= 0). Checks first, changes nothing when it raises. ``checked``: as :meth:`extend_computed_many`'s
        (live nodes, ``[R]`` int64 ``starts`` and ``counts`` and the ``[sum(counts)]`` tokens)."""
        if checked:
            ids, rows = self._lane_rows(node_ids, "node_ids")
            starts = int_array(starts, "starts", low=0)
            counts = int_array(counts, "counts", low=0)
            tokens = int_array(tokens, "tokens", low=0)
            if not len(starts) == len(counts) == len(rows):
                raise ValueError(f"starts and counts must hold one value per node ({len(rows)}), got {len(starts)} "
                                 f"and {len(counts)}")
            if len(tokens) != int(counts.sum()):
                raise ValueError(f"tokens must hold sum(counts) = {int(counts.sum())} ids, got {len(tokens)}")
        else:
            ids, rows = node_ids, node_ids & ROW_MASK
        t = self._table
        past = starts + counts > t.length[rows]
        if np.logical_or.reduce(past):
            i = int(np.flatnonzero(past)[0])
            raise TreeError(f"node {ids[i]} has {t.length[rows[i]]} tokens; cannot set tokens {starts[i]}.."
                            f"{starts[i] + counts[i] - 1}")
        t.tokens[ranges(t.start[rows] + starts, counts)] = tokens

    def advance_token_trees(self, trees: np.ndarray, cuts: Sequence[int] | np.ndarray, count: int,
                            checked: bool = True) -> np.ndarray:
        """A pipelined verification step's edits of ``R`` leaves whose token trees are computed, in one go: each
        leaf drops its last ``cuts[i]`` tokens (the reserved slots the last step's outcome left unused), grows
        ``count`` computed placeholder tokens (the slots its accepted K/V move into), and its token tree's nodes
        are pending again as placeholders (token 0) right after its new end, for the next step's draft.

        The same as ``truncate_many`` of the leaves with cuts, ``extend_computed_many(leaves, count)`` and the
        trees pruned and a tree of the same shape added to each leaf (:meth:`add_token_trees`), but the trees keep
        their nodes, ids and slots (the next step rewrites their K/V there): no node is made or freed, no page of a
        tree changes hands, and the forest's order stays (a speculative step's tree edits in a few numpy calls).

        Parameters
        ----------
        trees : [R, m] ints: each row the nodes of one token tree (:meth:`add_token_trees`' row for its leaf: its
            first node the root, the leaf's only child), every node one computed token; the leaves distinct.
        cuts : [R] ints >= 0, each below its leaf's length.
        count : int >= 0.
        checked : False for a caller that made the arguments itself (the verify group: its own trees, ``[R]``
            int64 cuts, every step): only the tree's state is checked (pending tokens, pages).

        Returns
        -------
        [R, count] int64: each leaf's new slots, as :meth:`extend_computed_many` gives them. Checks first,
        changes nothing when it raises.
        """
        if checked:
            trees, cuts, count = self._trees_checked(trees, cuts, count)
        rows = trees & ROW_MASK
        t = self._table
        roots = rows[:, 0]
        leaves = t.parent[roots]
        busy = (t.pending[leaves] > 0) | np.logical_or.reduce(t.pending[rows] > 0, axis=1)
        if np.logical_or.reduce(busy):
            raise TreeError(f"cannot advance the token trees of node(s) {t.node_id[leaves[busy]][:5].tolist()}: "
                            f"they or their trees have pending tokens; call commit_step() first")
        f = t.fields(leaves)
        room, lens = f[:, TAIL], f[:, LENGTH] - cuts
        last = t.slots[f[:, START] + lens - 1]
        ps = self.pool.page_size
        cut = cuts.nonzero()[0]
        some = len(cut)
        if some:   # (the cut tails' pages and the rooms they leave, found before any change)
            cut_rows = leaves[cut]
            self._check_truncation(cut_rows, lens[cut])
            dropped = ranges(f[cut, START] + lens[cut], cuts[cut])
            page_of = t.slots[dropped] // ps
            pages, times = count_distinct(page_of[page_of != t.slots[dropped - 1] // ps])   # (a kept token's stay)
            room[cut] = np.where(self.pool.refcount[last[cut] // ps] == 1, ps - 1 - last[cut] % ps, 0)
            freed = int(np.add.reduce(self.pool.refcount[pages] == times))
        growth = self._growth(room, count)
        if growth[2] > self.pool.num_free_pages + (freed if some else 0):
            self._check_free(growth[2])   # (raises, naming the pages)
        if some:
            self.pool.release(pages, times)
            t.length[cut_rows] = lens[cut]
            t.tail_room[cut_rows] = room[cut]
            self._cache.truncated_many(t.node_id[cut_rows], lens[cut])
        slots = self._extend_leaves(leaves, lens, room, last, count, growth)
        nodes = rows.reshape(-1)
        shift = t.prefix[leaves] + (lens + count) - t.prefix[roots]
        t.prefix[nodes] += shift.repeat(rows.shape[1])
        t.pending[nodes] = 1
        t.tokens[t.start[nodes]] = 0
        self._num_pending += nodes.size
        self._cache.moved()
        return slots

    # ================================================================ private

    def _growth(self, room: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Where ``count`` tokens appended to each of rows with tail rooms ``room`` (``[R]``) go: ``(j, opens,
        pages)``, ``j [R, count]`` each token's place in its row's fresh pages (< 0: its tail room), ``opens`` the
        tokens that open a page, ``pages`` how many."""
        # Token k of row i fills the row's tail room while k < room[i], then fresh pages; the rounds hand a
        # page to each row whose room ran out, round (k) after round, rows in order within one: the pages'
        # order is the (k, i) order of the tokens that open one, so one allocation gives the rounds' pages.
        j = np.arange(count, dtype=np.int64) - room[:, None]
        opens = (j >= 0) & (j % self.pool.page_size == 0)
        return j, opens, int(np.add.reduce(opens, axis=None))

    def _extend_leaves(self, rows: np.ndarray, lens: np.ndarray, room: np.ndarray, last: np.ndarray, count: int,
                       growth: tuple[np.ndarray, np.ndarray, int]) -> np.ndarray:
        """Append ``count`` computed placeholders to ``rows`` (``[R]`` int64, of ``lens`` tokens, tail rooms
        ``room``, last slots ``last``) where :meth:`_growth` puts them (its pages checked to be free); returns
        their slots ``[R, count]``."""
        t, ps = self._table, self.pool.page_size
        j, opens, num_pages = growth
        pages = self.pool.allocate(num_pages)
        slots = last[:, None] + 1 + np.arange(count)   # in the tail room
        if len(pages):
            rank = opens.T.cumsum().reshape(count, -1).T - 1   # [R, count]: the page a token opening one takes
            i, k = (j >= 0).nonzero()
            within = j[i, k] % ps
            slots[i, k] = pages[rank[i, k - within]] * ps + within
        t.make_room(rows, lens + count)
        at = ((t.start[rows] + lens)[:, None] + np.arange(count)).reshape(-1)   # (each row's new tokens, in order)
        t.slots[at] = slots.reshape(-1)
        t.tokens[at] = 0
        t.length[rows] = lens + count
        t.tail_room[rows] = np.where(room >= count, room - count, ps - 1 - (count - room - 1) % ps)
        self._layout = None
        return slots

    def _trees_checked(self, trees, cuts, count) -> tuple[np.ndarray, np.ndarray, int]:
        """:meth:`advance_token_trees`' arguments checked: ``trees`` ``[R, m]`` live nodes, each row the whole
        subtree of its first node, a leaf's only child, every node one token; ``cuts`` ``[R]`` ints in
        ``[0, length)`` of its leaf; ``count`` an int >= 0."""
        array = np.asarray(trees)
        if array.ndim != 2 or not array.shape[1]:
            raise ValueError(f"trees must be [R, m] node ids (m >= 1), got shape {list(array.shape)}")
        ids, rows = self._lane_rows(array.reshape(-1), "trees")
        self._distinct(ids, rows)
        ids, rows = ids.reshape(array.shape), rows.reshape(array.shape)
        cuts = int_array(cuts, "cuts", low=0)
        count = int_value(count, "count", low=0)
        if len(cuts) != len(rows):
            raise ValueError(f"cuts must hold one count per tree ({len(rows)}), got {len(cuts)}")
        t, order = self._table, self._order
        leaves = t.parent[rows[:, 0]]
        if np.logical_or.reduce(leaves < 0) or np.logical_or.reduce(t.num_children[np.maximum(leaves, 0)] != 1):
            raise TreeError("trees: each tree's first node must be the only child of its leaf")
        at = order.positions(ids[:, 0])
        whole = order.subtree_ends(at) - at == rows.shape[1]
        if np.logical_and.reduce(whole):
            below = order.ids[ranges(at, np.full(len(at), rows.shape[1], dtype=np.int64))].reshape(rows.shape)
            whole = np.logical_and.reduce(np.sort(below, axis=1) == np.sort(ids, axis=1), axis=1)
        if not np.logical_and.reduce(whole) or np.logical_or.reduce(t.length[rows] != 1, axis=None):
            raise TreeError(f"trees: each row must be the whole token tree under its leaf, one token a node (tree "
                            f"{ids[np.argmin(whole), :8].tolist()} is not)")
        if np.logical_or.reduce((cuts > 0) & (cuts >= t.length[leaves])):
            raise TreeError(f"cuts must leave each leaf a token: cuts {cuts.tolist()[:8]} of lengths "
                            f"{t.length[leaves].tolist()[:8]}")
        return ids, cuts, count
