"""kernels/batch_invariant_rms_norm.py: a row's output bits do not depend on the other rows, and the norm equals
treedec's torch RMSNorm within rounding (interpreted on the CPU: tests/conftest.py sets TRITON_INTERPRET=1)."""
import pytest
import torch

pytest.importorskip("triton")
from treedec.kernels.batch_invariant_rms_norm import batch_invariant_rms_norm, rms_norm_block  # noqa: E402
from treedec.models.layers import rms_norm  # noqa: E402

pytestmark = pytest.mark.triton


def test_block_depends_on_the_hidden_size_only():
    import inspect
    assert list(inspect.signature(rms_norm_block).parameters) == ["hidden"]
    assert (rms_norm_block(40), rms_norm_block(576), rms_norm_block(4096)) == (64, 1024, 1024)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_alone_equal_rows_in_a_batch(triton_device, offset, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, 40, generator=g).to(triton_device, dtype)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(triton_device, dtype)
    full = batch_invariant_rms_norm(x, w, 1e-6, offset)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), rms_norm(x, w, 1e-6, offset).float(), rtol=tol, atol=tol)
    for m in (1, 2, 7, 19):
        assert torch.equal(batch_invariant_rms_norm(x[:m], w, 1e-6, offset), full[:m]), f"{m=}"


def test_bad_weight_is_named():
    with pytest.raises(ValueError, match=r"weight must be \[4\]"):
        batch_invariant_rms_norm(torch.zeros(2, 4), torch.zeros(5), 1e-6)
