"""The array SequenceTree's batch operations (treedec.tree.lane_edits, prune_many) on examples: what they do,
what they refuse (changing nothing), and the node ids of reused rows. (That each equals its per-node
equivalent on the reference tree over random edit sequences: test_array_tree.py.)"""
import numpy as np
import pytest

from tests.tree.test_sequence_tree import make_tree
from tests.tree.tree_state import snapshot
from treedec import PoolExhaustedError, TreeError
from treedec.tree import PagedKVPool, PendingQueries, SequenceTree
from treedec.tree.reference import ReferenceSequenceTree


def decoding_forest(page_size=4, num_pages=64, requests=3):
    """``requests`` committed prompts of 5 tokens, each with two committed one-token leaves."""
    tree = make_tree(num_pages=num_pages, page_size=page_size)
    leaves = []
    for r in range(requests):
        root = tree.add_prompt(range(10 * r, 10 * r + 5))
        leaves += tree.branch(root, [[100 + r], [200 + r]])
    tree.commit_step()
    return tree, leaves


def test_append_tokens_fills_each_last_page_then_takes_one_fresh_page_per_full_leaf():
    tree, leaves = decoding_forest(page_size=2)
    assert tree.pages_to_append(leaves) == 0            # each leaf has 1 token in a 2-slot page
    free = tree.pool.num_free_pages
    slots = tree.append_tokens(leaves, [1, 2, 3, 4, 5, 6])
    assert slots.tolist() == [int(tree.slots(n)[0]) + 1 for n in leaves] and tree.pool.num_free_pages == free
    assert tree.pages_to_append(leaves) == 6 and tree.num_pending == 6
    slots = tree.append_tokens(np.array(leaves), None)   # placeholders, as a pipelined step appends
    assert tree.pool.num_free_pages == free - 6 and all(s % 2 == 0 for s in slots.tolist())
    assert [tree.tokens(n) for n in leaves[:2]] == [[100, 1, 0], [200, 2, 0]]
    tree.set_last_tokens(leaves, [7, 8, 9, 10, 11, 12])
    assert [tree.tokens(n)[-1] for n in leaves] == [7, 8, 9, 10, 11, 12]
    q = tree.pending_queries()
    assert isinstance(q, PendingQueries) and len(q) == 12
    layout = tree.layout()
    assert q.slots.tolist() == layout.query_slot.tolist() and q.positions.tolist() == layout.query_position.tolist()
    assert q.tokens.tolist() == tree.pending_tokens().tolist() and q.nodes.tolist() == tree.layout().node_ids[
        layout.query_node].tolist()
    assert q.positions.tolist()[:2] == [6, 7]           # 5 prompt tokens, the leaf's first, then these two
    with pytest.raises(ValueError, match="read-only"):
        q.slots[0] = 0
    tree.check_invariants()


def test_append_tokens_equals_extend_many_of_one_token_each():
    a, leaves = decoding_forest(page_size=3)
    b, _ = decoding_forest(page_size=3)
    for step in range(7):
        tokens = list(range(step, step + len(leaves)))
        slots = a.append_tokens(leaves, tokens)
        by_node = b.extend_many({n: [t] for n, t in zip(leaves, tokens)})
        assert slots.tolist() == [int(s[0]) for s in by_node.values()]
        assert a.layout().kv_slots.tolist() == b.layout().kv_slots.tolist()
        a.commit_step()
        b.commit_step()
    assert snapshot(a) == snapshot(b)


@pytest.mark.parametrize("call, error, match", [
    (lambda t, r, ls: t.append_tokens([ls[0], ls[0]], [1, 2]), TreeError, r"distinct, got node\(s\) \[\d+, \d+\]"),
    (lambda t, r, ls: t.append_tokens([ls[0], r], [1, 2]), TreeError, r"cannot extend node 0: it has children"),
    (lambda t, r, ls: t.append_tokens([ls[0], 999], [1, 2]), TreeError, r"unknown node id\(s\) \[999\]"),
    (lambda t, r, ls: t.append_tokens(ls, [1]), ValueError, r"tokens must hold one token per node \(6\), got 1"),
    (lambda t, r, ls: t.append_tokens(ls, [1, 2, 3, 4, 5, -6]), ValueError, r"tokens\[5\] = -6"),
    (lambda t, r, ls: t.append_tokens([1.5], [1]), TypeError, r"node_ids\[0\] must be an integer"),
    (lambda t, r, ls: t.append_tokens(ls, ["a"] * 6), TypeError, r"tokens\[0\] must be an integer"),
    (lambda t, r, ls: t.pages_to_append([ls[0], r]), TreeError, "only leaves grow"),
    (lambda t, r, ls: t.set_last_tokens([ls[0], 999], [1, 2]), TreeError, r"unknown node id\(s\) \[999\]"),
    (lambda t, r, ls: t.set_last_tokens([ls[0]], None), TypeError, "tokens must be a sequence"),
    (lambda t, r, ls: t.set_last_tokens([ls[1], ls[1]], [1, 2]), TreeError, "distinct"),
    (lambda t, r, ls: t.set_last_tokens(t.branch(r, 1), [1]), TreeError, r"hold no tokens"),
    (lambda t, r, ls: t.prune_many([ls[0], r]), TreeError, r"in the subtree of another node"),
    (lambda t, r, ls: t.prune_many([ls[0], ls[0]]), TreeError, "named twice"),
    (lambda t, r, ls: t.prune_many([ls[0], 999]), TreeError, r"unknown node id\(s\) \[999\]"),
])
def test_bad_batch_operations_raise_and_change_nothing(call, error, match):
    tree, leaves = decoding_forest()
    root = tree.roots[0]
    if "hold no tokens" in match:
        tree.commit_step()
    before = snapshot(tree)
    with pytest.raises(error, match=match):
        call(tree, root, leaves)
    if "hold no tokens" not in match:   # (that case's branch made a child first)
        assert snapshot(tree) == before
    tree.check_invariants()


def test_append_tokens_on_a_full_pool_raises_and_changes_nothing():
    tree, leaves = decoding_forest(page_size=1, num_pages=15, requests=2)   # 14 pages held, 1 free
    before = snapshot(tree)
    with pytest.raises(PoolExhaustedError, match="needs 4 page"):
        tree.append_tokens(leaves, [1, 2, 3, 4])
    assert snapshot(tree) == before
    tree.append_tokens(leaves[:1], [1])
    assert tree.pool.num_free_pages == 0


def test_prune_many_removes_every_subtree_at_once():
    tree, leaves = decoding_forest(page_size=2)
    roots = tree.roots
    tree.append_tokens(leaves, range(6))
    with pytest.raises(TreeError, match="pending tokens"):
        tree.prune_many([roots[0]])
    tree.commit_step()
    doomed = tree.subtree(roots[1]) + [leaves[0]]
    expected = sorted({int(p) for n in doomed for p in tree.slots(n) // 2})
    freed = tree.prune_many(np.array([roots[1], leaves[0]]))   # a whole request, and one leaf of another
    assert freed.tolist() == expected
    assert tree.roots == [roots[0], roots[2]] and tree.children(roots[0]) == [leaves[1]]
    assert roots[1] not in tree and leaves[2] not in tree and len(tree.prune_many([])) == 0
    tree.check_invariants()


def test_a_pruned_nodes_id_stays_unknown_when_its_row_is_reused():
    """Node ids name a row and its generation: a new node in a freed row has a new id, the old one is refused."""
    tree = make_tree()
    root = tree.add_prompt([1, 2])
    (a,) = tree.branch(root, [[3]])
    tree.commit_step()
    tree.prune(a)
    (b,) = tree.branch(root, [[4]])          # takes a's row
    assert b != a and a not in tree and b in tree and tree.children(root) == [b]
    for call in (lambda: tree.tokens(a), lambda: tree.append_tokens([a], [1]), lambda: tree.first_slots([a])):
        with pytest.raises(TreeError, match="unknown node id"):
            call()
    assert tree.tokens(b) == [4]
    tree.check_invariants()


def test_a_layout_after_appends_grows_from_the_last_one():
    """After appends only, the layout's slots are the last layout's with the new slots inserted (no gather);
    they equal a layout gathered from scratch, and the last layout (a snapshot) does not change."""
    tree, leaves = decoding_forest(page_size=4)
    tree._cache.few_tokens = 0   # (a forest this small would be gathered)
    old = tree.layout()
    old_slots = old.kv_slots.copy()
    tree.append_tokens(leaves[::2], [1, 2, 3])
    tree.extend(leaves[1], [4, 5])
    grown = tree.layout()
    tree._cache.forget_slots()
    tree._layout = None
    gathered = tree.layout()
    for name in ("node_ids", "parent", "kv_start", "kv_slots", "query_node", "query_offset", "node_prefix_len"):
        assert np.array_equal(getattr(grown, name), getattr(gathered, name)), name
    assert np.array_equal(old.kv_slots, old_slots) and grown.num_tokens == old.num_tokens + 5


def test_a_layout_after_any_edits_is_made_from_the_last_one():
    """After branches, token trees, accepts, prunes and appends, the layout made from the last one (its
    surviving nodes' slots kept, the new ones put in place) equals one gathered from scratch."""
    tree, leaves = decoding_forest(page_size=4)
    tree._cache.few_tokens = 0

    def made_is_gathered():
        made = tree.layout()
        tree._cache.forget_slots()
        tree._layout = None
        gathered = tree.layout()
        for name in ("node_ids", "parent", "kv_start", "kv_slots", "query_node", "query_offset", "node_prefix_len"):
            assert np.array_equal(getattr(made, name), getattr(gathered, name)), name

    roots = tree.roots
    tree.layout()
    ids = tree.add_token_tree(leaves[0], [1, 2, 3], [-1, 0, 0])
    tree.append_tokens(leaves[1:], range(5))
    kids = tree.branch(roots[2], [[7, 8], []])
    made_is_gathered()
    tree.commit_step()
    tree.accept(leaves[0], ids[:2])
    tree.prune_many([leaves[3], kids[1]])
    tree.add_prompt([5, 6, 7])
    made_is_gathered()
    tree.check_invariants()


def test_extend_many_of_many_leaves_equals_the_reference():
    """extend_many of one token to many leaves (a decode step through the old API: one array append) equals the
    object tree's, step after step, pages and slots included."""
    trees = [SequenceTree(PagedKVPool(256, 4, allocate_storage=False)),
             ReferenceSequenceTree(PagedKVPool(256, 4, allocate_storage=False))]
    for tree in trees:
        root = tree.add_prompt(range(5))
        leaves = tree.branch(root, [[1]] * 3 + [[]] * 17)
        tree.commit_step()
        for step in range(6):
            out = tree.extend_many({n: [step * 100 + i] for i, n in enumerate(leaves)})
            assert list(out) == leaves and all(len(s) == 1 for s in out.values())
            tree.commit_step()
    assert snapshot(trees[0])[0] == snapshot(trees[1])[0]
