"""Fuzzing the tree entry points with arbitrary input: Medusa choices, TokenTree parents,
TreeLayout.from_parents, and random SequenceTree operation sequences with bad arguments mixed in.

Whatever goes in, an entry point either works or raises the exceptions its docstring names
(TypeError / ValueError, TreeError being a ValueError; PoolExhaustedError when the pool is
full) and then has changed nothing; never an IndexError, KeyError, AttributeError,
RecursionError, OverflowError, ...
"""
import numpy as np
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import precondition, rule

from tests.tree.test_sequence_tree import make_tree
from tests.tree.tree_state import node_ids, snapshot
from treedec import PoolExhaustedError
from treedec.tree import TreeLayout
from treedec.tree.token_tree import TokenTree
from tests.trees import ConsistentTreeMachine

FUZZ = settings(max_examples=150, deadline=None)

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 6), st.integers(), st.integers(2**62, 2**80).map(lambda x: x * (-1) ** x),
    st.floats(), st.text(max_size=3), st.binary(max_size=2),
)
ARRAYS = st.one_of(
    st.lists(st.integers(-3, 6), max_size=5).map(np.array),
    st.lists(st.floats(-3, 6), max_size=5).map(np.array),
    st.lists(st.integers(-3, 6), max_size=5).map(lambda x: torch.tensor(x, dtype=torch.int64)),
    st.lists(st.booleans(), max_size=3).map(torch.tensor),
    st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), max_size=3).map(np.array),
)
# Nested lists / tuples / dicts of anything: ints (huge, negative), strings, floats, None, arrays.
JUNK = st.recursive(
    st.one_of(SCALARS, ARRAYS),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=2), inner, max_size=3)),
    max_leaves=20,
)


# ================================================================ Medusa choices


@FUZZ
@given(choices=JUNK)
def test_medusa_choices_from_junk_raise_only_value_error(choices):
    """from_medusa_choices documents ValueError only (deft.py and the CLI turn it into their own errors)."""
    try:
        tree = TokenTree.from_medusa_choices(choices)
    except ValueError:
        return
    assert tree.size == len(choices) + 1
    assert TokenTree(tree.parents) == tree


PATHS = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3), max_size=12)


@FUZZ
@given(choices=PATHS)
def test_medusa_choices_valid_exactly_when_prefix_closed_and_distinct(choices):
    paths = [tuple(p) for p in choices]
    valid = len(set(paths)) == len(paths) and all(p[:-1] in set(paths) or len(p) == 1 for p in paths)
    try:
        tree = TokenTree.from_medusa_choices(choices)
    except ValueError as e:
        assert not valid, f"valid choices {choices} rejected: {e}"
        assert "choices" in str(e)
        return
    assert valid, f"invalid choices {choices} accepted"
    order = sorted(paths, key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(order)}
    assert tree.parents == (-1,) + tuple(index.get(p[:-1], 0) for p in order)
    assert tree.depth == (0,) + tuple(len(p) for p in order)


# ================================================================ TokenTree and TreeLayout construction


@FUZZ
@given(parents=st.one_of(JUNK, st.lists(st.integers(-2, 8), max_size=8)))
def test_token_tree_from_anything(parents):
    try:
        tree = TokenTree(parents)
    except (TypeError, ValueError):
        return
    p = tree.parents
    assert p[0] == -1 and all(0 <= q < i for i, q in enumerate(p) if i)
    assert len(tree.paths) == len(tree.depth) == tree.size


@FUZZ
@given(parents=st.one_of(JUNK, st.lists(st.integers(-2, 5), max_size=5)),
       lengths=st.one_of(JUNK, st.lists(st.integers(-1, 4), max_size=5)),
       queries=st.one_of(JUNK, st.lists(st.tuples(st.integers(-1, 5), st.integers(-1, 4)), max_size=4)),
       node_ids=st.one_of(st.none(), JUNK))
def test_layout_from_parents_from_anything(parents, lengths, queries, node_ids):
    try:
        layout = TreeLayout.from_parents(parents, lengths, queries, node_ids=node_ids)
    except (TypeError, ValueError):
        return
    assert len(layout.parent) == len(layout.node_ids) == layout.num_nodes
    assert np.all(layout.parent < np.arange(layout.num_nodes))   # preorder: parents first
    assert np.all(layout.query_offset < layout.node_len[layout.query_node])


# ================================================================ SequenceTree operations with bad arguments


@FUZZ
@given(data=st.data(), m=st.integers(1, 8))
def test_add_token_tree_parents_valid_exactly_when_each_comes_first(data, m):
    parents = data.draw(st.one_of(st.lists(st.integers(-3, m + 3), min_size=m, max_size=m),
                                  st.lists(st.integers(-1, m - 1), min_size=m, max_size=m)))
    tree = make_tree(num_pages=16, page_size=3)
    root = tree.add_prompt([1])
    tree.commit_step()
    before = snapshot(tree)
    valid = all(-1 <= p < i for i, p in enumerate(parents))
    try:
        ids = tree.add_token_tree(root, list(range(m)), parents)
    except ValueError:
        assert not valid, f"valid parents {parents} rejected"
        assert snapshot(tree) == before
        return
    assert valid, f"invalid parents {parents} accepted"
    assert [tree.parent(i) for i in ids] == [root if p < 0 else ids[p] for p in parents]
    tree.check_invariants()

GOOD_TOKENS = st.lists(st.integers(0, 50), min_size=1, max_size=6)
TOKENS = st.one_of(GOOD_TOKENS, GOOD_TOKENS, GOOD_TOKENS, JUNK)   # mostly good: the tree must grow
# What each operation may raise for a bad argument (TreeError is a ValueError).
DOCUMENTED = (TypeError, ValueError, PoolExhaustedError)


class TreeOperationsWithBadArguments(ConsistentTreeMachine):
    """Good operations keep the tree consistent; a rejected one changes nothing."""

    def __init__(self):
        super().__init__()
        self.tree = make_tree(num_pages=40, page_size=3)
        self.tree.add_prompt([1, 2])

    def _nodes(self):
        return sorted(node_ids(self.tree))

    def _node_or_junk(self, data):
        """A live node id 3 times in 5, else an unknown id or a junk value."""
        nodes = self._nodes()
        kind = data.draw(st.integers(0, 4))
        if kind < 3 and nodes:
            return data.draw(st.sampled_from(nodes))
        return data.draw(SCALARS if kind == 4 else st.integers(-2, 100))

    def _attempt(self, call):
        """Run ``call``: accepted, the tree must be consistent; rejected, unchanged."""
        before = snapshot(self.tree)
        try:
            call()
        except DOCUMENTED:
            assert snapshot(self.tree) == before
            return
        self.tree.check_invariants()

    @rule(tokens=TOKENS)
    def add_prompt(self, tokens):
        self._attempt(lambda: self.tree.add_prompt(tokens))

    @rule(data=st.data(), tokens=TOKENS)
    def extend(self, data, tokens):
        node = self._node_or_junk(data)
        self._attempt(lambda: self.tree.extend(node, tokens))

    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=1, max_size=3))
    def extend_many(self, data, tokens):
        leaves = [i for i in self._nodes() if not self.tree.children(i)]
        nodes = [data.draw(st.sampled_from(leaves)) if leaves and data.draw(st.booleans()) else self._node_or_junk(data)
                 for _ in tokens]
        grow = dict(zip(nodes, tokens)) if data.draw(st.integers(0, 3)) else tokens
        self._attempt(lambda: self.tree.extend_many(grow))

    @rule(data=st.data(), children=st.one_of(st.integers(-1, 3), st.integers(39, 2**62), st.lists(TOKENS, max_size=3),
                                             JUNK))
    def branch(self, data, children):
        node = self._node_or_junk(data)
        self._attempt(lambda: self.tree.branch(node, children))

    @rule(data=st.data(), tokens=TOKENS, parents=st.one_of(st.lists(st.integers(-2, 6), max_size=6), JUNK))
    def add_token_tree(self, data, tokens, parents):
        node = self._node_or_junk(data)
        if isinstance(tokens, list) and data.draw(st.booleans()):   # parents that fit, but for the odd one
            parents = [data.draw(st.integers(-1, i - 1) if data.draw(st.integers(0, 9)) else st.integers(-3, 9))
                       for i in range(len(tokens))]
        self._attempt(lambda: self.tree.add_token_tree(node, tokens, parents))

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data())
    def prune(self, data):
        if data.draw(st.booleans()):
            self.tree.commit_step()
        node = self._node_or_junk(data)
        self._attempt(lambda: self.tree.prune(node))

    @rule(data=st.data(), num_tokens=st.one_of(st.integers(-2, 10), SCALARS))
    def queries(self, data, num_tokens):
        node = self._node_or_junk(data)
        self._attempt(lambda: self.tree.pages_to_extend(node, num_tokens))
        self._attempt(lambda: self.tree.pages_freed_by_prune([node]))



TestTreeOperationsWithBadArguments = TreeOperationsWithBadArguments.TestCase
TestTreeOperationsWithBadArguments.settings = settings(max_examples=80, stateful_step_count=20, deadline=None)
