"""The batched sampler (treedec/sampling/sampler.py) against the per-request path it replaces
(``treedec.sampling.params.sample_tokens`` / ``sampling_probs`` / ``treedec.sampling.logits.apply_penalties``), row by
row, distribution-wise (chi-square), and its counter-based numbers (treedec/sampling/rng.py)."""

import pytest
import torch

from tests.sampling.cuda_scan import gpu_order_device
from treedec.sampling.draw import row_cumsum
from treedec.sampling.rng import counter_uniform, mix64
from treedec.sampling.sampler import SamplingRows, sample_rows, warp_rows
from treedec.sampling.logits import apply_penalties
from treedec.sampling.params import SamplingParams, sampling_probs

VOCAB = 24


def rows_of(params, seeds=None, streams=None):
    n = len(params)
    return SamplingRows.build(params, seeds or [7] * n, streams or list(range(n)), "cpu")


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of observed ``counts`` under ``probs`` (tokens of expected count < 5 pooled)."""
    total = counts.sum()
    expected = probs.double() * total
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def test_mix64_is_a_fixed_bijection_of_the_64_bit_words():
    x = torch.tensor([0, 1, 2, -1, 2**62, -(2**63)], dtype=torch.int64)
    y = mix64(x)
    assert len(set(y.tolist())) == len(x)
    # SplitMix64's finalizer of 1 (computed with Python's unbounded ints)
    z = 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    z ^= z >> 31
    assert int(y[1]) % 2**64 == z


def test_counter_uniform_is_a_function_of_seed_stream_and_counter():
    seed = torch.tensor([3, 3, 3, 4], dtype=torch.int64)
    stream = torch.tensor([0, 1, 0, 0], dtype=torch.int64)
    counter = torch.tensor([5, 5, 6, 5], dtype=torch.int64)
    u = counter_uniform(seed, stream, counter)
    assert u.dtype == torch.float64 and ((u >= 0) & (u < 1)).all()
    assert len(set(u.tolist())) == 4   # any of the three changes the number
    assert torch.equal(counter_uniform(seed[:1], stream[:1], counter[:1]), u[:1])   # alone == in a batch
    n = 40000
    many = counter_uniform(torch.full((n,), 11), torch.zeros(n, dtype=torch.int64), torch.arange(n))
    hist = torch.histc(many.float(), 16, 0, 1)
    assert chi_square_p(hist, torch.full((16,), 1 / 16)) > 1e-4


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.2),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_warped_rows_equal_the_per_request_distribution(params):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 2
    rows = rows_of([params, PARAMS[0], params])
    warped = warp_rows(logits.float(), rows).softmax(-1)
    for i in (0, 2):
        assert torch.allclose(warped[i], sampling_probs(logits[i], params), atol=1e-6)
    assert torch.allclose(warped[1], sampling_probs(logits[1], PARAMS[0]), atol=1e-6)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_draws_follow_the_per_request_distribution(params):
    """Chi-square per field: 6000 draws of one row (a mixed batch around it) against sampling_probs."""
    torch.manual_seed(1)
    logits = torch.randn(VOCAB) * 1.5
    n = 6000
    batch = torch.stack([logits] * n)
    rows = rows_of([params] * n, seeds=list(range(n)), streams=[0] * n)
    drawn = sample_rows(batch, rows, torch.zeros(n, dtype=torch.int64))
    counts = torch.bincount(drawn, minlength=VOCAB)
    want = sampling_probs(logits, params)
    assert (counts[want == 0] == 0).all()   # a removed token is never drawn
    assert chi_square_p(counts, want) > 1e-4


def test_penalties_equal_apply_penalties_per_row():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    mask = torch.rand(4, VOCAB) < 0.3
    counts = torch.randint(0, 3, (4, VOCAB), dtype=torch.int32)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.5, frequency_penalty=-0.4),
              SamplingParams(), SamplingParams(repetition_penalty=0.8, presence_penalty=1.0)]
    rows = rows_of(params)
    from treedec.sampling.sampler import penalize
    got = penalize(logits, mask, counts, rows.repetition, rows.presence, rows.frequency)
    for i, p in enumerate(params):
        want = apply_penalties(logits[i:i + 1], mask[i:i + 1], counts[i:i + 1], p.repetition_penalty,
                               p.presence_penalty, p.frequency_penalty)
        assert torch.allclose(got[i], want[0]), i


def test_greedy_rows_take_the_argmax_of_the_penalized_logits_in_a_mixed_batch():
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    counts = torch.zeros(3, VOCAB, dtype=torch.int32)
    best = int(logits[0].argmax())
    logits[0, best] = logits[0].clone().index_fill_(0, torch.tensor([best]), -1e9).max() + 1.0
    counts[0, best] = 1   # a presence penalty takes the best token down (its logit is set to lead by < 2)
    params = [SamplingParams(temperature=0, presence_penalty=2.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0)]
    drawn = sample_rows(logits, rows_of(params), torch.zeros(3, dtype=torch.int64),
                        torch.zeros(3, VOCAB, dtype=torch.bool), counts)
    second = int(logits[0].clone().index_fill_(0, torch.tensor([best]), -1e9).argmax())
    assert int(drawn[0]) == second and int(drawn[2]) == int(logits[2].argmax())


def test_a_seeded_row_draws_the_same_whatever_the_batch():
    torch.manual_seed(4)
    logits = torch.randn(6, VOCAB)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in range(6)]
    draws = torch.arange(6, dtype=torch.int64) * 3
    whole = sample_rows(logits, rows_of(params, seeds=list(range(6))), draws)
    for i in range(6):
        alone = sample_rows(logits[i:i + 1], rows_of(params[i:i + 1], seeds=[i], streams=[i]), draws[i:i + 1])
        assert int(alone[0]) == int(whole[i])
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    shuffled = sample_rows(logits[order], rows_of([params[i] for i in order.tolist()], seeds=order.tolist(),
                                                  streams=order.tolist()), draws[order])
    assert torch.equal(shuffled, whole[order])


@pytest.mark.parametrize("vocab", [128256, 49152])
def test_a_row_cuts_top_p_and_draws_the_same_bits_alone_and_in_a_batch_of_16(monkeypatch, vocab):
    """Issue #53's 15/16 on the 8B shape: torch's CUDA ``cumsum`` adds a row in an order that follows the number of
    rows (tests/sampling/cuda_scan.py: the CPU here adds in that order), so float32 sums of a row's probabilities
    round otherwise alone than among 16, and a top-p boundary between the two roundings flips the kept set (on a
    flat 128k-token row, once in some hundreds of draws). Here each row's top-p is put where the float32 mass above
    a token differs between the two orders, so a cut read from float sums fails every row; the scores warped, and
    the tokens drawn, alone == in the batch, bit for bit."""
    device = gpu_order_device(monkeypatch)
    gen = torch.Generator().manual_seed(53)
    n = 16
    logits = (torch.randn(n, vocab, generator=gen) * 1.5).bfloat16().to(device)   # bf16: ties, as a model's
    temperature = torch.tensor([0.8], device=device)
    probs = (logits.float() / temperature).sort(-1, descending=True).values.softmax(-1)   # as warp() has them
    batched = row_cumsum(probs) - probs
    alone = torch.cat([row_cumsum(probs[i:i + 1]) - probs[i:i + 1] for i in range(n)])
    top_p = []
    for i in range(n):   # a top-p that one order's mass above a token reaches and the other's does not
        apart = torch.nonzero((batched[i] != alone[i]) & (batched[i] > 0.5) & (batched[i] < 0.99)).flatten()
        top_p.append(float(torch.maximum(batched[i], alone[i])[apart[0]]) if len(apart) else 0.95)
    assert sum(p != 0.95 for p in top_p) >= n // 2, "the two orders' float32 sums should differ in most rows"
    params = [SamplingParams(temperature=0.8, top_p=p, seed=1000 + i) for i, p in enumerate(top_p)]
    rows = SamplingRows.build(params, [1000 + i for i in range(n)], [0] * n, device)
    one = [rows.take(torch.tensor([i], device=device)) for i in range(n)]
    warped = warp_rows(logits, rows)
    for i in range(n):
        assert torch.equal(warp_rows(logits[i:i + 1], one[i])[0], warped[i]), f"row {i}: the top-p cut"
    draws = torch.full((n,), 27, dtype=torch.int64, device=device)
    tokens = sample_rows(logits, rows, draws)
    for i in range(n):
        assert int(sample_rows(logits[i:i + 1], one[i], draws[i:i + 1])) == int(tokens[i]), f"row {i}: the token"


def test_a_degenerate_row_never_draws_past_the_vocabulary():
    logits = torch.full((2, VOCAB), float("-inf"))
    logits[1, 3] = 0.0
    drawn = sample_rows(logits, rows_of([SamplingParams(temperature=1.0)] * 2), torch.zeros(2, dtype=torch.int64))
    assert ((drawn >= 0) & (drawn < VOCAB)).all() and int(drawn[1]) == 3


def test_rows_and_logits_must_agree():
    with pytest.raises(ValueError, match="L = 2 rows"):
        sample_rows(torch.zeros(3, VOCAB), rows_of([SamplingParams()] * 2), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingRows.build([SamplingParams()], [1, 2], [0], "cpu")


# ================================================================ the fused kernel (kernels/sampling_kernel.py)

def test_fused_draws_equal_the_reference_draws_row_by_row(triton_device):
    """The same uniform numbers, tie-free rows: the same tokens (greedy and penalized rows included)."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(8)
    params = PARAMS + [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95),
                       SamplingParams(temperature=1.0, top_k=3, repetition_penalty=1.2, presence_penalty=0.3)]
    n, vocab = 4 * len(params), 2000
    logits = (torch.randn(n, vocab, generator=gen) * 2).to(triton_device)
    mask = (torch.rand(n, vocab, generator=gen) < 0.05).to(triton_device)
    counts = torch.randint(0, 2, (n, vocab), generator=gen).to(triton_device)
    rows = SamplingRows.build(params * 4, list(range(n)), [0] * n, triton_device)
    draws = torch.arange(n, dtype=torch.int64, device=triton_device)
    fused = sample_rows(logits, rows, draws, mask, counts, kernel="triton")
    assert torch.equal(fused, sample_rows(logits, rows, draws, mask, counts, kernel="torch"))


@pytest.mark.slow   # (~0.1 s a row in the Triton interpreter)
def test_fused_draws_follow_the_per_request_distribution(triton_device):
    """Chi-square per field: 600 draws of one row under each of PARAMS in one batch, against sampling_probs."""
    pytest.importorskip("triton")
    torch.manual_seed(1)
    logits = torch.randn(VOCAB) * 1.5
    n = 600
    params = [p for p in PARAMS for _ in range(n)]
    rows = SamplingRows.build(params, list(range(len(params))), [0] * len(params), triton_device)
    batch = torch.stack([logits] * len(params)).to(triton_device)
    drawn = sample_rows(batch, rows, torch.zeros(len(params), dtype=torch.int64, device=triton_device),
                        kernel="triton").cpu()
    for i, p in enumerate(PARAMS):
        counts = torch.bincount(drawn[i * n:(i + 1) * n], minlength=VOCAB)
        want = sampling_probs(logits, p)
        assert (counts[want == 0] == 0).all(), p
        assert chi_square_p(counts, want) > 1e-4, p


def test_the_sampler_kernel_is_resolved_or_refused(monkeypatch):
    from treedec.sampling.sampler import resolve_sampler_kernel
    assert resolve_sampler_kernel("auto", "cpu") == "torch"
    assert resolve_sampler_kernel("auto", "cuda") == "torch"   # the faster on an H200 today (module docstring)
    assert resolve_sampler_kernel("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="kernel must be one of"):
        resolve_sampler_kernel("cuda", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        sample_rows(torch.zeros(1, VOCAB), rows_of([SamplingParams(temperature=1.0)]),
                    torch.zeros(1, dtype=torch.int64), kernel="triton")
