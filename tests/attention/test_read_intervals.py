"""attention/read_intervals.py and the planners over it with a sliding window: each query's root-path intervals
clipped to its window (positions are root-path indices), the tokens before every window never flattened, a shared
prefix inside the windows still one chunk for all its readers."""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from treedec import PlanConfig, TreeAttention
from treedec.attention import PLANNERS, AttentionVariant, make_plan
from treedec.attention.read_intervals import read_intervals
from treedec.tree import TreeLayout
from tests.attention.test_planners import check_structure, read_pairs_from_plan
from tests.trees import path_slots, random_forest


def fan(prompt: int = 3000, branches: int = 8, branch_len: int = 20) -> TreeLayout:
    """A ``prompt``-token node with ``branches`` branches under it, a query at each branch's end."""
    return TreeLayout.from_parents([-1] + [0] * branches, [prompt] + [branch_len] * branches,
                                   [(i, branch_len - 1) for i in range(1, branches + 1)])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 4, 16]), planner=st.sampled_from(PLANNERS),
       chunk_size=st.sampled_from([1, 5, 32, 1000]), query_tile=st.sampled_from([1, 3, 16]),
       window=st.sampled_from([1, 2, 9, 30, 80]))
def test_windowed_plan_reads_exactly_each_query_window(seed, page_size, planner, chunk_size, query_tile, window):
    tree = random_forest(np.random.default_rng(seed), page_size)
    layout = tree.layout()
    config = PlanConfig(planner, chunk_size, query_tile)
    plan = make_plan(layout, config, variant=AttentionVariant(window=window))
    assert plan.window == window
    check_structure(plan, config)
    expected = set()
    for q, (node, offset) in enumerate(zip(layout.query_node, layout.query_offset)):
        slots = path_slots(tree, int(layout.node_ids[node]), int(offset))
        expected |= {(q, int(s)) for s in slots[max(0, len(slots) - window):]}
    assert read_pairs_from_plan(plan) == expected


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), planner=st.sampled_from(PLANNERS), chunk_size=st.sampled_from([None, 16, 64]))
def test_a_window_past_every_position_plans_as_no_window(seed, planner, chunk_size):
    layout = random_forest(np.random.default_rng(seed), 4).layout()
    config = PlanConfig(planner, chunk_size, 4)
    plain = make_plan(layout, config)
    wide = make_plan(layout, config, variant=AttentionVariant(window=int(layout.query_position.max()) + 1))
    for field in dataclasses.fields(plain):
        a, b = getattr(plain, field.name), getattr(wide, field.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), field.name
    assert wide.window is not None and plain.window is None


@pytest.mark.parametrize("planner", PLANNERS)
def test_tokens_outside_every_window_are_never_planned(planner):
    """A 3000-token prompt under 8 branches of 20 tokens, window 100: each query reads the prompt's last 80 tokens
    and its branch; the other 2920 prompt tokens are in no chunk, and (but for the Q-guided path planner) the 80
    shared ones are flattened once, in chunks that every query reads (DeFT's grouping, within the window)."""
    layout = fan()
    plan = make_plan(layout, PlanConfig(planner, 64, 16), variant=AttentionVariant(window=100))
    prompt, branches = layout.kv_slots[:3000], layout.kv_slots[3000:]
    assert not np.isin(plan.kv_slots, prompt[:2920]).any()
    assert plan.max_slot == int(layout.kv_slots.max())
    if planner == "path":
        assert plan.num_tokens == 8 * 100 and plan.kv_tokens_read() == 8 * 100
        return
    assert np.array_equal(plan.kv_slots, np.concatenate([prompt[2920:], branches]))
    tail_chunks = np.flatnonzero(plan.chunk_kv_start[:-1] < 80)
    assert (np.diff(plan.chunk_entry_start)[tail_chunks] == 8).all()
    assert plan.kv_tokens_read() == 80 + 8 * 20   # each chunk once per work item: the tail once for all


def test_positions_are_root_path_indices_across_nodes():
    """A window that reaches back across several nodes: a query at position 12 of a chain of nodes of 5, 3, 2 and 3
    tokens, window 6, reads positions 7..12 (the last token of node 1, node 2, node 3)."""
    layout = TreeLayout.from_parents([-1, 0, 1, 2], [5, 3, 2, 3], [(3, 2)])
    reads = read_intervals(layout, AttentionVariant(window=6))
    kept = np.concatenate([reads.kv_slots[lo:hi] for lo, hi in zip(reads.lo, reads.hi)])
    assert sorted(kept.tolist()) == list(range(7, 13))
    assert reads.node_len.tolist() == [0, 1, 2, 3] and reads.kv_slots.tolist() == list(range(7, 13))


def test_window_one_reads_the_query_itself():
    layout = fan(50, 3, 4)
    plan = make_plan(layout, PlanConfig("flatten", 64, 4), variant=AttentionVariant(window=1))
    assert plan.num_tokens == 3 and sorted(plan.kv_slots.tolist()) == sorted(layout.query_slot.tolist())


def test_tree_attention_refuses_a_plan_of_another_window():
    layout = fan(40, 2, 3)
    windowed = TreeAttention(4, 2, 64, backend="torch", device="cpu", variant=AttentionVariant(window=8))
    plain = TreeAttention(4, 2, 64, backend="torch", device="cpu")
    capped = TreeAttention(4, 2, 64, backend="torch", device="cpu", variant=AttentionVariant(logit_softcap=9.0))
    k = v = torch.zeros(46, 1, 2, 64)
    q = torch.zeros(2, 4, 64)
    with pytest.raises(ValueError, match="plan was made for window=8, not this TreeAttention's window=None"):
        plain.run(q, k, v, windowed.plan(layout))
    assert capped.run(q, k, v, plain.plan(layout)).shape == q.shape   # a soft-cap does not change the plan


def test_make_plan_and_run_name_a_wrong_argument():
    with pytest.raises(TypeError, match="layout must be a TreeLayout .*got NoneType"):
        make_plan(None)
    with pytest.raises(TypeError, match="variant must be an AttentionVariant, got int"):
        make_plan(fan(10, 1, 1), variant=4)
    attn = TreeAttention(4, 2, 64, backend="torch", device="cpu")
    plan = attn.plan(fan(10, 1, 2))
    k = v = torch.zeros(12, 1, 2, 64)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got ndarray \(torch.from_numpy converts"):
        attn.run(np.zeros((1, 4, 64), np.float32), k, v, plan)
    with pytest.raises(TypeError, match="v_cache must be a torch.Tensor, got list"):
        attn.run(torch.zeros(1, 4, 64), k, [], plan)
