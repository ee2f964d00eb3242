"""The batch-invariant mode under torch.compile (``Engine(..., batch_invariant=True, compile_model=True)``): the
compiled forward keeps the mode's GEMMs and norms as opaque custom ops (its ATen graph has no mm, addmm or
reduction of its own), and its logits are the same bits for a row alone or in a batch. On the CPU: the rows ops
(Inductor's C++ kernels around them, bitwise), the Triton ops' graph and the engine's compiled path interpreted
(marked ``triton``); the GPU tests (bf16, Inductor, CUDA graphs) are marked ``gpu``."""
import os

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from treedec.engine import CudaGraphConfig, Engine
from treedec.models.batch_invariant import make_batch_invariant

from test_batch_invariance import PROMPTS, _gpu_prompts, assert_bitwise, decode_logits, tiny

#: ATen ops a switched model's graph must not hold: the GEMMs and reductions its custom ops own.
OWNED = {"mm", "addmm", "bmm", "matmul", "linear", "mean", "sum", "var_mean", "rsqrt", "_fused_rms_norm"}


def row_local_attend(layer, q, k, v):
    """Attention stand-in whose row ``i`` reads row ``i`` only (so any batch difference would be the model's)."""
    return q + v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)


def aten_graph(model, n=5):
    """The ATen ops (``namespace.name``) of ``model.forward_graph`` over ``n`` rows as AOTAutograd lowers it."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)
    compiled = torch.compile(model.forward_graph, backend=aot_autograd(fw_compiler=record), fullgraph=True)
    with torch.no_grad():
        compiled(torch.arange(n, device=model.device) + 3, torch.arange(n, device=model.device), row_local_attend)
    [gm] = graphs
    return [f"{n.target.namespace}.{n.target._opname}" for n in gm.graph.nodes
            if n.op == "call_function" and hasattr(n.target, "namespace")]


def assert_opaque(ops, matmul, norm, add_norm, model):
    assert ops.count(matmul) == sum(model.linear_paths().values()), ops
    # (two added norms a layer; the first layer's input norm has no add before it)
    assert ops.count(add_norm) == 2 * len(model.layers) and ops.count(norm) == 1, ops
    owned = sorted({op for op in ops if op.startswith("aten.") and op.split(".")[1] in OWNED})
    assert not owned, owned


def switched(kernel=None, device="cpu", dtype=torch.float32):
    model = tiny(dtype, device)
    make_batch_invariant(model, kernel)
    return model


def test_the_compiled_graph_keeps_the_rows_ops_opaque():
    model = switched()
    assert_opaque(aten_graph(model), "treedec.linear_rows", "treedec.rms_norm_rows", "treedec.add_rms_norm_rows",
                  model)
    # the check has power: the default mode's graph holds the GEMMs and the norms' reductions
    default = set(aten_graph(tiny()))
    assert {"aten.mm", "aten._fused_rms_norm"} & default, sorted(default)


@pytest.mark.triton
def test_the_compiled_graph_keeps_the_triton_ops_opaque(triton_device):
    if triton_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    model = switched("triton-kernels", triton_device)
    assert_opaque(aten_graph(model, n=3), "treedec.batch_invariant_matmul", "treedec.batch_invariant_rms_norm",
                  "treedec.batch_invariant_add_rms_norm", model)


def test_inductor_on_the_cpu_gives_a_row_the_same_bits_alone_or_in_a_batch():
    """Inductor's C++ kernels around the rows ops (RoPE, the activation, the gather): row 0 of 1, 6 and 17 rows."""
    model = switched()
    compiled = torch.compile(model.forward_graph, fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(0)
    tokens, positions = torch.randint(0, 512, (17,), generator=gen), torch.randint(0, 300, (17,), generator=gen)
    outs = []
    with torch.no_grad():
        for n in (1, 6, 17):
            out = compiled(tokens[:n], positions[:n], row_local_attend)
            outs.append((out.logits[:1].clone(), out.hidden[:1].clone()))
    for got in outs[1:]:
        assert_bitwise(outs[0], got)


def test_compile_pointwise_after_the_switch_keeps_the_mode():
    """compile_pointwise on a switched model compiles the mode's ops (the norms' custom ops inside); before the
    switch it is refused by name (it compiled torch's norms); a model fused with one kernel refuses another."""
    model = switched()
    model.compile_pointwise()
    assert model.ops.fused and model.ops.batch_invariant == "rows"
    engine = Engine(model, kv_tokens=512, page_size=4, batch_invariant=True)
    assert engine.model.ops is model.ops   # (kept, not replaced by the unfused set)
    _, alone = decode_logits(model, PROMPTS[:1], steps=2)
    _, batched = decode_logits(model, PROMPTS, steps=2, branch=True)
    assert_bitwise(alone, batched)
    fused = tiny()
    fused.compile_pointwise()
    with pytest.raises(ValueError, match="call compile_pointwise after the switch"):
        Engine(fused, kv_tokens=64, batch_invariant=True)
    with pytest.raises(ValueError, match="fused this model's 'rows' ops; kernel='triton-kernels' cannot replace"):
        make_batch_invariant(model, "triton-kernels")


@pytest.mark.triton
def test_the_engine_compiles_the_mode(triton_device):
    """Engine(batch_invariant=True, compile_model=...) takes the compiled static forward (AOTAutograd through the
    custom ops, capture off on the CPU): a request's logits alone == beside four others."""
    if triton_device.type == "cuda":
        pytest.skip("the GPU test below runs Inductor and captures")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    options = dict(backend="triton", cuda_graphs=CudaGraphConfig(max_queries=16, capture=False),
                   compile_model={"backend": "aot_eager"})
    runs = [decode_logits(tiny(), [p[:8] for p in prompts], steps=2, **options) for prompts in (PROMPTS[:1], PROMPTS)]
    engine = runs[1][0]
    assert engine.batch_invariance.kernel == "rows" and engine.graph_stats["static_eager"] > 0
    assert not any(k.startswith("eager") for k in engine.graph_stats)
    assert_bitwise(runs[0][1], runs[1][1])


# ---------------------------------------------------------------- GPU (bf16, Inductor, CUDA graphs)

@pytest.mark.gpu
def test_gpu_compiled_graph_keeps_the_ops_opaque():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = switched(device="cuda", dtype=torch.bfloat16)
    assert_opaque(aten_graph(model), "treedec.batch_invariant_matmul", "treedec.batch_invariant_rms_norm",
                  "treedec.batch_invariant_add_rms_norm", model)


@pytest.mark.gpu
def test_gpu_bf16_compiled_logits_alone_equal_logits_in_a_batch():
    """Inductor-compiled, captured steps: the first request's logits alone == beside 7 others (one a tree)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prompts = _gpu_prompts(8)
    runs = [decode_logits(tiny(torch.bfloat16, "cuda"), ps, steps=6, branch=True, cuda_graphs=True,
                          compile_model=True) for ps in (prompts[:1], prompts)]
    engine = runs[1][0]
    assert engine.batch_invariance.kernel == "triton-kernels" and engine.graph_stats["replays"] > 0
    assert_bitwise(runs[0][1], runs[1][1])


@pytest.mark.gpu
def test_gpu_bf16_compile_pointwise_in_the_mode_keeps_a_row_alone_equal_in_a_batch():
    """compile_pointwise after the switch (Inductor's RoPE and activation, dynamic rows; the norms' custom ops),
    captured: the first request's logits alone == beside 7 others."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prompts = _gpu_prompts(8)
    runs = []
    for ps in (prompts[:1], prompts):
        model = switched(device="cuda", dtype=torch.bfloat16)
        model.compile_pointwise()
        runs.append(decode_logits(model, ps, steps=6, branch=True, cuda_graphs=True))
    assert runs[1][0].model.ops.fused and runs[1][0].model.ops.batch_invariant == "triton-kernels"
    assert_bitwise(runs[0][1], runs[1][1])


@pytest.mark.gpu
def test_gpu_bf16_compiled_tree_verify_equals_the_path_decoded_token_by_token():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    options = dict(kv_tokens=8192, page_size=16, cuda_graphs=True, compile_model=True)
    verified, plain = tree_and_path_logits(lambda: tiny(torch.bfloat16, "cuda"), _gpu_prompts(1)[0], **options)
    assert_bitwise(verified, plain)


def tree_and_path_logits(make_model, prompt, **options):
    """A token tree verified in one step (a 4-token path with a sibling at each depth) against the same path decoded
    one token a step: the path's rows of the verify step, and the plain steps' logits."""
    path, siblings = [11, 12, 13, 14], [21, 22, 23, 24]
    tokens = path + siblings
    parents = [-1, 0, 1, 2, -1, 0, 1, 2]   # (sibling j hangs where path[j] does)
    engine = Engine(make_model(), batch_invariant=True, **options)
    node = engine.prefill(prompt).node
    engine.tree.add_token_tree(node, tokens, parents)
    verify = engine.step().logits
    plain_engine = Engine(make_model(), batch_invariant=True, **options)
    leaf = plain_engine.prefill(prompt).node
    plain = []
    for token in path:
        plain_engine.tree.extend(leaf, [token])
        plain.append(plain_engine.step().logits[0].clone())
    return [verify[i] for i in range(len(path))], plain


def test_tree_verify_equals_the_path_decoded_token_by_token_on_the_cpu():
    """The GPU test's check, uncompiled on the CPU (fp32, the rows ops): it has the rows in the right order."""
    verified, plain = tree_and_path_logits(tiny, list(range(40, 70)), kv_tokens=1024, page_size=4)
    assert_bitwise(verified, plain)
