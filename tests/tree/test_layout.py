import numpy as np
import pytest

from treedec import TreeError
from treedec.tree import TreeLayout


def test_from_parents_orders_depth_first_and_positions():
    # 0 -> (1 -> 3), 2 ; given out of order
    layout = TreeLayout.from_parents(parents=[-1, 0, 0, 1], lengths=[5, 2, 3, 1],
                                     queries=[(3, 0), (2, 2), (1, 1)])
    assert layout.node_ids.tolist() == [0, 1, 3, 2]
    assert layout.parent.tolist() == [-1, 0, 1, 0]
    assert layout.kv_start.tolist() == [0, 5, 7, 8, 11]
    assert layout.node_prefix_len.tolist() == [0, 5, 7, 5]
    assert layout.query_position.tolist() == [7, 7, 6]
    # default slots are numbered in the given node order: node 2 holds 7..9, node 3 holds 10
    assert layout.query_slot.tolist() == [10, 9, 6]


def test_forest_has_several_roots():
    layout = TreeLayout.from_parents([-1, -1, 0], [3, 4, 1], [(2, 0), (1, 3)])
    assert layout.parent.tolist() == [-1, 0, -1]
    assert layout.node_ids.tolist() == [0, 2, 1]


@pytest.mark.parametrize("parents,lengths,queries,match", [
    ([-1, 2, 1], [1, 1, 1], [(0, 0)], "cycle"),
    ([-1, 5], [1, 1], [(0, 0)], r"parents\[1\] = 5"),
    ([-1, 1], [1, 1], [(0, 0)], r"parents\[1\] = 1"),
    ([-1, 0], [1, -2], [(0, 0)], "lengths must be >= 0"),
    ([-1, 0], [1], [(0, 0)], "same length"),
    ([-1, 0], [1, 2], [(3, 0)], "query nodes"),
    ([-1, 0], [1, 2], [(1, 2)], "query offset"),
])
def test_bad_layouts(parents, lengths, queries, match):
    with pytest.raises(TreeError, match=match):
        TreeLayout.from_parents(parents, lengths, queries)


def test_explicit_slots_checked():
    with pytest.raises(TreeError, match=r"slots\[1\] has 1 slots but lengths\[1\] = 2"):
        TreeLayout.from_parents([-1, 0], [1, 2], [(1, 0)], slots=[[0], [4]])
    layout = TreeLayout.from_parents([-1, 0], [1, 2], [(1, 1)], slots=[[9], [4, 2]])
    assert layout.kv_slots.tolist() == [9, 4, 2] and layout.query_slot.tolist() == [2]


def test_node_prefix_len_of_a_deep_forest_is_the_tokens_above():
    """node_prefix_len, computed by pointer jumping for a layout that does not carry it, equals the sum of the
    ancestors' lengths: a chain 300 deep beside a random forest."""
    rng = np.random.default_rng(3)
    parents = [-1] + list(range(299)) + [-1] + [int(rng.integers(300, 300 + i)) for i in range(1, 100)]
    lengths = rng.integers(0, 7, len(parents)).tolist()
    layout = TreeLayout.from_parents(parents, lengths, [(len(parents) - 1, 0)] if lengths[-1] else [])
    above = {}
    for i, p in enumerate(parents):
        above[i] = 0 if p < 0 else above[p] + lengths[p]
    assert layout.node_prefix_len.tolist() == [above[int(i)] for i in layout.node_ids]
