"""kernels/batch_invariant_matmul.py: a row's output bits do not depend on the other rows (M), and the
product equals torch's within fp32 rounding. Without CUDA it runs in the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), so the shapes are small."""
import pytest
import torch

pytest.importorskip("triton")
from treedec.kernels.batch_invariant_matmul import (  # noqa: E402
    MAX_SPLITS, MatmulTiles, batch_invariant_matmul, batch_invariant_tiles)

pytestmark = pytest.mark.triton


def test_tiles_depend_on_n_k_the_itemsize_and_the_sm_count_only():
    import inspect
    assert list(inspect.signature(batch_invariant_tiles).parameters) == ["n", "k", "sms", "itemsize"]
    assert batch_invariant_tiles(96, 40) == MatmulTiles(64, 128, 64, 4, 4, splits=1, split_k=64)
    assert batch_invariant_tiles(24, 40) == MatmulTiles(64, 32, 64, 4, 4, splits=1, split_k=64)
    # an 8B model's projections on a 132-SM H200 (the sweep of 2026-12-04): only a long K over few column tiles
    # splits (one split a 4096 of K); narrow short ones take 64 x 256 blocks, wide or split ones 128 x 128
    down = batch_invariant_tiles(4096, 14336, 132)
    assert (down.splits, down.block_n, down.block_k, down.num_stages) == (4, 128, 128, 4)
    for n in (4096, 6144):                                       # o_proj, qkv: 32 and 48 column tiles
        t = batch_invariant_tiles(n, 4096, 132)
        assert (t.splits, t.block_n, t.block_k, t.num_stages) == (1, 64, 256, 3)
    for n in (28672, 128256):                                    # gate_up, the LM head: >= 1 column tile an SM
        t = batch_invariant_tiles(n, 4096, 132)
        assert (t.splits, t.block_n, t.block_k, t.num_stages) == (1, 128, 128, 4)
    # 4-byte operands: half the K block (the same pipeline in shared memory)
    assert batch_invariant_tiles(4096, 4096, 132, 4).block_k == 128
    assert batch_invariant_tiles(4096, 14336, 132, 4).block_k == 64
    for n, k in ((4096, 14336), (4096, 4096), (6144, 4096), (100, 1000), (64, 20000)):
        for itemsize in (2, 4):
            t = batch_invariant_tiles(n, k, 132, itemsize)
            assert t.split_k % t.block_k == 0 and (t.splits - 1) * t.split_k < k <= t.splits * t.split_k
            assert 1 <= t.splits <= MAX_SPLITS


@pytest.mark.parametrize("bias", [False, True])
def test_rows_alone_equal_rows_in_a_batch(bias):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    n, k = 24, 40
    x = torch.randn(33, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device)
    b = torch.randn(n, generator=g).to(device) if bias else None
    full = batch_invariant_matmul(x, w, b)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    for m in (1, 2, 7, 17, 33):
        part = batch_invariant_matmul(x[:m], w, b)
        assert torch.equal(part, full[:m]), f"{m=}"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_k", [32, 48, 96])
def test_split_k_rows_alone_equal_rows_in_a_batch(bias, split_k):
    """Several K splits (the last one short for 48: 200 = 4 * 48 + 8) reduced in order: each row's bits are the
    same for any M, and the product F.linear's within fp32 rounding."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    n, k = 40, 200
    x = torch.randn(19, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device)
    b = torch.randn(n, generator=g).to(device) if bias else None
    tiles = MatmulTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2, splits=0, split_k=split_k)
    full = batch_invariant_matmul(x, w, b, tiles=tiles)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    for m in (1, 2, 5, 19):
        assert torch.equal(batch_invariant_matmul(x[:m], w, b, tiles=tiles), full[:m]), f"{m=}"


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="share K"):
        batch_invariant_matmul(torch.zeros(2, 3), torch.zeros(4, 5))


@pytest.mark.parametrize("bias", [False, True])
def test_the_custom_ops_fake_impl_agrees_with_the_kernels(triton_device, bias):
    """``treedec::batch_invariant_matmul`` (what torch.compile traces): its fake impl's shape, dtype and strides are
    the kernel's, and the op gives the function's bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 40, generator=g).to(triton_device, torch.bfloat16)
    w = torch.randn(24, 40, generator=g).to(triton_device, torch.bfloat16)
    b = torch.randn(24, generator=g).to(triton_device, torch.bfloat16) if bias else None
    torch.library.opcheck(torch.ops.treedec.batch_invariant_matmul, (x, w, b))
    assert torch.equal(torch.ops.treedec.batch_invariant_matmul(x, w, b), batch_invariant_matmul(x, w, b))
