"""The triton backend (attention/backends/triton_backend.py, kernels/triton_tree_attention.py) against the references.

On a machine without CUDA the kernels run in the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), so the shapes are small: few heads, short trees.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from treedec import PlanConfig, TreeAttention
from treedec.attention import AttentionVariant, make_plan
from treedec.tree import PagedKVPool, SequenceTree
from tests.trees import check_against_references, poison_free_slots, random_forest, run_on_random_q

triton_kernels = pytest.importorskip("treedec.kernels.triton_tree_attention")
from treedec.attention.backends.triton_backend import run_plan_triton  # noqa: E402  (needs triton)

pytestmark = pytest.mark.triton

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def run_both(tree, layout, config, group, dtype, device, seed=0, **kwargs):
    """(triton out, triton lse, plan, q, k, v) for one step of ``tree``."""
    return run_on_random_q(run_plan_triton, tree, make_plan(layout, config), group, dtype, device, seed, **kwargs)


CASES = [  # seed, page_size, num_kv_heads, group, head_dim, dtype, planner, chunk_size, query_tile
    (0, 16, 2, 4, 64, torch.float16, "flatten", 32, 4),
    (1, 1, 1, 4, 64, torch.bfloat16, "flatten", 64, 16),
    (2, 16, 1, 3, 64, torch.float16, "node", 1, 5),
    (3, 1, 2, 1, 64, torch.float16, "node_chunk", 16, 8),
    (4, 16, 1, 3, 64, torch.bfloat16, "node_chunk", 48, 3),
    (5, 16, 1, 5, 64, torch.float16, "flatten", 96, 12),
    (6, 1, 1, 8, 64, torch.float16, "node", 1, 2),
    (7, 16, 1, 2, 128, torch.float16, "flatten", 64, 8),
    (8, 16, 1, 4, 256, torch.bfloat16, "node_chunk", 32, 4),
    (9, 1, 1, 4, 64, torch.float32, "flatten", 40, 6),
]


@pytest.mark.slow
@pytest.mark.parametrize("seed,page_size,hkv,group,head_dim,dtype,planner,chunk_size,query_tile", CASES)
def test_matches_references_on_random_forests(triton_device, seed, page_size, hkv, group, head_dim, dtype,
                                              planner, chunk_size, query_tile):
    rng = np.random.default_rng(seed)
    tree = random_forest(rng, page_size, num_kv_heads=hkv, head_dim=head_dim, dtype=dtype, max_nodes=8)
    poison_free_slots(tree)
    layout = tree.layout()
    slots = layout.kv_slots
    assert page_size == 1 or np.any(np.diff(slots) != 1), "the test tree should be paged non-contiguously"
    out, lse, plan, q, k, v = run_both(tree, layout, PlanConfig(planner, chunk_size, query_tile), group, dtype,
                                       triton_device, seed)
    check_against_references(out, lse, plan, q, k, v, TOLERANCE[dtype])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 16]), group=st.sampled_from([1, 2, 3, 4, 8]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]), planner=st.sampled_from(["flatten", "node", "node_chunk", "path"]),
       chunk_size=st.sampled_from([16, 33, 100]), query_tile=st.integers(1, 24))
@pytest.mark.slow
def test_matches_reference_property(triton_device, seed, page_size, group, dtype, planner, chunk_size, query_tile):
    rng = np.random.default_rng(seed)
    tree = random_forest(rng, page_size, num_kv_heads=1, head_dim=64, dtype=dtype, max_nodes=6)
    out, lse, plan, q, k, v = run_both(tree, tree.layout(), PlanConfig(planner, chunk_size, query_tile), group, dtype,
                                       triton_device, seed % 1000)
    check_against_references(out, lse, plan, q, k, v, TOLERANCE[dtype])


def two_request_forest(short_len=9, page_size=16, hkv=1, head_dim=64, dtype=torch.float16) -> SequenceTree:
    """A short request (one decode token) and a long one with a Medusa-like token tree."""
    pool = PagedKVPool(64, page_size, num_kv_heads=hkv, head_dim=head_dim, dtype=dtype)
    tree = SequenceTree(pool)
    short = tree.add_prompt(range(short_len))
    long = tree.add_prompt(range(150))
    tree.commit_step()
    tree.extend(short, [1])
    tree.add_token_tree(long, range(20), [-1, -1, -1, 0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12, 13])
    gen = torch.Generator().manual_seed(3)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    return tree


def has_dead_kv_tile(plan, block_n: int) -> bool:
    """Whether some work item has a block_n tile of its chunk that none of its entries reads."""
    lens = np.diff(plan.chunk_kv_start)
    per_tile = block_n // 32
    for chunk, e0, n in zip(plan.item_chunk, plan.item_entry_start, plan.item_num_entries):
        words = np.bitwise_or.reduce(plan.entry_mask[e0:e0 + n], axis=0)
        for t in range(-(-lens[chunk] // block_n)):
            if not words[t * per_tile:(t + 1) * per_tile].any():
                return True
    return False


def test_direct_write_when_every_query_has_one_partial(triton_device):
    tree = two_request_forest(short_len=70)
    out, lse, plan, q, k, v = run_both(tree, tree.layout(), PlanConfig("flatten", 4096, 16), 4, torch.float16,
                                       triton_device)
    assert plan.entry_direct.all() and plan.num_chunks == 1
    assert has_dead_kv_tile(plan, triton_kernels.launch_config(64, 64).block_n)
    check_against_references(out, lse, plan, q, k, v, 2e-3)


def test_mixed_direct_and_merged_queries(triton_device):
    tree = two_request_forest()
    out, lse, plan, q, k, v = run_both(tree, tree.layout(), PlanConfig("flatten", 32, 8), 4, torch.float16,
                                       triton_device)
    assert plan.entry_direct.any() and not plan.entry_direct.all()
    check_against_references(out, lse, plan, q, k, v, 2e-3)


@pytest.mark.parametrize("group,query_tile,dtype,entries_per_program", [
    (2, 3, torch.float16, 3),      # several work items per chunk
    (16, 20, torch.float16, 16),   # 320 rows: each work item split over two programs of 256
    (4, 20, torch.float32, 16),    # fp32 programs hold at most 64 rows
])
@pytest.mark.slow
def test_many_queries_per_chunk(triton_device, group, query_tile, dtype, entries_per_program):
    tree = two_request_forest(dtype=dtype)
    out, lse, plan, q, k, v = run_both(tree, tree.layout(), PlanConfig("flatten", 64, query_tile), group, dtype,
                                       triton_device)
    assert np.diff(plan.chunk_entry_start).max() > entries_per_program
    check_against_references(out, lse, plan, q, k, v, TOLERANCE[dtype])


def test_float32_workspace(triton_device):
    tree = two_request_forest(dtype=torch.bfloat16)
    out, lse, plan, q, k, v = run_both(tree, tree.layout(), PlanConfig("node_chunk", 32, 8), 4, torch.bfloat16,
                                       triton_device, workspace_dtype=torch.float32)
    check_against_references(out, lse, plan, q, k, v, 1e-2)


def test_runs_are_bitwise_identical(triton_device):
    tree = two_request_forest()
    first = run_both(tree, tree.layout(), PlanConfig("flatten", 32, 4), 4, torch.float16, triton_device)
    second = run_both(tree, tree.layout(), PlanConfig("flatten", 32, 4), 4, torch.float16, triton_device)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_tree_attention_triton_backend(triton_device):
    tree = two_request_forest(hkv=2)
    attn = TreeAttention(8, 2, 64, backend="triton", device=triton_device, plan_config=PlanConfig("flatten", 48, 8))
    plan = attn.plan(tree)
    q = torch.randn(plan.plan.num_queries, 8, 64).half().to(triton_device)
    k_cache, v_cache = (c.to(triton_device) for c in tree.pool.layer(0))
    out, lse = attn.run(q, k_cache, v_cache, plan, return_lse=True)
    check_against_references(out, lse, plan.plan, q, k_cache, v_cache, 2e-3)


def test_launch_table():
    for head_dim in (16, 32, 64, 128, 256):
        for block_m in (16, 32, 64, 128):
            assert triton_kernels.launch_config(head_dim, block_m).block_n % 32 == 0
    with pytest.raises(ValueError, match="no triton launch config for head_dim=96"):
        triton_kernels.launch_config(96, 64)
    with pytest.raises(ValueError, match="block_m one in"):
        triton_kernels.launch_config(128, 128, torch.float32)


@pytest.fixture
def small_step(triton_device):
    pool = PagedKVPool(8, 4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    tree = SequenceTree(pool)
    tree.add_prompt(range(10))
    plan = make_plan(tree.layout())
    q = torch.randn(10, 4, 64).half().to(triton_device)
    return q, pool.k[0].to(triton_device), pool.v[0].to(triton_device), plan.to(triton_device)


@pytest.mark.parametrize("mutate,error,match", [
    (lambda q, k, v, p: (q.float(), k, v, p), TypeError, "k_cache dtype torch.float16 differs from q dtype torch.float32"),
    (lambda q, k, v, p: (q.int(), k, v, p), TypeError, "q dtype must be one of"),
    (lambda q, k, v, p: (q[:4], k, v, p), ValueError, "q has 4 rows but the plan has 10 queries"),
    (lambda q, k, v, p: (q[:, :3], k, v, p), ValueError, "q's 3 heads must be a multiple of the caches' 2 KV heads"),
    (lambda q, k, v, p: (q[..., :48], k[..., :48], v[..., :48], p), ValueError, "head_dim must be one of"),
    (lambda q, k, v, p: (q, k, v[:4], p), ValueError, "differ in shape"),
    (lambda q, k, v, p: (q, k.transpose(0, 1), v, p), ValueError, "k_cache must be viewable as"),
    (lambda q, k, v, p: (q, k, v, p.plan), TypeError, "plan must be a DeviceTreePlan"),
    (lambda q, k, v, p: (q, k, v, replace(p, kv_slots=p.kv_slots.long())), ValueError, "plan tensors must be int32"),
])
def test_bad_inputs_raise_clear_errors(small_step, mutate, error, match):
    with pytest.raises(error, match=match):
        run_plan_triton(*mutate(*small_step), AttentionVariant(sm_scale=0.125))


def test_bad_workspace_dtype_raises(small_step):
    with pytest.raises(TypeError, match="workspace_dtype must be one of"):
        run_plan_triton(*small_step, AttentionVariant(sm_scale=0.125), workspace_dtype=torch.int32)


@pytest.mark.slow
def test_repeated_runs_of_one_plan_take_fresh_inputs(triton_device):
    """After the first launch of a plan, later ones (on a GPU: through the cached compiled
    runner) must read the new q/K/V; a misaligned q view must get its own specialization."""
    tree = two_request_forest(hkv=2)
    plan = make_plan(tree.layout(), PlanConfig("flatten", 64, 4))
    device_plan = plan.to(triton_device)
    gen = torch.Generator().manual_seed(7)
    shape = tree.pool.layer(0)[0].shape
    for step in range(3):
        k, v = (torch.randn(shape, generator=gen).half().to(triton_device) for _ in range(2))
        q = torch.randn(plan.num_queries, 8, 64, generator=gen).half().to(triton_device)
        if step == 2:  # a view whose data pointer is 2 bytes past a 16-byte boundary
            q = torch.randn(plan.num_queries * 8 * 64 + 1, generator=gen).half().to(triton_device)[1:]
            q = q.view(plan.num_queries, 8, 64)
        out, lse = run_plan_triton(q, k, v, device_plan, AttentionVariant())
        check_against_references(out, lse, plan, q, k, v, 2e-3)
