"""TokenTree: Medusa choices (order, validation) and EAGLE-2 expansion by cumulative log-prob."""
import math

import pytest

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
