"""kernels/batch_invariant_rms_norm.py: a row's output bits do not depend on the other rows, and the norm equals
treedec's torch RMSNorm within rounding (interpreted on the CPU: tests/conftest.py sets TRITON_INTERPRET=1)."""
import pytest
import torch

pytest.importorskip("triton")
from treedec.kernels.batch_invariant_rms_norm import (  # noqa: E402
    batch_invariant_add_rms_norm, batch_invariant_rms_norm, rms_norm_block)
from treedec.models.layers import add_rms_norm, rms_norm  # noqa: E402

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


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_add_norm_is_the_add_then_the_norm(triton_device, offset, dtype):
    """``s = x + y`` and the norm of ``s`` in one launch: the norm's bits are the unfused kernel's on that ``s``, a
    row's bits do not follow the batch, and ``s`` is torch's sum (bitwise on a GPU; within one bf16 step in the
    interpreter, which rounds fp32 -> bf16 towards zero)."""
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(19, 1100, generator=g).to(triton_device, dtype) for _ in range(2))   # (two row blocks)
    w = (1 + 0.1 * torch.randn(1100, generator=g)).to(triton_device, dtype)
    s, norm = batch_invariant_add_rms_norm(x, y, w, 1e-6, offset)
    assert torch.equal(norm, batch_invariant_rms_norm(s, w, 1e-6, offset))
    if triton_device.type == "cuda" or dtype == torch.float32:
        assert torch.equal(s, x + y)
    else:
        torch.testing.assert_close(s, x + y, rtol=2 ** -7, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(norm.float(), add_rms_norm(x, y, w, 1e-6, offset)[1].float(), rtol=tol, atol=tol)
    for m in (1, 2, 7):
        got = batch_invariant_add_rms_norm(x[:m], y[:m], w, 1e-6, offset)
        assert torch.equal(got[0], s[:m]) and torch.equal(got[1], norm[:m]), f"{m=}"


def test_the_custom_ops_fake_impls_agree_with_the_kernels(triton_device):
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randn(3, 5, 40, generator=g).to(triton_device, torch.bfloat16) for _ in range(2))
    w = torch.randn(40, generator=g).to(triton_device, torch.bfloat16)
    torch.library.opcheck(torch.ops.treedec.batch_invariant_rms_norm, (x, w, 1e-6, 1.0))
    torch.library.opcheck(torch.ops.treedec.batch_invariant_add_rms_norm, (x, y, w, 1e-6, 0.0))


def test_a_residual_of_another_shape_is_named():
    with pytest.raises(ValueError, match="x and y must share a shape and a dtype"):
        batch_invariant_add_rms_norm(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(4), 1e-6)
