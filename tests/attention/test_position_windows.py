"""attention/position_windows.py: batch-invariant plans cut each query's keys at absolute positions, share a window's
chunk among exactly the queries that read all its keys, and so give a query the same bits alone, beside other
requests, under a prefix-cache hit's split prompt, and (where the windows are its pieces) as the per-query copy of
the plain path planner, on the torch backend (rows form) and the triton kernels (interpreted on the CPU)."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from treedec import PlanConfig, TreeAttention
from treedec.attention import AttentionVariant, PlanBounds, make_plan
from treedec.attention.read_intervals import read_intervals
from treedec.tree import TreeLayout
from treedec.workloads.deft import medusa_tree
from tests.forests import Request, forest_of, random_forest_of_requests

CHUNK = 64
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def invariant(chunk_size=CHUNK, query_tile=4) -> PlanConfig:
    return PlanConfig("path", chunk_size, query_tile, batch_invariant=True)


def query_chunks(plan) -> list[list[tuple[int, ...]]]:
    """Each query's chunks, as the slot tuples of its entries in merge order (every entry reads its whole chunk)."""
    starts = plan.chunk_kv_start
    entry_chunk = np.repeat(np.arange(plan.num_chunks), np.diff(plan.chunk_entry_start))
    out = []
    for q in range(plan.num_queries):
        chunks = []
        for e in plan.query_entries[plan.query_entry_start[q]:plan.query_entry_start[q + 1]]:
            c = entry_chunk[e]
            n = starts[c + 1] - starts[c]
            bits = np.unpackbits(plan.entry_mask[e].view(np.uint8), bitorder="little")
            assert bits[:n].all() and not bits[n:].any(), "an entry that does not read its whole chunk"
            chunks.append(tuple(plan.kv_slots[starts[c]:starts[c + 1]].tolist()))
        out.append(chunks)
    return out


def path_keys(layout: TreeLayout, variant: AttentionVariant) -> list[tuple[int, list[int]]]:
    """Each query's (first key position, key slots in root-path order), from the read intervals."""
    q_idx, lo, hi, kv, *_ = read_intervals(layout, variant)
    first = variant.first_visible(layout.query_position)
    return [(int(first[q]), [int(s) for i in np.flatnonzero(q_idx == q)[np.argsort(lo[q_idx == q])]
                             for s in kv[lo[i]:hi[i]]]) for q in range(layout.num_queries)]


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 4, 16]), chunk=st.sampled_from([1, 7, 64]),
       window=st.sampled_from([None, None, 5, 100]))
def test_each_query_reads_its_absolute_windows_in_order(seed, page_size, chunk, window):
    forest = random_forest_of_requests(np.random.default_rng(seed), page_size, CHUNK)
    layout, _ = forest.layout([(g, r) for g in range(len(forest.prompts)) for r in range(len(forest.requests[g]))])
    variant = AttentionVariant(window=window)
    for impl_plan in (make_plan(layout, invariant(chunk), variant=variant),):
        chunks = query_chunks(impl_plan)
        for q, (first, keys) in enumerate(path_keys(layout, variant)):
            last = first + len(keys) - 1
            windows = [(max(k * chunk, first), min(k * chunk + chunk, last + 1))
                       for k in range(first // chunk, last // chunk + 1)]
            assert chunks[q] == [tuple(keys[a - first:b - first]) for a, b in windows], q
        # one chunk per distinct window: queries of the same keys share it, no two chunks hold the same keys
        starts = impl_plan.chunk_kv_start
        held = {tuple(impl_plan.kv_slots[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])}
        assert len(held) == impl_plan.num_chunks == len({c for per in chunks for c in per})


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 16]), chunk=st.sampled_from([7, 64]))
def test_a_query_plans_alike_alone_in_any_forest_and_under_a_split_prompt(seed, page_size, chunk):
    rng = np.random.default_rng(seed)
    forest = random_forest_of_requests(rng, page_size, CHUNK)
    everyone = [(g, r) for g in range(len(forest.prompts)) for r in range(len(forest.requests[g]))]
    splits = {g: int(rng.integers(1, n)) for g, n in enumerate(forest.prompts) if n > 1}
    seen = {}
    for members, split in [([m], None) for m in everyone] + [(everyone, None), (everyone[::-1], splits)]:
        layout, rows = forest.layout(members, split)
        for row, chunks in zip(rows, query_chunks(make_plan(layout, invariant(chunk)))):
            assert seen.setdefault(row, chunks) == chunks, row


def shared_prompt(requests=64, prompt=2000, question=50) -> TreeLayout:
    """``requests`` requests sharing a ``prompt``-token system prompt, each its own question and one pending token."""
    return TreeLayout.from_parents([-1] + [0] * requests, [prompt] + [question + 1] * requests,
                                   [(i, question) for i in range(1, requests + 1)])


def medusa_verify(prompt=4000) -> TreeLayout:
    parents = medusa_tree(64).parents
    return TreeLayout.from_parents([-1] + [0 if p < 0 else 1 + int(p) for p in parents], [prompt] + [1] * 64,
                                   [(i, 0) for i in range(1, 65)])


def test_a_shared_prefix_is_read_once():
    """64 requests over a 2000-token prompt: its 7 whole windows are one chunk each (the old per-query copies read
    all 2051 keys of each of the 64 paths); with a query tile of 64 each is read once, with the engine's 16 (8B
    heads) once a tile of 16 queries, as the default plans' shared chunks are."""
    layout = shared_prompt()
    for tile, reads in ((64, 1), (16, 4)):
        plan = make_plan(layout, invariant(256, tile))
        copies = make_plan(layout, PlanConfig("path", 256, tile))
        prompt = layout.kv_slots[:7 * 256]
        assert np.array_equal(np.unique(plan.kv_slots[np.isin(plan.kv_slots, prompt)], return_counts=True)[1],
                              np.ones(len(prompt), int))   # each whole window's key once in the plan
        assert plan.num_tokens == 7 * 256 + 64 * (2051 - 7 * 256) and copies.num_tokens == 64 * 2051
        assert plan.kv_tokens_read() == reads * 7 * 256 + 64 * (2051 - 7 * 256)
        assert copies.kv_tokens_read() == 64 * 2051
    medusa = make_plan(medusa_verify(), invariant(256, 16))
    assert medusa.num_tokens == 15 * 256 + 64 * 160 + int((medusa_tree(64).depth + 1).sum())   # was 256207


# ============================================================== bits: alone == in a forest == as copies

def q_rows(rows, hq, d, dtype):
    """The same q for a query wherever it runs: seeded by its (group, request, index)."""
    out = []
    for g, r, j in rows:
        gen = torch.Generator().manual_seed(1_000_003 * g + 1009 * r + j)
        out.append(torch.randn(hq, d, generator=gen))
    return torch.stack(out).to(dtype)


def outputs(forest, members, split, attn, dtype, k_cache, v_cache, config=None):
    """``{(group, request, index): (out, lse)}`` of one step of ``members`` planned by ``attn`` (or ``config``)."""
    layout, rows = forest.layout(members, split)
    q = q_rows(rows, attn.num_qo_heads, attn.head_dim, dtype).to(k_cache.device)
    plan = attn.plan(layout)
    out, lse = attn.run(q, k_cache, v_cache, plan, return_lse=True)
    return {row: (out[i], lse[i]) for i, row in enumerate(rows)}, layout, rows


def check_invariance(forest, rng, backend, dtype, device, hkv, group, head_dim, query_tile, chunk=CHUNK):
    """Every request's outputs (and LSEs) the same bits alone, in the whole forest (two orders) and with every
    prompt split as a prefix-cache hit stores it; and, for queries whose windows are the plain path planner's
    even pieces (paths of at most one chunk or of whole chunks), the same bits as its per-query copies."""
    attn = TreeAttention(hkv * group, hkv, head_dim, backend=backend, device=device, dtype=dtype,
                         plan_config=invariant(chunk, query_tile))
    assert backend != "torch" or attn.backend_impl.form == "rows"
    k_cache, v_cache = (c.to(device) for c in forest.kv(hkv, head_dim, dtype, int(rng.integers(1 << 30))))
    everyone = [(g, r) for g in range(len(forest.prompts)) for r in range(len(forest.requests[g]))]
    splits = {g: int(rng.integers(1, n)) for g, n in enumerate(forest.prompts) if n > 1}
    runs = [outputs(forest, [m], None, attn, dtype, k_cache, v_cache)[0] for m in everyone]
    alone = {row: value for run in runs for row, value in run.items()}
    for members, split in ((everyone, None), (everyone[::-1], splits)):
        batched = outputs(forest, members, split, attn, dtype, k_cache, v_cache)[0]
        for row, (out, lse) in batched.items():
            assert torch.equal(out, alone[row][0]) and torch.equal(lse, alone[row][1]), (row, split)
    copies = TreeAttention(hkv * group, hkv, head_dim, backend=backend, device=device, dtype=dtype,
                           plan_config=PlanConfig("path", chunk, query_tile))
    if backend == "torch":
        copies.backend_impl.form = "rows"   # (one query a chunk: its chunks form, one row at a time)
    copied, layout, rows = outputs(forest, everyone, None, copies, dtype, k_cache, v_cache)
    keys = layout.query_position + 1
    agree = [row for row, n in zip(rows, keys) if n <= chunk or n % chunk == 0]
    for row in agree:
        assert torch.equal(copied[row][0], alone[row][0]) and torch.equal(copied[row][1], alone[row][1]), row
    return len(agree)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       group=st.sampled_from([1, 4]), query_tile=st.sampled_from([1, 3, 16]))
def test_torch_bits_alone_equal_bits_in_forests_and_as_copies(seed, dtype, group, query_tile):
    rng = np.random.default_rng(seed)
    forest = random_forest_of_requests(rng, 4, CHUNK)
    check_invariance(forest, rng, "torch", dtype, "cpu", 2, group, 64, query_tile)


def whole_windows(rng, page_size=4):
    """Paths of whole chunks or less: three requests under a two-chunk prompt (one path through two nodes) and a
    short one, every query's windows the plain path planner's even pieces."""
    c = CHUNK
    under = [Request([-1], [c], [(0, c - 1)]), Request([-1], [c], [(0, c - 1)]),
             Request([-1, 0], [c // 2, c // 2], [(1, c // 2 - 1)])]
    return forest_of([2 * c, 10], [under, [Request([-1], [20], [(0, 19), (0, 18)])]], page_size, rng)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_bits_equal_the_per_query_copies_where_the_windows_are_its_pieces(dtype):
    rng = np.random.default_rng(0)
    assert check_invariance(whole_windows(rng), rng, "torch", dtype, "cpu", 2, 2, 64, 2) == 5


TRITON_CASES = [  # seed, dtype, hkv, group, head_dim, query_tile
    (0, torch.float32, 1, 4, 64, 4),
    (1, torch.bfloat16, 2, 2, 64, 3),
    (2, torch.float16, 1, 1, 64, 16),
]


@pytest.mark.triton
@pytest.mark.usefixtures("row_exact_dot")
@pytest.mark.parametrize("seed, dtype, hkv, group, head_dim, query_tile", TRITON_CASES)
def test_triton_bits_alone_equal_bits_in_forests_and_as_copies(triton_device, seed, dtype, hkv, group, head_dim,
                                                                query_tile):
    rng = np.random.default_rng(seed)
    forest = random_forest_of_requests(rng, 16, CHUNK, groups=2, max_requests=2)
    check_invariance(forest, rng, "triton", dtype, triton_device, hkv, group, head_dim, query_tile)
    assert check_invariance(whole_windows(rng), rng, "triton", dtype, triton_device, hkv, group, head_dim,
                            query_tile) == 5


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.usefixtures("row_exact_dot")
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       group=st.sampled_from([1, 3]), query_tile=st.sampled_from([1, 5, 16]), chunk=st.sampled_from([32, 64, 128]))
def test_triton_bits_property(triton_device, seed, dtype, group, query_tile, chunk):
    rng = np.random.default_rng(seed)
    forest = random_forest_of_requests(rng, 4, chunk, groups=2, max_requests=2)
    check_invariance(forest, rng, "triton", dtype, triton_device, 1, group, 64, query_tile, chunk)


@pytest.mark.triton
@pytest.mark.usefixtures("row_exact_dot")
def test_triton_static_plans_give_the_eager_bits(triton_device):
    """What a captured graph does, without capture: the whole forest and each request alone planned into one
    static plan (padded to its bounds) and launched there give the eager launch's bits, alone and batched alike."""
    rng = np.random.default_rng(4)
    forest = random_forest_of_requests(rng, 16, CHUNK, groups=2, max_requests=2)
    attn = TreeAttention(4, 1, 64, backend="triton", device=triton_device, dtype=torch.bfloat16,
                         plan_config=invariant())
    k_cache, v_cache = (c.to(triton_device) for c in forest.kv(1, 64, torch.bfloat16))
    everyone = [(g, r) for g in range(len(forest.prompts)) for r in range(len(forest.requests[g]))]
    bounds = PlanBounds.for_plan(attn.plan_host(forest.layout(everyone)[0]))
    static = attn.static_plan(bounds)
    q_static = torch.zeros(bounds.max_queries, 4, 64, dtype=torch.bfloat16, device=triton_device)
    seen = {}
    for members in [everyone] + [[m] for m in everyone]:
        eager, layout, rows = outputs(forest, members, None, attn, torch.bfloat16, k_cache, v_cache)
        q_static[:len(rows)] = q_rows(rows, 4, 64, torch.bfloat16).to(triton_device)
        out, lse = attn.run(q_static, k_cache, v_cache, attn.plan(layout, into=static), return_lse=True)
        for i, row in enumerate(rows):
            assert torch.equal(out[i], eager[row][0]) and torch.equal(lse[i], eager[row][1]), row
            assert torch.equal(seen.setdefault(row, out[i].clone()), out[i]), row
