"""kernels/batch_invariant_matmul.py: a row's output bits do not depend on the other rows (M), and the
product equals torch's within fp32 rounding. Without CUDA it runs in the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), so the shapes are small."""
import pytest
import torch

pytest.importorskip("triton")
from treedec.kernels.batch_invariant_matmul import (  # noqa: E402
    MatmulTiles, batch_invariant_matmul, batch_invariant_tiles)

pytestmark = pytest.mark.triton


def test_tiles_depend_on_n_k_and_the_sm_count_only():
    import inspect
    assert list(inspect.signature(batch_invariant_tiles).parameters) == ["n", "k", "sms"]
    assert batch_invariant_tiles(96, 40) == MatmulTiles(64, 128, 64, 4, 4, splits=1, split_k=64)
    assert batch_invariant_tiles(24, 40) == MatmulTiles(64, 32, 64, 4, 4, splits=1, split_k=64)
    # an 8B model's projections on a 132-SM H200: few column tiles split K (each split >= 4 K blocks, <= 8 splits)
    assert batch_invariant_tiles(4096, 14336, 132).splits == 4   # down_proj: 32 column tiles
    assert batch_invariant_tiles(4096, 4096, 132).splits == 4    # o_proj
    assert batch_invariant_tiles(6144, 4096, 132).splits == 2    # qkv: 48
    assert batch_invariant_tiles(28672, 4096, 132).splits == 1   # gate_up: 224 column tiles already
    assert batch_invariant_tiles(128256, 4096, 132).splits == 1  # the LM head
    for n, k in ((4096, 14336), (4096, 4096), (6144, 4096), (100, 1000)):
        t = batch_invariant_tiles(n, k, 132)
        assert t.split_k % t.block_k == 0 and (t.splits - 1) * t.split_k < k <= t.splits * t.split_k


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
