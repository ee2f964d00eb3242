import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import precondition, rule

from treedec import PoolExhaustedError, TreeError
from treedec.tree import PagedKVPool, SequenceTree
from tests.tree.tree_state import node_ids, snapshot
from tests.trees import ConsistentTreeMachine


def make_tree(num_pages=64, page_size=4):
    return SequenceTree(PagedKVPool(num_pages, page_size, allocate_storage=False))


def test_prompt_extend_fills_tail_page_first():
    tree = make_tree(page_size=4)
    root = tree.add_prompt([1, 2, 3, 4, 5])
    assert tree.slots(root).tolist() == [0, 1, 2, 3, 4]
    slots = tree.extend(root, [6, 7, 8, 9])
    assert slots.tolist() == [5, 6, 7, 8]  # 3 slots of page 1's tail, then a fresh page
    assert tree.sequence(root) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    tree.check_invariants()


def test_children_never_write_into_parent_pages():
    tree = make_tree(page_size=4)
    root = tree.add_prompt([1, 2, 3])                 # page 0, one slot free
    a, b = tree.branch(root, [[4], [5, 6]])
    for child in (a, b):
        assert not set(tree.slots(child) // 4) & set(tree.slots(root) // 4)
    assert tree.sequence(b) == [1, 2, 3, 5, 6]
    assert [tree.sequence_length(n) for n in (root, b)] == [len(tree.sequence(root)), 5]
    tree.check_invariants()


def test_pending_tokens_are_the_step_queries():
    tree = make_tree()
    root = tree.add_prompt([1, 2, 3])
    tree.commit_step()
    a, b = tree.branch(root, 2)
    tree.extend_many({a: [10], b: [20, 21]})
    layout = tree.layout()
    assert tree.pending_tokens().tolist() == [10, 20, 21]
    assert layout.query_position.tolist() == [3, 3, 4]
    assert layout.query_slot.tolist() == tree.pending_slots().tolist()
    tree.commit_step()
    assert tree.layout().num_queries == 0


def test_token_tree_packs_pages_and_prune_frees_them():
    tree = make_tree(page_size=4)
    root = tree.add_prompt([1] * 4)
    tree.commit_step()
    ids = tree.add_token_tree(root, [5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, -1, 4])
    assert tree.parent(ids[3]) == ids[1] and tree.parent(ids[4]) == root
    slots = np.concatenate([tree.slots(i) for i in ids])
    assert len(set((slots // 4).tolist())) == 2          # 6 tokens in 2 shared pages
    tree.check_invariants()
    free_before = tree.pool.num_free_pages
    tree.commit_step()
    assert len(tree.prune(ids[3])) == 0                   # its page still holds tokens 0-2
    assert len(tree.prune(ids[0])) == 1                   # tokens 0-2: the first page is free
    assert len(tree.prune(ids[4])) == 1                   # tokens 4, 5: the second page
    assert tree.pool.num_free_pages == free_before + 2
    tree.check_invariants()


def test_add_children_hangs_one_token_under_each_node_in_shared_pages():
    tree = make_tree(page_size=4)
    root = tree.add_prompt([1] * 4)
    a, b = tree.add_token_tree(root, [5, 6], [-1, -1])
    tree.commit_step()
    ids = tree.add_children([a, b, a, root, b], [7, 8, 9, 10, 11])
    assert [tree.parent(i) for i in ids] == [a, b, a, root, b] and tree.children(a) == [ids[0], ids[2]]
    assert tree.num_pending == 5 and [tree.tokens(i) for i in ids] == [[7], [8], [9], [10], [11]]
    assert len({int(tree.slots(i)[0]) // 4 for i in ids}) == 2     # 5 tokens in 2 shared pages
    tree.check_invariants()


def test_live_leaves_skip_paused():
    tree = make_tree()
    root = tree.add_prompt([1])
    a, b, c = tree.branch(root, 3)
    tree.pause(b)
    assert tree.live_leaves() == [a, c]
    tree.resume(b)
    assert tree.live_leaves() == [a, b, c]


@pytest.mark.parametrize("op,match", [
    (lambda t, r: t.extend(99, [1]), "unknown node id 99"),
    (lambda t, r: t.extend(r, [1]), "only leaves grow"),
    (lambda t, r: t.branch(r, 0), r"1 <= k <= 64 \(the pool's pages\) children, got k=0"),
    (lambda t, r: t.branch(r, 10**12), "got k=1000000000000"),   # used to make 10**12 empty nodes
    (lambda t, r: t.branch(r, []), "at least one child"),
    (lambda t, r: t.add_prompt([]), "at least one token"),
    (lambda t, r: t.add_token_tree(r, [1, 2], [1, 0]), "cycle"),
    (lambda t, r: t.add_token_tree(r, [1, 2, 3], [-1, 2, -1]), "forward reference"),
    (lambda t, r: t.add_token_tree(r, [1, 2], [-1]), "one parent per token"),
    (lambda t, r: t.add_token_tree(r, [1, 2], [-1, 2]), r"parents\[1\] = 2 is not a token index in \[-1, 2\)"),
    (lambda t, r: t.prune(t.children(r)[0]), "pending tokens"),
    (lambda t, r: t.add_children([r, 99], [1, 2]), "unknown node id 99"),
    (lambda t, r: t.add_children([r], [1, 2]), "one node per token"),
])
def test_bad_operations_raise_and_change_nothing(op, match):
    tree = make_tree()
    root = tree.add_prompt([1, 2, 3])
    tree.commit_step()
    tree.branch(root, [[4]])
    before = snapshot(tree)
    with pytest.raises(TreeError, match=match):
        op(tree, root)
    assert snapshot(tree) == before


def test_prune_twice_is_an_unknown_node():
    tree = make_tree()
    root = tree.add_prompt([1])
    (a,) = tree.branch(root, [[2]])
    tree.commit_step()
    tree.prune(a)
    before = snapshot(tree)
    with pytest.raises(TreeError, match=f"unknown node id {a}"):
        tree.prune(a)
    assert snapshot(tree) == before


@pytest.mark.parametrize("op", [
    lambda t, r, a: t.add_prompt(range(40)),
    lambda t, r, a: t.extend(a, range(40)),
    lambda t, r, a: t.branch(r, [range(20), range(20)]),
    lambda t, r, a: t.add_token_tree(a, range(30), [-1] * 30),
])
def test_exhausted_pool_raises_and_changes_nothing(op):
    tree = make_tree(num_pages=8, page_size=4)  # 32 slots
    root = tree.add_prompt(range(6))
    (a,) = tree.branch(root, [[1]])
    tree.commit_step()
    before = snapshot(tree)
    with pytest.raises(PoolExhaustedError, match="exhausted"):
        op(tree, root, a)
    assert snapshot(tree) == before


def test_pages_to_extend_and_freed_by_prune():
    tree = make_tree(num_pages=16, page_size=4)
    root = tree.add_prompt(range(6))                 # 2 pages, 2 free slots in the second
    a, b = tree.branch(root, [[1], [2, 3, 4, 5, 6]])
    tree.commit_step()
    assert tree.pages_to_extend(a, 3) == 0 and tree.pages_to_extend(a, 4) == 1
    assert tree.pages_to_extend(b, 3) == 0 and tree.pages_to_extend(b, 4) == 1
    tree.add_token_tree(a, [7, 8, 9], [-1, 0, 0])    # one packed page, held by 3 nodes
    tree.commit_step()
    (x, y, z) = tree.children(a)[0], *tree.children(tree.children(a)[0])
    free = tree.pool.num_free_pages
    assert tree.pages_freed_by_prune([y]) == 0                 # the packed page is still held by x and z
    assert tree.pages_freed_by_prune([y, z]) == 0              # ... and by x alone
    assert tree.pages_freed_by_prune([x]) == 1 and tree.pages_freed_by_prune([a]) == 2
    assert tree.pages_freed_by_prune([a, b]) == 4 and tree.pages_freed_by_prune([root]) == 6
    assert tree.pool.num_free_pages == free                    # nothing changed
    with pytest.raises(TreeError, match="unknown node id 99"):
        tree.pages_freed_by_prune([99])


def dead_end_tree():
    """root - a - b - {c - d, e}: c leads only to d; b has two children."""
    tree = make_tree(num_pages=32, page_size=4)
    root = tree.add_prompt([1, 2])
    (a,) = tree.branch(root, [[3]])
    (b,) = tree.branch(a, [[4]])
    c, e = tree.branch(b, [[5], [6]])
    (d,) = tree.branch(c, [[7]])
    tree.commit_step()
    return tree, root, a, b, c, d, e


def test_subtree_is_the_node_and_its_descendants_in_preorder():
    tree, root, a, b, c, d, e = dead_end_tree()
    assert tree.subtree(root) == [root, a, b, c, d, e]
    assert tree.subtree(c) == [c, d] and tree.subtree(e) == [e] and tree.subtree(np.int64(b)) == [b, c, d, e]
    other = tree.add_prompt([9])
    assert tree.subtree(other) == [other] and tree.subtree(root) == [root, a, b, c, d, e]


def test_prune_dead_end_cuts_the_branch_at_its_highest_lone_ancestor():
    tree, root, a, b, c, d, e = dead_end_tree()
    free = tree.pool.num_free_pages
    assert tree.prune_dead_end(d, root) == c            # c led only to d; b keeps e
    assert c not in tree and d not in tree and tree.children(b) == [e]
    assert tree.pool.num_free_pages == free + 2
    assert tree.prune_dead_end(e, root) == a            # now b, a lead only to e
    assert tree.subtree(root) == [root] and tree.pool.num_free_pages == tree.pool.num_pages - 1
    tree.check_invariants()
    tree, root, a, b, c, d, e = dead_end_tree()
    assert tree.prune_dead_end(c, b) == c               # a node with children goes with them
    assert tree.prune_dead_end(e, b) == e               # the root's own child: only it
    assert tree.prune_dead_end(b, a) == b and tree.subtree(root) == [root, a]
    tree.check_invariants()


@pytest.mark.parametrize("leaf, root, error, match", [
    ("d", "d", TreeError, "is not a proper ancestor"),
    ("e", "c", TreeError, "is not a proper ancestor"),
    ("a", "d", TreeError, "is not a proper ancestor"),
    (99, "root", TreeError, "unknown node id 99"),
    ("d", 99, TreeError, "unknown node id 99"),
    ("d", "other", TreeError, "is not a proper ancestor"),
    ("d", "x", TypeError, "node id must be an int"),
    ("pending", "root", TreeError, "pending tokens"),
])
def test_bad_prune_dead_end_raises_and_changes_nothing(leaf, root, error, match):
    tree, *nodes = dead_end_tree()
    names = dict(zip(["root", "a", "b", "c", "d", "e"], nodes), other=tree.add_prompt([9]), x="x")
    tree.commit_step()
    (names["pending"],) = tree.branch(names["e"], [[8]])
    before = snapshot(tree)
    with pytest.raises(error, match=match):
        tree.prune_dead_end(names.get(leaf, leaf), names.get(root, root))
    assert snapshot(tree) == before
    with pytest.raises(TreeError, match="unknown node id 99"):
        tree.subtree(99)


def test_extend_many_is_all_or_nothing():
    tree = make_tree(num_pages=6, page_size=4)
    root = tree.add_prompt([1])
    a, b = tree.branch(root, [[2], [3]])
    tree.commit_step()
    before = snapshot(tree)
    with pytest.raises(PoolExhaustedError):
        tree.extend_many({a: range(8), b: range(8)})   # a fits alone, both do not
    assert snapshot(tree) == before
    with pytest.raises(TreeError, match="only leaves grow"):
        tree.extend_many({a: [1], root: [1]})
    assert snapshot(tree) == before


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_accept_keeps_the_path_and_its_kv_and_frees_the_rest(page_size):
    pool = PagedKVPool(64, page_size, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    tree = SequenceTree(pool)
    root = tree.add_prompt(list(range(10)))
    tree.commit_step()
    ids = tree.add_token_tree(root, [20, 21, 22, 23, 24], [-1, 0, 1, 0, -1])   # chains 20-21-22 and 20-23, and 24
    pool.k.normal_()
    pool.v.normal_()
    tree.commit_step()   # as a verify step does
    path = [ids[0], ids[1], ids[2]]
    kv = pool.gather(np.concatenate([tree.slots(n) for n in path]))
    free_before = pool.num_free_pages
    slots = tree.accept(root, path)
    assert tree.sequence(root) == list(range(10)) + [20, 21, 22] and tree.children(root) == []
    assert tree.layout().num_queries == 0   # moved, not pending: nothing to recompute
    for a, b in zip(pool.gather(slots), kv):
        assert torch.equal(a, b)
    assert pool.num_free_pages >= free_before   # the token tree's pages went back
    tree.check_invariants()
    tree.prune(root)
    assert pool.num_free_pages == pool.num_pages


@pytest.mark.parametrize("path,error,match", [
    (lambda ids: [ids[1]], TreeError, "path must be a chain under node 0"),         # skips the first token
    (lambda ids: [ids[0], ids[2]], TreeError, "path must be a chain"),             # 22 hangs under 21, not 20
    (lambda ids: [99], TreeError, "unknown node id 99"),
    (lambda ids: [float(ids[0])], TypeError, "path"),
])
def test_bad_accepts_change_nothing(path, error, match):
    tree = make_tree(page_size=4)
    root = tree.add_prompt(list(range(10)))
    tree.commit_step()
    ids = tree.add_token_tree(root, [20, 21, 22], [-1, 0, 1])
    tree.commit_step()
    before = snapshot(tree)
    with pytest.raises(error, match=match):
        tree.accept(root, path(ids))
    assert snapshot(tree) == before


def test_accept_waits_for_the_step():
    tree = make_tree(page_size=4)
    root = tree.add_prompt(list(range(10)))
    tree.commit_step()
    ids = tree.add_token_tree(root, [20, 21], [-1, 0])   # pending: not computed yet
    before = snapshot(tree)
    with pytest.raises(TreeError, match="pending tokens"):
        tree.accept(root, ids)
    assert snapshot(tree) == before


@pytest.mark.slow
def test_checks_still_run_under_python_O():
    """The pool's and the tree's checks are exceptions, not asserts: ``python -O`` strips asserts."""
    script = """
from treedec.tree import PagedKVPool, SequenceTree
assert False, "asserts must be stripped here"
tree = SequenceTree(PagedKVPool(8, 4, allocate_storage=False))
root = tree.add_prompt([1, 2, 3])
pool = tree.pool
for call in (lambda: tree.add_prompt("123"), lambda: tree.extend(root, [2**64]),
             lambda: tree.add_token_tree(root, [1, 2], [-1, 5]), lambda: pool.decref([5]),
             lambda: pool.incref([7]), lambda: pool.decref([-1]), lambda: pool.decref([0, 0])):
    try:
        call()
        raise SystemExit("a bad argument was accepted")
    except (TypeError, ValueError):
        pass
def expect_broken(check):
    try:
        check()
        raise SystemExit(f"{check.__qualname__} missed a wrong refcount")
    except RuntimeError as e:
        print("caught:", e)
pool.refcount[0] = 3              # a live page: only the tree knows it has 1 holder
expect_broken(tree.check_invariants)
pool.refcount[0], pool.refcount[5] = 1, 1   # a free page with a holder: the pool sees it too
expect_broken(pool.check_invariants)
"""
    out = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr + out.stdout
    assert "caught: SequenceTree invariant broken: pages [0] have refcounts [3]" in out.stdout
    assert "caught: pool invariant broken: free pages [5] have refcounts [1], expected 0" in out.stdout


class TreeOperations(ConsistentTreeMachine):
    """Random operation sequences keep slots unique and refcounts exact; nothing leaks."""

    def __init__(self):
        super().__init__()
        self.tree = make_tree(num_pages=48, page_size=3)

    def _nodes(self):
        return sorted(node_ids(self.tree))

    @rule(n=st.integers(1, 20))
    def add_prompt(self, n):
        try:
            self.tree.add_prompt(range(n))
        except PoolExhaustedError:
            pass

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data(), n=st.integers(1, 10))
    def extend_leaf(self, data, n):
        leaves = [i for i in self._nodes() if not self.tree.children(i)]
        leaf = data.draw(st.sampled_from(leaves))
        need, free = self.tree.pages_to_extend(leaf, n), self.tree.pool.num_free_pages
        try:
            self.tree.extend(leaf, range(n))
        except PoolExhaustedError:
            assert need > free
            return
        assert free - self.tree.pool.num_free_pages == need

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data(), sizes=st.lists(st.integers(0, 7), min_size=1, max_size=3))
    def branch(self, data, sizes):
        node = data.draw(st.sampled_from(self._nodes()))
        try:
            self.tree.branch(node, [range(s) for s in sizes])
        except PoolExhaustedError:
            pass

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data(), m=st.integers(1, 8))
    def token_tree(self, data, m):
        node = data.draw(st.sampled_from(self._nodes()))
        parents = [data.draw(st.integers(-1, i - 1)) for i in range(m)]
        try:
            self.tree.add_token_tree(node, range(m), parents)
        except PoolExhaustedError:
            pass

    @precondition(lambda self: self.tree.num_nodes)
    @rule(data=st.data())
    def prune(self, data):
        self.tree.commit_step()
        node = data.draw(st.sampled_from(self._nodes()))
        expected = self.tree.pages_freed_by_prune([node])
        assert len(self.tree.prune(node)) == expected



TestTreeOperations = TreeOperations.TestCase
TestTreeOperations.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_set_tokens_and_truncate():
    """set_tokens rewrites ids only; truncate drops a leaf's computed tail and frees the pages only it held."""
    tree = make_tree(num_pages=16, page_size=4)
    root = tree.add_prompt(list(range(6)))          # pages: 2 (slots 0-5 of 8)
    tree.commit_step()
    tree.extend(root, [0, 0, 0, 0, 0])              # 11 tokens: a third page
    tree.set_tokens(root, 6, [60, 61])
    assert tree.sequence(root)[6:8] == [60, 61] and tree.pending_tokens().tolist() == [60, 61, 0, 0, 0]
    with pytest.raises(TreeError, match="pending"):
        tree.truncate(root, 7)
    tree.commit_step()
    free = tree.pool.num_free_pages
    assert len(tree.truncate(root, 7)) == 1 and tree.pool.num_free_pages == free + 1
    assert tree.sequence(root) == [0, 1, 2, 3, 4, 5, 60]
    tree.check_invariants()
    tree.extend(root, [9])                          # refills the kept page (only this node holds it)
    assert tree.slots(root)[7] == tree.slots(root)[6] + 1
    tree.commit_step()
    tree.check_invariants()
    before = snapshot(tree)
    for op, match in [(lambda: tree.set_tokens(root, 7, [1, 2]), "cannot set tokens 7..8"),
                      (lambda: tree.truncate(root, 9), "to 9")]:
        with pytest.raises(TreeError, match=match):
            op()
    with pytest.raises(ValueError, match="length"):
        tree.truncate(root, 0)
    assert snapshot(tree) == before
    tree.branch(root, [[1]])
    with pytest.raises(TreeError, match="children"):
        tree.truncate(root, 2)


def test_first_slots_are_each_nodes_first_slot():
    """first_slots: a token tree's slots in one call, equal to each node's slots()[0]; nodes without tokens and
    unknown nodes raise."""
    tree = make_tree(num_pages=16, page_size=4)
    root = tree.add_prompt(list(range(6)))
    ids = tree.add_token_tree(root, [5, 6, 7, 8, 9], [-1, 0, 0, 1, -1])
    assert tree.first_slots(ids).tolist() == [int(tree.slots(i)[0]) for i in ids]
    assert tree.first_slots([root]).tolist() == [int(tree.slots(root)[0])] and len(tree.first_slots([])) == 0
    with pytest.raises(TreeError):
        tree.first_slots([root, 999])


def test_truncate_keeps_a_page_a_kept_token_shares():
    """Truncating into a page (kept tokens before the cut in it) frees only the pages past it, on a long node
    whose pages are not in slot order (a speculative path accepted from another page in between)."""
    tree = make_tree(num_pages=64, page_size=4)
    root = tree.add_prompt(list(range(30)))
    tree.commit_step()
    ids = tree.add_token_tree(root, [1, 2, 3], [-1, 0, 1])
    tree.commit_step()
    tree.accept(root, ids[:2])                         # two tokens from the tree's page join the node
    tree.extend(root, list(range(9)))
    tree.commit_step()
    length = tree.node_length(root)
    pages_before = tree.pool.num_free_pages
    freed = tree.truncate(root, 31)                   # keeps the prompt and one accepted token
    kept_pages = set((tree.slots(root) // 4).tolist())
    assert not kept_pages & set(freed.tolist()) and tree.pool.num_free_pages == pages_before + len(freed)
    assert tree.node_length(root) == 31 < length and len(freed) >= 2
    tree.check_invariants()


def test_extend_computed_appends_tokens_no_step_computes():
    """extend_computed gives slots for K/V the caller writes: nothing pending, a leaf only, checked first."""
    tree = make_tree(num_pages=4, page_size=4)
    root = tree.add_prompt([1, 2, 3])
    tree.commit_step()
    slots = tree.extend_computed(root, [7, 8, 9])        # one slot of the first page, two of a fresh one
    assert tree.num_pending == 0 and tree.sequence(root) == [1, 2, 3, 7, 8, 9] and len(slots) == 3
    assert tree.node_length(root) == 6
    assert tree.pool.num_free_pages == 2
    tree.check_invariants()
    tree.truncate(root, 4)                               # the tail page goes back; its first page is refilled
    assert tree.pool.num_free_pages == 3
    assert tree.extend_computed(root, [5]).tolist() == [int(tree.slots(root)[3]) + 1]
    state = snapshot(tree)
    for bad, error in [([0] * 20, PoolExhaustedError), ([-1], ValueError), (["a"], TypeError)]:
        with pytest.raises(error):
            tree.extend_computed(root, bad)
        assert snapshot(tree) == state
    tree.extend(root, [4])
    with pytest.raises(TreeError, match="pending"):
        tree.extend_computed(root, [1])
    tree.commit_step()
    tree.branch(root, [[6]])
    tree.commit_step()
    state = snapshot(tree)
    with pytest.raises(TreeError, match="children"):
        tree.extend_computed(root, [1])
    assert snapshot(tree) == state
    tree.check_invariants()
