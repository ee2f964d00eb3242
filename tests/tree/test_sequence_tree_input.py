"""SequenceTree on bad input: token ids, parents and node ids of every kind raise a specific error and
change nothing; check_invariants names what a corrupted tree broke."""
import re

import numpy as np
import pytest
import torch

from treedec import TreeError
from tests.tree.test_sequence_tree import make_tree
from tests.tree.tree_state import snapshot


def _deeply_nested(depth):
    x = [1]
    for _ in range(depth):
        x = [x]
    return x


# (value, exception, what the message says after the argument's name)
BAD_TOKENS = [
    ("123", TypeError, r" must be a sequence of integers, got str '123'"),   # used to become [1, 2, 3]
    (b"12", TypeError, r" must be a sequence of integers, got bytes"),
    (["7"], TypeError, r"\[0\] must be an integer, got str '7'"),
    ([1.0], TypeError, r"\[0\] must be an integer, got float 1.0"),
    ([7, 2.5], TypeError, r"\[1\] must be an integer, got float 2.5"),            # used to truncate to 2
    (np.array([1.0, 2.0]), TypeError, r" must be integers, got a float64 array"),
    (np.array([1], dtype=np.float16), TypeError, r" must be integers, got a float16 array"),
    (torch.tensor([1.0]), TypeError, r" must be integers, got a torch.float32 tensor"),
    (torch.tensor([1], dtype=torch.bfloat16), TypeError, r" must be integers, got a torch.bfloat16 tensor"),
    ([True], TypeError, r"\[0\] must be an integer, got bool True"),
    ([1, False], TypeError, r"\[1\] must be an integer, got bool False"),
    (np.array([True]), TypeError, r" must be integers, got a bool array"),
    (torch.tensor([True, False]), TypeError, r" must be integers, got a torch.bool tensor"),
    ([-1], ValueError, r" must be >= 0 and fit in int64, got .*\[0\] = -1"),
    (np.array([3, -5]), ValueError, r" must be >= 0 and fit in int64, got .*\[1\] = -5"),
    (torch.tensor([-1]), ValueError, r" must be >= 0 .*\[0\] = -1"),
    ([2**63], ValueError, r" must be >= 0 and fit in int64, got .*\[0\] = 9223372036854775808"),
    ([5, 2**64], ValueError, r"\[1\] = 18446744073709551616"),                 # used to overflow later
    (np.array([2**64 - 1], dtype=np.uint64), ValueError, r"\[0\] = 18446744073709551615"),
    ([-(2**70)], ValueError, r"\[0\] = -1180591620717411303424"),
    ([2**20_000], ValueError, r"\[0\] = <a 20001-bit int>"),     # too long for str()
    ([None], TypeError, r"\[0\] must be an integer, got NoneType None"),
    (None, TypeError, r" must be a sequence of integers, got NoneType None"),
    (7, TypeError, r" must be a sequence of integers, got int 7"),
    (np.int64(7), TypeError, r" must be a sequence of integers, got int64"),
    ([[1, 2]], TypeError, r"\[0\] must be an integer, got list \[1, 2\]"),
    ([(1,)], TypeError, r"\[0\] must be an integer, got tuple"),
    ([[]], TypeError, r"\[0\] must be an integer, got list \[\]"),
    (np.array([[1, 2]]), ValueError, r" must be 1-D, got an array of shape \(1, 2\)"),
    (torch.tensor([[1]]), ValueError, r" must be 1-D, got an array of shape \(1, 1\)"),
    (np.array(5), ValueError, r" must be 1-D, got an array of shape \(\)"),
    ({1: 2}, TypeError, r" must be a sequence of integers, got dict"),
    ({1, 2}, TypeError, r" must be a sequence of integers, got set"),
    ([1 + 0j], TypeError, r"\[0\] must be an integer, got complex"),
    (np.array([1 + 0j]), TypeError, r" must be integers, got a complex128 array"),
    ([np.float64(1.0)], TypeError, r"\[0\] must be an integer, got float64"),
    (np.array(["1"]), TypeError, r" must be integers, got a <U1 array"),
    (np.array([1, "a"], dtype=object), TypeError, r"\[1\] must be an integer, got str 'a'"),
    ([torch.tensor(1.0)], TypeError, r"\[0\] must be an integer, got Tensor"),
    ([object()], TypeError, r"\[0\] must be an integer, got object"),
    (_deeply_nested(50_000), TypeError, r"\[0\] must be an integer, got list \[\[\[\.\.\.\]\]\]"),
]

TOKEN_ENTRY_POINTS = {
    # name: (call(tree, root, leaf, other_leaf, tokens), the argument's name in the message)
    "add_prompt": (lambda t, r, a, b, x: t.add_prompt(x), "tokens"),
    "extend": (lambda t, r, a, b, x: t.extend(a, x), "tokens for node {a}"),
    "extend_many": (lambda t, r, a, b, x: t.extend_many({b: [5], a: x}), "tokens for node {a}"),
    "branch": (lambda t, r, a, b, x: t.branch(a, [[5], x]), "children[1]"),
    "add_token_tree": (lambda t, r, a, b, x: t.add_token_tree(a, x, [-1]), "tokens"),
}


def tree_with_leaves():
    tree = make_tree(num_pages=32, page_size=4)
    root = tree.add_prompt([1, 2, 3])
    a, b = tree.branch(root, [[4], [5, 6]])
    tree.commit_step()
    return tree, root, a, b


@pytest.mark.parametrize("entry", TOKEN_ENTRY_POINTS)
@pytest.mark.parametrize("tokens, error, match", BAD_TOKENS,
                         ids=[f"{type(v).__name__}-{i}" for i, (v, _, _) in enumerate(BAD_TOKENS)])
def test_bad_token_ids_raise_and_change_nothing(entry, tokens, error, match):
    tree, root, a, b = tree_with_leaves()
    call, name = TOKEN_ENTRY_POINTS[entry]
    before = snapshot(tree)
    counts = (tree.num_nodes, tree.num_tokens, tree.pool.num_free_pages)
    with pytest.raises(error, match=re.escape(name.format(a=a)) + match):
        call(tree, root, a, b, tokens)
    assert snapshot(tree) == before
    assert (tree.num_nodes, tree.num_tokens, tree.pool.num_free_pages) == counts
    tree.check_invariants()


@pytest.mark.parametrize("tokens", [
    [7, 8, 9], (7, 8, 9), range(7, 10), (t for t in [7, 8, 9]), np.array([7, 8, 9], dtype=np.int8),
    np.array([7, 8, 9], dtype=np.uint16), np.array([7, 8, 9], dtype=np.int32), torch.tensor([7, 8, 9]),
    torch.tensor([7, 8, 9], dtype=torch.int32), [np.int64(7), np.uint8(8), torch.tensor(9)],
    np.array([7, 8, 9], dtype=object), np.arange(10)[7:],
])
def test_integer_token_ids_of_any_kind_are_accepted(tokens):
    tree = make_tree()
    root = tree.add_prompt(tokens)
    assert tree.tokens(root) == [7, 8, 9] and all(type(t) is int for t in tree.tokens(root))
    assert tree.add_prompt([2**63 - 1]) == root + 1   # the largest int64
    tree.check_invariants()


@pytest.mark.parametrize("parents, error, match", [
    ("-10", TypeError, r"parents must be a sequence of integers, got str '-10'"),
    ([-1, 0.0, 1], TypeError, r"parents\[1\] must be an integer, got float 0.0"),
    (np.array([-1.0, 0.0, 1.0]), TypeError, r"parents must be integers, got a float64 array"),
    (torch.tensor([-1.0, 0.0, 0.0]), TypeError, r"parents must be integers, got a torch.float32 tensor"),
    ([-1, True, 1], TypeError, r"parents\[1\] must be an integer, got bool True"),
    ([-1, 0, None], TypeError, r"parents\[2\] must be an integer, got NoneType"),
    ([[-1], [0], [0]], TypeError, r"parents\[0\] must be an integer, got list \[-1\]"),
    (None, TypeError, r"parents must be a sequence of integers, got NoneType"),
    ({0: -1}, TypeError, r"parents must be a sequence of integers, got dict"),
    (np.array([[-1, 0, 0]]), ValueError, r"parents must be 1-D"),
    ([-1, -2, 0], ValueError, r"parents must be >= -1 and fit in int64, got parents\[1\] = -2"),
    ([-1, 0, 2**64], ValueError, r"parents\[2\] = 18446744073709551616"),
    ([-1, 0, 3], TreeError, r"parents\[2\] = 3 is not a token index in \[-1, 3\)"),
    ([-1, 2, 5], TreeError, r"parents\[2\] = 5 is not a token index"),   # was an IndexError in the cycle check
    ([-1, 2, 0], TreeError, r"parents\[1\] = 2: parents must come before children \(a forward reference\)"),
    ([-1, 1, 1], TreeError, r"parents\[1\] = 1: parents must come before children \(a cycle\)"),
    ([-1, 0], TreeError, "need one parent per token"),
])
def test_bad_parents_raise_and_change_nothing(parents, error, match):
    tree, root, a, b = tree_with_leaves()
    before = snapshot(tree)
    with pytest.raises(error, match=match):
        tree.add_token_tree(a, [7, 8, 9], parents)
    assert snapshot(tree) == before
    ids = tree.add_token_tree(a, [7, 8, 9], np.array([-1, 0, 0], dtype=np.int32))   # integer arrays are fine
    assert [tree.parent(i) for i in ids] == [a, ids[0], ids[0]]
    tree.check_invariants()


@pytest.mark.parametrize("call, error, match", [
    (lambda t, r, a: t.extend(1.0, [1]), TypeError, "node id must be an int, got float 1.0"),   # used to mean node 1
    (lambda t, r, a: t.extend(True, [1]), TypeError, "node id must be an int, got bool True"),
    (lambda t, r, a: t.extend("1", [1]), TypeError, "node id must be an int, got str '1'"),
    (lambda t, r, a: t.prune(np.float64(r)), TypeError, "node id must be an int, got float64"),
    (lambda t, r, a: t.branch([a], 1), TypeError, r"node id must be an int, got list"),
    (lambda t, r, a: t.pages_freed_by_prune("12"), TypeError, "node id must be an int, got str '1'"),
    (lambda t, r, a: t.extend_many([(a, [1])]), TypeError, r"tokens_by_node must be a dict \{leaf id: tokens\}"),
    (lambda t, r, a: t.branch(a, True), TypeError, "children must be a sequence, got bool True"),
    (lambda t, r, a: t.branch(a, 2.0), TypeError, "children must be a sequence, got float 2.0"),
    (lambda t, r, a: t.branch(a, "12"), TypeError, "children must be a sequence, got str '12'"),
    (lambda t, r, a: t.branch(a, {1: [2]}), TypeError, "children must be a sequence, got dict"),
    (lambda t, r, a: t.pages_to_extend(a, 1.5), TypeError, "num_tokens must be an integer, got float 1.5"),
    (lambda t, r, a: t.pages_to_extend(a, -1), ValueError, "num_tokens must be >= 0"),
])
def test_bad_node_ids_and_containers_raise_and_change_nothing(call, error, match):
    tree, root, a, b = tree_with_leaves()
    before = snapshot(tree)
    with pytest.raises(error, match=match):
        call(tree, root, a)
    assert snapshot(tree) == before
    assert 1.0 not in tree and True not in tree and np.int64(root) in tree


def _slot(t, node, i):
    """Where node's i-th slot is in the array tree's token buffer."""
    return t._table.start[t._table.node_id == node][0] + i


def _column(name, node, value):
    def corrupt(t, r, a, b):
        getattr(t._table, name)[t._table.node_id == {"r": r, "a": a, "b": b}[node]] = value
    return corrupt


@pytest.mark.parametrize("corrupt, match", [
    (lambda t, r, a, b: t._table.slots.__setitem__(_slot(t, b, 0), t._table.slots[_slot(t, a, 0)]),
     r"tokens share KV slots \[4\]"),
    (lambda t, r, a, b: t._table.slots.__setitem__(_slot(t, a, 0), -1), r"slots \[-1\] are outside the pool's \[0, 128\)"),
    (lambda t, r, a, b: t.pool.refcount.__setitem__(0, 2), r"pages \[0\] have refcounts \[2\] but are held by \[1\]"),
    (lambda t, r, a, b: t._table.slots.__setitem__(_slot(t, r, 1), 11), r"node 0 holds a page twice: \[0, 2, 0\]"),
    (_column("parent", "b", 2), r"nodes \[2\] are unreachable from the roots \[0\]"),   # its own parent
    (_column("num_children", "r", 3), r"nodes \[0\] count \[3\] children, have \[2\]"),
    (_column("prefix", "b", 0), r"nodes \[2\] have \[0\] tokens above them recorded, not their path's"),
    (_column("cap", "r", 10**6), r"node regions of the token buffer overlap"),
    (_column("tail_room", "a", 4), r"nodes \[1\] have tail room past their last page"),
    (_column("node_id", "b", -1), r"2 live rows, but num_nodes is 3"),
])
def test_check_invariants_names_the_broken_invariant(corrupt, match):
    tree, root, a, b = tree_with_leaves()
    tree.check_invariants()
    corrupt(tree, root, a, b)
    with pytest.raises(RuntimeError, match="SequenceTree invariant broken: " + match):
        tree.check_invariants()
