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
