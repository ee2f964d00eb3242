"""advance_token_trees (treedec.tree.verify_edits): a pipelined verify step's leaves cut and grown and their token
trees pending again, keeping the trees' nodes and slots, is the step the tree would reach by pruning each tree,
truncating and extending its leaf and adding a tree of the same shape (the edits the verify group made before);
bad arguments, pending tokens and a short pool are refused with nothing changed. (tests/tree/test_array_tree.py
checks it against the reference tree's own, edit after edit.)"""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import rule

from tests.tree.test_array_tree import EDIT_ERRORS, ArrayEqualsReference
from tests.tree.tree_state import snapshot
from treedec import PoolExhaustedError, TreeError
from treedec.tree import PagedKVPool, SequenceTree
from treedec.tree.reference import ReferenceSequenceTree

PARENTS = [-1, 0, 0, 1, 2, 1]   # a 6-token tree of one root, depth 3


def verify_tree(page_size: int = 4, num_pages: int = 64, requests: int = 3) -> tuple[SequenceTree, list, np.ndarray]:
    """Requests whose leaves each carry a computed 6-token tree and a computed reservation of 4 slots."""
    tree = SequenceTree(PagedKVPool(num_pages, page_size, allocate_storage=False))
    leaves = [tree.add_prompt(list(range(5 + 3 * r))) for r in range(requests)]
    tree.commit_step()
    tree.extend_computed_many(np.array(leaves, dtype=np.int64), 4)
    trees = tree.add_token_trees(leaves, PARENTS)
    tree.commit_step()
    return tree, leaves, trees


def shape(tree: SequenceTree) -> tuple:
    """What a step reads of the forest, ids and slots aside: its order's parents, node lengths and positions, the
    queries' nodes and positions, the free pages' count."""
    layout = tree.layout()
    return (layout.parent.tolist(), np.diff(layout.kv_start).tolist(), layout.node_prefix_len.tolist(),
            layout.query_node.tolist(), layout.query_position.tolist(), tree.num_pending, tree.pool.num_free_pages)


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_advance_is_prune_truncate_extend_and_add_keeping_the_trees(checked, page_size):
    cuts = np.array([0, 2, 3], dtype=np.int64)
    tree, leaves, trees = verify_tree(page_size)
    other, _, other_trees = verify_tree(page_size)
    tree_slots = tree.first_slots(trees.reshape(-1))
    slots = tree.advance_token_trees(trees if checked else trees.copy(), cuts, 5, checked=checked)
    other.prune_many(other_trees[:, 0])
    lengths = np.array([other.node_length(n) for n in leaves]) - cuts
    other.truncate_many(np.array(leaves)[cuts > 0], lengths[cuts > 0])
    other.extend_computed_many(np.array(leaves, dtype=np.int64), 5)   # (its slots: maybe the freed trees' pages)
    other.add_token_trees(leaves, PARENTS)
    assert slots.shape == (3, 5) and [tree.node_length(n) for n in leaves] == (lengths + 5).tolist()
    assert all(np.array_equal(tree.slots(n)[-5:], row) for n, row in zip(leaves, slots))
    assert shape(tree) == shape(other)
    assert np.array_equal(tree.first_slots(trees.reshape(-1)), tree_slots)   # the trees keep their nodes and slots
    assert tree.pending_tokens().tolist() == [0] * 18
    tree.check_invariants()
    tree.commit_step()
    tree.advance_token_trees(trees, np.zeros(3, dtype=np.int64), 0)   # (nothing cut or grown: pending again)
    assert tree.num_pending == 18
    tree.check_invariants()


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("cuts", [[1, 1, 1], [0, 2, 3], [4, 0, 1]])
def test_advance_equals_the_reference_trees_own(page_size, cuts):
    """The array tree's advance and the reference's (its leaves cut, their pages back in one decref, then grown by
    rounds): the same slots and pages, so the cut pages come back to the growth in the batch's order."""
    trees = []
    for make in (SequenceTree, ReferenceSequenceTree):
        tree = make(PagedKVPool(128, page_size, allocate_storage=False))
        leaves = [tree.add_prompt(list(range(5 + 3 * r))) for r in range(3)]
        tree.commit_step()
        for leaf in leaves:
            tree.extend_computed(leaf, [0] * 4)
        hung = [tree.add_token_tree(leaf, [0] * len(PARENTS), PARENTS) for leaf in leaves]
        tree.commit_step()
        trees.append((tree, leaves, tree.advance_token_trees(hung, cuts, 5)))
    (arr, arr_leaves, arr_slots), (ref, ref_leaves, ref_slots) = trees
    assert np.array_equal(arr_slots, ref_slots)
    assert [arr.slots(n).tolist() for n in arr_leaves] == [ref.slots(n).tolist() for n in ref_leaves]
    assert arr.pool.refcount.tolist() == ref.pool.refcount.tolist()
    assert arr.pool.free_pages.tolist() == ref.pool.free_pages.tolist()
    assert arr.layout().query_position.tolist() == ref.layout().query_position.tolist()


def test_an_empty_leaf_advances_without_a_cut():
    tree = SequenceTree(PagedKVPool(64, 4, allocate_storage=False))
    root = tree.add_prompt([1, 2, 3])
    tree.commit_step()
    leaf = tree.branch(root, [[]])[0]   # (a node of no tokens)
    trees = tree.add_token_trees([leaf], PARENTS)
    tree.commit_step()
    with pytest.raises(TreeError, match="leave each leaf a token"):
        tree.advance_token_trees(trees, np.array([1]), 2)
    assert tree.advance_token_trees(trees, np.array([0]), 2).shape == (1, 2) and tree.node_length(leaf) == 2
    tree.check_invariants()


def test_bad_arguments_are_refused_and_change_nothing():
    tree, leaves, trees = verify_tree()
    cuts = np.zeros(3, dtype=np.int64)
    before = snapshot(tree)
    bad = [((trees[:, :5], cuts, 1), TreeError, "whole token tree"),
           ((trees.reshape(-1), cuts, 1), ValueError, r"\[R, m\]"),
           ((np.array([trees[0], trees[0]]), cuts[:2], 1), TreeError, "distinct"),
           ((trees, cuts[:2], 1), ValueError, "one count per tree"),
           ((trees, np.array([0, 99, 0]), 1), TreeError, "leave each leaf a token"),
           ((trees, cuts, -1), ValueError, "count"),
           ((trees[:, 1:], cuts, 1), TreeError, "only child"),
           ((trees + (1 << 40), cuts, 1), TreeError, "unknown node"),
           ((trees.astype(float), cuts, 1), TypeError, "trees")]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            tree.advance_token_trees(*args)
        assert snapshot(tree) == before, args


@pytest.mark.parametrize("checked", [True, False])
def test_pending_tokens_are_refused(checked):
    tree, leaves, trees = verify_tree()
    tree.advance_token_trees(trees, np.zeros(3, dtype=np.int64), 1)   # (the trees pending: their step not run)
    before = snapshot(tree)
    with pytest.raises(TreeError, match="pending"):
        tree.advance_token_trees(trees, np.zeros(3, dtype=np.int64), 1, checked=checked)
    assert snapshot(tree) == before


def test_a_short_pool_is_refused_unless_the_cuts_free_what_it_needs():
    # page 4: the leaf holds 5 prompt tokens and 4 reserved (pages a: 4, b: 4, c: 1), its tree 2 pages
    tree, leaves, trees = verify_tree(page_size=4, num_pages=17, requests=1)
    tree.add_prompt(list(range(4 * tree.pool.num_free_pages)))   # (the rest of the pool)
    tree.commit_step()
    assert tree.pool.num_free_pages == 0
    before = snapshot(tree)
    with pytest.raises(PoolExhaustedError):   # growing 5: 3 into page c, 2 into a fresh page
        tree.advance_token_trees(trees, np.array([0]), 5)
    assert snapshot(tree) == before
    slots = tree.advance_token_trees(trees, np.array([3]), 5)   # the cut frees page c; 2 fit b, 3 its fresh page
    assert slots.shape == (1, 5) and tree.pool.num_free_pages == 0 and tree.node_length(leaves[0]) == 11
    assert np.array_equal(tree.slots(leaves[0])[-5:], slots[0])
    tree.check_invariants()


class AdvanceEqualsReference(ArrayEqualsReference):
    """The array tree == the reference tree machine (tests/tree/test_array_tree.py) with advance_token_trees among
    its edits."""

    @rule(data=st.data(), count=st.integers(0, 5))
    def advance_token_trees(self, data, count):
        """advance_token_trees == the reference's own (each leaf truncated, extended by rounds, its tree pending
        again) for leaves whose one child's subtree is a tree of one-token nodes; refusals (a cut that leaves no
        token, pending tokens, a short pool) change nothing."""
        ref = self.ref
        leaves = self._leaves()
        if leaves and data.draw(st.booleans()):   # trees of one root hung and computed first, as a verify group's
            m = data.draw(st.integers(1, 5))
            parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, m)]
            hung = data.draw(st.lists(st.sampled_from(leaves), unique=True, min_size=1, max_size=4))
            try:
                ids = self.arr.add_token_trees([self.to_arr[n] for n in hung], parents)
            except EDIT_ERRORS:
                return
            self._pair([i for n in hung for i in ref.add_token_tree(n, [0] * m, parents)], ids.reshape(-1).tolist())
            self.commit()
        elif data.draw(st.booleans()):
            self.commit()
        by_size: dict[int, list] = {}
        for n in self._nodes():
            kids = ref.children(n)
            below = ref.subtree(kids[0]) if len(kids) == 1 else ()
            if below and all(ref.node_length(i) == 1 for i in below):
                by_size.setdefault(len(below), []).append((n, below))
        if not by_size:
            return
        picked = data.draw(st.lists(st.sampled_from(by_size[data.draw(st.sampled_from(sorted(by_size)))]),
                                    min_size=1, max_size=4, unique_by=lambda pair: pair[0]))
        cuts = [data.draw(st.integers(0, max(0, ref.node_length(leaf) - (data.draw(st.integers(0, 9)) > 0))))
                for leaf, _ in picked]   # (now and then its length: refused)
        before = snapshot(self.arr)
        try:
            slots = self.arr.advance_token_trees([[self.to_arr[i] for i in below] for _, below in picked], cuts, count)
        except EDIT_ERRORS:
            assert snapshot(self.arr) == before
            pending = any(ref.sequence_length(i) > ref.computed_length(i) for leaf, below in picked
                          for i in (leaf, *below))
            short = not pending and all(c < ref.node_length(leaf) or not c for (leaf, _), c in zip(picked, cuts))
            assert pending or short or any(c and c >= ref.node_length(leaf) for (leaf, _), c in zip(picked, cuts))
            return
        assert np.array_equal(ref.advance_token_trees([below for _, below in picked], cuts, count), slots)


TestAdvanceEqualsReference = AdvanceEqualsReference.TestCase
TestAdvanceEqualsReference.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


@pytest.mark.slow
def test_advance_equals_reference_long_runs():
    """The same machine, more and longer runs (they found a zero-token leaf refused and a cut page's order)."""
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(AdvanceEqualsReference, settings=settings(max_examples=400, stateful_step_count=80,
                                                                        deadline=None))
