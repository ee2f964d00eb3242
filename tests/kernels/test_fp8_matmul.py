"""The fp8 x fp8 GEMM (treedec/kernels/fp8_matmul.py) against the de-quantized product of the same e4m3 operands:
on the GPU, or on the CPU under the Triton interpreter."""
import pytest
import torch

pytest.importorskip("triton")
from treedec.kernels.batch_invariant_matmul import MatmulTiles  # noqa: E402
from treedec.kernels.fp8_matmul import fp8_matmul, fp8_matmul_tiles, launch  # noqa: E402
from treedec.models.fp8 import dequantize, quantize_rows  # noqa: E402

pytestmark = pytest.mark.triton


def _case(m, n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, w_scale = quantize_rows(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    return x.to(device), w.to(device), w_scale.view(-1).to(device), bias.to(device)


def _reference(xq, x_scale, w, w_scale, bias):
    out = dequantize(xq, x_scale.view(-1), torch.float32) @ dequantize(w, w_scale, torch.float32).T
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("m,n,k", [(1, 40, 48), (5, 64, 300), (17, 33, 256), (3, 17, 600)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_product_equals_the_dequantized_operands_product(triton_device, m, n, k, with_bias):
    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float32
    x, w, w_scale, bias = _case(m, n, k, triton_device)
    xq, x_scale = quantize_rows(x)
    bias = bias.to(dtype) if with_bias else None
    out = fp8_matmul(xq, x_scale, w, w_scale, bias, out_dtype=dtype)
    ref = _reference(xq, x_scale, w, w_scale, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    # and near the unquantized product (e4m3 keeps 3 mantissa bits: a few percent of the largest output)
    exact = x.float() @ dequantize(w, w_scale, torch.float32).T + (0 if bias is None else bias.float())
    assert (out.float() - exact).abs().max() <= 0.1 * exact.abs().max()


@pytest.mark.parametrize("split_k", [0, 64, 96])
def test_k_splits_give_the_same_product_and_rows_alone_equal_rows_in_a_batch(triton_device, split_k):
    """One K range or several (their partials scaled in the ordered reduction): the same product; a row's bits do
    not depend on the other rows."""
    x, w, w_scale, bias = _case(9, 48, 300, triton_device, seed=1)
    xq, x_scale = quantize_rows(x)
    tiles = MatmulTiles(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2, splits=0, split_k=split_k)
    full = launch(xq, x_scale, w, w_scale, bias, torch.float32, tiles)
    torch.testing.assert_close(full, _reference(xq, x_scale, w, w_scale, bias), atol=1e-4, rtol=1e-5)
    for m in (1, 4):
        assert torch.equal(launch(xq[:m], x_scale[:m], w, w_scale, bias, torch.float32, tiles), full[:m])


def test_the_tiling_is_the_matmul_rule_for_one_byte_operands():
    down = fp8_matmul_tiles(4096, 14336, 132)
    assert (down.splits, down.block_m, down.block_k, down.num_stages) == (4, 64, 256, 3)
    assert fp8_matmul_tiles(28672, 4096, 132).splits == 1


def test_bad_operands_are_refused_by_name(triton_device):
    x, w, w_scale, _ = _case(2, 16, 32, triton_device)
    xq, x_scale = quantize_rows(x)
    with pytest.raises(ValueError, match="float8_e4m3fn rows"):
        fp8_matmul(x, x_scale, w, w_scale)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_matmul(xq, x_scale[:1], w, w_scale)
    with pytest.raises(ValueError, match="bias must be"):
        fp8_matmul(xq, x_scale, w, w_scale, torch.zeros(3, device=triton_device))
