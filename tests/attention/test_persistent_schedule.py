"""treedec/attention/persistent_schedule.py: units cover the plan's work once, balanced over CTAs."""
import dataclasses
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from treedec import PlanConfig
from treedec.attention import make_plan, schedule_units
from treedec.attention.persistent_schedule import (COST_PER_UNIT, FULL_TILE_FLAG, SCHEDULE_HEADER, TILE_SIZES,
                                                   UNIT_FIELDS, live_kv_tokens, live_tiles)
from treedec.attention.planner_choice import PLANNER_ENV
from treedec.kernels import planner_build
from bench.suite import fewshot
from tests.trees import random_forest

IMPLS = ["numpy", pytest.param("compiled", marks=pytest.mark.skipif(planner_build.build_problem() is not None,
                                                                    reason="no compiled planner here"))]


def plan_for(seed: int, chunk_size: int = 32, query_tile: int = 4):
    tree = random_forest(np.random.default_rng(seed), page_size=4, num_kv_heads=1, max_nodes=10)
    return make_plan(tree.layout(), PlanConfig("flatten", chunk_size=chunk_size, query_tile=query_tile))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), group=st.sampled_from([1, 3, 4, 8, 80]), hkv=st.integers(1, 3),
       ctas=st.integers(1, 40), rows=st.sampled_from([16, 64]))
def test_units_cover_every_item_head_and_row_once(seed, group, hkv, ctas, rows):
    plan = plan_for(seed)
    s = schedule_units(plan, group, hkv, ctas, rows)
    assert s.cta_unit_start[0] == 0 and s.cta_unit_start[-1] == s.num_units
    assert np.all(np.diff(s.cta_unit_start) >= 0)
    chunk, head, entry_start, row_begin, row_end = s.unit_info.T[:5]
    assert np.all(row_end - row_begin <= rows) and np.all(row_end > row_begin)
    covered = set()
    for c, h, e, b, end in s.unit_info[:, :5].tolist():
        for r in range(b, end):
            key = (c, h, e, r)
            assert key not in covered
            covered.add(key)
    expected = {(int(plan.item_chunk[i]), h, int(plan.item_entry_start[i]), r)
                for i in range(plan.num_items) for h in range(hkv)
                for r in range(int(plan.item_num_entries[i]) * group)}
    assert covered == expected


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), ctas=st.integers(1, 64), tile=st.sampled_from(TILE_SIZES))
def test_greedy_assignment_is_within_the_list_scheduling_bound(seed, ctas, tile):
    """Loads add up to the units' costs; no CTA carries more than the mean load plus the heaviest unit."""
    plan = plan_for(seed, chunk_size=16, query_tile=2)
    s = schedule_units(plan, 4, 2, ctas, tile_tokens=tile)
    costs = unit_costs(plan, s)
    assert s.cta_cost.sum() == pytest.approx(costs.sum())
    cta_of_unit = np.repeat(np.arange(ctas), np.diff(s.cta_unit_start))
    per_cta = np.bincount(cta_of_unit, weights=costs, minlength=ctas)
    np.testing.assert_allclose(per_cta, s.cta_cost)
    assert s.cta_cost.max() <= costs.sum() / ctas + costs.max() + 1e-9
    assert s.imbalance() >= 1.0


def unit_costs(plan, s) -> np.ndarray:
    """Each unit's cost from the cost model, recomputed from its fields."""
    live = dict(zip(zip(plan.item_chunk.tolist(), plan.item_entry_start.tolist()),
                    live_kv_tokens(plan, tile_tokens=s.tile_tokens).tolist()))
    return np.array([COST_PER_UNIT + (end - begin) + live[(c, e)] for c, _, e, begin, end in s.unit_info[:, :5].tolist()])


@pytest.mark.parametrize("tile", TILE_SIZES)
def test_live_tokens_count_only_tiles_some_entry_reads(tile):
    plan = plan_for(3, chunk_size=256, query_tile=64)
    live = live_kv_tokens(plan, tile_tokens=tile)
    chunk_len = np.diff(plan.chunk_kv_start)[plan.item_chunk]
    assert np.all(live <= chunk_len) and np.all(live > 0)
    for i in range(plan.num_items):
        e0, n = plan.item_entry_start[i], plan.item_num_entries[i]
        words = np.bitwise_or.reduce(plan.entry_mask[e0:e0 + n], axis=0)
        tiles = {t // tile for t in range(int(chunk_len[i])) if (words[t // 32] >> (t % 32)) & 1}
        assert live[i] == min(len(tiles) * tile, chunk_len[i])


@pytest.mark.parametrize("name,value", [("group", 0), ("num_kv_heads", -1), ("num_ctas", 0), ("rows_per_unit", 0),
                                        ("tile_tokens", 32), ("tile_tokens", 128)])
def test_bad_arguments_raise(name, value):
    args = dict(group=4, num_kv_heads=2, num_ctas=8, rows_per_unit=64)
    args[name] = value
    with pytest.raises(ValueError, match=name):
        schedule_units(plan_for(0), **args)


def ranges_of(num_tokens: int, picks) -> tuple[tuple[int, int], ...]:
    """Sorted, non-overlapping ``dynamic_kv`` ranges of a plan's ``num_tokens`` from ``picks`` of (where in [0, 1],
    length): each starts at its place or where the one before stops (adjacent ones touch), cut at the end."""
    ranges, cursor = [], 0
    for where, length in sorted(picks):
        start = max(int(where * num_tokens), cursor)
        stop = min(start + length, num_tokens)
        if start < stop:
            ranges.append((start, stop))
            cursor = stop
    return tuple(ranges)


def test_with_dynamic_kv_is_dataclasses_replace():
    """TreePlan.with_dynamic_kv (the speculative spans' path) gives what dataclasses.replace gives: the same
    fields, the others shared; the plan it was made from keeps its ranges."""
    plan = plan_for(0, chunk_size=200, query_tile=3)
    got, want = plan.with_dynamic_kv(((0, 3),)), dataclasses.replace(plan, dynamic_kv=((0, 3),))
    assert type(got) is type(want) and vars(got).keys() == vars(want).keys()
    assert all(vars(got)[k] is vars(want)[k] for k in vars(want)) and plan.dynamic_kv == ()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), ctas=st.integers(1, 16), tile=st.sampled_from(TILE_SIZES),
       dynamic=st.lists(st.tuples(st.floats(0, 1), st.sampled_from([1, 5, 64, 200, 10_000])), max_size=4))
def test_each_unit_lists_exactly_the_tiles_its_item_reads(seed, ctas, tile, dynamic):
    """The kernels' tile lists: tiles[tile_begin:tile_end] are the item's live tiles, ascending, flagged full
    where every entry reads the whole tile and no token of it is in one of the plan's dynamic_kv ranges;
    device_array() holds the header (tile size, 0), the records, then the lists at the offsets the records name;
    each record carries its chunk's first slot index and length and its first live tile."""
    plan = plan_for(seed, chunk_size=200, query_tile=3)
    plan = dataclasses.replace(plan, dynamic_kv=ranges_of(plan.num_tokens, dynamic))
    s = schedule_units(plan, 2, 2, ctas, tile_tokens=tile)
    flat = s.device_array()
    assert s.tile_tokens == tile and flat[:SCHEDULE_HEADER].tolist() == [tile, 0]
    assert flat.dtype == np.int32 and len(flat) == SCHEDULE_HEADER + s.unit_info.size + len(s.tiles)
    records = flat[SCHEDULE_HEADER:SCHEDULE_HEADER + s.unit_info.size].reshape(-1, len(UNIT_FIELDS))
    item_of = {(int(c), int(e)): i for i, (c, e) in enumerate(zip(plan.item_chunk, plan.item_entry_start))}
    dynamic_positions = [p for start, stop in plan.dynamic_kv for p in range(start, stop)]
    for rec in records.tolist():
        chunk, _, entry_start, _, _, begin, end, kv_begin, chunk_len, first_tile = rec
        i = item_of[(chunk, entry_start)]
        e0, n = plan.item_entry_start[i], plan.item_num_entries[i]
        reads = [[bool((m[t // 32] >> (t % 32)) & 1) for t in range(chunk_len)] for m in plan.entry_mask[e0:e0 + n]]
        assert kv_begin == plan.chunk_kv_start[chunk]
        assert chunk_len == plan.chunk_kv_start[chunk + 1] - plan.chunk_kv_start[chunk]
        live = sorted({t // tile for t in range(chunk_len) if any(r[t] for r in reads)})
        dynamic_tiles = {(p - kv_begin) // tile for p in dynamic_positions if 0 <= p - kv_begin < chunk_len}
        full = {i for i in live if (i + 1) * tile <= chunk_len and all(all(r[i * tile:(i + 1) * tile]) for r in reads)
                and i not in dynamic_tiles}
        expected = [i | (FULL_TILE_FLAG if i in full else 0) for i in live]
        assert flat[begin:end].tolist() == expected
        assert first_tile == (expected[0] if expected else 0)


def test_tiles_every_query_reads_whole_are_flagged_full():
    """A 300-token prompt read by 3 branch queries, one 360-token chunk: the prompt's four whole
    tiles are full, the tile where the prompt ends and the branches' tiles are not."""
    plan = make_plan(fewshot("t", 300, 3, 20).layout, PlanConfig("flatten", chunk_size=512, query_tile=3))
    _, tiles = live_tiles(plan)
    assert plan.num_chunks == 1 and tiles.tolist() == [0 | FULL_TILE_FLAG, 1 | FULL_TILE_FLAG, 2 | FULL_TILE_FLAG,
                                                       3 | FULL_TILE_FLAG, 4, 5]
    _, tiles96 = live_tiles(plan, 96)  # tokens 0-287 in three whole tiles, 288-359 in a short one
    assert tiles96.tolist() == [0 | FULL_TILE_FLAG, 1 | FULL_TILE_FLAG, 2 | FULL_TILE_FLAG, 3]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dynamic_kv, tiles, tiles96", [
    ((), [0, 1, 2, 3], [0, 1, 2]),                           # none: the planner's plan
    (((70, 75),), [0, 2, 3], [1, 2]),                        # inside 64-token tile 1 (96-token tile 0)
    (((127, 129),), [0, 3], [0, 2]),                         # across the 64-token tiles 1 and 2
    (((300, 360),), [0, 1, 2, 3], [0, 1, 2]),                # the branches: tiles that were not full
    (((0, 360),), [], []),                                   # every token
    (((0, 1), (130, 131)), [1, 3], [2]),                     # 64: tiles 0 and 2; 96: tiles 0 and 1
    (((10, 20), (200, 201)), [1, 2], [1]),                   # 64: tiles 0 and 3; 96: tiles 0 and 2
    (((300, 320), (330, 340)), [0, 1, 2, 3], [0, 1, 2]),     # both in the branches
    (((64, 100), (100, 128)), [0, 2, 3], [2]),               # adjacent: 64: both in tile 1; 96: tiles 0 and 1
    (((5, 6), (70, 71), (250, 260), (300, 301)), [2], [1]),  # four: 64: tiles 0, 1, 3; 96: tiles 0, 2
])
def test_tiles_holding_a_dynamic_position_are_never_full(impl, dynamic_kv, tiles, tiles96, monkeypatch):
    """The device may clear mask bits of the dynamic_kv positions after the plan is written: a tile holding one
    of any range loses its full flag (its mask words are read), the other tiles keep theirs, and the live tiles
    stay."""
    monkeypatch.setenv(PLANNER_ENV, impl)
    plan = make_plan(fewshot("t", 300, 3, 20).layout, PlanConfig("flatten", chunk_size=512, query_tile=3))
    assert plan.dynamic_kv == () and plan.num_chunks == 1
    plan = dataclasses.replace(plan, dynamic_kv=dynamic_kv)
    for tile, full, live in ((64, tiles, 6), (96, tiles96, 4)):
        listed = schedule_units(plan, 1, 1, 4, tile_tokens=tile).tiles
        assert listed.tolist() == [t | (FULL_TILE_FLAG if t in full else 0) for t in range(live)]
        assert live_tiles(plan, tile)[1].tolist() == listed.tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_dynamic_position_unflags_the_tile_of_its_own_chunk(impl, monkeypatch):
    """Positions are in the flattened KV order: the tile that loses its flag is the one of the chunk holding the
    position, counted from that chunk's first token; every other item's tiles keep their flags. A tile meeting
    only the second of two ranges (the first far before it, in another chunk) loses its flag too."""
    monkeypatch.setenv(PLANNER_ENV, impl)
    plan = make_plan(fewshot("t", 1000, 3, 20).layout, PlanConfig("flatten", chunk_size=256, query_tile=3))
    item_tile_start, before = live_tiles(plan)

    def tile_index(chunk: int, tile: int) -> int:
        return int(item_tile_start[int(np.flatnonzero(plan.item_chunk == chunk)[0])]) + tile

    position = int(plan.chunk_kv_start[1]) + 64 + 10   # token 10 of chunk 1's (full) tile 1
    early = int(plan.chunk_kv_start[0]) + 2 * 64       # the first token of chunk 0's (full) tile 2
    index, early_index = tile_index(1, 1), tile_index(0, 2)
    assert plan.num_chunks == 5 and before[index] == 1 | FULL_TILE_FLAG and before[early_index] == 2 | FULL_TILE_FLAG
    expected = before.copy()
    expected[index] = 1
    for dynamic_kv in (((position, position + 1),), ((position - 10, position + 54),)):  # a token; the whole tile
        after = schedule_units(dataclasses.replace(plan, dynamic_kv=dynamic_kv), 1, 1, 4).tiles
        assert after.tolist() == expected.tolist()
    expected[early_index] = 2
    for dynamic_kv in (((early, early + 1), (position, position + 1)),
                       ((early, early + 64), (position - 10, position))):
        after = schedule_units(dataclasses.replace(plan, dynamic_kv=dynamic_kv), 1, 1, 4).tiles
        assert after.tolist() == expected.tolist()


def bad_range(k, value, why):
    return f"dynamic_kv[{k}] = {value!r} {why}"


OUTSIDE = "is outside the plan's KV: 0 <= start < stop <= num_tokens (360)"
NOT_A_TUPLE = "dynamic_kv must be a tuple of (start, stop) ranges or an [R, 2] int array, got {!r}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dynamic_kv, message", [
    (((-1, 3),), bad_range(0, (-1, 3), OUTSIDE)),
    (((0, 361),), bad_range(0, (0, 361), OUTSIDE)),
    (((4, 5), (361, 362)), bad_range(1, (361, 362), OUTSIDE)),
    (((5, 3),), bad_range(0, (5, 3), "is empty or reversed: start must be < stop")),
    (((1, 2), (3, 3)), bad_range(1, (3, 3), "is empty or reversed: start must be < stop")),
    (((10, 20), (5, 8)), bad_range(1, (5, 8), "starts before dynamic_kv[0] = (10, 20): the ranges must be sorted "
                                              "by start")),
    (((10, 20), (15, 30)), bad_range(1, (15, 30), "overlaps dynamic_kv[0] = (10, 20): the ranges must not overlap "
                                                 "(adjacent ones may touch)")),
    (((0, 4), (10, 20), (10, 30)), bad_range(2, (10, 30), "overlaps dynamic_kv[1] = (10, 20): the ranges must not "
                                                         "overlap (adjacent ones may touch)")),
    (((1.0, 2),), "dynamic_kv[0] must be a (start, stop) pair of ints, got (1.0, 2)"),
    (((True, 2),), "dynamic_kv[0] must be a (start, stop) pair of ints, got (True, 2)"),
    (((1, 2), (3,)), "dynamic_kv[1] must be a (start, stop) pair of ints, got (3,)"),
    (((1, 2, 3),), "dynamic_kv[0] must be a (start, stop) pair of ints, got (1, 2, 3)"),
    (([1, 2],), "dynamic_kv[0] must be a (start, stop) pair of ints, got [1, 2]"),
    ((1, 2), "dynamic_kv[0] must be a (start, stop) pair of ints, got 1"),   # the old single-range form
    ((0, 0), "dynamic_kv[0] must be a (start, stop) pair of ints, got 0"),
    (None, NOT_A_TUPLE.format(None)),
    ("ab", NOT_A_TUPLE.format("ab")),
    ([(1, 2)], NOT_A_TUPLE.format([(1, 2)])),
    (np.array([[1, 2.5]]), "dynamic_kv as an array must be [R, 2] ints, got float64 (1, 2)"),
    (np.array([1, 2]), "dynamic_kv as an array must be [R, 2] ints, got int64 (2,)"),
    (np.array([[10, 20], [15, 30]]), "dynamic_kv[1] = (15, 30) overlaps the range before it"),
    (np.array([[10, 20], [0, 5]]), "dynamic_kv[1] = (0, 5) starts before the range before it"),
    (np.array([[5, 5]]), "dynamic_kv[0] = (5, 5) is empty or reversed"),
    (np.array([[300, 400]]), "dynamic_kv[0] = (300, 400) is outside the plan's KV"),
])
def test_a_bad_dynamic_range_is_named(impl, dynamic_kv, message, monkeypatch):
    monkeypatch.setenv(PLANNER_ENV, impl)
    plan = make_plan(fewshot("t", 300, 3, 20).layout, PlanConfig("flatten", chunk_size=512, query_tile=3))
    assert plan.num_tokens == 360
    plan = dataclasses.replace(plan, dynamic_kv=dynamic_kv)
    with pytest.raises(ValueError, match=re.escape(message)):
        schedule_units(plan, 1, 1, 4)
    with pytest.raises(ValueError, match=re.escape(message)):
        live_tiles(plan)
