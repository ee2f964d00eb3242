"""TokenTree: Medusa choices (order, validation) and EAGLE-2 expansion by cumulative log-prob."""
import math

import numpy as np
import pytest
import torch

from treedec.tree.token_tree import TokenTree, expand_by_logprob


def test_medusa_choices_sorted_like_medusa():
    tree = TokenTree.from_medusa_choices([[1], [0, 0], [0], [0, 1], [1, 0], [0, 0, 0]])
    # sorted by (len, path): [0], [1], [0,0], [0,1], [1,0], [0,0,0]
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert tree.depth == (0, 1, 1, 2, 2, 2, 3)
    assert tree.paths == ((), (0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.size == 7 and tree.children(1) == [3, 4]
    assert tree.draft_parents() == [-1, -1, 0, 0, 1, 2]


@pytest.mark.parametrize("choices, match", [
    ([[0], [0]], r"path \[0\] twice"),
    ([[0], [1, 0]], r"path \[1, 0\] has no parent path \[1\]"),
    ([[0], [0, -1]], r"choices\[1\] must be a non-empty list of non-negative ints"),
    ([[0], [0, 1.0]], r"choices\[1\]"),
    ([[0], []], r"choices\[1\]"),
    ([[True]], r"choices\[0\]"),
    ("01", "choices must be a list"),
])
def test_medusa_choices_errors(choices, match):
    snapshot = [list(c) for c in choices] if isinstance(choices, list) else choices
    with pytest.raises(ValueError, match=match):
        TokenTree.from_medusa_choices(choices)
    assert choices == snapshot   # input untouched


def test_tree_validation_and_chain():
    assert TokenTree.chain(3).parents == (-1, 0, 1, 2) and TokenTree.chain(0).size == 1
    with pytest.raises(ValueError, match="start with -1"):
        TokenTree((0, 0))
    with pytest.raises(ValueError, match=r"parents\[2\] must be an int index in \[0, 2\)"):
        TokenTree((-1, 0, 2))
    with pytest.raises(ValueError, match="num_draft"):
        TokenTree.chain(-1)


def table_candidates(table):
    def candidates(path):
        entries = table.get(path, [])
        return [t for t, _ in entries], [math.log(p) for _, p in entries]
    return candidates


TABLE = {
    (): [(10, 0.6), (11, 0.3), (12, 0.1)],
    (10,): [(20, 0.9), (21, 0.05), (22, 0.05)],
    (11,): [(23, 0.5), (24, 0.5), (25, 0.0001)],
    (12,): [(26, 1.0)],
    (10, 20): [(30, 0.8), (31, 0.2)],
    (10, 21): [(32, 1.0)],
    (11, 23): [(33, 1.0)],
    (11, 24): [(34, 1.0)],
}


def test_expand_by_logprob_keeps_best_cumulative():
    tree, tokens = expand_by_logprob(7, table_candidates(TABLE), depth=3, top_k=2, total_tokens=5)
    # scores: 10:.6 11:.3 12:.1 | 10,20:.54 11,23:.15 11,24:.15 ... | 10,20,30:.432 ...
    # layer 3 expands the top-2 of layer 2: (10,20) .54 and (11,23) .15 (the earlier of a tie);
    # kept: the best 5 of all, ties to the shallower node: (11,23) .15 beats (11,23,33) .15
    assert tokens == [7, 10, 11, 20, 23, 30]   # sorted by depth, then score
    assert tree.parents == (-1, 0, 0, 1, 2, 3)
    again = expand_by_logprob(7, table_candidates(TABLE), depth=3, top_k=2, total_tokens=5)
    assert again == (tree, tokens)   # a pure function of its inputs


@pytest.mark.parametrize("depth, top_k, total", [(1, 1, 1), (2, 3, 100), (3, 1, 4), (4, 3, 9)])
def test_expand_by_logprob_is_ancestor_closed(depth, top_k, total):
    tree, tokens = expand_by_logprob(0, table_candidates(TABLE), depth=depth, top_k=top_k, total_tokens=total)
    assert max(tree.depth) <= depth and tree.size <= total + 1 and tokens[0] == 0
    d = tree.depth
    assert all(d[i] == d[p] + 1 for i, p in enumerate(tree.parents) if p >= 0)


def test_expand_by_logprob_errors():
    with pytest.raises(ValueError, match="top_k must be an int >= 1, got 0"):
        expand_by_logprob(0, table_candidates(TABLE), depth=2, top_k=0, total_tokens=3)
    with pytest.raises(ValueError, match=r"log-prob 0\.5 for token 1, expected <= 0"):
        expand_by_logprob(0, lambda path: ([1], [0.5]), depth=1, top_k=1, total_tokens=1)
    with pytest.raises(ValueError, match="gave a token twice"):
        expand_by_logprob(0, lambda path: ([1, 1], [-1.0, -2.0]), depth=1, top_k=1, total_tokens=1)
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        expand_by_logprob(0, lambda path: ([1, 2], [-1.0]), depth=1, top_k=1, total_tokens=1)


def test_expand_by_logprob_batched_sees_whole_layers():
    per_path = table_candidates(TABLE)
    layers = []

    def layer(paths):
        layers.append(list(paths))
        return [per_path(p) for p in paths]

    assert (expand_by_logprob(7, layer, depth=3, top_k=2, total_tokens=5, batched=True)
            == expand_by_logprob(7, per_path, depth=3, top_k=2, total_tokens=5))
    assert layers == [[()], [(10,), (11,)], [(10, 20), (11, 23)]]   # one call per layer, best first
    with pytest.raises(ValueError, match="gave 0 results for a layer of 1 token paths"):
        expand_by_logprob(0, lambda paths: [], depth=1, top_k=1, total_tokens=1, batched=True)


# ================================================================ bad parents, token ids and choices

@pytest.mark.parametrize("parents, error, match", [
    ("-1", TypeError, r"parents must be a sequence of integers, got str '-1'"),
    ((-1, 0.0), TypeError, r"parents\[1\] must be an integer, got float 0.0"),
    ((-1, True), TypeError, r"parents\[1\] must be an integer, got bool True"),
    (np.array([-1.0, 0.0]), TypeError, "parents must be integers, got a float64 array"),
    (torch.tensor([-1.0, 0.5]), TypeError, "parents must be integers, got a torch.float32 tensor"),
    ((-1, None), TypeError, r"parents\[1\] must be an integer, got NoneType"),
    (None, TypeError, "parents must be a sequence of integers, got NoneType"),
    (5, TypeError, "parents must be a sequence of integers, got int 5"),
    ({-1: 0}, TypeError, "parents must be a sequence of integers, got dict"),
    (((-1,), (0,)), TypeError, r"parents\[0\] must be an integer, got tuple"),
    (np.array([[-1, 0]]), ValueError, "parents must be 1-D"),
    ((-1, 2**64), ValueError, r"parents\[1\] = 18446744073709551616"),
    ((-1, -2), ValueError, r"parents\[1\] = -2"),
    ((-1, -1), ValueError, r"parents\[1\] must be an int index in \[0, 1\)"),
    ((), ValueError, "must start with -1"),
])
def test_token_tree_rejects_bad_parents(parents, error, match):
    with pytest.raises(error, match=match):
        TokenTree(parents)


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1], np.array([-1, 0, 0, 1], dtype=np.int16),
                                     torch.tensor([-1, 0, 0, 1]), (-1, np.int64(0), 0, 1)])
def test_token_tree_takes_integer_parents_of_any_kind(parents):
    tree = TokenTree(parents)
    assert tree.parents == (-1, 0, 0, 1) and all(type(p) is int for p in tree.parents)
    assert tree == TokenTree((-1, 0, 0, 1))


@pytest.mark.parametrize("num_draft, error", [(True, TypeError), (1.0, TypeError), ("2", TypeError), (-1, ValueError)])
def test_chain_rejects_non_int_lengths(num_draft, error):
    with pytest.raises(error, match="num_draft"):
        TokenTree.chain(num_draft)


@pytest.mark.parametrize("choices, match", [
    ([[0], [0, np.int64(1)]], None),                  # numpy ints are ints
    ([[0], [0, 2**70]], None),                        # a huge candidate index is still an index
    ([[0], [[0]]], r"choices\[1\] must be a non-empty list of non-negative ints, got list \[\[0\]\]"),
    ([[0], "0"], r"choices\[1\]"),
    ([[0], bytearray(b"\x00")], r"choices\[1\]"),
    ([[0], None], r"choices\[1\] must be .*, got NoneType None"),
    ([[0], {0: 0}], r"choices\[1\]"),
    ([[0], [None]], r"choices\[1\]"),
    ({(0,): 1}, "choices must be a list of index paths"),
    (None, "choices must be a list of index paths"),
    (np.array([[0]]), "choices must be a list of index paths"),
])
def test_medusa_choices_odd_inputs(choices, match):
    if match is None:
        assert TokenTree.from_medusa_choices(choices).parents == (-1, 0, 1)
    else:
        with pytest.raises(ValueError, match=match):
            TokenTree.from_medusa_choices(choices)


def test_medusa_choices_deep_nesting_is_a_value_error_not_a_recursion_error():
    deep = [0]
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match=r"choices\[1\] must be a non-empty list of non-negative ints"):
        TokenTree.from_medusa_choices([[0], deep])   # the message used to repr() the whole nesting


@pytest.mark.parametrize("root_token, candidates, error, match", [
    ("7", lambda path: ([1], [-1.0]), TypeError, "root_token must be an integer, got str '7'"),
    (7.0, lambda path: ([1], [-1.0]), TypeError, "root_token must be an integer, got float"),
    (-1, lambda path: ([1], [-1.0]), ValueError, "root_token must be >= 0"),
    (7, lambda path: ([1.0], [-1.0]), TypeError, r"candidates\(\[\]\) tokens\[0\] must be an integer, got float"),
    (7, lambda path: ("12", [-1.0, -2.0]), TypeError, r"candidates\(\[\]\) tokens must be a sequence of integers"),
    (7, lambda path: ([2**64], [-1.0]), ValueError, r"candidates\(\[\]\) tokens must be >= 0 and fit in int64"),
    (7, lambda path: ([-3], [-1.0]), ValueError, r"candidates\(\[\]\) tokens must be >= 0"),
])
def test_expand_by_logprob_rejects_bad_token_ids(root_token, candidates, error, match):
    with pytest.raises(error, match=match):
        expand_by_logprob(root_token, candidates, depth=1, top_k=1, total_tokens=1)


def test_expand_by_logprob_takes_numpy_and_torch_token_ids():
    tree, tokens = expand_by_logprob(np.int64(7), lambda path: (torch.tensor([3, 4]), [-0.1, -0.2]),
                                     depth=1, top_k=1, total_tokens=2)
    assert tokens == [7, 3, 4] and all(type(t) is int for t in tokens)
