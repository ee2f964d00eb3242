"""SequenceTree's batch edits of batched speculative verification: what the verify table
(:mod:`treedec.runtime.verify_table`) does every step for all its requests at once, each a few numpy calls
whatever their number, none a Python loop over the requests.

A pipelined verification step of ``R`` requests whose trees share one shape of ``m`` tokens and depth ``D``::

    tree.prune_many(roots)                               # the trees of step n - 1
    tree.truncate_many(nodes, lengths)                   # the reserved slots step n - 2 did not use
    slots = tree.extend_computed_many(nodes, 1 + D)      # [R, 1 + D]: reserved for step n's root and path
    ids = tree.add_token_trees(nodes, parents)           # [R, m]: step n + 1's trees, placeholders
    tree.set_tokens_many(nodes, starts, tokens, counts)  # step n's root and accepted tokens, read back

Each equals the per-node operation applied to the nodes in order (the reference tree's; tested): the same
nodes, slots, pages and refcounts. :class:`~treedec.tree.SequenceTree` inherits them.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treedec.errors import TreeError
from treedec.tree.node_table import FIELD, ROW_MASK, ranges
from treedec.tree.validate import int_array, int_list, int_value

__all__ = ["VerifyEdits"]

TAIL, LENGTH, START = (FIELD[c] for c in ("tail_room", "length", "start"))


class VerifyEdits:
    """:meth:`add_token_trees`, :meth:`extend_computed_many`, :meth:`truncate_many` and :meth:`set_tokens_many` of
    a :class:`~treedec.tree.SequenceTree`."""

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
        t.num_children[rows] += m - int(kids.sum())
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
        if busy.any():
            raise TreeError(f"cannot append computed tokens to node(s) {ids[busy][:5].tolist()}: they have pending "
                            f"tokens; call commit_step() first")
        ps = self.pool.page_size
        f = t.fields(rows)
        room, lens = f[:, TAIL], f[:, LENGTH]
        # Token k of row i fills the row's tail room while k < room[i], then fresh pages; the rounds hand a
        # page to each row whose room ran out, round (k) after round, rows in order within one: the pages'
        # order is the (k, i) order of the tokens that open one, so one allocation gives the rounds' pages.
        j = np.arange(count, dtype=np.int64) - room[:, None]   # [R, count]: the token's place in its fresh pages
        fresh = j >= 0
        opens = fresh & (j % ps == 0)
        num_pages = int(opens.sum())
        self._check_free(num_pages)
        pages = self.pool.allocate(num_pages)
        slots = t.slots[f[:, START] + lens - 1][:, None] + 1 + np.arange(count)   # in the tail room
        if len(pages):
            rank = opens.T.cumsum().reshape(count, -1).T - 1   # [R, count]: the page a token opening one takes
            i, k = fresh.nonzero()
            within = j[i, k] % ps
            slots[i, k] = pages[rank[i, k - within]] * ps + within
        t.make_room(rows, lens + count)
        at = ranges(t.start[rows] + lens, np.full(len(rows), count, dtype=np.int64))
        t.slots[at] = slots.reshape(-1)
        t.tokens[at] = 0
        t.length[rows] = lens + count
        t.tail_room[rows] = np.where(room >= count, room - count, ps - 1 - (count - room - 1) % ps)
        self._layout = None
        return slots

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
        if busy.any():
            raise TreeError(f"cannot truncate node(s) {ids[busy][:5].tolist()}: they have pending tokens; call "
                            f"commit_step() first")
        have = t.length[rows]
        long = lengths > have
        if long.any():
            i = int(np.flatnonzero(long)[0])
            raise TreeError(f"cannot truncate node {ids[i]} of {have[i]} tokens to {lengths[i]}")
        self._check_truncation(rows, lengths)
        ps = self.pool.page_size
        start = t.start[rows]
        dropped = ranges(start + lengths, have - lengths)
        page_of = t.slots[dropped] // ps
        begins = page_of != t.slots[dropped - 1] // ps   # a page stays when a kept token is in it
        freed = self.pool.decref(page_of[begins]) if begins.any() else np.zeros(0, dtype=np.int64)
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
        if past.any():
            i = int(np.flatnonzero(past)[0])
            raise TreeError(f"node {ids[i]} has {t.length[rows[i]]} tokens; cannot set tokens {starts[i]}.."
                            f"{starts[i] + counts[i] - 1}")
        t.tokens[ranges(t.start[rows] + starts, counts)] = tokens
