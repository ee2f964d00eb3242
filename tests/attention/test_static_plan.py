"""Static plans (attention/static_plan.py): bounds, padding, and runs of new trees from the same buffers."""
import numpy as np
import pytest
import torch

from treedec import TreeAttention
from treedec.attention import AttentionVariant, PlanBounds, PlanConfig, StaticPlan, make_plan, reference_tree_attention
from treedec.attention.backends.triton_backend import TritonBackend
from treedec.errors import PlanError
from treedec.tree import PagedKVPool, SequenceTree, TreeLayout
from tests.trees import random_forest, rel_error


def _tree_plan():
    tree = SequenceTree(PagedKVPool(64, 4, allocate_storage=False))
    root = tree.add_prompt(list(range(30)))
    tree.commit_step()
    tree.branch(root, [[1], [2, 3], [4]])
    return make_plan(tree.layout(), PlanConfig(chunk_size=8, query_tile=2), 2)


def test_bounds_for_a_plan_fit_it_and_name_what_does_not():
    plan = _tree_plan()
    bounds = PlanBounds.for_plan(plan)
    assert bounds.fits(plan) and bounds.max_queries == 4 and bounds.entries > bounds.max_queries
    small = PlanBounds(max_queries=2, max_tokens=1024, max_chunks=16, max_entries=64, max_items=16, max_chunk_tokens=32)
    assert small.problem(plan) == "the tree's plan has 4 queries, over PlanBounds.max_queries=2"
    assert bounds.union(small) == bounds
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        PlanBounds(max_queries=4, max_tokens=0)


@pytest.mark.parametrize("bound, what", [("max_queries", "queries"), ("max_tokens", "needed KV tokens"),
                                         ("max_chunks", "chunks"), ("max_entries", "entries"),
                                         ("max_items", "work items"),
                                         ("max_chunk_tokens", "tokens in its longest chunk")])
def test_problem_names_each_bound_a_plan_exceeds(bound, what):
    plan = _tree_plan()
    value = {"max_queries": plan.num_queries, "max_tokens": plan.num_tokens, "max_chunks": plan.num_chunks,
             "max_entries": plan.num_entries, "max_items": plan.num_items,
             "max_chunk_tokens": plan.max_chunk_len}[bound]
    roomy = dict(max_queries=64, max_tokens=1024, max_chunks=64, max_entries=256, max_items=64, max_chunk_tokens=4096)
    assert PlanBounds(**roomy).problem(plan) is None
    bounds = PlanBounds(**{**roomy, bound: value - 1})
    assert bounds.problem(plan) == f"the tree's plan has {value} {what}, over PlanBounds.{bound}={value - 1}"
    assert not bounds.fits(plan) and PlanBounds(**{**roomy, bound: value}).fits(plan)


def test_write_pads_the_plan_and_copies_extra_sections():
    pytest.importorskip("triton")
    plan = _tree_plan()
    bounds = PlanBounds.for_plan(plan)
    backend = TritonBackend(4, 2, 64, torch.float16, AttentionVariant(sm_scale=0.125))
    static = StaticPlan(bounds, backend, torch.device("cpu"), extra={"inputs": (3, bounds.max_queries)})
    p = static.write(plan, extra={"inputs": np.array([[1, 2, 3, 4], [30, 30, 31, 30], [5, 6, 7, 8]])})
    assert p is static.device_plan and p.backend == "triton" and p.prepared is not None
    assert p.plan.num_queries == 4 and p.plan.num_items == bounds.items and p.plan.num_entries == bounds.entries
    q = plan.num_queries
    assert static.extra["inputs"].tolist() == [[1, 2, 3, 4], [30, 30, 31, 30], [5, 6, 7, 8]]
    n_items, n_chunks = plan.num_items, plan.num_chunks
    assert p.item_num_entries[n_items:].eq(0).all()
    assert p.item_num_entries[:n_items].tolist() == plan.item_num_entries.tolist()
    assert p.chunk_kv_start[: n_chunks + 1].tolist() == plan.chunk_kv_start.tolist()
    assert p.query_entry_start[q:].eq(int(plan.query_entry_start[-1])).all()
    assert p.entry_mask[: plan.num_entries, : plan.mask_words].tolist() == plan.entry_mask.tolist()
    assert p.entry_mask[: plan.num_entries, plan.mask_words:].eq(0).all()
    # a smaller plan in the same buffers: the same prepared DeviceTreePlan, empty rows past its queries
    small = make_plan(TreeLayout.from_parents([-1, 0], [30, 1], [(1, 0)]), PlanConfig(chunk_size=8, query_tile=2), 2)
    with pytest.raises(ValueError, match=r"extra sections \['nope'\]"):
        static.write(small, extra={"nope": np.zeros(1, dtype=np.int32)})
    assert static.current is plan
    assert static.write(small) is p and static.current is small
    assert p.query_entry_start[2:].eq(int(small.query_entry_start[-1])).all()
    assert p.item_num_entries[small.num_items:].eq(0).all()


def test_a_plan_over_the_bounds_changes_nothing():
    pytest.importorskip("triton")
    plan = _tree_plan()
    static = StaticPlan(PlanBounds.for_plan(plan), TritonBackend(4, 2, 64, torch.float16,
                                                                 AttentionVariant(sm_scale=0.125)), torch.device("cpu"))
    static.write(plan)
    before = static._dev.clone()
    big = make_plan(TreeLayout.from_parents([-1, 0, 0, 0, 0, 0], [30, 1, 1, 1, 1, 1],
                                            [(i, 0) for i in range(1, 6)]), PlanConfig(chunk_size=8, query_tile=2), 2)
    with pytest.raises(PlanError, match="over PlanBounds.max_queries=4"):
        static.write(big)
    other_tile = make_plan(TreeLayout.from_parents([-1, 0], [30, 1], [(1, 0)]), PlanConfig(chunk_size=8, query_tile=1),
                           2)
    with pytest.raises(PlanError, match="query tile 1 differs"):
        static.write(other_tile)
    assert static.current is plan and torch.equal(static._dev, before)


def test_torch_backend_has_no_static_plans():
    with pytest.raises(ValueError, match="static plans .* triton or cuda"):
        TreeAttention(4, 2, 64, backend="torch", device="cpu").static_plan(PlanBounds(max_queries=4, max_tokens=64))


@pytest.mark.slow
@pytest.mark.triton
def test_runs_from_one_static_plan_match_the_reference_for_new_trees(triton_device):
    """What a captured graph does, without capture: plan trees of different shapes into one static
    plan and run the same launch (q at the bounds' rows) on the same buffers each time."""
    hkv, group, d = 1, 4, 64
    attn = TreeAttention(hkv * group, hkv, d, backend="triton", device=triton_device,
                         plan_config=PlanConfig("flatten", 32, 4))
    bounds = PlanBounds(max_queries=32, max_tokens=2048, max_chunk_tokens=64)
    static = attn.static_plan(bounds)
    q_static = torch.zeros(bounds.max_queries, hkv * group, d, dtype=torch.float16, device=triton_device)
    plans = []
    for seed in range(3):
        tree = random_forest(np.random.default_rng(seed), 16, num_kv_heads=hkv, head_dim=d, dtype=torch.float16,
                             max_nodes=6)
        plan = attn.plan(tree, into=static)
        plans.append(plan)
        n = static.current.num_queries
        q = torch.randn(n, hkv * group, d, generator=torch.Generator().manual_seed(seed)).half()
        q_static[:n] = q.to(triton_device)
        k, v = (c.to(triton_device) for c in tree.pool.layer(0))
        out, lse = attn.run(q_static, k, v, plan, return_lse=True)
        ref, ref_lse = reference_tree_attention(q, *tree.pool.layer(0), static.current.layout, AttentionVariant())
        assert rel_error(out[:n].cpu(), ref) < 2e-3
        torch.testing.assert_close(lse[:n].cpu(), ref_lse, atol=2e-3, rtol=1e-4)
    assert all(p is plans[0] for p in plans)


@pytest.mark.triton
def test_run_checks_the_current_plans_slots_against_the_cache(triton_device):
    """A static plan's DeviceTreePlan carries its bounds' sizes; the slot check uses the plan it holds now."""
    attn = TreeAttention(4, 1, 64, backend="triton", device=triton_device, plan_config=PlanConfig("flatten", 32, 4))
    pool = PagedKVPool(64, 4, num_kv_heads=1, head_dim=64, dtype=torch.float16)
    tree = SequenceTree(pool)
    root = tree.add_prompt(list(range(8)))
    tree.commit_step()
    tree.extend(root, [1])
    static = attn.static_plan(PlanBounds(max_queries=4, max_tokens=256, max_chunk_tokens=64))
    plan = attn.plan(tree, into=static)
    tree.commit_step()
    tree.extend(root, list(range(39)))
    tree.commit_step()
    tree.extend(root, [2])   # one query that reads slots past the small cache below
    attn.plan(tree, into=static)
    q = torch.zeros(4, 4, 64, dtype=torch.float16, device=triton_device)
    k, v = (c[:4].to(triton_device) for c in pool.layer(0))   # 4 pages: 16 slots
    with pytest.raises(ValueError, match="the plan reads slot 48 but the cache holds 16 slots"):
        attn.run(q, k, v, plan)
