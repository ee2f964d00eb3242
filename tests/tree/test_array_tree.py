"""The array SequenceTree equals the object ReferenceSequenceTree it replaced, operation by operation.

Random edit sequences (every operation, with bad arguments mixed in) are applied to both, each over its own pool
with K/V storage: after every step both give the same answer to every query (nodes, parents, children, tokens,
slots, tail room, pending, pages, layouts, pending tokens), the same refcounts, free pages and K/V contents, and
pass check_invariants; an edit that raises in one raises the same type in the other and changes neither. Node ids
are compared through the pairing of the ids both returned (the array tree reuses rows, so its ids after a prune
differ from the reference's). The batch operations of the array tree (append_tokens, pages_to_append,
set_last_tokens, pending_queries, prune_many, prune_dead_ends, branch_many; batched verification's add_token_trees,
extend_computed_many, truncate_many, set_tokens_many; advance_token_trees in test_verify_edits.py) equal theirs.
"""
from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from tests.tree.tree_state import node_ids, public_state, snapshot
from treedec.errors import PoolExhaustedError
from treedec.tree import PagedKVPool, SequenceTree
from treedec.tree.node_table import NodeTable
from treedec.tree.reference import ReferenceSequenceTree

NUM_PAGES = 40
TOKENS = st.lists(st.integers(0, 50), min_size=0, max_size=7)
JUNK_IDS = st.sampled_from([1.5, "3", True, None, -1, 10**9, 2**70])
EDIT_ERRORS = (TypeError, ValueError, PoolExhaustedError)   # TreeError is a ValueError


def make_pool(page_size: int) -> PagedKVPool:
    return PagedKVPool(NUM_PAGES, page_size, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)


class ArrayEqualsReference(RuleBasedStateMachine):
    """``self.ref`` and ``self.arr`` driven by the same edits; ``self.to_arr`` pairs their ids."""

    @initialize(page_size=st.sampled_from([1, 2, 3, 4]), small=st.booleans())
    def start(self, page_size, small):
        self.ref = ReferenceSequenceTree(make_pool(page_size))
        self.arr = SequenceTree(make_pool(page_size))
        if small:   # a table that starts tiny: its columns, free rows and token buffers grow and compact often
            self.arr._table = NodeTable(rows=1, tokens=4)
        self.arr._cache.few_tokens = 0 if small else 16   # layouts grown by inserts after appends, whatever the size
        self.to_arr: dict[int, int] = {}
        self.stale: list[int] = []   # reference ids of pruned nodes

    # ================================================================ comparing the two

    def _to_ref(self) -> dict[int, int]:
        return {a: r for r, a in self.to_arr.items()}

    def _pair(self, ref_ids, arr_ids) -> None:
        ref_ids = [ref_ids] if isinstance(ref_ids, int) else list(ref_ids)
        arr_ids = [arr_ids] if isinstance(arr_ids, int) else list(arr_ids)
        assert len(ref_ids) == len(arr_ids)
        for r, a in zip(ref_ids, arr_ids):
            assert r not in self.to_arr and a not in self._to_ref(), (r, a)
            self.to_arr[r] = a

    def _arr_state_as_ref(self):
        """The array tree's public state with its ids written as the reference's."""
        back = self._to_ref()
        name = lambda i: None if i is None else back[i]   # noqa: E731
        nodes, roots, printout, *counts, layout, pending, refcount, free = public_state(self.arr)
        nodes = [(name(i), name(p), [name(c) for c in kids], *rest) for i, p, kids, *rest in nodes]
        printout = re.sub(r"node (\d+):", lambda m: f"node {back[int(m.group(1))]}:", printout)
        layout = ([name(i) for i in layout[0]],) + layout[1:]
        return nodes, [name(r) for r in roots], printout, *counts, layout, pending, refcount, free

    @invariant()
    def same_state(self):
        if not hasattr(self, "ref"):
            return
        assert self._arr_state_as_ref() == public_state(self.ref)
        assert torch.equal(self.ref.pool.k, self.arr.pool.k) and torch.equal(self.ref.pool.v, self.arr.pool.v)
        self.ref.check_invariants()
        self.arr.check_invariants()

    def both(self, edit, strict: bool = True):
        """Run ``edit(tree)`` on both; the same outcome: both return (the results are returned) or both raise
        the same type (``strict=False``: of one family, TypeError, ValueError or PoolExhaustedError: an id past
        int64 is a TreeError to the reference's dicts, a ValueError to the array tree's ids) and change
        nothing."""
        ref_before, arr_before = snapshot(self.ref), snapshot(self.arr)
        outcomes = []
        for tree in (self.ref, self.arr):
            try:
                outcomes.append(("ok", edit(tree)))
            except EDIT_ERRORS as e:
                outcomes.append(("raised", type(e)))
        (ref_kind, ref_out), (arr_kind, arr_out) = outcomes
        assert ref_kind == arr_kind, (outcomes,)
        if ref_kind == "raised":
            assert ref_out is arr_out or not strict and _family(ref_out) is _family(arr_out), outcomes
            assert snapshot(self.ref) == ref_before and snapshot(self.arr) == arr_before
            return None
        return ref_out, arr_out

    # ================================================================ choosing nodes

    def _nodes(self) -> list[int]:
        return node_ids(self.ref)

    def _node(self, data, junk_odds: int = 8):
        """A reference node id (1 in ``junk_odds``: a stale id or junk); the same node's array id comes from
        :meth:`_arr`."""
        nodes = self._nodes()
        if nodes and data.draw(st.integers(0, junk_odds - 1), label="real"):
            return data.draw(st.sampled_from(nodes), label="node")
        if self.stale and data.draw(st.booleans(), label="stale"):
            return ("stale", data.draw(st.sampled_from(self.stale)))
        return ("junk", data.draw(JUNK_IDS))

    def _as(self, tree, node):
        if isinstance(node, tuple):
            kind, value = node
            return (self.to_arr[value] if tree is self.arr else value) if kind == "stale" else value
        return self.to_arr[node] if tree is self.arr else node

    def _leaves(self) -> list[int]:
        return [n for n in self._nodes() if not self.ref.children(n)]

    def _forget(self, before: list[int]) -> None:
        self.stale += [n for n in before if n not in self.ref]

    # ================================================================ the edits

    @rule(tokens=st.one_of(TOKENS, st.just("12"), st.just([1.5])))
    def add_prompt(self, tokens):
        out = self.both(lambda t: t.add_prompt(tokens))
        if out:
            self._pair(*out)

    @precondition(lambda self: self._nodes())
    @rule(data=st.data(), pages=st.integers(1, 3))
    def add_shared_root(self, data, pages):
        """A root over whole pages another node holds (as the prefix cache's): its slots, maybe the wrong ones."""
        node = data.draw(st.sampled_from(self._nodes()))
        slots = self.ref.slots(node)[: pages * self.ref.pool.page_size]
        if data.draw(st.integers(0, 4)) == 0:
            slots = slots[::-1].copy()   # not in slot order: refused
        tokens = list(range(len(slots)))
        out = self.both(lambda t: t.add_shared_root(tokens, slots))
        if out:
            self._pair(*out)

    @rule(data=st.data(), tokens=TOKENS)
    def extend(self, data, tokens):
        node = self._node(data)
        out = self.both(lambda t: t.extend(self._as(t, node), tokens))
        if out:
            assert np.array_equal(*out)

    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=0, max_size=4))
    def extend_many(self, data, tokens):
        nodes = [self._node(data, junk_odds=12) for _ in tokens]
        if len(set(map(repr, nodes))) != len(nodes):
            return
        out = self.both(lambda t: t.extend_many({self._as(t, n): x for n, x in zip(nodes, tokens)}))
        if out:
            ref_out, arr_out = out
            assert [s.tolist() for s in ref_out.values()] == [s.tolist() for s in arr_out.values()]

    @rule(data=st.data(), children=st.one_of(st.integers(-1, 4), st.lists(TOKENS, min_size=0, max_size=3)))
    def branch(self, data, children):
        node = self._node(data)
        out = self.both(lambda t: t.branch(self._as(t, node), children))
        if out:
            self._pair(*out)

    @rule(data=st.data(), m=st.integers(0, 7))
    def add_token_tree(self, data, m):
        node = self._node(data)
        parents = [data.draw(st.integers(-1, i - 1) if data.draw(st.integers(0, 9)) else st.integers(-3, 9))
                   for i in range(m)]
        if data.draw(st.integers(0, 9)) == 0:
            parents = parents[:-1]
        tokens = list(range(10, 10 + m))
        out = self.both(lambda t: t.add_token_tree(self._as(t, node), tokens, parents))
        if out:
            self._pair(*out)

    @rule(data=st.data(), m=st.integers(0, 6))
    def add_children(self, data, m):
        anchors = [self._node(data, junk_odds=15) for _ in range(m)]
        tokens = list(range(m + data.draw(st.integers(0, 1))))
        out = self.both(lambda t: t.add_children([self._as(t, a) for a in anchors], tokens))
        if out:
            self._pair(*out)

    @precondition(lambda self: self._nodes())
    @rule(data=st.data())
    def accept(self, data):
        anchor = data.draw(st.sampled_from(self._nodes()))
        path, node = [], anchor
        while self.ref.children(node) and data.draw(st.booleans(), label="deeper"):
            node = data.draw(st.sampled_from(self.ref.children(node)))
            path.append(node)
        if path and data.draw(st.integers(0, 7)) == 0:
            path = path[1:]   # not a chain from the anchor
        before = self._nodes()
        out = self.both(lambda t: t.accept(self._as(t, anchor), [self._as(t, n) for n in path]))
        if out:
            assert np.array_equal(*out)
        self._forget(before)

    @rule(data=st.data())
    def prune(self, data):
        if data.draw(st.booleans()):
            self.commit()
        node = self._node(data)
        before = self._nodes()
        out = self.both(lambda t: t.prune(self._as(t, node)))
        if out:
            assert np.array_equal(*out)
        self._forget(before)

    @precondition(lambda self: self._nodes())
    @rule(data=st.data())
    def prune_dead_end(self, data):
        self.commit()
        leaf = data.draw(st.sampled_from(self._nodes()))
        root = data.draw(st.sampled_from(self.ref.path(leaf) + self._nodes()[:2]))
        before = self._nodes()
        out = self.both(lambda t: t.prune_dead_end(self._as(t, leaf), self._as(t, root)))
        if out:
            assert out[1] == self.to_arr[out[0]]
        self._forget(before)

    @precondition(lambda self: self._nodes())
    @rule(data=st.data())
    def prune_dead_ends(self, data):
        """prune_dead_ends == prune_dead_end of each leaf in order; it refuses, changing nothing, what those refuse."""
        self.commit()
        root = data.draw(st.sampled_from(self._nodes()))
        below = st.sampled_from([n for n in self._nodes() if root in self.ref.path(n)])   # (root itself: refused)
        leaves = data.draw(st.lists(below, max_size=5))
        before, listed = snapshot(self.arr), self._nodes()
        try:
            tops = self.arr.prune_dead_ends([self._as(self.arr, n) for n in leaves], self._as(self.arr, root))
        except EDIT_ERRORS:
            assert snapshot(self.arr) == before
            with pytest.raises(EDIT_ERRORS):
                alone = copy.deepcopy(self.ref)
                for n in leaves:
                    alone.prune_dead_end(n, root)
            return
        assert tops == [self.to_arr[self.ref.prune_dead_end(n, root)] for n in leaves]
        self._same_free_pages()
        self._forget(listed)

    def _same_free_pages(self) -> None:
        """The same free pages after a batch prune (pushed in another order: the reference's stack takes this one)."""
        assert set(self.ref.pool.free_pages.tolist()) == set(self.arr.pool.free_pages.tolist())
        self.ref.pool._free[:self.arr.pool.num_free_pages] = self.arr.pool.free_pages[::-1]

    @rule(data=st.data(), tokens=st.one_of(TOKENS, st.just([-1])))
    def extend_computed(self, data, tokens):
        node = self._node(data)
        out = self.both(lambda t: t.extend_computed(self._as(t, node), tokens))
        if out:
            assert np.array_equal(*out)
            self._write_kv(out[0], tokens)

    @rule(data=st.data(), start=st.integers(-1, 8), tokens=TOKENS)
    def set_tokens(self, data, start, tokens):
        node = self._node(data)
        self.both(lambda t: t.set_tokens(self._as(t, node), start, tokens))

    @rule(data=st.data(), length=st.integers(-1, 12))
    def truncate(self, data, length):
        if data.draw(st.booleans()):
            self.commit()
        node = self._node(data)
        out = self.both(lambda t: t.truncate(self._as(t, node), length))
        if out:
            assert np.array_equal(*out)

    @rule(data=st.data(), pause=st.booleans())
    def pause_or_resume(self, data, pause):
        node = self._node(data)
        self.both(lambda t: t.pause(self._as(t, node)) if pause else t.resume(self._as(t, node)))
        assert self.ref.live_leaves() == [self._to_ref()[n] for n in self.arr.live_leaves()]

    @rule()
    def commit(self):
        """The step's forward: both pools get the pending tokens' K/V (from token and position), then commit."""
        layout = self.ref.layout()
        self._write_kv(layout.query_slot, self.ref.pending_tokens(), layout.query_position)
        self.ref.commit_step()
        self.arr.commit_step()

    def _write_kv(self, slots, tokens, positions=None):
        positions = np.zeros(len(slots)) if positions is None else positions
        for pool in (self.ref.pool, self.arr.pool):
            kv = torch.tensor(np.stack([np.asarray(tokens, dtype=np.float64), positions], axis=1), dtype=torch.float32)
            pool.write(0, slots, kv[:, None, :], -kv[:, None, :])

    # ================================================================ the array tree's batch operations

    def _lane_nodes(self, data) -> list:
        """Leaves mostly, now and then an inner node, a node twice, or a junk id."""
        leaves = self._leaves()
        nodes = data.draw(st.lists(st.sampled_from(leaves), unique=True, max_size=6)) if leaves else []
        kind = data.draw(st.integers(0, 9), label="fault")
        if kind == 0 and nodes:
            nodes.append(nodes[0])
        elif kind == 1 and self._nodes():
            nodes.append(data.draw(st.sampled_from(self._nodes())))
        elif kind == 2:
            nodes.append(self._node(data, junk_odds=1))
        return nodes

    @rule(data=st.data(), placeholders=st.booleans())
    def append_tokens(self, data, placeholders):
        """append_tokens == extend_many of one token each (placeholders: zeros); pages_to_append == the pages
        that takes; a node named twice (which a dict cannot say) raises and changes nothing."""
        nodes = self._lane_nodes(data)
        tokens = data.draw(st.lists(st.integers(0, 50), min_size=len(nodes), max_size=len(nodes)))
        arr_nodes = [self._as(self.arr, n) for n in nodes]
        # (as dict keys, True is 1: a dict of these nodes is shorter than the list, which append_tokens refuses)
        distinct = len(dict.fromkeys(self._as(self.ref, n) for n in nodes)) == len(nodes)
        real = distinct and not any(isinstance(n, tuple) for n in nodes)
        valid = real and not any(self.ref.children(n) for n in nodes)
        before = snapshot(self.arr)
        try:
            need = self.arr.pages_to_append(arr_nodes)
        except EDIT_ERRORS:
            assert not valid and snapshot(self.arr) == before
        else:
            assert valid and need == sum(self.ref.pages_to_extend(n, 1) for n in nodes)
            assert snapshot(self.arr) == before
        if not distinct:
            with pytest.raises(EDIT_ERRORS):
                self.arr.append_tokens(arr_nodes, None if placeholders else tokens)
            assert snapshot(self.arr) == before
            return
        ref_tokens = [0] * len(nodes) if placeholders else tokens
        out = self.both(lambda t: t.extend_many({self._as(t, n): [x] for n, x in zip(nodes, ref_tokens)})
                        if t is self.ref else t.append_tokens(arr_nodes, None if placeholders else tokens),
                        strict=False)
        if out:
            assert [s[0] for s in out[0].values()] == out[1].tolist()

    @rule(data=st.data())
    def set_last_tokens(self, data):
        """set_last_tokens == set_tokens of each node's last token."""
        nodes = [n for n in self._lane_nodes(data)]
        tokens = data.draw(st.lists(st.integers(0, 50), min_size=len(nodes), max_size=len(nodes)))
        valid = (len(set(map(repr, nodes))) == len(nodes) and all(not isinstance(n, tuple) for n in nodes)
                 and all(self.ref.node_length(n) for n in nodes))
        before = snapshot(self.arr)
        try:
            self.arr.set_last_tokens([self._as(self.arr, n) for n in nodes], tokens)
        except EDIT_ERRORS:
            assert not valid and snapshot(self.arr) == before
            return
        assert valid
        for n, x in zip(nodes, tokens):
            self.ref.set_tokens(n, self.ref.node_length(n) - 1, [x])

    @rule()
    def pending_queries(self):
        """pending_queries == the layout's query nodes, slots, positions and pending_tokens, in one call."""
        q, layout = self.arr.pending_queries(), self.ref.layout()
        assert [self._to_ref()[n] for n in q.nodes.tolist()] == layout.node_ids[layout.query_node].tolist()
        assert q.slots.tolist() == layout.query_slot.tolist() and q.positions.tolist() == layout.query_position.tolist()
        assert q.tokens.tolist() == self.ref.pending_tokens().tolist() and len(q) == layout.num_queries

    @rule(data=st.data())
    def prune_many(self, data):
        """prune_many == prune of each (the pool's free list compared as a set: it is pushed in another order)."""
        if data.draw(st.booleans()):
            self.commit()
        nodes = data.draw(st.lists(st.sampled_from(self._nodes()), max_size=4)) if self._nodes() else []
        if data.draw(st.integers(0, 9)) == 0:
            nodes.append(self._node(data, junk_odds=1))
        subtrees = [set(self.ref.subtree(n)) for n in nodes if not isinstance(n, tuple)]
        valid = (len(subtrees) == len(nodes) and sum(map(len, subtrees)) == len(set().union(*subtrees))
                 and not any(self.ref.sequence_length(i) > self.ref.computed_length(i) for s in subtrees for i in s))
        before, listed = snapshot(self.arr), self._nodes()
        try:
            freed = self.arr.prune_many([self._as(self.arr, n) for n in nodes])
        except EDIT_ERRORS:
            assert not valid and snapshot(self.arr) == before
            return
        assert valid
        ref_freed = [p for n in nodes for p in self.ref.prune(n).tolist()]
        assert sorted(ref_freed) == freed.tolist()
        self._same_free_pages()
        self._forget(listed)

    @rule(data=st.data())
    def branch_many(self, data):
        """branch_many == branch of each node with its tokens, in order (a node named twice, nested ones)."""
        nodes = data.draw(st.lists(st.sampled_from(self._nodes()), max_size=6)) if self._nodes() else []
        nodes += [self._node(data, junk_odds=1)] * (data.draw(st.integers(0, 9)) == 0)
        counts = None if data.draw(st.booleans()) else [data.draw(st.integers(0, 5)) for _ in nodes]
        tokens = list(range(20, 20 + sum(counts or [1] * len(nodes)) - (data.draw(st.integers(0, 9)) == 0)))

        def each(nodes, made):
            at = np.cumsum([0] + (counts or [1] * len(nodes))).tolist()
            ref = [i for n, a, b in zip(nodes, at, at[1:]) for i in self.ref.branch(n, [tokens[a:b]])]
            self._pair(ref, made.tolist())
        self._batch(data, lambda arr_nodes: self.arr.branch_many(arr_nodes, tokens, counts), each, nodes)

    # The batch edits of batched verification (treedec.tree.verify_edits) == the per-node edit of each, in order:
    # tried on the array tree first (a refusal changes nothing), then done node by node on the reference.

    def _batch(self, data, edit, each, nodes: list | None = None) -> None:
        nodes = self._lane_nodes(data) if nodes is None else nodes
        before = snapshot(self.arr)
        try:
            out = edit([self._as(self.arr, n) for n in nodes])
        except EDIT_ERRORS:
            assert snapshot(self.arr) == before
            return
        assert not any(isinstance(n, tuple) for n in nodes)
        each(nodes, out)

    @rule(data=st.data(), m=st.integers(1, 5))
    def add_token_trees(self, data, m):
        parents = [data.draw(st.integers(-1, i - 1)) for i in range(m)]

        def each(nodes, ids):
            made = [self.ref.add_token_tree(n, [0] * m, parents) for n in nodes]
            assert ids.shape == (len(nodes), m)
            self._pair([i for row in made for i in row], ids.reshape(-1).tolist())
        self._batch(data, lambda nodes: self.arr.add_token_trees(nodes, parents), each)

    @rule(data=st.data(), count=st.integers(0, 5))
    def extend_computed_many(self, data, count):
        def each(nodes, slots):
            ref = np.array([[self.ref.extend_computed(n, [0])[0] for n in nodes] for _ in range(count)])
            assert np.array_equal(ref.T.reshape(slots.shape), slots)
        self._batch(data, lambda nodes: self.arr.extend_computed_many(nodes, count), each)

    @rule(data=st.data())
    def truncate_many(self, data):
        if data.draw(st.booleans()):
            self.commit()
        cut = data.draw(st.lists(st.integers(0, 6), min_size=7, max_size=7))

        def lengths(nodes):
            return [max(1, self.ref.node_length(n) - c) if n in self.ref else 1 for n, c in zip(nodes, cut)]

        def each(nodes, freed):
            ref = [p for n, k in zip(nodes, lengths(nodes)) for p in self.ref.truncate(n, k).tolist()]
            assert sorted(ref) == freed.tolist()
            self._same_free_pages()
        self._batch(data, lambda nodes: self.arr.truncate_many(
            nodes, lengths([self._to_ref().get(n, -1) if type(n) is int else -1 for n in nodes])), each)

    @rule(data=st.data())
    def set_tokens_many(self, data):
        nodes = [n for n in self._lane_nodes(data) if not isinstance(n, tuple)]
        starts = [data.draw(st.integers(0, 3)) for _ in nodes]
        counts = [data.draw(st.integers(0, 3)) for _ in nodes]
        tokens = list(range(sum(counts)))
        before = snapshot(self.arr)
        try:
            self.arr.set_tokens_many([self._as(self.arr, n) for n in nodes], starts, tokens, counts)
        except EDIT_ERRORS:
            assert snapshot(self.arr) == before
            assert any(s + c > self.ref.node_length(n) for n, s, c in zip(nodes, starts, counts))
            return
        at = 0
        for n, s, c in zip(nodes, starts, counts):
            self.ref.set_tokens(n, s, tokens[at:at + c])
            at += c

    def teardown(self):
        if not hasattr(self, "ref"):
            return
        self.commit()
        for tree in (self.ref, self.arr):
            for root in tree.roots:
                tree.prune(root)
            assert tree.pool.num_free_pages == NUM_PAGES and not tree.pool.refcount.any()


def _family(error: type) -> type:
    return next(e for e in (PoolExhaustedError, TypeError, ValueError) if issubclass(error, e))


TestArrayEqualsReference = ArrayEqualsReference.TestCase
TestArrayEqualsReference.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.slow
def test_array_equals_reference_long_runs():
    """The same machine, more and longer runs."""
    run_state_machine_as_test(ArrayEqualsReference, settings=settings(max_examples=400, stateful_step_count=80,
                                                                      deadline=None))
