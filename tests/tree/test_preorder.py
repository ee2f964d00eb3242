"""The depth-first order a SequenceTree keeps up to date edit by edit (treedec.tree.preorder), and the fast
paths of the speculative edits: after any sequence of edits the kept order and the layout equal ones built
from scratch; Preorder's own updates; a token tree's checked shape reused without loosening a check."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import invariant, precondition, rule

from tests.tree.test_sequence_tree import make_tree
from tests.tree.tree_state import fresh_layout, node_ids, snapshot
from tests.trees import ConsistentTreeMachine
from treedec import PoolExhaustedError, TreeError
from treedec.tree import TreeLayout
from treedec.tree.preorder import Preorder
from treedec.tree.token_tree_edits import KNOWN_SHAPES


def assert_same_layout(a: TreeLayout, b: TreeLayout):
    for name in ("node_ids", "parent", "kv_start", "kv_slots", "query_node", "query_offset"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), f"{name}: {getattr(a, name)} != {getattr(b, name)}"
        assert getattr(a, name).dtype == np.int64


SHAPES = [[-1, 0, 0, 1, -1, 4], [-1, -1, 0, 1, 1], [-1], [-1, 0, 1, 2]]   # repeated: the kept shapes serve


class KeptOrderMachine(ConsistentTreeMachine):
    """Every edit of a speculative or search step, in random order, with the preorder kept from the start:
    check_invariants compares it with a fresh walk after each step, and the layout matches a fresh build."""

    def __init__(self):
        super().__init__()
        self.tree = make_tree(num_pages=64, page_size=3)
        self.tree.add_prompt([1, 2, 3, 4])
        self.tree.layout()   # from here on the edits keep the order

    def _pick(self, data, nodes, what="node"):
        return data.draw(st.sampled_from(sorted(nodes)), label=what)

    @invariant()
    def layout_is_fresh(self):
        assert_same_layout(self.tree.layout(), fresh_layout(self.tree))

    @rule(n=st.integers(1, 8))
    def add_prompt(self, n):
        try:
            self.tree.add_prompt(range(n))
        except PoolExhaustedError:
            pass

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data())
    def extend_many(self, data):
        leaves = [i for i in node_ids(self.tree) if not self.tree.children(i)]
        grow = data.draw(st.dictionaries(st.sampled_from(sorted(leaves)), st.lists(st.integers(0, 9), max_size=4),
                                         max_size=4))
        try:
            self.tree.extend_many(grow)
        except PoolExhaustedError:
            pass

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data(), sizes=st.lists(st.integers(0, 4), min_size=1, max_size=3))
    def branch(self, data, sizes):
        try:
            self.tree.branch(self._pick(data, node_ids(self.tree)), [range(s) for s in sizes])
        except PoolExhaustedError:
            pass

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data())
    def add_token_tree(self, data):
        node = self._pick(data, node_ids(self.tree))
        parents = data.draw(st.one_of(st.sampled_from(SHAPES),
                                      st.integers(1, 7).flatmap(lambda m: st.tuples(*[st.integers(-1, i - 1)
                                                                                       for i in range(m)]))))
        try:
            self.tree.add_token_tree(node, list(range(len(parents))), list(parents))
        except PoolExhaustedError:
            pass

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data())
    def add_children(self, data):
        anchors = data.draw(st.lists(st.sampled_from(sorted(node_ids(self.tree))), min_size=1, max_size=6))
        try:
            self.tree.add_children(anchors, list(range(len(anchors))))
        except PoolExhaustedError:
            pass

    @rule()
    def commit(self):
        self.tree.commit_step()

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data())
    def accept(self, data):
        anchor = self._pick(data, node_ids(self.tree), "anchor")
        path, node = [], anchor
        while self.tree.children(node) and data.draw(st.booleans(), label="deeper"):
            node = data.draw(st.sampled_from(self.tree.children(node)))
            path.append(node)
        before = snapshot(self.tree)
        try:
            self.tree.accept(anchor, path)
        except (TreeError, PoolExhaustedError) as e:   # pending tokens below the anchor, or no room
            assert "pending" in str(e) or "exhausted" in str(e), e
            assert snapshot(self.tree) == before
            return
        assert self.tree.children(anchor) == []

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data())
    def prune(self, data):
        node = self._pick(data, node_ids(self.tree))
        if any(self.tree.sequence_length(i) > self.tree.computed_length(i) for i in self.tree.subtree(node)):
            self.tree.commit_step()
        self.tree.prune(node)

    @precondition(lambda self: any(self.tree.node_length(i) and not self.tree.children(i)
                                   for i in node_ids(self.tree)))
    @rule(data=st.data())
    def truncate(self, data):
        self.tree.commit_step()
        leaf = self._pick(data, [i for i in node_ids(self.tree) if self.tree.node_length(i)
                                 and not self.tree.children(i)], "leaf")
        self.tree.truncate(leaf, data.draw(st.integers(1, self.tree.node_length(leaf))))


TestKeptOrder = KeptOrderMachine.TestCase
TestKeptOrder.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_preorder_insert_and_cut():
    #   0 -> (1 -> 2), 3 ; 4
    order = Preorder(np.array([10, 11, 12, 13, 14]), np.array([-1, 0, 1, 0, -1]))
    # a child of 12 (it ends 12's and 11's subtree, before 13); two of 13 and a grandchild; a new root
    grown = order.insert(at=np.array([3, 4, 4, 4, 5]), ids=np.array([20, 21, 22, 23, 24]),
                         old_parent=np.array([2, 3, -1, 3, -1]), new_parent=np.array([-1, -1, 1, -1, -1]))
    assert grown.ids.tolist() == [10, 11, 12, 20, 13, 21, 22, 23, 14, 24]
    assert grown.parent.tolist() == [-1, 0, 1, 2, 0, 4, 5, 4, -1, -1]
    assert grown == Preorder.build([10, 14, 24], {10: [11, 13], 11: [12], 12: [20], 13: [21, 23], 14: [], 20: [],
                                                  21: [22], 22: [], 23: [], 24: []})
    assert [grown.subtree_end(i) for i in range(10)] == [8, 4, 4, 4, 8, 7, 7, 8, 9, 10]
    assert grown.subtree_ends(np.array([4, 0, 9])).tolist() == [8, 8, 10]
    assert grown.positions(np.array([23, 10, 23])).tolist() == [7, 0, 7] and grown.position(24) == 9
    spliced = order.splice(3, np.array([30, 31]), np.array([2, 3]))   # a chain under 12, before 13
    assert spliced.ids.tolist() == [10, 11, 12, 30, 31, 13, 14] and spliced.parent.tolist() == [-1, 0, 1, 2, 3, 0, -1]
    assert order.insert(np.array([3, 3]), np.array([30, 31]), np.array([2, -1]), np.array([-1, 0])) == spliced
    cut = grown.cut(4, 8)   # node 13's subtree
    assert cut.ids.tolist() == [10, 11, 12, 20, 14, 24] and cut.parent.tolist() == [-1, 0, 1, 2, -1, -1]
    with pytest.raises(ValueError, match="read-only"):
        cut.parent[0] = 3   # layouts share these arrays


def test_add_children_under_nested_anchors_keeps_depth_first_order():
    """Children of a node and of its last descendant go to the same place: the descendant's come first."""
    tree = make_tree(page_size=4)
    root = tree.add_prompt([1, 2])
    (a,) = tree.branch(root, [[3]])
    (b,) = tree.branch(a, [[4]])
    tree.layout()
    ids = tree.add_children([root, b, a, b, root], [5, 6, 7, 8, 9])
    assert tree.layout().node_ids.tolist() == [root, a, b, ids[1], ids[3], ids[2], ids[0], ids[4]]
    assert_same_layout(tree.layout(), fresh_layout(tree))
    tree.check_invariants()


def test_a_token_tree_shape_is_checked_once_and_never_loosens_a_check():
    tree = make_tree(num_pages=64, page_size=4)
    root = tree.add_prompt([1, 2, 3])
    tree.layout()
    shape = [-1, 0, 0, 1]
    first = tree.add_token_tree(root, [5, 6, 7, 8], shape)
    again = tree.add_token_tree(root, [5, 6, 7, 8], list(shape))   # the kept order serves
    assert [tree.parent(i) for i in again] == [root, again[0], again[0], again[1]] and again[0] == first[-1] + 1
    before = snapshot(tree)
    for bad, match in [([-1, 0, 0, 4], "not a token index"), ([-1, 0, 3, 1], "forward reference"),
                       ([-1, 0, 0], "one parent per token")]:
        with pytest.raises(TreeError, match=match):
            tree.add_token_tree(root, [5, 6, 7, 8], bad)
        assert snapshot(tree) == before
    for m in range(1, KNOWN_SHAPES + 3):   # more shapes than are kept: the oldest make way
        tree.add_token_tree(root, list(range(m)), [-1] + list(range(m - 1)))
    assert len(tree._token_trees) == KNOWN_SHAPES
    assert_same_layout(tree.layout(), fresh_layout(tree))
    tree.check_invariants()


def test_check_invariants_names_a_stale_kept_order():
    tree = make_tree()
    root = tree.add_prompt([1, 2])
    a, b = tree.branch(root, [[3], [4]])
    tree.layout()
    tree._order = Preorder(np.array([root, b, a]), np.array([-1, 0, 0]))
    with pytest.raises(RuntimeError, match=r"the kept preorder \(ids \[0, 2, 1\].*is not the tree's \(ids \[0, 1, 2\]"):
        tree.check_invariants()
