"""attention/custom_ops.py: tree attention and the K/V store as torch custom ops, and the engine's
compiled graph forward that calls them (on the CPU the Triton kernels run in the interpreter)."""
import numpy as np
import pytest
import torch

from treedec import TreeAttention
from treedec.engine import CudaGraphConfig, Engine
from treedec.models import from_config
from treedec.workloads.deft import medusa_tree
from tests.engines import tiny_model
from tests.trees import random_forest

pytestmark = pytest.mark.triton


def _step_inputs(device, seed=0, group=2, hkv=2, head_dim=64, dtype=torch.float16):
    rng = np.random.default_rng(seed)
    tree = random_forest(rng, 16, num_kv_heads=hkv, head_dim=head_dim, dtype=dtype, max_nodes=6)
    attn = TreeAttention(hkv * group, hkv, head_dim, backend="triton", device=device, dtype=dtype)
    plan = attn.plan(tree)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(plan.plan.num_queries, hkv * group, head_dim, generator=gen).to(device, dtype)
    k_cache, v_cache = (cache.to(device) for cache in tree.pool.layer(0))
    return attn, plan, q, k_cache, v_cache


def test_tree_attention_op_equals_run(triton_device):
    attn, plan, q, k_cache, v_cache = _step_inputs(triton_device)
    torch.testing.assert_close(attn.run_op(q, k_cache, v_cache, plan), attn.run(q, k_cache, v_cache, plan),
                               atol=0, rtol=0)


def test_ops_pass_opcheck(triton_device):
    """Schemas, fake (meta) implementations and declared mutations agree with what the ops do."""
    attn, plan, q, k_cache, v_cache = _step_inputs(triton_device)
    args = attn.op_args(plan)
    assert args.backend == plan.backend
    torch.library.opcheck(torch.ops.treedec.tree_attention.default, args.inputs(q, k_cache, v_cache, attn.variant),
                          test_utils=("test_schema", "test_faketensor"))
    slots = torch.tensor([3, 0, 17], device=triton_device)
    k_slots = torch.zeros(32, 2, 64, device=triton_device)
    v_slots = torch.zeros(32, 2, 64, device=triton_device)
    k, v = torch.randn(3, 2, 64, device=triton_device), torch.randn(3, 2, 64, device=triton_device)
    torch.library.opcheck(torch.ops.treedec.store_kv.default, (k_slots, v_slots, slots, k, v),
                          test_utils=("test_schema", "test_faketensor"))
    torch.ops.treedec.store_kv(k_slots, v_slots, slots, k, v)
    assert torch.equal(k_slots[slots], k) and torch.equal(v_slots[slots], v)


def test_op_args_need_a_kernel_plan(triton_device):
    attn, plan, q, k_cache, v_cache = _step_inputs(triton_device)
    torch_attn = TreeAttention(4, 2, 64, backend="torch", device="cpu")
    with pytest.raises(ValueError, match="custom op runs plans prepared for the triton or cuda kernels"):
        torch_attn.op_args(torch_attn.plan(plan.plan.layout))
    with pytest.raises(ValueError, match="q must have shape"):
        attn.run_op(q[:, :1], k_cache, v_cache, plan)


def test_compile_model_options_are_checked():
    model = tiny_model()
    with pytest.raises(ValueError, match="compile_model compiles the forward of graphed steps: it needs cuda_graphs"):
        Engine(model, kv_tokens=256, backend="torch", compile_model=True)
    with pytest.raises(TypeError, match="compile_model must be a bool or a dict"):
        Engine(model, kv_tokens=256, backend="torch", cuda_graphs=CudaGraphConfig(capture=False), compile_model="yes")


@pytest.mark.slow
def test_compiled_graph_steps_equal_eager(triton_device):
    """Steps of a compiled static forward (Dynamo + AOTAutograd through the custom ops, one compile per
    bucket, capture off) give the uncompiled static steps' logits, hidden states and K/V."""
    if triton_device.type == "cuda":
        pytest.skip("covered by the GPU test with capture and Inductor")
    model = tiny_model()
    graphs = CudaGraphConfig(max_queries=64, capture=False)
    engines = [Engine(model, kv_tokens=1024, page_size=4, backend="triton", cuda_graphs=graphs, compile_model=c)
               for c in (False, {"backend": "aot_eager"})]
    medusa = medusa_tree(32)
    results = []
    for engine in engines:
        out = []
        root = engine.prefill(list(range(40, 70)))
        out.append(root.logits[None])
        kids = engine.tree.branch(root.node, [[1], [3]])
        out.append(engine.step().logits)
        engine.tree.add_token_tree(kids[0], list(range(32)), medusa.parents)
        engine.tree.extend(kids[1], [9])
        step = engine.step(return_hidden=True)       # 33 queries: a second bucket
        out += [step.logits, step.hidden]
        engine.tree.extend_many({leaf: [7] for leaf in engine.tree.live_leaves()})
        out.append(engine.step().logits)
        results.append(out)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    torch.testing.assert_close(engines[0].pool.k, engines[1].pool.k, atol=2e-5, rtol=0)
    torch.testing.assert_close(engines[0].pool.v, engines[1].pool.v, atol=2e-5, rtol=0)
    assert engines[1].graph_stats["static_eager"] == 4 and not any(k.startswith("eager") for k in engines[1].graph_stats)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_compiled_captured_steps_equal_eager_on_gpu(backend):
    """Inductor-compiled, captured steps (both kernel backends; auto is cuda on an H100/H200)
    equal eager steps over trees of changing shapes."""
    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    eager = Engine(model, kv_tokens=8192, page_size=16, backend=backend)
    compiled = Engine(model, kv_tokens=8192, page_size=16, backend=backend, cuda_graphs=True, compile_model=True)
    medusa = medusa_tree(64)
    results = []
    for engine in (eager, compiled):
        gen = np.random.default_rng(2)
        out = []
        root = engine.prefill(gen.integers(0, 512, 1500).tolist()).node
        for _ in range(6):
            ids = engine.tree.add_token_tree(root, gen.integers(0, 512, 64).tolist(), medusa.parents)
            verified = engine.step(return_hidden=True)
            out += [verified.logits, verified.hidden]
            engine.tree.accept(root, [ids[0]])
            engine.tree.extend(root, gen.integers(0, 512, int(gen.integers(1, 40))).tolist())
            out.append(engine.step(logits_rows=[0]).logits)
        results.append(out)
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(eager.pool.k.float(), compiled.pool.k.float(), atol=2e-2, rtol=2e-2)
    assert compiled.graph_stats["replays"] > compiled.graph_stats["captures"] > 0
