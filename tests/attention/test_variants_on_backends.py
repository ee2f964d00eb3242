"""Every attention variant on every backend against one definition: each query's softmax over its own root path,
one query at a time (``tree.path``, no layouts, masks or plans), the variant's scale, soft-cap and window applied
to it as AttentionVariant defines them. The reference and torch backends run here, triton in its interpreter on
the CPU (on a GPU: compiled), cuda on a GPU (``-m gpu``)."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from treedec import PlanConfig, TreeAttention
from treedec.attention import AttentionVariant, get_backend
from treedec.tree import SequenceTree
from tests.trees import path_slots, poison_free_slots, random_forest, rel_error

VARIANTS = [AttentionVariant(), AttentionVariant(sm_scale=0.3), AttentionVariant(logit_softcap=5.0),
            AttentionVariant(window=1), AttentionVariant(window=7), AttentionVariant(window=40),
            AttentionVariant(sm_scale=0.2, logit_softcap=3.0, window=25)]
IDS = ["plain", "scale", "softcap", "window1", "window7", "window40", "all"]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def path_attention(tree: SequenceTree, q: torch.Tensor, k_cache, v_cache, variant: AttentionVariant) -> torch.Tensor:
    """[Q, Hq, D] fp32: each query over the keys of its root path that the variant shows it (by their index on
    the path), its logits through the variant's scale and soft-cap."""
    layout = tree.layout()
    hq, d = q.shape[1:]
    hkv = k_cache.shape[2]
    k_flat = k_cache.reshape(-1, hkv, d).float().repeat_interleave(hq // hkv, dim=1)
    v_flat = v_cache.reshape(-1, hkv, d).float().repeat_interleave(hq // hkv, dim=1)
    outs = []
    for i, (node, offset) in enumerate(zip(layout.query_node.tolist(), layout.query_offset.tolist())):
        slots = torch.from_numpy(path_slots(tree, int(layout.node_ids[node]), offset))
        position = len(slots) - 1
        if variant.window is not None:
            slots = slots[max(0, position - variant.window + 1):]
        s = torch.einsum("hd,thd->ht", q[i].float().cpu(), k_flat[slots].cpu()) * variant.scale(d)
        if variant.logit_softcap is not None:
            s = variant.logit_softcap * torch.tanh(s / variant.logit_softcap)
        outs.append(torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), v_flat[slots].cpu()))
    return torch.stack(outs)


def run_variant(backend, device, tree, variant, group, dtype, planner, chunk_size, query_tile, seed):
    hkv, d = tree.pool.num_kv_heads, tree.pool.head_dim
    attn = TreeAttention(hkv * group, hkv, d, backend=backend, device=device, dtype=dtype, variant=variant,
                         plan_config=PlanConfig(planner, chunk_size, query_tile))
    plan = attn.plan(tree)
    q = torch.randn(plan.plan.num_queries, hkv * group, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    k_cache, v_cache = (c.to(device) for c in tree.pool.layer(0))
    out = attn.run(q.to(device), k_cache, v_cache, plan)
    assert out.dtype == dtype and out.shape == q.shape
    return rel_error(out.cpu(), path_attention(tree, q, *tree.pool.layer(0), variant))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 3, 16]), group=st.sampled_from([1, 2, 4]),
       variant=st.sampled_from(VARIANTS), backend=st.sampled_from(["reference", "torch"]),
       planner=st.sampled_from(["flatten", "node", "node_chunk", "path"]), chunk_size=st.sampled_from([7, 32, 128]))
def test_host_backends_compute_every_variant(seed, page_size, group, variant, backend, planner, chunk_size):
    rng = np.random.default_rng(seed)
    tree = random_forest(rng, page_size, num_kv_heads=int(rng.integers(1, 3)), head_dim=64)
    error = run_variant(backend, "cpu", tree, variant, group, torch.float32, planner, chunk_size,
                        int(rng.integers(1, 9)), seed % 1000)
    assert error < TOLERANCE[torch.float32], f"{error=}"


@pytest.mark.parametrize("form", ["dense", "chunks", "rows"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_every_torch_form_applies_the_variant(form, variant):
    tree = random_forest(np.random.default_rng(5), 4, num_kv_heads=2, head_dim=64)
    attn = TreeAttention(4, 2, 64, backend="torch", device="cpu", variant=variant, plan_config=PlanConfig("flatten", 16))
    attn.backend_impl.form = form
    plan = attn.plan(tree)
    q = torch.randn(plan.plan.num_queries, 4, 64)
    out = attn.run(q, *tree.pool.layer(0), plan)
    assert attn.backend_impl.forms == {form: 1}
    assert rel_error(out, path_attention(tree, q, *tree.pool.layer(0), variant)) < 1e-5


@pytest.mark.triton
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 16]), group=st.sampled_from([1, 4]),
       variant=st.sampled_from(VARIANTS), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       planner=st.sampled_from(["flatten", "node_chunk"]), chunk_size=st.sampled_from([16, 64]))
def test_triton_computes_every_variant(triton_device, seed, page_size, group, variant, dtype, planner, chunk_size):
    rng = np.random.default_rng(seed)
    tree = random_forest(rng, page_size, num_kv_heads=1, head_dim=64, dtype=dtype, max_nodes=6)
    poison_free_slots(tree)
    error = run_variant("triton", triton_device, tree, variant, group, dtype, planner, chunk_size,
                        int(rng.integers(1, 9)), seed % 1000)
    assert error < TOLERANCE[dtype], f"{error=}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda kernels need a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_cuda_computes_every_variant(variant, head_dim, dtype):
    if get_backend("cuda").why_unavailable(torch.device("cuda")):
        pytest.skip(get_backend("cuda").why_unavailable(torch.device("cuda")))
    for seed in range(4):
        rng = np.random.default_rng(seed)
        tree = random_forest(rng, 16, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
        poison_free_slots(tree)
        for planner, chunk_size in (("flatten", None), ("node_chunk", 64)):
            error = run_variant("cuda", "cuda", tree, variant, 4, dtype, planner, chunk_size, None, seed)
            assert error < TOLERANCE[dtype], f"{seed=} {planner=}: {error=}"


# The held trees of bench/attention.py (BENCH.md's suite) with the issue's variants: a soft-cap, Gemma 3's window of
# 512 keys and Mistral's of 4096 (the windows scaled with the trees on the CPU).
SUITE_VARIANTS = [AttentionVariant(logit_softcap=50.0), AttentionVariant(window=512),
                  AttentionVariant(window=4096, logit_softcap=30.0)]


def suite_error(name: str, variant: AttentionVariant, backend: str, device, scale: float, dtype) -> float:
    """Relative error of ``backend`` against the fp32 reference on suite tree ``name`` at ``scale``, its window
    scaled alike."""
    from bench.suite import build_workload
    from treedec.attention import reference_tree_attention
    window = None if variant.window is None else max(1, round(variant.window * scale))
    variant = AttentionVariant(variant.sm_scale, variant.logit_softcap, window)
    w = build_workload(name, scale=scale)
    q, k, v = w.random_inputs(device, dtype)
    attn = TreeAttention(q.shape[1], k.shape[2], q.shape[2], backend=backend, device=device, dtype=dtype,
                         variant=variant)
    out = attn.run(q, k, v, attn.plan(w.layout))
    ref, _ = reference_tree_attention(q, k, v, w.layout, variant)
    return rel_error(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("variant", SUITE_VARIANTS, ids=["softcap50", "window512", "window4096-softcap30"])
def test_torch_backend_on_the_suite_trees(variant):
    from bench.suite import SUITE
    for name in SUITE:
        assert suite_error(name, variant, "torch", "cpu", 0.05, torch.float32) < 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels at full scale need a GPU")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("variant", SUITE_VARIANTS, ids=["softcap50", "window512", "window4096-softcap30"])
def test_kernels_on_the_suite_trees(backend, variant):
    from bench.suite import SUITE
    for name in SUITE:
        assert suite_error(name, variant, backend, "cuda", 1.0, torch.float16) < 2e-3, name
