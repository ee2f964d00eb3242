"""attention/backends: the Backend protocol, the registry the four backends register into, and no dispatch
on backend names anywhere in treedec/ (decisions go through a backend's capabilities)."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from treedec import TreeAttention
from treedec.attention import AttentionVariant
from treedec.attention import Backend, SpanMasking, backend_names, get_backend, register_backend
from treedec.attention.backends import CAPABILITIES, base, resolve_backend
from treedec.attention.backends.cuda_backend import CudaOpSizes
from treedec.attention.backends.torch_backend import TorchBackend
from treedec.attention.backends.triton_backend import TritonOpSizes
from treedec.errors import BackendUnavailableError
from treedec.tree import PagedKVPool, SequenceTree

PACKAGE = Path(__file__).resolve().parents[2] / "treedec"

# name: (prepares_launch, static_plans, custom_op, span_masking)
EXPECTED = {
    "reference": (False, False, False, SpanMasking.UNSUPPORTED),
    "torch": (False, False, False, SpanMasking.HOST),
    "triton": (True, True, True, SpanMasking.DEVICE),
    "cuda": (True, True, True, SpanMasking.DEVICE),
}


def test_the_four_backends_are_registered_in_order():
    assert backend_names() == ("reference", "torch", "triton", "cuda")
    assert backend_names(lambda b: b.static_plans) == ("triton", "cuda")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_backend_is_registered_with_its_capabilities(name):
    backend = get_backend(name)
    assert issubclass(backend, Backend) and backend.name == name
    assert (backend.prepares_launch, backend.static_plans, backend.custom_op, backend.span_masking) == EXPECTED[name]
    assert set(CAPABILITIES) == {"name", "prepares_launch", "static_plans", "custom_op", "span_masking"}


@pytest.mark.parametrize("name", ["flash", "", "auto", "Torch", None])
def test_an_unknown_name_is_an_error_that_lists_the_known_ones(name):
    with pytest.raises(ValueError, match="unknown attention backend") as error:
        get_backend(name)
    for known in EXPECTED:
        assert repr(known) in str(error.value)


def test_the_cpu_backends_are_available_and_cuda_says_why_not_on_the_cpu():
    cpu = torch.device("cpu")
    assert get_backend("reference").why_unavailable(cpu) is None and get_backend("torch").why_unavailable(cpu) is None
    assert "cuda" in get_backend("cuda").why_unavailable(cpu).lower()


def test_register_backend_refuses_a_name_twice_a_non_backend_and_missing_capabilities():
    with pytest.raises(ValueError, match="'torch' is registered already"):
        register_backend(TorchBackend)
    with pytest.raises(TypeError, match="takes a Backend subclass"):
        register_backend(object)

    class NoCapabilities(Backend):
        name = "incomplete"

    with pytest.raises(TypeError, match="must set the Backend capabilities"):
        register_backend(NoCapabilities)

    class Auto(TorchBackend):
        name = "auto"

    with pytest.raises(ValueError, match="other than 'auto'"):
        register_backend(Auto)
    assert backend_names() == tuple(EXPECTED)


def test_a_registered_backend_runs_through_tree_attention(monkeypatch):
    """The protocol is the whole contract: a new class, registered, is chosen and run by name."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    runs = []

    class Counting(TorchBackend):
        name = "counting"

        def run(self, q, k_cache, v_cache, plan, kv_scale=None):
            runs.append(plan.plan.num_queries)
            return super().run(q, k_cache, v_cache, plan, kv_scale)

        def run_out(self, q, k_cache, v_cache, plan, kv_scale=None):   # (TreeAttention.run without return_lse)
            runs.append(plan.plan.num_queries)
            return super().run_out(q, k_cache, v_cache, plan, kv_scale)

    register_backend(Counting)
    assert resolve_backend("counting", torch.device("cpu")) == ("counting", "requested 'counting'")
    pool = PagedKVPool(8, 4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    tree = SequenceTree(pool)
    tree.add_prompt(range(6))
    attn = TreeAttention(4, 2, 64, backend="counting", device="cpu", dtype=torch.float32)
    assert attn.backend == "counting" and isinstance(attn.backend_impl, Counting)
    plan = attn.plan(tree)
    q = torch.randn(6, 4, 64)
    k_cache, v_cache = pool.layer(0)
    out = attn.run(q, k_cache, v_cache, plan)
    torch.testing.assert_close(out, TreeAttention(4, 2, 64, backend="torch", device="cpu").run(q, k_cache, v_cache,
                                                                                                plan))
    assert runs == [6]


def test_unknown_names_reach_users_as_backend_unavailable():
    with pytest.raises(BackendUnavailableError, match="must be 'auto' or one of"):
        resolve_backend("flash", torch.device("cpu"))


@pytest.mark.parametrize("sizes", [TritonOpSizes(3, 10, 17, 4, True), CudaOpSizes(17, False, 96, 5)])
def test_op_sizes_travel_as_ints_and_come_back_typed(sizes):
    values = sizes.to_list()
    assert values == [int(getattr(sizes, f.name)) for f in dataclasses.fields(sizes)]
    assert all(type(v) is int for v in values)
    back = type(sizes).from_list(values)
    assert back == sizes and all(type(getattr(back, f.name)) is type(getattr(sizes, f.name))
                                 for f in dataclasses.fields(sizes))
    with pytest.raises(ValueError, match=f"{type(sizes).__name__} takes {len(values)} sizes"):
        type(sizes).from_list(values[:-1])


def test_the_custom_op_refuses_a_backend_without_one():
    q = torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match="runs the triton or cuda kernels, not the torch backend"):
        torch.ops.treedec.tree_attention(q, q[None], q[None], [], [], "torch", AttentionVariant().op_values())
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        torch.ops.treedec.tree_attention(q, q[None], q[None], [], [], "flash", AttentionVariant().op_values())


@pytest.mark.parametrize("variant", [AttentionVariant(), AttentionVariant(sm_scale=0.1, logit_softcap=30.0)],
                         ids=["plain", "softcap"])
def test_the_cuda_op_launches_what_run_launches(monkeypatch, variant):
    """torch.ops.treedec.tree_attention gets a cuda plan as OpArgs (tensors, typed sizes as ints) and the layer's
    variant, and launches the kernels with what CudaBackend.run launches them with: the same logit arguments, the
    extension of the variant's key (the cuda backend's host side on the CPU; the launch itself recorded)."""
    from treedec.attention.backends import cuda_backend
    from treedec.attention import PlanBounds, StaticPlan, make_plan

    pool = PagedKVPool(16, 4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    tree = SequenceTree(pool)
    root = tree.add_prompt(range(9))
    tree.branch(root, [[1, 2], [3]])
    plan = make_plan(tree.layout())
    backend = cuda_backend.CudaBackend.without_kernels(8, 2, 64, torch.float16, 4, 64)
    device_plan = StaticPlan(PlanBounds.for_plan(plan), backend, torch.device("cpu")).write(plan)
    calls = []
    monkeypatch.setattr(cuda_backend, "launch_prepared", lambda *a: calls.append(a) or (a[0].clone(), None))
    backend.variant, backend.logit_args = variant, variant.logit_args(64)
    monkeypatch.setattr(cuda_backend.kernels, "extension", lambda device, key: f"the extension of {key}")
    backend.ext = f"the extension of {variant.kernel_key()}"   # run() checks that it has kernels; the launch is
    # recorded, not run
    q = torch.zeros(device_plan.plan.num_queries, 8, 64, dtype=torch.float16)
    k_cache, v_cache = pool.layer(0)
    backend.run(q, k_cache, v_cache, device_plan)
    args = device_plan.prepared.op_args()
    assert args.backend == "cuda" and isinstance(args.sizes, CudaOpSizes) and args.sizes.merge is True
    torch.ops.treedec.tree_attention(*args.inputs(q, k_cache, v_cache, backend.variant))
    (q1, k1, v1, arrays1, starts1, units1, o1, lse1, *rest1), (q2, k2, v2, arrays2, starts2, units2, o2, lse2, *rest2) \
        = calls
    assert q1 is q2 and k1 is k2 and v1 is v2 and starts1 is starts2 and units1 is units2
    assert arrays1.keys() == arrays2.keys() and all(arrays1[n] is arrays2[n] for n in arrays1)
    assert (o1.shape, o1.dtype, lse1.shape, lse1.dtype) == (o2.shape, o2.dtype, lse2.shape, lse2.dtype)
    # merge, tile, max entries, logit args, ext, kv_scale
    assert rest1 == rest2 and rest1[-3] == variant.logit_args(64)


def test_host_backends_refuse_static_plans():
    attn = TreeAttention(4, 2, 64, backend="torch", device="cpu")
    with pytest.raises(ValueError, match="static plans \\(CUDA graphs\\) run on the triton or cuda kernels"):
        attn.backend_impl.for_static_plans(None)


BACKEND_NAMES = set(EXPECTED)


def _literals(node: ast.AST) -> set[str] | None:
    """The strings of a str constant or a tuple/list/set of them, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and \
            all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return {e.value for e in node.elts}
    return None


def name_dispatch(source: str) -> list[str]:
    """Comparisons (==, !=, in, not in) of anything with an attention backend's name as a string literal, except a
    device's ``.type`` (``device.type == "cuda"`` is the device, not a backend)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides, sides[1:]):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                continue
            for literal, other in ((right, left), (left, right)):
                names = _literals(literal)
                if names and names & BACKEND_NAMES and not (isinstance(other, ast.Attribute) and other.attr == "type"):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_dispatch_check_finds_the_string_tests_it_forbids():
    sources = ['if backend == "cuda": pass', 'if plan.backend != "torch": pass',
               'x = self.backend in ("triton", "cuda")', 'x = name not in ["torch", "reference"]',
               'x = "reference" == engine.attn.backend']
    assert all(name_dispatch(s) for s in sources)
    assert not name_dispatch('x = device.type == "cuda" or q.device.type not in ("cpu", "cuda")')
    assert not name_dispatch('x = plan.backend != self.backend or backend == "nccl"')


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_dispatches_on_backend_names(path):
    """Decisions by backend go through its capabilities (Backend's class attributes and methods), never a string
    test of its name; the user's ``backend="cuda"`` is resolved once, through the registry."""
    found = name_dispatch(path.read_text())
    assert not found, f"{path.relative_to(PACKAGE)} compares backend names: {found}"


def test_auto_takes_the_dtype_into_account_on_an_h200(monkeypatch):
    """auto on an sm_90 GPU picks cuda for fp16/bf16 and triton for fp32 (the cuda kernels refuse fp32), saying
    why; an explicit cuda for fp32 is refused at the choice, naming the dtype (no device needed: the GPU faked)."""
    from treedec.attention.backends import get_backend
    for name in ("cuda", "triton"):
        monkeypatch.setattr(get_backend(name), "why_unavailable", classmethod(lambda cls, device: None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    assert resolve_backend("auto", gpu, dtype=torch.bfloat16)[0] == "cuda"
    assert resolve_backend("auto", gpu, dtype=torch.float16)[0] == "cuda"
    backend, reason = resolve_backend("auto", gpu, dtype=torch.float32)
    assert backend == "triton" and "cuda: the cuda kernels take" in reason and "torch.float32" in reason
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' cannot run: the cuda kernels take"):
        resolve_backend("cuda", gpu, dtype=torch.float32)
