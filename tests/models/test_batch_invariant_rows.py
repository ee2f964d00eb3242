"""models/batch_invariant_rows.py: the batch-invariant mode's CPU ops give a row the bits it gets alone, equal
treedec's torch ops, and as custom ops (what torch.compile traces) agree with their fake impls."""
import pytest
import torch
import torch.nn.functional as F

from treedec.models.batch_invariant_rows import add_rms_norm_rows, linear_rows, rms_norm_rows
from treedec.models.layers import add_rms_norm, rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_alone_equal_rows_in_a_batch(dtype):
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(33, 96, generator=g).to(dtype) for _ in range(2))
    w, b = torch.randn(80, 96, generator=g).to(dtype), torch.randn(80, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    full = linear_rows(x, w, b), rms_norm_rows(x, nw, 1e-6, 1.0), add_rms_norm_rows(x, y, nw, 1e-6)
    assert torch.equal(full[0][0], F.linear(x[0], w, b))
    assert torch.equal(full[1], rms_norm(x, nw, 1e-6, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(full[2], add_rms_norm(x, y, nw, 1e-6)))
    for m in (1, 2, 17):
        assert torch.equal(linear_rows(x[:m], w, b), full[0][:m]), f"{m=}"
        assert torch.equal(rms_norm_rows(x[:m], nw, 1e-6, 1.0), full[1][:m]), f"{m=}"
        s, norm = add_rms_norm_rows(x[:m], y[:m], nw, 1e-6)
        assert torch.equal(s, full[2][0][:m]) and torch.equal(norm, full[2][1][:m]), f"{m=}"


def test_a_row_past_torchs_grain_is_normed_alone():
    """A row of 32768 values or more (torch's CPU reduction splits it over threads by its length): each row of a
    batch gets the bits of its own call."""
    x = torch.randn(3, 40000, generator=torch.Generator().manual_seed(1))
    w = torch.ones(40000)
    assert torch.equal(rms_norm_rows(x, w, 1e-6)[1], rms_norm(x[1], w, 1e-6))


def test_the_custom_ops_fake_impls_agree_with_the_functions():
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randn(2, 3, 40, generator=g) for _ in range(2))
    w, b, nw = torch.randn(24, 40, generator=g), torch.randn(24, generator=g), torch.randn(40, generator=g)
    for op, args in ((torch.ops.treedec.linear_rows, (x, w, b)), (torch.ops.treedec.linear_rows, (x, w, None)),
                     (torch.ops.treedec.rms_norm_rows, (x, nw, 1e-6, 1.0)),
                     (torch.ops.treedec.add_rms_norm_rows, (x, y, nw, 1e-6, 0.0))):
        torch.library.opcheck(op, args)
    assert torch.equal(torch.ops.treedec.linear_rows(x, w, b), linear_rows(x, w, b))
