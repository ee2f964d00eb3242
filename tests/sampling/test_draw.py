"""The inverse-CDF draw and its blocked prefix sums (treedec.sampling.draw): the blocked sums equal torch's
cumsum up to rounding, never decrease over non-negative values, keep a zero's sum equal to its predecessor's
exactly (so a zero-weight token is never drawn, at block borders too), and the draw is the first token past
``u * total``."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.sampling.cuda_scan import gpu_order_device
from treedec.sampling.draw import BLOCK, exact_prefix_sums, inverse_cdf, row_cumsum


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3 * BLOCK + 5), rows=st.integers(1, 3), zeros=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_row_cumsum_is_cumsum_monotone_and_exact_over_zeros(n, rows, zeros, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, n, generator=gen, dtype=torch.float64)
    x[:, ::zeros] = 0.0
    got = row_cumsum(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, x.cumsum(-1), rtol=1e-12, atol=1e-12)
    assert (got[:, 1:] >= got[:, :-1]).all()
    zero = x[:, 1:] == 0
    assert torch.equal(got[:, 1:][zero], got[:, :-1][zero])


def test_row_cumsum_keeps_float32_and_leading_dims():
    x = torch.rand(2, 3, 2 * BLOCK + 1)
    got = row_cumsum(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, x.cumsum(-1), rtol=1e-5, atol=1e-4)


def test_inverse_cdf_draws_the_first_token_past_u_times_total():
    vocab = 3 * BLOCK
    weights = torch.zeros(4, vocab)
    # row 0: all weight on one token past the first block; row 1: two tokens at a block border
    weights[0, BLOCK + 7] = 2.0
    weights[1, BLOCK - 1], weights[1, BLOCK] = 1.0, 1.0
    weights[2:] = 1.0
    uniform = torch.tensor([0.999, 0.4999, 0.0, 0.5])
    drawn = inverse_cdf(weights, uniform)
    assert drawn.dtype == torch.int64
    assert drawn.tolist() == [BLOCK + 7, BLOCK - 1, 0, vocab // 2]
    assert inverse_cdf(weights[1:2], torch.tensor([0.5])).tolist() == [BLOCK]


def test_inverse_cdf_never_draws_a_zero_weight_token():
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(64, 2 * BLOCK + 3, generator=gen)
    weights[:, BLOCK - 2:BLOCK + 2] = 0.0     # zeros around a block border
    weights[:, ::3] = 0.0
    uniform = torch.rand(64, generator=gen, dtype=torch.float64)
    drawn = inverse_cdf(weights, uniform)
    assert (weights.gather(1, drawn[:, None]) > 0).all()


def test_inverse_cdf_of_nan_rows_stays_in_the_vocabulary():
    weights = torch.full((2, BLOCK + 10), float("nan"))
    assert inverse_cdf(weights, torch.tensor([0.3, 0.9])).tolist() == [BLOCK + 9] * 2


@pytest.mark.parametrize("vocab", [128256, 49152])
def test_a_row_draws_the_same_token_alone_and_in_a_batch_of_16(monkeypatch, vocab):
    """The draw's cumulative weights are exact (exact_prefix_sums), so a row draws the same token alone and among 16
    whatever order the device adds in (tests/sampling/cuda_scan.py: torch's CUDA ``cumsum`` follows the number of
    rows). Weights over many decades (float64 sums of them round) and each row's number put between the float64
    cumulative weights of the two orders at a token where they differ: a draw from float sums fails there."""
    device = gpu_order_device(monkeypatch)
    gen = torch.Generator().manual_seed(53)
    n = 16
    weights = (torch.randn(n, vocab, generator=gen) * 6).softmax(-1).double().to(device)
    batched, alone = row_cumsum(weights), torch.cat([row_cumsum(weights[i:i + 1]) for i in range(n)])
    uniform = []
    for i in range(n):
        apart = torch.nonzero(batched[i] != alone[i]).flatten()
        j = apart[len(apart) // 2] if len(apart) else None
        uniform.append(0.5 if j is None else float((batched[i, j] + alone[i, j]) / 2 / alone[i, -1]))
    assert sum(u != 0.5 for u in uniform) >= n // 2, "the two orders' float64 sums should differ in most rows"
    uniform = torch.tensor(uniform, dtype=torch.float64, device=device)
    drawn = inverse_cdf(weights, uniform)
    for i in range(n):
        assert int(inverse_cdf(weights[i:i + 1], uniform[i:i + 1])) == int(drawn[i]), f"row {i}"


def test_exact_prefix_sums_are_fixed_point_below_2_to_the_53():
    """Each row times the power of two that puts its largest weight below 2**(52 - ceil_log2(V)) (2**50 for 4
    tokens): 1.0 -> 2**49, 6.0 (0.75 * 2**3) -> 0.75 * 2**50."""
    weights = torch.tensor([[0.0, 1.0, 0.5, 0.25], [float("nan"), 1.0, 0.0, 0.0], [0.0] * 4, [3.0, 0.0, 0.0, 6.0],
                            [float("inf"), 1.0, 0.0, 0.0]])
    exact = exact_prefix_sums(weights)
    assert exact.units.dtype == torch.int64
    assert exact.units[0].tolist() == [0, 2 ** 49, 2 ** 48, 2 ** 47]
    assert exact.units[1:3].eq(0).all() and exact.units[4].eq(0).all()   # no distribution: NaN, all 0, inf
    assert exact.units[3].tolist() == [3 * 2 ** 47, 0, 0, 6 * 2 ** 47]
    assert torch.equal(exact.total, exact.units.sum(-1)) and torch.equal(exact.sums[:, :4], exact.units.cumsum(-1))
    # a tiny row: the shift stays within float32's exponents (2**127), so fewer units, none below 2**-127
    assert exact_prefix_sums(torch.tensor([[2.0 ** -100, 0.0], [2.0 ** -140, 0.0]])).units.tolist() == \
        [[2 ** 27, 0], [0, 0]]
