"""The cuda backend (treedec/kernels/cuda/*, attention/backends/cuda_backend.py, its static plans).

On a GPU (``-m gpu``; the sources' CPU compile is tests/kernels/test_cuda_build.py): results match the
dense fp32 reference and the torch plan executor on random forests, page sizes, dtypes, head dims and GQA
ratios; runs are bitwise deterministic; a captured CUDA graph replays correctly for new trees planned into
the same buffers.
"""
import dataclasses

import numpy as np
import pytest
import torch

from treedec import PlanConfig, TreeAttention
from treedec.attention import AttentionVariant, PlanBounds, make_plan, reference_tree_attention
from treedec.attention.persistent_schedule import FULL_TILE_FLAG, SCHEDULE_HEADER, TILE_SIZES, TILE_TOKENS, UNIT_FIELDS
from treedec.errors import PlanError
from treedec.tree import PagedKVPool, SequenceTree
from treedec.workloads.deft import medusa_tree
from tests.trees import check_against_references, poison_free_slots, random_forest, rel_error, run_on_random_q

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


class Sm90aTiles:
    """An extension's ``takes_tile`` as the sm_90a build answers it: 64 always, 96 for head dims 64/128."""

    @staticmethod
    def takes_tile(bf16: bool, head_dim: int, tile_tokens: int) -> bool:
        return tile_tokens == 64 or (tile_tokens == 96 and head_dim <= 128)


def test_long_chunks_choose_96_token_tiles_where_a_kernel_takes_them(monkeypatch):
    from treedec.attention.backends.cuda_backend import LONG_CHUNK_TOKENS, TILE_TOKENS_ENV, choose_tile_tokens
    monkeypatch.delenv(TILE_TOKENS_ENV, raising=False)
    tree = prompt_with_token_tree(3000, 16, hkv=2, d=64, flat=True)
    long_plan = make_plan(tree.layout(), PlanConfig("flatten", chunk_size=2 * LONG_CHUNK_TOKENS), 4)
    short_plan = make_plan(tree.layout(), PlanConfig("flatten", chunk_size=LONG_CHUNK_TOKENS // 2), 4)
    assert long_plan.max_chunk_len >= LONG_CHUNK_TOKENS > short_plan.max_chunk_len
    ext = Sm90aTiles()
    assert choose_tile_tokens(long_plan, torch.bfloat16, 128, ext) == 96
    assert choose_tile_tokens(long_plan, torch.float16, 256, ext) == 64   # no 96-token kernel for head dim 256
    assert choose_tile_tokens(short_plan, torch.float16, 128, ext) == 64
    monkeypatch.setenv(TILE_TOKENS_ENV, "64")
    assert choose_tile_tokens(long_plan, torch.bfloat16, 128, ext) == 64
    monkeypatch.setenv(TILE_TOKENS_ENV, "96")
    assert choose_tile_tokens(short_plan, torch.bfloat16, 64, ext) == 96
    with pytest.raises(ValueError, match=r"TREEDEC_TILE_TOKENS='96'.*head_dim=256.*take tiles of \[64\]"):
        choose_tile_tokens(short_plan, torch.float16, 256, ext)
    for bad in ("128", "sixty-four"):
        monkeypatch.setenv(TILE_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=f"TREEDEC_TILE_TOKENS='{bad}'"):
            choose_tile_tokens(long_plan, torch.float16, 128, ext)


# ----------------------------------------------------------------------------- GPU

def run_cuda(tree, config, group, dtype, seed=0):
    from treedec.attention.backends.cuda_backend import run_plan_cuda
    return run_on_random_q(run_plan_cuda, tree, make_plan(tree.layout(), config, group), group, dtype, "cuda", seed)


def kernel_takes_tile(tile: int, dtype, head_dim: int) -> bool:
    from treedec.kernels.cuda_tree_attention import extension
    return extension(torch.device("cuda")).takes_tile(dtype == torch.bfloat16, head_dim, tile)


def force_tile(monkeypatch, tile: int) -> None:
    """Every later schedule lists ``tile``-token tiles (cuda_tree_attention.TILE_TOKENS_ENV)."""
    from treedec.attention.backends.cuda_backend import TILE_TOKENS_ENV
    monkeypatch.setenv(TILE_TOKENS_ENV, str(tile))


CASES = [  # seed, page_size, num_kv_heads, group, head_dim, dtype, planner, chunk_size, query_tile
    (0, 16, 2, 4, 128, torch.float16, "flatten", 64, 16),
    (1, 1, 1, 4, 128, torch.bfloat16, "flatten", 64, 16),
    (2, 16, 2, 1, 64, torch.float16, "flatten", 128, 64),
    (3, 4, 1, 3, 64, torch.bfloat16, "node_chunk", 96, 5),
    (4, 16, 1, 8, 256, torch.float16, "flatten", 32, 8),
    (5, 16, 2, 4, 256, torch.bfloat16, "node", None, 16),
    (6, 1, 1, 80, 64, torch.float16, "flatten", 64, 3),     # more heads per KV head than rows per unit
    (7, 16, 2, 2, 128, torch.bfloat16, "path", None, 32),
    (8, 4, 3, 5, 128, torch.float16, "flatten", 4096, 16),
    (9, 16, 1, 4, 64, torch.bfloat16, "flatten", 32, 2),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tile", TILE_SIZES)
@pytest.mark.parametrize("seed,page_size,hkv,group,head_dim,dtype,planner,chunk_size,query_tile", CASES)
def test_matches_references_on_random_forests(seed, page_size, hkv, group, head_dim, dtype, planner,
                                              chunk_size, query_tile, tile, monkeypatch):
    """With each KV tile size; a size the kernel does not take (96 with head dim 256 or off sm_90a) is refused."""
    rng = np.random.default_rng(seed)
    tree = random_forest(rng, page_size, num_kv_heads=hkv, head_dim=head_dim, dtype=dtype, max_nodes=12)
    poison_free_slots(tree)
    config = PlanConfig(planner, chunk_size=chunk_size, query_tile=query_tile)
    force_tile(monkeypatch, tile)
    if not kernel_takes_tile(tile, dtype, head_dim):
        assert tile != TILE_TOKENS
        with pytest.raises(ValueError, match=f"TREEDEC_TILE_TOKENS='{tile}'.*take tiles of \\[64\\]"):
            run_cuda(tree, config, group, dtype, seed)
        return
    check_against_references(*run_cuda(tree, config, group, dtype, seed), TOLERANCE[dtype])


def prompt_with_token_tree(prompt_len: int, tree_size: int, page_size=16, hkv=8, d=128, dtype=torch.bfloat16,
                           flat: bool = False):
    """A prompt and a Medusa token tree of ``tree_size`` (or, ``flat``, that many sibling tokens) below it."""
    pool = PagedKVPool(num_pages=(prompt_len + tree_size) // page_size + 8, page_size=page_size, num_layers=1,
                       num_kv_heads=hkv, head_dim=d, dtype=dtype)
    tree = SequenceTree(pool)
    root = tree.add_prompt(np.arange(prompt_len) % 1000)
    tree.commit_step()
    parents = [-1] * tree_size if flat else medusa_tree(tree_size).parents
    tree.add_token_tree(root, np.arange(tree_size), parents)
    pool.k.normal_(generator=torch.Generator().manual_seed(1))
    pool.v.normal_(generator=torch.Generator().manual_seed(2))
    return tree


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("prompt_len,tree_size,planner,chunk_size", [
    (4000, 64, "flatten", None), (3000, 256, "flatten", 256), (10000, 64, "node", None)])
def test_medusa_tree_over_long_prompt(prompt_len, tree_size, planner, chunk_size):
    """Many entries per chunk, auto chunk sizes, and (node planner) chunks longer than one live-tile segment."""
    tree = prompt_with_token_tree(prompt_len, tree_size)
    check_against_references(*run_cuda(tree, PlanConfig(planner, chunk_size=chunk_size), 4, torch.bfloat16),
                             TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("prompt_len,branches,group,head_dim,dtype", [
    (40, 3, 4, 128, torch.float16),      # 145 tokens: 3 tiles
    (200, 2, 4, 128, torch.bfloat16),    # 253 tokens: 4 tiles
    (10, 1, 4, 64, torch.float16),       # 28 tokens: 1 tile
    (1000, 4, 16, 64, torch.bfloat16)])  # 64 rows, 19 tiles
@pytest.mark.parametrize("tile", TILE_SIZES)
def test_units_of_at_most_64_rows(prompt_len, branches, group, head_dim, dtype, tile, monkeypatch):
    """One chunk, a query per branch, <= 64 rows: on sm_90a the second consumer's rows are all
    padding and it only keeps the turns (odd and even tile counts, a single tile; both tile sizes)."""
    if not kernel_takes_tile(tile, dtype, head_dim):
        pytest.skip(f"the kernel takes no {tile}-token tiles here (test_matches_references_on_random_forests "
                    f"checks the refusal)")
    force_tile(monkeypatch, tile)
    hkv = 2
    pool = PagedKVPool(num_pages=128, page_size=16, num_layers=1, num_kv_heads=hkv, head_dim=head_dim, dtype=dtype)
    tree = SequenceTree(pool)
    root = tree.add_prompt(np.arange(prompt_len) % 100)
    tree.commit_step()
    kids = tree.branch(root, [np.arange(17 * (i + 1)) % 100 for i in range(branches)])
    tree.commit_step()
    for kid in kids:
        tree.add_token_tree(kid, [1], [-1])
    pool.k.normal_(generator=torch.Generator().manual_seed(3))
    pool.v.normal_(generator=torch.Generator().manual_seed(4))
    config = PlanConfig("flatten", chunk_size=4096, query_tile=64 // group)
    check_against_references(*run_cuda(tree, config, group, dtype), TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_balanced_chunks_on_hopper_match_the_reference():
    """fewshot_b30_p4k's shape through TreeAttention("cuda"): on sm_90a the planner gets
    LIGHT_TILE_COST and cuts the branches into longer chunks than the prompt."""
    from treedec.attention.backends.cuda_backend import LIGHT_TILE_COST
    pool = PagedKVPool(num_pages=700, page_size=16, num_layers=1, num_kv_heads=8, head_dim=128, dtype=torch.float16,
                       device="cuda")
    tree = SequenceTree(pool)
    root = tree.add_prompt(np.arange(4000) % 100)
    tree.commit_step()
    kids = tree.branch(root, [np.arange(199) % 100] * 30)
    tree.commit_step()
    for kid in kids:
        tree.extend(kid, [1])
    gen = torch.Generator(device="cuda").manual_seed(5)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    attn = TreeAttention(32, 8, 128, backend="cuda", device="cuda")
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert attn.plan_config.light_tile_cost == (LIGHT_TILE_COST if hopper else None)
    plan = attn.plan(tree)
    lens = np.diff(plan.plan.chunk_kv_start)
    assert (len(set(lens[:-1].tolist())) > 1) == hopper
    q = torch.randn(plan.plan.num_queries, 32, 128, dtype=torch.float16, device="cuda")
    out, lse = attn.run(q, pool.layer(0)[0], pool.layer(0)[1], plan, return_lse=True)
    check_against_references(out, lse, plan.plan, q, *pool.layer(0), TOLERANCE[torch.float16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_long_chunks_choose_96_token_tiles_on_hopper():
    """choose_tile_tokens: 96 where the longest chunk has >= LONG_CHUNK_TOKENS tokens and the kernel
    takes 96 (sm_90a, head dims 64/128), else 64; the schedule heads its device array with the size."""
    from treedec.attention.backends.cuda_backend import LONG_CHUNK_TOKENS, plan_schedule
    tree = prompt_with_token_tree(3000, 64)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for chunk_size, expected in ((2 * LONG_CHUNK_TOKENS, 96 if hopper else 64), (LONG_CHUNK_TOKENS // 2, 64)):
        attn = TreeAttention(32, 8, 128, backend="cuda", device="cuda", plan_config=PlanConfig("flatten", chunk_size),
                             dtype=torch.bfloat16)
        plan = attn.plan(tree)
        schedule = plan_schedule(plan)   # made at plan time: run() only launches
        q = torch.randn(plan.plan.num_queries, 32, 128, dtype=torch.bfloat16, device="cuda")
        out, lse = attn.run(q, *(c.cuda() for c in tree.pool.layer(0)), plan, return_lse=True)
        assert schedule.tile_tokens == expected and schedule.device_array()[0] == expected
        check_against_references(out, lse, plan.plan, q, *(c.cuda() for c in tree.pool.layer(0)),
                                 TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_runs_are_bitwise_deterministic():
    tree = prompt_with_token_tree(3000, 64)
    first = run_cuda(tree, PlanConfig("flatten", chunk_size=128), 4, torch.bfloat16)
    second = run_cuda(tree, PlanConfig("flatten", chunk_size=128), 4, torch.bfloat16)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_merge_kernel_gives_the_same_bits(head_dim):
    """The merge kernel loading the most partial rows at once (a plan with over 8 partials a query: 16, 8 with
    head dim 256) and those loading 8 and 4 sum in the same order: the same bits. Here over 32 partials
    a query, so the merge's batches of 32 are crossed too."""
    from treedec.attention.backends.cuda_backend import CudaBackend, run_plan_cuda
    tree = prompt_with_token_tree(2500, 64, hkv=2, d=head_dim)
    out, lse, plan, q, k_cache, v_cache = run_cuda(tree, PlanConfig("flatten", chunk_size=64), 4, torch.bfloat16)
    check_against_references(out, lse, plan, q, k_cache, v_cache, TOLERANCE[torch.bfloat16])
    device_plan = plan.to("cuda")
    prepared = CudaBackend(q.shape[1], k_cache.shape[2], head_dim, q.dtype, AttentionVariant(), q.device).prepare(device_plan)
    assert prepared.max_query_entries > 32
    for forced in (8, 4):  # the bound the launch picks its kernel by
        other_out, other_lse = run_plan_cuda(q, k_cache, v_cache, device_plan, AttentionVariant(),
                                             prepared=dataclasses.replace(prepared, max_query_entries=forced))
        assert torch.equal(out, other_out) and torch.equal(lse, other_lse), forced


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chained_calls_see_the_kernels_before_them():
    """Stage 1 starts while the kernel before it drains (programmatic launch) and reads only plan
    arrays before its wait: q and K/V written by the kernel just before a call, and a previous
    call's merge still reading the shared partial workspace, must not leak into any result.
    (A check of the chain's results, not a race detector: on an H200 a build without the waits
    passed it too, the window being shorter than the kernels before it take to drain.)"""
    hkv, group, d, dtype = 2, 4, 128, torch.float16
    tree = prompt_with_token_tree(3000, 64, hkv=hkv, d=d, dtype=dtype)
    attn = TreeAttention(hkv * group, hkv, d, backend="cuda", device="cuda", plan_config=PlanConfig("flatten", 256))
    plan = attn.plan(tree)
    n = plan.plan.num_queries
    gen = torch.Generator(device="cuda").manual_seed(5)
    k_pool, v_pool = (c.cuda() for c in tree.pool.layer(0))
    calls = 6
    qs = [torch.randn(n, hkv * group, d, device="cuda", dtype=dtype, generator=gen) for _ in range(calls)]
    ks = [torch.randn(k_pool.shape, device="cuda", dtype=dtype, generator=gen) for _ in range(calls)]
    vs = [torch.randn(v_pool.shape, device="cuda", dtype=dtype, generator=gen) for _ in range(calls)]
    q, k, v = torch.empty_like(qs[0]), torch.empty_like(k_pool), torch.empty_like(v_pool)
    outs = []
    torch.cuda.synchronize()
    for i in range(calls):  # no synchronization in between: each call right behind kernels writing its inputs
        torch.mul(qs[i], 1.0, out=q)
        torch.mul(ks[i], 1.0, out=k)
        torch.mul(vs[i], 1.0, out=v)
        outs.append(attn.run(q, k, v, plan))
        outs.append(attn.run(qs[i], ks[i], vs[i], plan))  # back to back with the call before
    torch.cuda.synchronize()
    for i in range(calls):
        ref, _ = reference_tree_attention(qs[i], ks[i], vs[i], plan.plan.layout, AttentionVariant())
        assert rel_error(outs[2 * i], ref) < TOLERANCE[dtype], f"call {2 * i}"
        assert torch.equal(outs[2 * i], outs[2 * i + 1]), f"call {2 * i + 1}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tree_attention_runs_cuda_when_asked_and_rejects_fp32():
    attn = TreeAttention(8, 2, 64, backend="cuda", device="cuda")
    assert attn.backend == "cuda" and attn.plan_config.query_tile == 32  # 128-row units
    tree = random_forest(np.random.default_rng(0), 16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    plan = attn.plan(tree)
    k, v = (c.cuda() for c in tree.pool.layer(0))
    with pytest.raises(TypeError, match="fp32|float32"):
        attn.run(torch.randn(plan.plan.num_queries, 8, 64, device="cuda"), k, v, plan)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graph_replays_new_trees():
    """Capture run() once; plan() other trees into the same buffers; replay == reference."""
    hkv, group, d, dtype = 2, 4, 128, torch.float16
    pool = random_cuda_pool(hkv, d, dtype)
    bounds = PlanBounds(max_queries=128, max_tokens=8192)
    attn = TreeAttention(hkv * group, hkv, d, backend="cuda", device="cuda", plan_config=PlanConfig("flatten"),
                         dtype=dtype)
    static = attn.static_plan(bounds)
    q_static = torch.zeros(bounds.max_queries, hkv * group, d, dtype=dtype, device="cuda")
    k_cache, v_cache = pool.layer(0)
    rng = np.random.default_rng(0)

    def new_tree():
        tree = SequenceTree(pool)
        root = tree.add_prompt(rng.integers(0, 100, int(rng.integers(100, 3000))))
        tree.commit_step()
        kids = tree.branch(root, [rng.integers(0, 100, int(rng.integers(1, 200))) for _ in range(rng.integers(1, 6))])
        tree.commit_step()
        for kid in kids:
            m = int(rng.integers(1, 20))
            tree.add_token_tree(kid, rng.integers(0, 100, m), [int(rng.integers(-1, i)) for i in range(m)])
        return tree

    tree = new_tree()
    plan = attn.plan(tree, into=static)
    graph = capture(lambda: attn.run(q_static, k_cache, v_cache, plan, return_lse=True))
    for step in range(4):
        if step:
            tree.commit_step()
            for root in list(tree.roots):
                tree.prune(root)
            tree = new_tree()
        assert attn.plan(tree, into=static) is plan
        check_replay(graph, q_static, static.current, k_cache, v_cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graph_replays_new_trees_with_96_token_tiles():
    """static_plan(tile_tokens=96): every plan lists 96-token tiles and the graph, holding that
    tile's kernel, replays trees of short and long chunks; where no kernel takes 96 it is refused."""
    hkv, group, d, dtype = 2, 4, 64, torch.bfloat16
    pool = random_cuda_pool(hkv, d, dtype)
    bounds = PlanBounds(max_queries=64, max_tokens=8192)
    attn = TreeAttention(hkv * group, hkv, d, backend="cuda", device="cuda",
                         plan_config=PlanConfig("flatten", chunk_size=2048), dtype=dtype)
    if not kernel_takes_tile(96, dtype, d):
        with pytest.raises(ValueError, match="take tiles of \\[64\\]"):
            attn.static_plan(bounds, tile_tokens=96)
        return
    with pytest.raises(ValueError, match="tile_tokens"):
        attn.static_plan(bounds, tile_tokens=128)
    static = attn.static_plan(bounds, tile_tokens=96)
    q_static = torch.zeros(bounds.max_queries, hkv * group, d, dtype=dtype, device="cuda")
    k_cache, v_cache = pool.layer(0)
    trees = [prompt_in(pool, n, 5) for n in (600, 5000, 300, 4000)]
    plan = attn.plan(trees[0], into=static)
    graph = capture(lambda: attn.run(q_static, k_cache, v_cache, plan, return_lse=True))
    for tree in trees:
        attn.plan(tree, into=static)
        assert plan.prepared.schedule.tile_tokens == 96
        check_replay(graph, q_static, static.current, k_cache, v_cache)


def random_cuda_pool(hkv: int, d: int, dtype, num_pages: int = 1024) -> PagedKVPool:
    """A one-layer CUDA pool of 16-token pages filled with standard normal K and V."""
    pool = PagedKVPool(num_pages=num_pages, page_size=16, num_layers=1, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                       device="cuda")
    pool.k.normal_()
    pool.v.normal_()
    return pool


def check_replay(graph, q_static, host, k_cache, v_cache) -> None:
    """Random q for the planned tree ``host``'s queries, replay ``graph`` (a :class:`capture` of a
    static plan's run, outputs (out, lse)), compare with the fp32 reference."""
    n = host.num_queries
    q_static[:n] = torch.randn(n, *q_static.shape[1:], device="cuda", dtype=q_static.dtype)
    graph.replay()
    out, lse = graph.outputs
    ref, ref_lse = reference_tree_attention(q_static[:n], k_cache, v_cache, host.layout, AttentionVariant())
    assert rel_error(out[:n], ref) < TOLERANCE[q_static.dtype]
    torch.testing.assert_close(lse[:n], ref_lse, atol=2e-3, rtol=1e-4)


def prompt_in(pool, prompt_len: int, branches: int) -> SequenceTree:
    """A new tree in ``pool``: a prompt and ``branches`` one-token branches pending."""
    tree = SequenceTree(pool)
    root = tree.add_prompt(np.arange(prompt_len) % 100)
    tree.commit_step()
    for b in range(branches):
        tree.add_token_tree(root, [b], [-1])
    return tree


class capture:
    """A CUDA graph of ``fn()`` (warmed up on a side stream first); its return value in ``outputs``."""

    def __init__(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # builds, sets kernel attributes outside the capture
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn()

    def replay(self):
        self.graph.replay()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_plan_over_bounds_raises_and_keeps_the_previous_plan():
    pool = PagedKVPool(num_pages=256, page_size=16, num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float16,
                       device="cuda")
    attn = TreeAttention(4, 1, 64, backend="cuda", device="cuda")
    static = attn.static_plan(PlanBounds(max_queries=8, max_tokens=1024))
    tree = SequenceTree(pool)
    root = tree.add_prompt(np.arange(100))
    tree.commit_step()
    tree.extend(root, [1])
    attn.plan(tree, into=static)
    first = static.current
    tree.commit_step()
    tree.add_token_tree(root, np.arange(16), [-1] + list(range(15)))
    with pytest.raises(PlanError, match="max_queries"):
        attn.plan(tree, into=static)
    assert static.current is first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_python_rows_and_tile_tables_match_the_kernels():
    from treedec.kernels.cuda_tree_attention import ROWS_PER_UNIT, extension, rows_per_unit
    ext = extension(torch.device("cuda"))
    assert ext.default_tile_tokens() == TILE_TOKENS and ext.schedule_header() == SCHEDULE_HEADER
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for bf16 in (False, True):
        assert [d for d in ROWS_PER_UNIT if ext.takes_tile(bf16, d, 96)] == ([64, 128] if hopper else [])
        assert all(ext.takes_tile(bf16, d, TILE_TOKENS) for d in ROWS_PER_UNIT)
        assert not any(ext.takes_tile(bf16, d, t) for d in ROWS_PER_UNIT for t in (32, 128))
    assert ext.full_tile_flag() == FULL_TILE_FLAG
    assert ext.unit_fields() == len(UNIT_FIELDS)
    for bf16 in (False, True):
        assert all(ext.rows_per_unit(bf16, d) == rows_per_unit((9, 0) if hopper else (8, 0), d) for d in ROWS_PER_UNIT)
        assert all(ext.ctas_per_sm(bf16, d) >= 1 for d in ROWS_PER_UNIT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_is_cuda_on_hopper_and_each_plan_names_its_kernels():
    """auto on an H100/H200 is cuda for every step (measured faster down to one row per KV head); plans say so."""
    attn = TreeAttention(32, 8, 128, backend="auto", device="cuda", dtype=torch.bfloat16)
    mha = TreeAttention(8, 8, 128, backend="auto", device="cuda", dtype=torch.bfloat16)
    if torch.cuda.get_device_capability() != (9, 0):
        assert attn.backend == "triton"
        return
    assert attn.backend == mha.backend == "cuda" and "faster than triton" in attn.backend_reason
    for tree_size, expected in ((1, "cuda"), (16, "cuda")):   # x4 heads per KV head: 4 / 64 rows
        tree = prompt_with_token_tree(2000, tree_size, flat=True)
        plan = attn.plan(tree)
        assert plan.backend == expected
        k, v = (c.cuda() for c in tree.pool.layer(0))
        q = torch.randn(plan.plan.num_queries, 32, 128, device="cuda", dtype=torch.bfloat16)
        out, lse = attn.run(q, k, v, plan, return_lse=True)
        ref, ref_lse = reference_tree_attention(q, k, v, plan.plan.layout, AttentionVariant())
        assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)


def unshared_sequences(lengths, page_size=16, hkv=8, d=128, dtype=torch.bfloat16) -> SequenceTree:
    """One sequence per length (independent trees of a forest), each with one pending query token: a
    decode step of an unshared batch."""
    pool = PagedKVPool(num_pages=sum(-(-(n + 1) // page_size) + 1 for n in lengths), page_size=page_size,
                       num_layers=1, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    tree = SequenceTree(pool)
    roots = [tree.add_prompt(np.arange(n) % 1000) for n in lengths]
    tree.commit_step()
    for root in roots:
        tree.extend(root, [1])
    pool.k.normal_(generator=torch.Generator().manual_seed(1))
    pool.v.normal_(generator=torch.Generator().manual_seed(2))
    return tree


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cuda", "triton", "auto"])
@pytest.mark.parametrize("lengths", [[2048] * 32, np.random.default_rng(4).integers(1000, 8000, 16).tolist(),
                                     [32768], [131072]], ids=["32x2k", "16-ragged", "32k", "128k"])
def test_unshared_batches_and_long_sequences_match_the_reference(backend, lengths):
    """Decode steps of unshared batches and single sequences up to 128k tokens, through TreeAttention's
    planning for each backend: == the fp32 reference; a long sequence is split along its KV (several
    partials merged); a second run gives the same bits."""
    tree = unshared_sequences(lengths)
    attn = TreeAttention(32, 8, 128, backend=backend, device="cuda", dtype=torch.bfloat16)
    plan = attn.plan(tree)
    k, v = (c.cuda() for c in tree.pool.layer(0))
    q = torch.randn(plan.plan.num_queries, 32, 128, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator("cuda").manual_seed(3))
    out, lse = attn.run(q, k, v, plan, return_lse=True)
    ref, ref_lse = reference_tree_attention(q, k, v, plan.plan.layout, AttentionVariant())
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16], f"{rel_error(out, ref)=}"
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)
    if len(lengths) == 1:
        assert len(plan.plan.chunk_kv_start) - 1 > 1, "a long single sequence must be split along its KV"
    again, again_lse = attn.run(q, k, v, plan, return_lse=True)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)
