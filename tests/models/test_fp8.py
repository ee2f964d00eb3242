"""models/fp8.py: the fp8 method's load and apply against a de-quantized reference.

Tolerances: on the CPU the method de-quantizes (``weight.float() * scale`` cast to the model dtype, then
``F.linear``), so it equals the reference built from the same fp8 weights bit for bit. Quantizing one value
to e4m3 (3 mantissa bits) errs by at most 1/16 of it (plus the scaled subnormal step); a quantized-on-load
layer's output is within 5% (relative Frobenius norm) of the float layer's. On a GPU (``torch._scaled_mm``,
activations quantized per token) the output is within 2% of the reference GEMM of the same quantized
activations and weights (bf16 output rounding and fp32 accumulation order), and within 6% of the float one.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from treedec.models import from_config
from treedec.models.fp8 import DEQUANTIZE, FP8, FP8_MAX, GEMV_DEQUANTIZE, GEMV_FP8_MATMUL, Fp8Linear, dequantize, \
    quantize_rows
from treedec.models.linear import Linear
from tests.models.families import DenseAttend

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _fp8_layer(shards=(24,), cols=32, strategy="channel", dtype=torch.float32, device="cpu", seed=0, bias=False,
               activations="dynamic"):
    """A Linear of the checkpoint fp8 method loaded shard by shard from random fp8 weights and scales; returns
    (layer, the de-quantized weight [out, cols] in float32)."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(cols, sum(shards), bias, dtype, device, shards=shards, method=Fp8Linear("checkpoint", strategy,
                                                                                    activations=activations))
    start, parts = 0, []
    for rows in shards:
        q = (torch.randn(rows, cols, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale = torch.rand(rows, 1, generator=gen) * 1e-3 + 1e-4 if strategy == "channel" else \
            torch.tensor(float(torch.rand((), generator=gen)) * 1e-3 + 1e-4)
        sl = slice(start, start + rows)
        layer.method.load(layer, "weight", q.to(device), sl, "w", "f")
        layer.method.load(layer, "weight_scale", scale.to(device), sl, "s", "f")
        parts.append(q.float() * scale.reshape(-1, 1))
        start += rows
    if bias:   # (a quantized layer's bias is not initialised: checkpoints hold it)
        layer.bias.data.copy_(torch.randn(sum(shards), generator=gen))
    layer.finish_loading()
    return layer, torch.cat(parts).to(device)


def test_quantize_rows_error_is_within_e4m3_rounding():
    x = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]
    x[3] = 0   # an all-zero row: scale 1, zeros
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (64, 1) and scale[3] == 1
    err = (q.float() * scale - x).abs()
    assert bool((err <= x.abs() / 16 + scale * 2.0 ** -9).all())
    assert torch.equal(q.float().abs().amax(1)[x.abs().amax(1) > 0], torch.full((63,), FP8_MAX))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_apply_is_the_dequantized_reference_bit_for_bit(strategy, dtype):
    """qkv-like shards each with its own scale (kept per shard, per row); the CPU path says it de-quantizes."""
    layer, w = _fp8_layer((16, 8, 8), strategy=strategy, dtype=dtype, bias=True)
    assert layer.path == DEQUANTIZE and layer.weight.dtype == FP8 and layer.weight_scale.shape == (32,)
    if strategy == "tensor":   # each shard's rows hold its one scale
        assert all(len(torch.unique(layer.weight_scale[a:b])) == 1 for a, b in ((0, 16), (16, 24), (24, 32)))
    x = torch.randn(5, 32).to(dtype)
    assert torch.equal(layer(x), F.linear(x, w.to(dtype), layer.bias))
    assert torch.equal(dequantize(layer.weight, layer.weight_scale, torch.float32), w)


def test_quantize_on_load_is_close_to_the_float_layer():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen) * 0.02
    layer = Linear(64, 48, False, torch.float32, "cpu", method=Fp8Linear("quantize"))
    layer.method.load(layer, "weight", w[:16], slice(0, 16), "w", "f")   # shard by shard: rows are independent
    layer.method.load(layer, "weight", w[16:], slice(16, 48), "w", "f")
    layer.finish_loading()
    x = torch.randn(9, 64, generator=gen)
    assert _rel(layer(x), F.linear(x, w)) < 0.05
    q, scale = quantize_rows(w)
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scale.view(-1))


def test_a_quantized_model_traces_whole_with_torch_compile():
    """The fp8 method is traceable: the engine's compile_model compiles the whole forward (fullgraph)."""
    model = from_config("tiny", seed=0, dtype=torch.float32, device="cpu", quantization="fp8")
    attend = DenseAttend(model.attention_variants())
    rows = torch.arange(6)
    with torch.no_grad():
        eager = model.forward_graph(rows, rows, attend).logits
        compiled = torch.compile(lambda t: model.forward_graph(t, t, attend).logits, fullgraph=True,
                                 backend="aot_eager")(rows)
    assert torch.equal(compiled, eager)


def test_bad_method_fields_are_named():
    with pytest.raises(ValueError, match="Fp8Linear weight_scales must be one of \\('tensor', 'channel'\\), got 'block'"):
        Fp8Linear("checkpoint", "block")
    with pytest.raises(ValueError, match="computes per-channel weight scales"):
        Fp8Linear("quantize", "tensor")


# ===================================================================== on a GPU (run by the lead)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("rows", [17, 64, 256, 300])
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_the_fp8_gemm_equals_the_dequantized_reference_on_gpu(rows, strategy):
    """Above 16 rows (the fp8 x fp8 Triton GEMM up to 256, torch._scaled_mm at 300), with per-token activation
    scales: == the fp32 GEMM of the same quantized activations and weights within 2%, and the float one within 6%;
    the path is reported."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability >= 8.9")
    layer, w = _fp8_layer((128, 64, 64), cols=256, strategy=strategy, dtype=torch.bfloat16, device="cuda",
                          bias=True)
    assert layer.path == GEMV_FP8_MATMUL
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    xq, xs = quantize_rows(x)
    same_inputs = (xq.float() * xs) @ w.T + layer.bias.float()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 256)
    assert _rel(out, same_inputs) < 0.02
    assert _rel(out, x.float() @ w.T + layer.bias.float()) < 0.06


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("activations", ["dynamic", "none"])
def test_few_rows_take_the_weight_only_gemv_on_gpu(rows, activations):
    """At most 16 rows: the GEMV (activations unquantized) == the float GEMM with the de-quantized weights within
    bf16's rounding (1%), for the dynamic scheme and a weight-only one."""
    layer, w = _fp8_layer((128, 64, 64), cols=256, strategy="channel", dtype=torch.bfloat16, device="cuda",
                          bias=True, activations=activations)
    assert layer.path == (GEMV_FP8_MATMUL if activations == "dynamic" else GEMV_DEQUANTIZE)
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 256)
    assert _rel(out, x.float() @ w.T + layer.bias.float()) < 0.01


@pytest.mark.gpu
@CUDA
def test_fp8_model_graphed_compiled_steps_on_gpu():
    """A quantized-on-load tiny model on the GPU: every projection but the head fp8 (the GEMV at these few rows,
    the fp8 x fp8 Triton GEMM for the 200-token prompt's); compiled, captured steps equal eager ones over the same
    tokens (the eager run's greedy ones: each engine choosing its own would compare different sequences once a
    near-tie flips, as on 2026-12-02 at the fifth step) within 4e-2 (the prompt's activations are quantized per row:
    Inductor's fused quantization, on inputs its fused norms rounded otherwise, can move a value to the next e4m3
    code, a 6% step: one logit of 4608 differed by 0.0215 on 2026-12-04); logits near the bf16 model's (rel 0.1)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability >= 8.9")
    from treedec.engine import Engine
    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda", quantization="fp8")
    bf16 = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    c = model.config
    assert model.linear_paths() == {GEMV_FP8_MATMUL: 4 * c.num_layers, "F.linear": 1}
    prompt = np.random.default_rng(0).integers(0, c.vocab_size, 200).tolist()
    outs, tokens = [], []
    for m, kw in ((model, {}), (model, dict(cuda_graphs=True, compile_model=True)), (bf16, {})):
        engine = Engine(m, kv_tokens=4096, page_size=16, **kw)
        pre = engine.prefill(prompt)
        logits = [pre.logits.float().reshape(-1, c.vocab_size)[-1]]
        for i in range(8):
            if len(tokens) == i:   # (the first run's greedy choices, fed to every run)
                tokens.append(int(logits[-1].argmax()))
            engine.tree.extend(pre.node, [tokens[i]])
            logits.append(engine.step().logits[0].float().reshape(-1))
        outs.append(torch.stack(logits))
    torch.testing.assert_close(outs[1], outs[0], atol=4e-2, rtol=2e-2)
    assert _rel(outs[0], outs[2]) < 0.1
