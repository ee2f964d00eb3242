"""kernels/batch_invariant_matmul.py: a row's output bits do not depend on the other rows (M), and the
product equals torch's within fp32 rounding. Without CUDA it runs in the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), so the shapes are small."""
import pytest
import torch

pytest.importorskip("triton")
from treedec.kernels.batch_invariant_matmul import (  # noqa: E402
    MatmulTiles, batch_invariant_matmul, batch_invariant_tiles)

pytestmark = pytest.mark.triton


def test_tiles_depend_on_n_and_k_only():
    import inspect
    assert list(inspect.signature(batch_invariant_tiles).parameters) == ["n", "k"]
    assert batch_invariant_tiles(96, 40) == MatmulTiles(block_m=64, block_n=128, block_k=64, num_warps=4)
    assert batch_invariant_tiles(4096, 14336) == MatmulTiles(block_m=64, block_n=128, block_k=64, num_warps=4)
    assert batch_invariant_tiles(24, 40) == MatmulTiles(block_m=64, block_n=32, block_k=64, num_warps=4)


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


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="share K"):
        batch_invariant_matmul(torch.zeros(2, 3), torch.zeros(4, 5))
