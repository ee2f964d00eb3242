"""The compiled planner (treedec/kernels/planner) gives the numpy planner's plans, schedules and static-plan
writes bit for bit; which one runs is chosen by TREEDEC_PLANNER and reported, never switched silently."""
import contextlib
import dataclasses
import logging
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from treedec.attention import (PLANNERS, AttentionVariant, PlanBounds, PlanConfig, StaticPlan, make_plan, planners,
                               schedule_units)
from treedec.attention import balanced_chunks, persistent_schedule, planner_choice, split_kv, static_plan, tree_plan
from treedec.attention.backends.cuda_backend import CudaBackend
from treedec.attention.persistent_schedule import FULL_TILE_FLAG, TILE_SIZES, PersistentSchedule, live_tiles
from treedec.attention.planner_choice import PLANNER_ENV, planner_impl
from treedec.errors import BackendUnavailableError, PlanError
from treedec.kernels import planner_build
from treedec.tree import TreeLayout
from treedec.workloads.deft import medusa_tree

BUILD_PROBLEM = planner_build.build_problem()
needs_compiled = pytest.mark.skipif(BUILD_PROBLEM is not None, reason=f"no compiled planner here: {BUILD_PROBLEM}")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def using(impl: str):
    """TREEDEC_PLANNER=impl inside the block (hypothesis tests cannot take the monkeypatch fixture)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PLANNER_ENV, impl)
        yield


def both(fn):
    """``fn()`` under the numpy planner, then the compiled one."""
    with using("numpy"):
        reference = fn()
    with using("compiled"):
        return reference, fn()


def assert_same(a, b):
    """Every compared field of two plans or schedules equal: arrays bitwise, with dtype and shape."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert (x.dtype, x.shape) == (y.dtype, y.shape), (f.name, x.dtype, y.dtype, x.shape, y.shape)
            assert x.tobytes() == y.tobytes(), f.name
        elif f.name == "layout":
            assert x is y
        elif f.compare:
            assert (type(x), x) == (type(y), y), (f.name, x, y)
    if isinstance(a, PersistentSchedule):
        assert_same_array(a.device_array(), b.device_array())


def assert_same_array(x, y):
    assert (x.dtype, x.shape) == (y.dtype, y.shape) and x.tobytes() == y.tobytes()


def paged_slots(rng, lengths, page_size: int) -> list[np.ndarray]:
    """Each node's tokens in pages of ``page_size`` slots, the pages of the pool in random order."""
    pages = rng.permutation(sum(-(-n // page_size) for n in lengths) + 8)
    out, used = [], 0
    for n in lengths:
        count = -(-n // page_size)
        slots = (pages[used:used + count, None] * page_size + np.arange(page_size)).reshape(-1)[:n]
        out.append(slots.astype(np.int64))
        used += count
    return out


def random_layout(rng, page_size: int, decode_batch: bool) -> TreeLayout:
    """A forest with one step pending: requests of a prompt, branches (some empty) and token trees, queries on
    some leaves' tails and token-tree nodes, other leaves paused; or (``decode_batch``) independent sequences,
    one query at each end (a step whose queries share no KV)."""
    if decode_batch:
        lengths = rng.integers(1, rng.choice([300, 3000]), rng.integers(1, 40)).tolist()
        return TreeLayout.from_parents([-1] * len(lengths), lengths, [(i, n - 1) for i, n in enumerate(lengths)],
                                       paged_slots(rng, lengths, page_size))
    parents, lengths, queries = [], [], []
    for _ in range(rng.integers(1, 5)):
        nodes = [len(parents)]
        parents.append(-1)
        lengths.append(int(rng.integers(1, rng.choice([100, 700, 5000]))))
        for _ in range(rng.integers(0, 12)):
            nodes.append(len(parents))
            parents.append(int(rng.choice(nodes[:-1])))
            lengths.append(0 if rng.random() < 0.1 else int(rng.integers(1, 60)))
        for leaf in [n for n in nodes if n not in parents and lengths[n] > 0]:
            kind = rng.random()
            if kind < 0.5:
                queries += [(leaf, lengths[leaf] - 1 - k) for k in range(min(lengths[leaf], rng.integers(1, 4)))]
            elif kind < 0.8:  # a token tree: nodes of one token, each a query
                tree = [leaf]
                for _ in range(rng.integers(1, 12)):
                    tree.append(len(parents))
                    parents.append(int(rng.choice(tree[:-1])))
                    lengths.append(1)
                    queries.append((tree[-1], 0))
    if not queries:
        queries.append((0, lengths[0] - 1))
    return TreeLayout.from_parents(parents, lengths, [queries[i] for i in rng.permutation(len(queries))],
                                   paged_slots(rng, lengths, page_size))


configs = st.one_of(
    st.builds(PlanConfig, planner=st.sampled_from(PLANNERS), chunk_size=st.sampled_from([None, None, 16, 64, 300]),
              query_tile=st.sampled_from([None, 1, 4, 16, 32]), num_kv_heads=st.sampled_from([1, 2, 8]),
              num_sms=st.sampled_from([132, 16]), persistent_ctas=st.sampled_from([None, 8, 132]),
              light_tile_cost=st.sampled_from([None, 0.5, 0.7, 1.0])),
    # the cuda backend's: automatic flatten chunks on a persistent grid (split-KV, one round, balanced chunks)
    st.builds(PlanConfig, query_tile=st.sampled_from([8, 16, 32]), num_kv_heads=st.sampled_from([1, 2, 8]),
              persistent_ctas=st.sampled_from([8, 32, 132]), light_tile_cost=st.sampled_from([None, 0.5, 0.7])),
    # the batch-invariant mode's: absolute windows of a fixed chunk, shared by the queries reading all their keys
    st.builds(PlanConfig, planner=st.just("path"), chunk_size=st.sampled_from([1, 7, 16, 64, 300]),
              query_tile=st.sampled_from([None, 1, 4, 16]), batch_invariant=st.just(True)))


# sliding windows (AttentionVariant.window) from one token to past every position of random_layout's trees
windows = st.sampled_from([None, None, 1, 7, 64, 700, 6000]).map(lambda w: AttentionVariant(window=w))


@needs_compiled
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 4, 16]), decode_batch=st.booleans(),
       config=configs, group=st.sampled_from([1, 4, 8]), variant=windows)
def test_plans_are_bitwise_the_numpy_planners(seed, page_size, decode_batch, config, group, variant):
    layout = random_layout(np.random.default_rng(seed), page_size, decode_batch)
    assert_same(*both(lambda: make_plan(layout, config, group, variant)))


def shuffled(layout: TreeLayout, rng) -> TreeLayout:
    """``layout`` with its nodes (and their tokens) in a random order: no longer a preorder, which the
    TreeLayout contract asks for but the numpy planner does not need (the compiled one then counts chunk
    readers from the read intervals instead of the tree's order)."""
    order = rng.permutation(layout.num_nodes)            # order[new] = old
    new_of = np.empty_like(order)
    new_of[order] = np.arange(len(order))
    parent = np.where(layout.parent[order] >= 0, new_of[np.maximum(layout.parent[order], 0)], -1)
    lens = layout.node_len[order]
    kv_start = np.concatenate([[0], np.cumsum(lens)])
    slots = np.concatenate([layout.kv_slots[layout.kv_start[i]:layout.kv_start[i + 1]] for i in order])
    return TreeLayout(np.arange(len(order)), parent, kv_start, slots, new_of[layout.query_node], layout.query_offset)


@needs_compiled
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), config=configs, variant=windows)
def test_layouts_out_of_preorder_plan_as_numpy_does(seed, config, variant):
    rng = np.random.default_rng(seed)
    layout = shuffled(random_layout(rng, 4, False), rng)
    assert_same(*both(lambda: make_plan(layout, config, 4, variant)))


def with_dynamic_kv(plan, rng, dynamic: tuple[int, int]):
    """``plan`` with ``dynamic_kv`` ``dynamic = (count, length)``: up to ``count`` random sorted ranges of at most
    ``length`` positions, adjacent ones among them (cut at the plan's end; count 0: none)."""
    count, length = dynamic
    ranges, cursor = [], 0
    for where in np.sort(rng.integers(0, plan.num_tokens + 1, count)):
        start = max(int(where), cursor) if rng.random() < 0.8 else cursor  # now and then one touching the last
        stop = min(start + int(rng.integers(1, length + 1)), plan.num_tokens)
        if start < stop:
            ranges.append((start, stop))
            cursor = stop
    return dataclasses.replace(plan, dynamic_kv=tuple(ranges))


dynamic_ranges = st.tuples(st.sampled_from([0, 1, 2, 5, 16]), st.sampled_from([1, 30, 64, 500, 10**6]))


@needs_compiled
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), decode_batch=st.booleans(), config=configs, group=st.sampled_from([1, 4, 5]),
       kv_heads=st.sampled_from([1, 3, 8]), ctas=st.sampled_from([1, 7, 132]), rows=st.sampled_from([16, 64, 128]),
       tile=st.sampled_from(TILE_SIZES), dynamic=dynamic_ranges)
def test_schedules_are_bitwise_the_numpy_ones(seed, decode_batch, config, group, kv_heads, ctas, rows, tile, dynamic):
    rng = np.random.default_rng(seed)
    with using("numpy"):
        plan = with_dynamic_kv(make_plan(random_layout(rng, 4, decode_batch), config, group), rng, dynamic)
    assert_same(*both(lambda: schedule_units(plan, group, kv_heads, ctas, rows, tile)))


def fewshot(prompt: int, branches: int, branch_len: int) -> TreeLayout:
    return TreeLayout.from_parents([-1] + [0] * branches, [prompt] + [branch_len] * branches,
                                   [(i, branch_len - 1) for i in range(1, branches + 1)])


def medusa_forest(requests: int, prompt: int = 4000) -> TreeLayout:
    """bench/plan_cost.py's trees: requests of a prompt with the 64-token Medusa tree pending under it."""
    tree = medusa_tree(64).parents
    parents, lengths, queries = [], [], []
    for _ in range(requests):
        root = len(parents)
        parents.append(-1)
        lengths.append(prompt)
        for p in tree:
            queries.append((len(parents), 0))
            parents.append(root if p < 0 else root + 1 + int(p))
            lengths.append(1)
    return TreeLayout.from_parents(parents, lengths, queries)


CUDA_LIKE = PlanConfig(query_tile=32, num_kv_heads=8, persistent_ctas=132, light_tile_cost=0.7)


@needs_compiled
@pytest.mark.parametrize("name, layout, config, shows", [
    # each case drives one branch of the planner; `shows` checks that the numpy planner took it, from its plan and
    # what its split-KV and balanced-chunk searches returned
    ("balanced chunks", fewshot(4000, 30, 200), CUDA_LIKE,
     lambda p, found: found["balanced"] == [p.chunk_kv_start.tolist()]),
    ("even: short chunks", fewshot(1500, 10, 100), CUDA_LIKE, lambda p, found: p.chunk_size == 256),
    ("even: no balanced cut fits", fewshot(4000, 10, 200), dataclasses.replace(CUDA_LIKE, persistent_ctas=8),
     lambda p, found: found["balanced"] == [None]),
    ("split-KV", TreeLayout.from_parents([-1] * 40, [1000] * 40, [(i, 999) for i in range(40)]), CUDA_LIKE,
     lambda p, found: found["split"] == [p.chunk_kv_start.tolist()]),
    ("few sequences: one round of even chunks",
     TreeLayout.from_parents([-1] * 3, [900] * 3, [(i, 899) for i in range(3)]), CUDA_LIKE,
     lambda p, found: found["split"] == [None]),
    ("one round, refined", medusa_forest(8), CUDA_LIKE, lambda p, found: p.chunk_size == 4064),
    ("medusa 64 over 4k", medusa_forest(1), CUDA_LIKE, lambda p, found: p.chunk_size == 512),
    ("paused branch", TreeLayout.from_parents([-1, 0, 0], [50, 30, 20], [(2, 19)]), PlanConfig(chunk_size=16),
     lambda p, found: p.num_tokens == 70),
    ("path", medusa_forest(2, 300), PlanConfig("path", query_tile=4), lambda p, found: p.num_tokens > 600),
    ("batch-invariant windows", medusa_forest(2, 300), PlanConfig("path", 64, 4, batch_invariant=True),
     lambda p, found: p.num_chunks == 2 * (4 + 64) and p.num_tokens == 2 * (256 + sum(44 + d for d in
                                                                                        medusa_tree(64).depth + 1))),
    ("windowed balanced chunks", fewshot(4000, 30, 200), CUDA_LIKE, lambda p, found: p.num_tokens < 30 * 200 + 1300),
    ("windowed split-KV", TreeLayout.from_parents([-1] * 40, [2000] * 40, [(i, 1999) for i in range(40)]), CUDA_LIKE,
     lambda p, found: found["split"] == [p.chunk_kv_start.tolist()] and p.num_tokens == 40 * 1024),
])
def test_every_branch_of_the_planner_matches(name, layout, config, shows, monkeypatch):
    found = {"split": [], "balanced": []}
    for key, fn in (("split", "split_kv_bounds"), ("balanced", "balanced_flatten_bounds")):
        original = getattr(planners, fn)
        monkeypatch.setattr(planners, fn, lambda *a, _f=original, _k=key: found[_k].append(_f(*a)) or found[_k][-1])
    variant = AttentionVariant(window=1024 if name.startswith("windowed") else None)
    reference, compiled = both(lambda: make_plan(layout, config, 4, variant))
    found = {k: [None if v is None else v.tolist() for v in values] for k, values in found.items()}
    assert shows(reference, found), name
    assert_same(reference, compiled)
    tile = 96 if reference.max_chunk_len >= 1024 else 64
    assert_same(*both(lambda: schedule_units(reference, 4, 8, 132, 128, tile)))


def static_plans(plan, tile):
    """Two static plans of the cuda backend's host side on the CPU, with an extra section (as the engine's)."""
    bounds = PlanBounds.for_plan(plan)
    backend = CudaBackend.without_kernels(32, 8, 128, torch.bfloat16, 132, tile)
    return [StaticPlan(bounds, backend, torch.device("cpu"), extra={"inputs": (3, bounds.max_queries)})
            for _ in range(2)]


@needs_compiled
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), tile=st.sampled_from(TILE_SIZES), dynamic=dynamic_ranges)
def test_static_writes_fill_the_same_buffers(seed, tile, dynamic):
    rng = np.random.default_rng(seed)
    with using("numpy"):
        plans = [with_dynamic_kv(make_plan(random_layout(rng, 4, False), CUDA_LIKE, 4), rng, dynamic) for _ in range(3)]
    big = max(plans, key=lambda p: (p.num_queries, p.num_tokens))
    reference, compiled = static_plans(big, tile)
    for plan in [big] + [p for p in plans if reference.bounds.fits(p)]:  # a big plan, then smaller ones over it
        inputs = rng.integers(0, 1000, (3, max(1, plan.num_queries // 2)))  # narrower than the section
        with using("numpy"):
            reference.write(plan, extra={"inputs": inputs})
        with using("compiled"):
            compiled.write(plan, extra={"inputs": inputs})
        assert torch.equal(reference._host, compiled._host) and torch.equal(reference._dev, compiled._dev)
        assert_same(reference.device_plan.prepared.schedule, compiled.device_plan.prepared.schedule)


@pytest.mark.parametrize("impl", ["numpy", pytest.param("compiled", marks=needs_compiled)])
def test_an_extra_section_narrower_than_its_rows_reaches_the_device(impl, monkeypatch):
    """A 2-D extra section written narrower than its rows: every row's values are copied, the last row's too
    (the copy once ended at start + values.size, short of the last row when it is the buffer's last section)."""
    monkeypatch.setenv(PLANNER_ENV, impl)
    plan = make_plan(fewshot(100, 3, 5), PlanConfig(chunk_size=32, query_tile=2), 1)
    static = static_plans(plan, 64)[0]
    values = np.arange(1, 7).reshape(3, 2)
    static.write(plan, extra={"inputs": values})
    assert static.extra["inputs"][:, :2].tolist() == values.tolist()


@needs_compiled
def test_the_compiled_constants_are_the_numpy_planners():
    expected = {"MASK_BITS": tree_plan.MASK_BITS, "PERSISTENT_MIN_CHUNK": planners.PERSISTENT_MIN_CHUNK,
                "PERSISTENT_MAX_CHUNK": planners.PERSISTENT_MAX_CHUNK,
                "PERSISTENT_REFINE_CHUNK": planners.PERSISTENT_REFINE_CHUNK,
                "BALANCED_MIN_GAIN": planners.BALANCED_MIN_GAIN, "TILE_TOKENS": balanced_chunks.TILE_TOKENS,
                "MAX_QUERY_TILE_PAIRS": balanced_chunks.MAX_QUERY_TILE_PAIRS,
                "SPLIT_UNIT_COST": split_kv.SPLIT_UNIT_COST,
                "COST_PER_ROW": persistent_schedule.COST_PER_ROW,
                "COST_PER_KV_TOKEN": persistent_schedule.COST_PER_KV_TOKEN,
                "COST_PER_UNIT": persistent_schedule.COST_PER_UNIT,
                "FULL_TILE_FLAG": persistent_schedule.FULL_TILE_FLAG,
                "UNIT_FIELDS": len(persistent_schedule.UNIT_FIELDS),
                "SCHEDULE_HEADER": persistent_schedule.SCHEDULE_HEADER,
                "COALESCE_GAP": static_plan._COALESCE_GAP}
    assert planner_build.load_planner().constants() == expected


@needs_compiled
@pytest.mark.parametrize("window", [0, 16])
def test_bad_arrays_raise_value_errors_not_crashes(window):
    module = planner_build.load_planner()
    layout = fewshot(50, 2, 3)
    args = [layout.parent, layout.kv_start, layout.kv_slots, layout.query_node, layout.query_offset]
    sizes = [0, 0, 4, 8, 132, 0, 1.0, 1, window, False]
    bad = {
        "kv_start must have one more": [args[0], args[1][:-1], *args[2:]],
        "query_offset and query_node differ": [*args[:4], args[4][:1]],
        "query_node out of range": [*args[:3], np.array([7, 1]), args[4]],
        "query_offset out of range": [*args[:4], np.array([3, 0])],
        "parents form a cycle": [np.array([-1, 2, 1]), *args[1:]],
        "parent index out of range": [np.array([-1, 0, 9]), *args[1:]],
        "must be a 1-D integer array": [args[0].astype(np.float64), *args[1:]],
    }
    for message, arrays in bad.items():
        with pytest.raises(ValueError, match=message):
            module.make_plan(*arrays, *sizes)
    with pytest.raises(ValueError, match="no queries"):
        module.make_plan(*args[:3], np.zeros(0, np.int64), np.zeros(0, np.int64), *sizes)
    for planner, chunk in ((0, 16), (3, 0)):   # batch-invariant plans: the path planner, a fixed chunk
        with pytest.raises(ValueError, match="batch_invariant plans need the path planner and a fixed chunk_size"):
            module.make_plan(*args, planner, chunk, *sizes[2:-1], True)
    plan = make_plan(layout, PlanConfig(chunk_size=16, query_tile=2), 1)
    items = [plan.item_chunk, plan.item_entry_start, plan.item_num_entries, plan.chunk_kv_start, plan.entry_mask]
    none = np.zeros((0, 2), np.int64)
    with pytest.raises(ValueError, match="points outside"):
        module.schedule_units(plan.item_chunk, plan.item_entry_start + 100, *items[2:], 1, 1, 4, 64, 64, none)
    with pytest.raises(ValueError, match="size is out of range"):
        module.schedule_units(*items, 1, 1, 4, 64, 48, none)
    host = np.zeros(16, np.int32)
    with pytest.raises(ValueError, match="does not fit"):
        module.stage_sections(host, [(np.arange(20), 0, 20, 0, 0)])
    with pytest.raises(ValueError, match="bad padding"):
        module.stage_sections(host, [(np.arange(4), 0, 8, 0, 3)])
    with pytest.raises(ValueError, match="host must be"):
        module.stage_sections(host.astype(np.int64), [])


@needs_compiled
@pytest.mark.parametrize("ranges, message", [
    (np.array([[0.0, 2.0]]), "dynamic_kv must be a 2-D integer array"),
    (np.array([1, 2]), "dynamic_kv must be a 2-D integer array"),
    (None, "dynamic_kv must be a 2-D integer array"),
    (np.zeros((1, 3), np.int64), "dynamic_kv must have shape [R, 2], got [1, 3]"),
    (np.zeros((0, 3), np.int64), "dynamic_kv must have shape [R, 2], got [0, 3]"),
    (np.array([[-1, 2]]), "dynamic_kv range 0 [-1, 2) must have 0 <= start < stop <= num_tokens (56)"),
    (np.array([[3, 3]]), "dynamic_kv range 0 [3, 3) must have 0 <= start < stop <= num_tokens (56)"),
    (np.array([[1, 2], [5, 3]]), "dynamic_kv range 1 [5, 3) must have 0 <= start < stop <= num_tokens (56)"),
    (np.array([[50, 57]]), "dynamic_kv range 0 [50, 57) must have 0 <= start < stop <= num_tokens (56)"),
    (np.array([[10, 20], [5, 8]]), "dynamic_kv range 1 [5, 8) must start at or after range 0's stop (20)"),
    (np.array([[10, 20], [15, 30]]), "dynamic_kv range 1 [15, 30) must start at or after range 0's stop (20)"),
])
def test_bad_dynamic_ranges_raise_value_errors_in_the_binding(ranges, message):
    """The binding checks the ranges itself (ValueError, nothing crashes) though schedule_units checks them first:
    its overlap search relies on their order."""
    module = planner_build.load_planner()
    plan = make_plan(fewshot(50, 2, 3), PlanConfig(chunk_size=16, query_tile=2), 1)
    items = [plan.item_chunk, plan.item_entry_start, plan.item_num_entries, plan.chunk_kv_start, plan.entry_mask]
    with pytest.raises(ValueError, match=re.escape("compiled planner: " + message)):
        module.schedule_units(*items, 1, 1, 4, 64, 64, ranges)


@needs_compiled
def test_dynamic_ranges_in_any_integer_layout_give_the_same_schedule():
    """A list, an int32 array or a strided view of the ranges is read as the C-contiguous int64 array is; adjacent
    ranges are allowed."""
    module = planner_build.load_planner()
    plan = make_plan(fewshot(300, 3, 20), PlanConfig(chunk_size=512, query_tile=3), 1)
    items = [plan.item_chunk, plan.item_entry_start, plan.item_num_entries, plan.chunk_kv_start, plan.entry_mask]
    ranges = np.array([[10, 20], [20, 30], [200, 201]], np.int64)
    strided = np.zeros((3, 4), np.int64)
    strided[:, ::2] = ranges
    results = [module.schedule_units(*items, 1, 1, 4, 64, 64, r)[2]
               for r in (ranges, ranges.tolist(), ranges.astype(np.int32), strided[:, ::2], ranges.T.copy().T)]
    assert not strided[:, ::2].flags.c_contiguous and not ranges.T.copy().T.flags.c_contiguous
    assert all(r.tolist() == results[0].tolist() for r in results)
    with using("numpy"):
        expected = live_tiles(dataclasses.replace(plan, dynamic_kv=tuple(map(tuple, ranges.tolist()))))[1]
    assert results[0].tolist() == expected.tolist()
    none = module.schedule_units(*items, 1, 1, 4, 64, 64, np.zeros((0, 2), np.int64))[2]
    assert (none & ~FULL_TILE_FLAG).tolist() == (expected & ~FULL_TILE_FLAG).tolist()   # the same live tiles
    assert np.all((expected & FULL_TILE_FLAG) <= (none & FULL_TILE_FLAG)) and np.any(none != expected)  # flags gone


# ---- which implementation runs, and why


@pytest.fixture
def fresh_choice():
    """planner_impl() decides again in the test, and again after it."""
    planner_choice._resolve.cache_clear()
    yield
    planner_choice._resolve.cache_clear()


def test_numpy_is_forced_by_the_environment_and_plans_with_the_reference(fresh_choice, monkeypatch, caplog):
    monkeypatch.setenv(PLANNER_ENV, "numpy")
    calls = []
    reference = planners._numpy_plan
    monkeypatch.setattr(planners, "_numpy_plan", lambda *a: calls.append(a) or reference(*a))
    with caplog.at_level(logging.INFO, logger="treedec"):
        impl = planner_impl()
        make_plan(fewshot(50, 2, 3), PlanConfig(chunk_size=16), 1)
        planner_impl()
    assert (impl.name, impl.reason, impl.module) == ("numpy", "TREEDEC_PLANNER=numpy", None) and len(calls) == 1
    assert [r.getMessage() for r in caplog.records] == ["treedec planner: numpy (TREEDEC_PLANNER=numpy)"]


@needs_compiled
def test_auto_is_compiled_where_it_builds(fresh_choice, monkeypatch, caplog):
    monkeypatch.delenv(PLANNER_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="treedec"):
        impl = planner_impl()
    assert impl.name == "compiled" and impl.module is not None and impl.reason.startswith("auto: compiled")
    assert "treedec planner: compiled" in caplog.text


def test_auto_without_a_compiler_plans_with_numpy_and_says_why(fresh_choice, monkeypatch, caplog):
    monkeypatch.setenv(PLANNER_ENV, "auto")
    monkeypatch.setattr(planner_build, "build_problem", lambda: "no C++ compiler: 'c++' is not on PATH")
    with caplog.at_level(logging.INFO, logger="treedec"):
        impl = planner_impl()
    assert impl.name == "numpy" and "no C++ compiler" in impl.reason and "no C++ compiler" in caplog.text
    assert make_plan(fewshot(50, 2, 3), PlanConfig(chunk_size=16), 1).num_queries == 2
    monkeypatch.setenv(PLANNER_ENV, "compiled")  # asked for by name: an error, not numpy
    with pytest.raises(BackendUnavailableError, match="TREEDEC_PLANNER=compiled .* no C\\+\\+ compiler"):
        planner_impl()


def test_a_failed_build_raises_at_every_plan_never_a_silent_switch(fresh_choice, monkeypatch):
    monkeypatch.setenv(PLANNER_ENV, "auto")
    monkeypatch.setattr(planner_build, "build_problem", lambda: None)
    attempts = []

    def broken():
        attempts.append(1)
        raise BackendUnavailableError("building the compiled planner in /cache failed: c++ exited with 1")

    monkeypatch.setattr(planner_build, "load_planner", broken)
    for _ in range(2):
        with pytest.raises(BackendUnavailableError, match="failed: c\\+\\+ exited with 1; set TREEDEC_PLANNER=numpy"):
            make_plan(fewshot(50, 2, 3), PlanConfig(chunk_size=16), 1)
    assert len(attempts) == 1  # built once: the failure is kept, not retried at every step


@needs_compiled
def test_the_variable_is_read_at_every_call(monkeypatch):
    """planner_impl reads os.environ's own mapping: a value set, changed or deleted there counts at the next call."""
    monkeypatch.setenv(PLANNER_ENV, "numpy")
    assert planner_impl().name == "numpy"
    monkeypatch.setenv(PLANNER_ENV, "Compiled ")
    assert planner_impl().name == "compiled"
    monkeypatch.setenv(PLANNER_ENV, "numpy")
    monkeypatch.delenv(PLANNER_ENV)
    assert planner_impl().name == "compiled"


@pytest.mark.parametrize("value", ["cpp", "NUMPY2", "1"])
def test_an_unknown_setting_is_named(fresh_choice, monkeypatch, value):
    monkeypatch.setenv(PLANNER_ENV, value)
    with pytest.raises(ValueError, match=f"TREEDEC_PLANNER must be one of .* got '{value.lower()}'"):
        planner_impl()


@pytest.mark.parametrize("group", [0, -1, 1.5, True])
def test_group_size_is_checked_before_either_planner(group):
    with pytest.raises(PlanError, match="group_size must be an int >= 1"):
        make_plan(fewshot(50, 2, 3), PlanConfig(chunk_size=16, query_tile=2), group)


def test_build_problems_are_named_without_building(monkeypatch, tmp_path):
    monkeypatch.setattr(planner_build, "SOURCE_DIR", tmp_path)  # an install without the C++ sources
    assert planner_build.build_problem().startswith("its C++ sources are not installed")
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert planner_build.build_problem() == "no C++ compiler: 'no-such-compiler-here' is not on PATH (install g++ or " \
                                            "clang, or set CXX)"
