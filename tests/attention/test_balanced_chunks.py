import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from treedec import PlanError
from treedec.attention import PlanConfig, make_plan
from treedec.attention.balanced_chunks import (balanced_flatten_bounds, light_ends, longest_unit_cost,
                                               readers_per_chunk, units_per_kv_head)
from treedec.attention.persistent_schedule import TILE_TOKENS
from treedec.attention.read_intervals import read_intervals
from treedec.attention.planners import PERSISTENT_MAX_CHUNK, _sorted_runs
from treedec.tree import TreeLayout
from tests.attention.test_planners import read_pairs_from_plan
from tests.trees import random_forest


def fewshot(prompt: int, branches: int, branch_len: int) -> TreeLayout:
    """A prompt and ``branches`` children of ``branch_len`` tokens, a query at the end of each."""
    return TreeLayout.from_parents([-1] + [0] * branches, [prompt] + [branch_len] * branches,
                                   [(i, branch_len - 1) for i in range(1, branches + 1)])


def runs_of(layout):
    q_idx, lo, hi, kv_slots, *_ = read_intervals(layout)
    return _sorted_runs(q_idx, lo, hi), len(kv_slots)


def readers_brute(runs, start, end):
    q, lo, hi = runs
    return len(set(q[(lo < end) & (hi > start)].tolist()))


@given(st.integers(0, 2**32 - 1), st.integers(1, 6))
@settings(max_examples=40, deadline=None)
def test_readers_and_light_ends_match_a_brute_force_count(seed, light_readers):
    rng = np.random.default_rng(seed)
    runs, total = runs_of(random_forest(rng, page_size=4, max_nodes=20).layout())
    bounds = np.unique(np.r_[0, np.sort(rng.integers(1, total, 4)), total]) if total > 1 else np.array([0, total])
    expected = [readers_brute(runs, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    assert readers_per_chunk(bounds, runs).tolist() == expected
    ends = light_ends(runs, total, light_readers)
    num_tiles = -(-total // TILE_TOKENS)
    for s in range(num_tiles):
        e = s
        while e < num_tiles and readers_brute(runs, s * TILE_TOKENS, (e + 1) * TILE_TOKENS) <= light_readers:
            e += 1
        assert ends[s] == e, (s, ends[s], e)


def test_light_chunks_grow_longer_than_heavy_ones_and_the_cut_fits_the_grid():
    # fewshot_b30_p4k's shape: the prompt read by 30 queries (120 rows per KV head: heavy), branches by one each
    runs, total = runs_of(fewshot(4000, 30, 200))
    bounds = balanced_flatten_bounds(runs, total, query_tile=32, num_kv_heads=8, ctas=132, light_tile_cost=0.7,
                                     max_chunk=PERSISTENT_MAX_CHUNK)
    lens = np.diff(bounds)
    assert bounds[0] == 0 and bounds[-1] == total and np.all(bounds[1:-1] % TILE_TOKENS == 0)
    assert lens.max() <= PERSISTENT_MAX_CHUNK
    assert units_per_kv_head(bounds, runs, 32) * 8 <= 132
    readers = readers_per_chunk(bounds, runs)
    heavy, light = lens[readers > 16], lens[readers <= 16]
    assert heavy.size and light.size and light.max() > heavy.max()
    even = np.minimum(np.arange(17) * 625, total)   # what the one-round rule cuts: 16 even chunks
    assert longest_unit_cost(bounds, runs, 32, 0.7) < longest_unit_cost(even, runs, 32, 0.7)


def test_no_cut_fits_a_grid_too_small_for_one_unit_per_kv_head():
    runs, total = runs_of(fewshot(4000, 30, 200))
    assert balanced_flatten_bounds(runs, total, 32, num_kv_heads=8, ctas=4, light_tile_cost=0.7,
                                   max_chunk=PERSISTENT_MAX_CHUNK) is None


@pytest.mark.slow
def test_make_plan_balances_only_long_persistent_flatten_chunks_and_reads_the_same_pairs():
    layout = fewshot(4000, 30, 200)
    config = PlanConfig(query_tile=32, num_kv_heads=8, persistent_ctas=132)
    even = make_plan(layout, config)
    balanced = make_plan(layout, PlanConfig(query_tile=32, num_kv_heads=8, persistent_ctas=132, light_tile_cost=0.7))
    assert even.chunk_size == 625 and len(set(np.diff(even.chunk_kv_start)[:-1].tolist())) == 1
    assert len(set(np.diff(balanced.chunk_kv_start).tolist())) > 2 and balanced.num_items * 8 <= 132
    assert balanced.chunk_size == np.diff(balanced.chunk_kv_start).max()
    assert read_pairs_from_plan(balanced) == read_pairs_from_plan(even)
    # short units (a 256-token even chunk) and a given chunk size stay even
    small = fewshot(1500, 10, 100)
    assert make_plan(small, PlanConfig(query_tile=32, num_kv_heads=8, persistent_ctas=132, light_tile_cost=0.7)) \
        .chunk_kv_start.tolist() == make_plan(small, config).chunk_kv_start.tolist()
    fixed = PlanConfig(chunk_size=512, query_tile=32, num_kv_heads=8, persistent_ctas=132, light_tile_cost=0.7)
    assert set(np.diff(make_plan(layout, fixed).chunk_kv_start)[:-1].tolist()) == {500}


@pytest.mark.parametrize("cost", [0, -0.5, 1.5, True, "0.7", float("nan")])
def test_light_tile_cost_outside_0_1_is_a_plan_error(cost):
    with pytest.raises(PlanError, match="light_tile_cost"):
        PlanConfig(light_tile_cost=cost)
