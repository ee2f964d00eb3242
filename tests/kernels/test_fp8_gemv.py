"""The weight-only fp8 GEMV (treedec/kernels/fp8_gemv.py) against the de-quantized reference: on the GPU, or on
the CPU under the Triton interpreter (fp32 activations there: the interpreter has no bf16 dot)."""
import pytest
import torch

fp8_gemv_module = pytest.importorskip("treedec.kernels.fp8_gemv")
from treedec.kernels.fp8_gemv import MAX_ROWS, GemvConfig, fp8_gemv, launch, launch_config
from treedec.models.fp8 import FP8, dequantize, quantize_rows

pytestmark = pytest.mark.triton


def _case(m, n, k, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_rows(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x.to(device), q.to(device), s.view(-1).to(device), bias.to(device)


@pytest.mark.parametrize("m,n,k", [(1, 40, 48), (5, 64, 300), (MAX_ROWS, 33, 256), (3, 17, 600)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_gemv_equals_the_dequantized_weights_product(triton_device, m, n, k, with_bias):
    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float32
    x, q, s, bias = _case(m, n, k, triton_device, dtype)
    bias = bias if with_bias else None
    out = fp8_gemv(x, q, s, bias)
    ref = x.float() @ dequantize(q, s, torch.float32).T + (0 if bias is None else bias.float())
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dot,swap_ab", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_every_tile_schedule_gives_the_same_product(triton_device, dot, swap_ab, split_k):
    """Tensor-core tiles or per-row sums, the K range split over programs or not: the same product (the splits'
    partials summed in a fixed order), with and without a bias."""
    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float32
    x, q, s, bias = _case(3, 48, 700, triton_device, dtype, seed=1)
    ref = x.float() @ dequantize(q, s, torch.float32).T + bias.float()
    cfg = GemvConfig(block_n=16, block_k=64, split_k=split_k, dot=dot, num_warps=4, num_stages=2, swap_ab=swap_ab)
    out = launch(x, q, s, bias, cfg)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_leading_dimensions_are_kept_and_zero_rows_give_an_empty_result(triton_device):
    x, q, s, _ = _case(6, 32, 64, triton_device, torch.float32 if triton_device.type == "cpu" else torch.bfloat16)
    out = fp8_gemv(x.view(2, 3, 64), q, s)
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out.view(6, 32), fp8_gemv(x, q, s))
    assert fp8_gemv(x[:0], q, s).shape == (0, 32)


def test_bad_inputs_are_refused_by_name():
    x = torch.zeros(MAX_ROWS + 1, 64)
    q = torch.zeros(32, 64, dtype=FP8)
    s = torch.ones(32)
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        fp8_gemv(x, q, s)
    with pytest.raises(ValueError, match="float8_e4m3fn weight, got torch.bfloat16"):
        fp8_gemv(x[:2], q.to(torch.bfloat16), s)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_gemv(x[:2, :48], q, s)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_gemv(x[:2], q, s.double())


def test_the_schedule_follows_the_sweep():
    """8B's projections on an H200 (132 SMs): 32-wide tiles over the whole K, o_proj (4096 x 4096) 128-wide with K
    split in four; a short K is never split."""
    for m in (1, 8):
        assert launch_config(m, 6144, 4096, 132) == GemvConfig(32, 256, 1, True, 4, 3)
        assert launch_config(m, 4096, 14336, 132) == GemvConfig(32, 256, 1, True, 4, 3)
        assert launch_config(m, 4096, 4096, 132) == GemvConfig(128, 256, 4, True, 4, 3)
    assert launch_config(1, 64, 40, 132).split_k == 1 and launch_config(1, 64, 40, 132).block_k == 64
