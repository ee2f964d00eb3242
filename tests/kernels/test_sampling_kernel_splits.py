"""kernels/sampling_kernel.py's rows split over programs: the split is a function of V alone; a row's token,
threshold and max are the same bits alone and in batches of 3 and 17; every split (a row shorter than one, a V
that is no multiple of it, several) keeps the reference's sets and draws the reference's tokens (treedec.sampling's
``warp_rows`` then ``draw.inverse_cdf``, the same uniform numbers) on random and adversarial rows (ties, -inf, NaN,
top_k=1, a tiny top_p, min_p); the launch sequence is fixed by the host flags and reads nothing back from the
device (no .item(), .tolist(), .cpu()). The interpreter is slow (~10 ms a program and launch), so rows are few
and short; on a GPU, Llama 3's vocabulary alone == batched, and under CUDA graph capture."""
import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
from treedec.checks import FLOAT32_MAX  # noqa: E402
from treedec.kernels import sampling_kernel as K  # noqa: E402
from treedec.kernels.sampling_kernel import (MAX_SPLITS, SPLIT, fused_warp_draw, search_passes,  # noqa: E402
                                             split_layout)
from treedec.sampling.draw import inverse_cdf  # noqa: E402
from treedec.sampling.params import SamplingParams  # noqa: E402
from treedec.sampling.sampler import SamplingRows, sample_rows, warp_rows  # noqa: E402

pytestmark = pytest.mark.triton
P = SamplingParams


def draw(logits, params, uniform, split=SPLIT):
    rows = SamplingRows.build(params, [0] * len(params), list(range(len(params))), logits.device)
    got = fused_warp_draw(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, uniform.to(logits.device),
                          top_k_cut=rows.top_k_cut, top_p_cut=rows.top_p_cut, min_p_cut=rows.min_p_cut, split=split)
    return rows, got


def uniforms(n, seed=0):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def kept_by_kernel(logits, rows, threshold, row_max):
    """The kernel's kept set, from its threshold and max: s >= threshold and exp(s - max) >= min_p."""
    s = (logits.float() / rows.temperature[:, None]).clamp(max=FLOAT32_MAX)
    return (s >= threshold[:, None]) & (torch.exp(s - row_max[:, None]) >= rows.min_p[:, None])


def reference(logits, rows, uniform):
    """The torch path's kept sets and tokens (rows of temperature > 0)."""
    warped = warp_rows(logits.float(), rows)
    return torch.isfinite(warped), inverse_cdf(warped.softmax(dim=-1), uniform.to(logits.device))


def bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x


@pytest.mark.parametrize("vocab, split, splits, length", [
    (128256, SPLIT, 32, SPLIT), (1000, SPLIT, 1, SPLIT), (SPLIT, SPLIT, 1, SPLIT), (SPLIT + 1, SPLIT, 2, SPLIT),
    (MAX_SPLITS * SPLIT + 1, SPLIT, MAX_SPLITS, SPLIT + 1), (10 ** 6, SPLIT, MAX_SPLITS, 15625),
    (1000, 256, 4, 256), (1000, 100, 10, 100)])
def test_the_split_is_a_function_of_the_vocabulary(vocab, split, splits, length):
    layout = split_layout(vocab, split)
    assert (layout.splits, layout.length) == (splits, length)
    assert (splits - 1) * length < vocab <= splits * length   # every split holds an element
    assert layout.padded == triton.next_power_of_2(splits) and layout.block == min(K.BLOCK, triton.next_power_of_2(
        min(length, vocab)))


def test_the_pass_count_is_fixed_by_the_cuts_asked_for():
    assert [search_passes(k, p) for k, p in [(False, False), (True, False), (False, True), (True, True)]] == \
        [1, 10, 10, 18]
    with pytest.raises(ValueError, match="split must be >= 1"):
        split_layout(1000, 0)


class Launches:
    """Stands in for the three kernels: records each launch's kernel, grid, host scalars, flags and which of its
    tensors start 16 bytes aligned (Triton compiles a kernel for its pointers' alignment)."""

    def __init__(self):
        self.calls = []

    def kernel(self, name):
        calls = self.calls

        class Kernel:
            def __getitem__(self, grid):
                def launch(*args, **flags):
                    scalars = tuple(a for a in args if not isinstance(a, torch.Tensor))
                    aligned = tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))
                    calls.append((name, grid, scalars, tuple(sorted(flags.items())), aligned))
                return launch
        return Kernel()


def _forbidden(name):
    def method(*args, **kwargs):
        raise AssertionError(f"Tensor.{name} reads the device back (a host sync)")
    return method


def test_the_launch_sequence_is_fixed_by_the_flags_and_reads_nothing_back(monkeypatch):
    """The host side of a call, with the kernels recorded instead of run and every Tensor method that would
    wait for the device made to fail: a fixed sequence (stats, the passes, the draw) whatever the data and the
    number of rows, S programs a row and the same compiled kernels (flags, scalars, alignments) for any L."""
    launches = Launches()
    for name in ("_stats_kernel", "_pass_kernel", "_draw_kernel"):
        monkeypatch.setattr(K, name, launches.kernel(name))
    vocab, split = 1000, 256
    data = [torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)), torch.full((5, vocab), float("nan"))]
    by_rows = {}
    for num_rows in (5, 2):
        rows = SamplingRows.build([P(top_k=3, top_p=0.5, min_p=0.1)] * num_rows, [0] * num_rows,
                                  list(range(num_rows)), "cpu")
        uniform = torch.zeros(num_rows, dtype=torch.float64)
        sequences = {}
        with monkeypatch.context() as forbid:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
                forbid.setattr(torch.Tensor, name, _forbidden(name))
            with pytest.raises(AssertionError, match="host sync"):
                bool(torch.ones(1))
            for flags, logits in itertools.product(itertools.product([False, True], repeat=3), data):
                launches.calls.clear()
                fused_warp_draw(logits[:num_rows], rows.temperature, rows.top_k, rows.top_p, rows.min_p, uniform,
                                top_k_cut=flags[0], top_p_cut=flags[1], min_p_cut=flags[2], split=split)
                sequences.setdefault(flags, []).append(list(launches.calls))
        for (top_k_cut, top_p_cut, _), (calls, same_calls) in sequences.items():
            assert calls == same_calls   # the data changes nothing
            passes = search_passes(top_k_cut, top_p_cut)
            assert [c[0] for c in calls] == ["_stats_kernel"] + ["_pass_kernel"] * passes + ["_draw_kernel"]
            assert all(c[1] == (num_rows, 4) for c in calls[:-1]) and calls[-1][1] == (num_rows,)
            steps = [dict(c[3]) for c in calls[1:-1]]
            assert [(s["FIRST"], s["FINAL"]) for s in steps] == [(i == 0, i == passes - 1) for i in range(passes)]
        by_rows[num_rows] = {flags: [(c[0], c[1][1:]) + c[2:] for c in calls[0]] for flags, calls in sequences.items()}
    assert by_rows[5] == by_rows[2]


ROWS = [P(temperature=0.7), P(top_k=5), P(top_p=0.9), P(temperature=0.9, top_k=300, top_p=0.8, min_p=0.02),
        P(temperature=0), P(min_p=0.05), P(top_k=1)]


@pytest.mark.parametrize("vocab, split", [(1000, SPLIT), (1000, 256), (1024, 256), (600, 64)],
                         ids=["shorter-than-a-split", "4-splits-no-multiple", "4-splits-multiple", "10-splits"])
def test_every_split_keeps_the_reference_sets_and_draws_its_tokens(vocab, split, triton_device):
    params = ROWS if split >= 256 else ROWS[1:4]
    logits = (torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(vocab)) * 2).to(triton_device)
    uniform = uniforms(len(params), seed=split)
    rows, got = draw(logits, params, uniform, split)
    sampled = torch.nonzero(rows.temperature > 0).reshape(-1)
    safe = rows.take(sampled)
    want_kept, want_tokens = reference(logits[sampled], safe, uniform[sampled])
    mine = kept_by_kernel(logits[sampled], safe, got.threshold[sampled], got.row_max[sampled])
    assert torch.equal(mine, want_kept)
    assert torch.equal(got.tokens[sampled], want_tokens)
    assert (got.tokens[rows.temperature == 0] == 0).all()


@pytest.mark.parametrize("split", [SPLIT, 256], ids=["one-split", "4-splits"])
def test_adversarial_rows_in_splits_keep_the_documented_sets(split, triton_device):
    """Ties (bf16-rounded logits), a max tied across splits under top_k=1, a tiny top_p, NaN, -inf and +inf in
    single splits, a kept set wholly in the short last split, min_p: top-k and tie-free rows keep the reference's
    sets and draw its tokens; top-p keeps the reference's set plus the rest of its boundary's tied group."""
    vocab = 1000
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(10, vocab, generator=gen) * 2
    logits[:3] = logits[:3].to(torch.bfloat16).float()   # ties
    logits[3, [100, 900]] = 20.0                          # the max, twice, in the first and last splits
    logits[4, 950] = float("nan")
    logits[5] = float("-inf")
    logits[6, :768] = float("-inf")                       # finite in the last split only
    logits[7, 600] = float("inf")                         # saturates at float32's largest: that token only
    logits[9] = torch.linspace(-5, 5, vocab)              # the top 10 in the last split
    params = [P(top_k=25), P(top_p=0.8), P(top_p=1e-9), P(top_k=1), P(top_p=0.9), P(top_p=0.9), P(top_p=0.9),
              P(top_p=0.9), P(min_p=0.3), P(top_k=10)]
    logits = logits.to(triton_device)
    uniform = uniforms(10, seed=3)
    rows, got = draw(logits, params, uniform, split)
    mine = kept_by_kernel(logits, rows, got.threshold, got.row_max)
    finite = [0, 1, 2, 3, 6, 7, 8, 9]
    want, tokens = reference(logits[finite], rows.take(torch.tensor(finite, device=triton_device)), uniform[finite])
    want = dict(zip(finite, want))
    tokens = dict(zip(finite, tokens.tolist()))
    s = logits.float()
    for i in (0, 3, 6, 7, 8, 9):
        assert torch.equal(mine[i], want[i]) and int(got.tokens[i]) == tokens[i], i
    assert torch.nonzero(mine[3]).reshape(-1).tolist() == [100, 900]
    for i in (1, 2):
        assert (mine[i] >= want[i]).all() and (s[i][mine[i] & ~want[i]] == got.threshold[i]).all(), i
    assert int(mine[2].sum()) == int((s[2] == s[2].max()).sum())
    assert got.tokens[[4, 5]].tolist() == [vocab - 1, vocab - 1]
    assert int(got.tokens[6]) >= 768 and int(got.tokens[7]) == 600 and int(got.tokens[9]) >= vocab - 10
    assert mine[torch.arange(10, device=triton_device), got.tokens][[0, 1, 2, 3, 6, 7, 8, 9]].all()


def _mixed_rows(vocab):
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(17, vocab, generator=gen) * 2
    logits[3] = logits[3].to(torch.bfloat16).float()      # ties
    logits[5, 11] = float("nan")
    logits[9] = float("-inf")
    logits[12, :400] = float("-inf")
    params = [P(top_k=5), P(top_p=0.9), P(temperature=0), P(top_p=0.5), P(min_p=0.1), P(top_p=0.9), P(),
              P(temperature=0.8, top_k=40, top_p=0.7), P(top_k=1), P(top_k=3), P(temperature=1.3, min_p=0.02),
              P(top_p=1e-6), P(top_p=0.95), P(temperature=0), P(top_k=100, min_p=0.05), P(top_p=0.99), P(top_k=2)]
    return logits, params, uniforms(17, seed=5)


@pytest.mark.parametrize("split", [SPLIT, 256], ids=["one-split", "3-splits"])
def test_a_row_gives_the_same_bits_alone_and_in_batches_of_3_and_17(split, triton_device):
    logits, params, uniform = _mixed_rows(600)
    logits = logits.to(triton_device)
    _, batch = draw(logits, params, uniform, split)
    for i in (3, 7):
        for index in ([i], [i - 1, i, i + 1]):
            _, part = draw(logits[index], [params[j] for j in index], uniform[index], split)
            at = index.index(i)
            for field in ("tokens", "threshold", "row_max"):
                assert torch.equal(bits(getattr(part, field)[at]), bits(getattr(batch, field)[i])), (i, index, field)


@pytest.mark.gpu
def test_llama3_rows_on_the_gpu_are_batch_invariant_and_capture():
    """128256 tokens (32 splits): a row alone == the row in 64, bitwise; a captured call replays the eager one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    logits = (torch.randn(64, 128256, generator=torch.Generator(device=device).manual_seed(0), device=device) * 3
              ).to(torch.bfloat16)
    params = ([P(temperature=0.8, top_p=0.95), P(temperature=0.7, top_k=50), P(temperature=1.0, min_p=0.05),
               P(temperature=0.9, top_k=1000, top_p=0.9, min_p=0.01), P(temperature=0)] * 13)[:64]
    uniform = uniforms(64, seed=1).to(device)
    _, batch = draw(logits, params, uniform)
    for i in (0, 1, 3, 63):
        _, alone = draw(logits[i:i + 1], [params[i]], uniform[i:i + 1])
        for field in ("tokens", "threshold", "row_max"):
            assert torch.equal(bits(getattr(alone, field)[0]), bits(getattr(batch, field)[i])), (i, field)
    rows = SamplingRows.build(params, list(range(64)), [0] * 64, device)
    draws = torch.zeros(64, dtype=torch.int64, device=device)
    eager = sample_rows(logits, rows, draws, kernel="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample_rows(logits, rows, draws, kernel="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
