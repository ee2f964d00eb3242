"""SequenceTree.release_outside_window: the pages it frees are exactly those no future query can read through
the window (a reference computed token by token from positions), refcounts stay exact, truncations that would
read released K/V are refused and change nothing, and pruning a node that released pages leaks none."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treedec.errors import TreeError
from treedec.tree import PagedKVPool, SequenceTree


def held_reference(tree: SequenceTree, window: int, margin: int, released: dict) -> set:
    """The pages some node must still hold: per node, every page of its tokens from the first run that a query
    at or after its committed end may read (within ``margin`` more tokens), kept from earlier calls' cuts."""
    ps, pages = tree.pool.page_size, set()
    t = tree._table
    for row in t.live_rows().tolist():
        node = t.node_id.item(row)
        length, pending = t.length.item(row), t.pending.item(row)
        page_of = t.slots[t.start.item(row):t.start.item(row) + length] // ps
        visible = min(max(length - pending - window + 1 - margin, 0), length - 1)
        cut = visible
        while cut > 0 and page_of[cut - 1] == page_of[visible]:   # the run of the first visible token stays
            cut -= 1
        cut = max(cut, released.get(node, 0))
        released[node] = cut
        pages |= set(page_of[cut:].tolist())
    return pages


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), window=st.integers(1, 20), margin=st.sampled_from([0, 4]),
       page_size=st.sampled_from([1, 4, 8]))
def test_release_frees_exactly_what_no_query_reads(seed, window, margin, page_size):
    rng = np.random.default_rng(seed)
    tree = SequenceTree(PagedKVPool(400, page_size, allocate_storage=False))
    tree.commit_step()
    released: dict = {}
    for _ in range(2):
        tree.add_prompt(rng.integers(0, 50, int(rng.integers(1, 30))).tolist())
    for _ in range(25):
        leaves = tree.live_leaves()
        op = rng.integers(0, 4)
        if op == 0 and len(leaves) < 8:   # branch a leaf or an inner node
            nodes = leaves + [tree.parent(n) for n in leaves if tree.parent(n) is not None]
            tree.branch(int(rng.choice(nodes)), [rng.integers(0, 50, int(rng.integers(1, 5))).tolist()
                                                 for _ in range(int(rng.integers(1, 3)))])
        elif op == 1 and len(leaves) > 2:
            tree.commit_step()
            tree.prune(int(rng.choice(leaves)))
        else:
            tree.extend_many({n: rng.integers(0, 50, int(rng.integers(1, 6))).tolist() for n in leaves})
        if rng.random() < 0.5:
            tree.commit_step()
        before = set(np.flatnonzero(tree.pool.refcount > 0).tolist())
        freed = tree.release_outside_window(window, margin)
        expected = held_reference(tree, window, margin, released)
        in_use = set(np.flatnonzero(tree.pool.refcount > 0).tolist())
        assert in_use == expected, (sorted(in_use ^ expected), window, margin)
        assert set(freed.tolist()) == before - in_use
        tree.check_invariants()
    tree.commit_step()
    for root in tree.roots:
        tree.prune(root)
    assert tree.pool.num_free_pages == tree.pool.num_pages   # nothing leaked


def test_shared_prefix_page_stays_while_a_branch_can_read_it():
    tree = SequenceTree(PagedKVPool(64, 4, allocate_storage=False))
    root = tree.add_prompt(list(range(10)))            # pages 0-2 (positions 0..9)
    a, b = tree.branch(root, [[1], [2]])
    tree.commit_step()
    for _ in range(8):
        tree.extend_many({a: [3]})                     # a grows; b stays at position 10
        tree.commit_step()
    tree.release_outside_window(4)
    # root's end is position 10: it keeps the run of position 7 on; b's one token is read by b's future queries
    assert tree._table.released[tree._row(root)] == 4 and tree.held_prefix(a) == 0
    tree.check_invariants()
    assert tree.held_prefix(root) == 0


def test_truncation_into_released_tokens_is_refused_and_changes_nothing():
    tree = SequenceTree(PagedKVPool(64, 4, allocate_storage=False))
    node = tree.add_prompt(list(range(30)))
    tree.commit_step()
    tree.release_outside_window(6)
    row = tree._row(node)
    released, refcount = tree._table.released[row], tree.pool.refcount.copy()
    assert released > 0
    with pytest.raises(TreeError, match="released"):
        tree.truncate(node, 12)
    with pytest.raises(TreeError, match="released"):
        tree.truncate_many([node], [12])
    assert tree._table.released[row] == released and np.array_equal(tree.pool.refcount, refcount)
    assert tree.node_length(node) == 30
    tree.truncate(node, 29)                             # its window (tokens 24..28) still clear of the released
    tree.check_invariants()
    with pytest.raises(ValueError, match="window"):
        tree.release_outside_window(7)


def test_one_token_window_keeps_the_last_page():
    tree = SequenceTree(PagedKVPool(64, 4, allocate_storage=False))
    node = tree.add_prompt(list(range(9)))
    tree.commit_step()
    assert tree.release_outside_window(1).tolist() == [0, 1]
    assert tree.node_length(node) == 9 and tree._table.released[tree._row(node)] == 8
    tree.check_invariants()
