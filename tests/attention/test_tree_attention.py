import dataclasses
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from treedec import BackendUnavailableError, PlanConfig, TreeAttention
from treedec.attention import reference_tree_attention
from treedec.tree import PagedKVPool, SequenceTree, TreeLayout
from tests.trees import path_slots, random_forest, rel_error


def path_reference(tree, layout, q, k_cache, v_cache, sm_scale):
    """Attention of each query over its own path, one query at a time (no masks at all)."""
    hq, d = q.shape[1:]
    hkv = k_cache.shape[2]
    k_flat = k_cache.reshape(-1, hkv, d).float().repeat_interleave(hq // hkv, dim=1)
    v_flat = v_cache.reshape(-1, hkv, d).float().repeat_interleave(hq // hkv, dim=1)
    outs = []
    for i, (node, offset) in enumerate(zip(layout.query_node, layout.query_offset)):
        slots = torch.from_numpy(path_slots(tree, int(layout.node_ids[node]), int(offset)))
        p = torch.softmax(torch.einsum("hd,thd->ht", q[i].float(), k_flat[slots]) * sm_scale, dim=-1)
        outs.append(torch.einsum("ht,thd->hd", p, v_flat[slots]))
    return torch.stack(outs)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 3, 16]),
       group=st.sampled_from([1, 2, 3, 4, 8]), head_dim=st.sampled_from([64, 128, 256]),
       planner=st.sampled_from(["flatten", "node", "node_chunk", "path"]), chunk_size=st.sampled_from([7, 32, 128]))
def test_torch_executor_matches_references(seed, page_size, group, head_dim, planner, chunk_size):
    rng = np.random.default_rng(seed)
    hkv = int(rng.integers(1, 3))
    tree = random_forest(rng, page_size, num_kv_heads=hkv, head_dim=head_dim)
    attn = TreeAttention(hkv * group, hkv, head_dim, backend="torch", device="cpu",
                         plan_config=PlanConfig(planner, chunk_size, int(rng.integers(1, 9))))
    plan = attn.plan(tree)
    q = torch.randn(plan.plan.num_queries, hkv * group, head_dim, generator=torch.Generator().manual_seed(seed))
    k_cache, v_cache = tree.pool.layer(0)
    out, lse = attn.run(q, k_cache, v_cache, plan, return_lse=True)
    ref, ref_lse = reference_tree_attention(q, k_cache, v_cache, plan.plan.layout, attn.variant)
    assert out.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:2]
    assert rel_error(out, ref) < 1e-5
    assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
    assert rel_error(ref, path_reference(tree, plan.plan.layout, q, k_cache, v_cache,
                                         attn.variant.scale(head_dim))) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_precision_inputs(dtype, tol):
    tree = random_forest(np.random.default_rng(1), 16, num_kv_heads=2, head_dim=128, dtype=dtype)
    attn = TreeAttention(8, 2, 128, backend="torch", device="cpu", plan_config=PlanConfig("flatten", 32, 4))
    plan = attn.plan(tree)
    q = torch.randn(plan.plan.num_queries, 8, 128).to(dtype)
    k_cache, v_cache = tree.pool.layer(0)
    out = attn.run(q, k_cache, v_cache, plan)
    ref, _ = reference_tree_attention(q, k_cache, v_cache, plan.plan.layout, attn.variant)
    assert out.dtype == dtype
    assert rel_error(out, ref) < tol


def test_reference_backend_and_layout_input():
    layout = TreeLayout.from_parents([-1, 0, 0], [20, 3, 4], [(1, 2), (2, 3)])
    k = torch.randn(27, 1, 2, 64)
    v = torch.randn(27, 1, 2, 64)
    q = torch.randn(2, 4, 64)
    plan = TreeAttention(4, 2, 64, device="cpu").plan(layout)
    outs = [TreeAttention(4, 2, 64, backend=b, device="cpu").run(q, k, v, plan) for b in ("reference", "torch")]
    assert rel_error(outs[1], outs[0]) < 1e-5


@pytest.fixture
def small_step():
    pool = PagedKVPool(16, 4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    tree = SequenceTree(pool)
    tree.add_prompt(range(10))
    attn = TreeAttention(4, 2, 64, backend="torch", device="cpu")
    return attn, attn.plan(tree), pool


@pytest.mark.parametrize("mutate,error,match", [
    (lambda q, k, v: (q[:5], k, v), ValueError,
     r"q must have shape \[num_queries, num_qo_heads, head_dim\] = \(10, 4, 64\)"),
    (lambda q, k, v: (q.int(), k, v), TypeError, "q must be one of"),
    (lambda q, k, v: (q, k.float(), v), TypeError, "k_cache dtype torch.float32 differs"),
    (lambda q, k, v: (q, k[:, :, :1], v), ValueError, r"k_cache must have shape \[num_pages, page_size, 2, 64\]"),
    (lambda q, k, v: (q, k, v[:2]), ValueError, "differ in shape"),
    (lambda q, k, v: (q, k[:2], v[:2]), ValueError, "the plan reads slot 9 but the cache holds 8 slots"),
    (lambda q, k, v: (q, k.transpose(0, 1), v), ValueError, "k_cache must be contiguous"),
    (lambda q, k, v: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v), ValueError,
     "q must be contiguous in its last dim"),
])
def test_run_rejects_bad_inputs(small_step, mutate, error, match):
    attn, plan, pool = small_step
    q = torch.randn(10, 4, 64, dtype=torch.float16)
    with pytest.raises(error, match=match):
        attn.run(*mutate(q, *pool.layer(0)), plan)


def test_constructor_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TreeAttention(6, 4, 64)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        TreeAttention(4, 4, 96)


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((8.0, 8, 128), {}, TypeError, r"num_qo_heads must be an int, got 8\.0"),
    ((8, True, 128), {}, TypeError, "num_kv_heads must be an int, got True"),
    ((8, 8, "128"), {}, TypeError, "head_dim must be an int"),
    ((8, 8, 128), {"variant": 0.125}, TypeError, "variant must be an AttentionVariant, got float"),
    ((8, 8, 128), {"device": "tpu"}, ValueError, "device must be a torch.device or a device string"),
    ((8, 8, 128), {"device": 3.5}, ValueError, "device must be a torch.device or a device string"),
    ((8, 8, 128), {"device": "meta"}, ValueError, "device must be a CPU or CUDA device"),
    ((8, 8, 128), {"plan_config": {"planner": "flatten"}}, TypeError, "plan_config must be a PlanConfig"),
])
def test_constructor_names_the_bad_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        TreeAttention(*args, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CPU-only torch")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match="device 'cuda' asked for, but this machine has"):
        TreeAttention(8, 8, 128, device="cuda")


@pytest.mark.parametrize("tree", [None, 3, [0, 1], "tree"])
def test_plan_takes_a_tree_or_layout(tree):
    with pytest.raises(TypeError, match="plan\\(\\) takes a SequenceTree or its TreeLayout, got"):
        TreeAttention(4, 2, 64, device="cpu").plan(tree)


def test_a_prepared_plan_is_the_plan_with_its_launch(small_step):
    """prepare() sets the backend and launch as dataclasses.replace would, every other field the plan's own."""
    attn, plan, _ = small_step
    again = attn.prepare(plan)
    expected = dataclasses.replace(plan, backend=attn.backend, prepared=again.prepared)
    assert type(again) is type(expected) and again.backend == attn.backend and again.prepared is not plan.prepared
    assert all(getattr(again, f.name) is getattr(expected, f.name) for f in dataclasses.fields(expected))


def test_plan_into_must_be_a_static_plan(small_step):
    attn, _, pool = small_step
    tree = SequenceTree(pool)
    tree.add_prompt(range(3))
    with pytest.raises(TypeError, match="into must be a StaticPlan"):
        attn.plan(tree, into={})


def test_backend_choice_is_reported_and_explicit_failures_raise():
    auto = TreeAttention(4, 2, 64, device="cpu")
    assert auto.backend == "torch" and "auto" in auto.backend_reason
    with pytest.raises(BackendUnavailableError, match="cuda backend"):
        TreeAttention(4, 2, 64, backend="cuda", device="cpu")
    with pytest.raises(BackendUnavailableError, match="must be 'auto' or one of"):
        TreeAttention(4, 2, 64, backend="flash")


@pytest.mark.parametrize("triton_version, numpy_version, fails", [
    ("3.6.0", "2.4.1", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.1", False), ("3.9.0", "2.4.6", False),
])
def test_triton_interpreter_versions_that_break_are_named(monkeypatch, triton_version, numpy_version, fails):
    """The CPU interpreter of Triton < 3.7 cannot run the kernels under numpy >= 2.4: say so, with the fix."""
    triton = pytest.importorskip("triton")
    import numpy as np

    from treedec.attention import get_backend
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(np, "__version__", numpy_version)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    problem = get_backend("triton").why_unavailable(torch.device("cpu"))
    if fails:
        assert "triton-lang/triton#9171" in problem and "triton>=3.7" in problem
        with pytest.raises(BackendUnavailableError, match="numpy"):
            TreeAttention(8, 2, 64, backend="triton", device="cpu")
    else:
        assert problem is None


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache"])
def test_run_names_an_input_that_is_not_a_tensor(name):
    """Was: AttributeError 'numpy.ndarray' object has no attribute 'dim' from inside the checks."""
    attn = TreeAttention(4, 2, 64, backend="torch", device="cpu", dtype=torch.float32)
    pool = PagedKVPool(num_pages=4, page_size=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    tree = SequenceTree(pool)
    tree.add_prompt([1, 2, 3])
    plan = attn.plan(tree)
    inputs = {"q": torch.zeros(3, 4, 64), "k_cache": pool.layer(0)[0], "v_cache": pool.layer(0)[1]}
    inputs[name] = inputs[name].numpy()
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got ndarray \(torch.from_numpy"):
        attn.run(inputs["q"], inputs["k_cache"], inputs["v_cache"], plan)
