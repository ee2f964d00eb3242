from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from treedec import PlanError
from treedec.attention import PlanConfig, make_plan
from treedec.attention.read_intervals import read_intervals
from treedec.attention.planners import (PERSISTENT_MAX_CHUNK, _flatten_bounds, _sorted_runs,
                                        _units_per_kv_head, auto_chunk_size, default_query_tile)
from treedec.tree import TreeLayout
from tests.trees import path_slots, random_forest


def read_pairs_from_plan(plan):
    """Set of (query, slot) pairs the plan's masks say are read."""
    pairs = set()
    for c in range(plan.num_chunks):
        t0, t1 = plan.chunk_kv_start[c], plan.chunk_kv_start[c + 1]
        for e in range(plan.chunk_entry_start[c], plan.chunk_entry_start[c + 1]):
            bits = np.unpackbits(plan.entry_mask[e].view(np.uint8), bitorder="little")
            assert not bits[t1 - t0:].any(), "mask bits set past the chunk's end"
            assert bits.any(), "an entry that reads nothing"
            for t in np.flatnonzero(bits):
                pairs.add((int(plan.entry_query[e]), int(plan.kv_slots[t0 + t])))
    return pairs


def check_structure(plan, config):
    assert plan.chunk_kv_start[0] == 0 and plan.chunk_kv_start[-1] == plan.num_tokens
    assert np.all(np.diff(plan.chunk_kv_start) > 0)
    # entries sorted by (chunk, query), one per pair
    chunk_of_entry = np.repeat(np.arange(plan.num_chunks), np.diff(plan.chunk_entry_start))
    key = chunk_of_entry * plan.num_queries + plan.entry_query
    assert np.all(np.diff(key) > 0)
    # per-query CSR lists each query's entries in chunk order
    for q in range(plan.num_queries):
        entries = plan.query_entries[plan.query_entry_start[q]:plan.query_entry_start[q + 1]]
        assert len(entries) >= 1 and np.all(plan.entry_query[entries] == q)
        assert np.all(np.diff(chunk_of_entry[entries]) > 0)
        assert np.all(plan.entry_direct[entries] == (len(entries) == 1))
    # work items tile every entry exactly once, at most query_tile at a time, within their chunk
    covered = np.concatenate([np.arange(s, s + n) for s, n in zip(plan.item_entry_start, plan.item_num_entries)])
    assert np.array_equal(np.sort(covered), np.arange(plan.num_entries))
    assert plan.item_num_entries.max() <= config.query_tile
    assert np.all(chunk_of_entry[plan.item_entry_start] == plan.item_chunk)
    if config.planner == "flatten":
        lens = np.diff(plan.chunk_kv_start)
        assert lens.max() <= config.chunk_size and lens[:-1].min(initial=lens.max()) == lens.max()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 4, 16]),
       planner=st.sampled_from(["flatten", "node", "node_chunk", "path"]),
       chunk_size=st.sampled_from([1, 5, 32, 64, 1000]), query_tile=st.sampled_from([1, 3, 16]))
def test_plan_reads_exactly_each_query_path(seed, page_size, planner, chunk_size, query_tile):
    rng = np.random.default_rng(seed)
    tree = random_forest(rng, page_size)
    layout = tree.layout()
    config = PlanConfig(planner, chunk_size, query_tile)
    plan = make_plan(layout, config)
    check_structure(plan, config)
    expected = set()
    for q, (node, offset) in enumerate(zip(layout.query_node, layout.query_offset)):
        expected |= {(q, int(s)) for s in path_slots(tree, int(layout.node_ids[node]), int(offset))}
    assert read_pairs_from_plan(plan) == expected


def test_kv_guided_grouping_reads_shared_prefix_once():
    # 1000-token prompt, 8 branches of 10 with one query each: the prefix chunks hold all 8 queries
    layout = TreeLayout.from_parents([-1] + [0] * 8, [1000] + [10] * 8, [(i, 9) for i in range(1, 9)])
    plan = make_plan(layout, PlanConfig("flatten", 100, 16))
    assert plan.num_tokens == 1080 and plan.num_chunks == 11
    assert np.diff(plan.chunk_entry_start)[:10].tolist() == [8] * 10
    assert plan.kv_tokens_read() == 1080  # each chunk once: one tile of 8 queries


def test_unread_branches_are_not_flattened():
    # a paused branch (no query below it) costs nothing
    layout = TreeLayout.from_parents([-1, 0, 0], [10, 50, 5], [(2, 4)])
    plan = make_plan(layout, PlanConfig("flatten", 8, 4))
    assert plan.num_tokens == 15


def test_node_planner_one_chunk_per_node_and_node_chunk_splits():
    layout = TreeLayout.from_parents([-1, 0, 0], [100, 7, 3], [(1, 6), (2, 2)])
    assert np.diff(make_plan(layout, PlanConfig("node", 1, 4)).chunk_kv_start).tolist() == [100, 7, 3]
    assert np.diff(make_plan(layout, PlanConfig("node_chunk", 40, 4)).chunk_kv_start).tolist() == [34, 34, 32, 7, 3]


def test_single_chunk_queries_are_direct():
    layout = TreeLayout.from_parents([-1, 0, 0], [10, 2, 2], [(1, 1), (2, 1)])
    assert make_plan(layout, PlanConfig("flatten", 64, 4)).entry_direct.all()
    assert not make_plan(layout, PlanConfig("flatten", 4, 4)).entry_direct.any()


@pytest.mark.parametrize("kwargs,match", [
    (dict(planner="radix"), "planner must be one of"),
    (dict(chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(query_tile=2.5), "query_tile must be an int >= 1"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(PlanError, match=match):
        PlanConfig(**kwargs)


def test_no_queries():
    with pytest.raises(PlanError, match="no queries"):
        make_plan(TreeLayout.from_parents([-1], [4], []))


def test_default_query_tile_aims_at_64_rows():
    assert [default_query_tile(g) for g in (1, 2, 3, 4, 5, 8, 128)] == [64, 32, 21, 16, 12, 8, 1]
    with pytest.raises(PlanError, match="group_size must be >= 1"):
        default_query_tile(0)
    layout = TreeLayout.from_parents([-1], [4], [(0, 3)])
    assert make_plan(layout, PlanConfig(), group_size=4).query_tile == 16


def test_auto_chunk_size_rule():
    sizes = [auto_chunk_size(w) for w in (1, 10_000, 130_000, 550_000, 1_000_000, 10**9)]
    assert sizes == [64, 128, 512, 1024, 2048, 4096]
    assert auto_chunk_size(130_000, num_sms=33) == 1024  # a quarter of the SMs: fewer, longer chunks
    # 4000-token prompt, 64 queries below it, 8 KV heads, 16 queries per tile: 4 tiles x 8 heads
    layout = TreeLayout.from_parents([-1] + [0] * 64, [4000] + [1] * 64, [(i, 0) for i in range(1, 65)])
    plan = make_plan(layout, PlanConfig(num_kv_heads=8), group_size=4)
    assert plan.chunk_size == 512 and plan.num_chunks == 8
    assert make_plan(layout, PlanConfig("node"), group_size=4).chunk_size is None


def test_auto_chunk_size_for_a_persistent_grid_gives_each_cta_about_one_unit():
    # medusa64 over 4k / 32k tokens and the cuda kernel's 132-CTA grid (H200): 512 and 4096
    assert auto_chunk_size(80_000, persistent_ctas=132) == 512
    assert auto_chunk_size(640_000, persistent_ctas=132) == 4096
    assert auto_chunk_size(10**9, persistent_ctas=132) == 4096 and auto_chunk_size(1, persistent_ctas=132) == 256
    with pytest.raises(PlanError, match="persistent_ctas"):
        PlanConfig(persistent_ctas=0)


def test_persistent_flatten_chunks_fit_one_round_of_units():
    # A prompt, 9 branches of 20 tokens with a query each, 8 KV heads, 132 CTAs.
    def layout(prompt):
        return TreeLayout.from_parents([-1] + [0] * 9, [prompt] + [20] * 9, [(i, 19) for i in range(1, 10)])
    config = PlanConfig(query_tile=32, num_kv_heads=8, persistent_ctas=132)
    # 5000 tokens: 256-token chunks make 20 chunks x 8 KV heads = 160 units, 512-token ones 80
    plan = make_plan(layout(4820), config)
    assert plan.chunk_size == 512 and plan.num_items * 8 == 80
    assert make_plan(layout(4820), PlanConfig(chunk_size=256, query_tile=32)).num_items * 8 > 132
    # enough CTAs for one round at 256: the rule leaves it
    assert make_plan(layout(4820), replace(config, persistent_ctas=160)).chunk_size == 256
    # 20000 tokens, chunks >= PERSISTENT_REFINE_CHUNK: the finest even chunking that fits, 16 x 8
    # units (17 chunks would make 136), not a power of two
    plan = make_plan(layout(19820), config)
    assert plan.chunk_size == 1250 and plan.num_chunks == 16 and plan.num_items * 8 == 128
    assert make_plan(layout(19820), PlanConfig(chunk_size=-(-20000 // 17), query_tile=32)).num_items * 8 > 132
    # 64 queries (two items per chunk) over 40000 tokens: even PERSISTENT_MAX_CHUNK makes two rounds
    wide = TreeLayout.from_parents([-1] + [0] * 64, [40000] + [1] * 64, [(i, 0) for i in range(1, 65)])
    plan = make_plan(wide, config)
    assert plan.chunk_size == PERSISTENT_MAX_CHUNK and plan.num_items * 8 == 160


@given(st.integers(0, 2**32 - 1), st.sampled_from([64, 256, 1024]), st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_unit_estimate_matches_the_flatten_plan(seed, chunk_size, query_tile):
    tree = random_forest(np.random.default_rng(seed), page_size=4)
    layout = tree.layout()
    plan = make_plan(layout, PlanConfig("flatten", chunk_size, query_tile))
    q_idx, lo, hi, *_ = read_intervals(layout)
    total = len(plan.kv_slots)
    assert np.array_equal(_flatten_bounds(total, chunk_size), plan.chunk_kv_start)
    assert _units_per_kv_head(total, chunk_size, _sorted_runs(q_idx, lo, hi), query_tile) == plan.num_items


def test_path_planner_reads_each_shared_prefix_once_per_query():
    # 1000-token prompt, 8 branches of 10 tokens, one query at the end of each branch
    layout = TreeLayout.from_parents([-1] + [0] * 8, [1000] + [10] * 8, [(i, 9) for i in range(1, 9)])
    path = make_plan(layout, PlanConfig("path", 256, 16))
    flat = make_plan(layout, PlanConfig("flatten", 256, 16))
    assert path.num_tokens == 8 * 1010 and path.kv_tokens_read() == 8 * 1010   # Q-guided
    assert flat.kv_tokens_read() == 1080                                         # KV-guided
    assert np.diff(path.chunk_entry_start).max() == 1                            # one query per chunk
    assert path.chunk_size == 256 and np.diff(path.chunk_kv_start).max() <= 256


@pytest.mark.parametrize("layout, config, match", [
    (None, PlanConfig(), "layout must be a TreeLayout .*, got NoneType"),
    ("tree", PlanConfig(), "layout must be a TreeLayout .*, got str"),
    ("LAYOUT", {"planner": "flatten"}, "config must be a PlanConfig, got dict"),
])
def test_make_plan_names_an_argument_of_the_wrong_type(layout, config, match):
    """Was: AttributeError 'NoneType' object has no attribute 'num_queries'."""
    if layout == "LAYOUT":
        layout = random_forest(np.random.default_rng(0), 4).layout()
    with pytest.raises(TypeError, match=match):
        make_plan(layout, config)
