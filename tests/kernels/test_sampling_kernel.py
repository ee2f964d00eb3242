"""kernels/sampling_kernel.py: the fused warp and draw keeps the reference's token sets (treedec.sampling.sampler's
``warp_rows``) on tie-free rows, field by field and mixed per row, and every tied token at a top-p boundary; it
draws the first kept token past ``u`` times the kept mass, never a removed one; NaN and -inf rows give V - 1.
Without CUDA it runs in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so rows are few and
short; the GPU test runs Llama 3's vocabulary under CUDA graph capture."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from treedec.checks import FLOAT32_MAX  # noqa: E402
from treedec.kernels.sampling_kernel import CAP, fused_warp_draw  # noqa: E402
from treedec.sampling.params import SamplingParams  # noqa: E402
from treedec.sampling.sampler import SamplingRows, sample_rows, warp_rows  # noqa: E402

pytestmark = pytest.mark.triton
REPO = Path(__file__).resolve().parents[2]

P = SamplingParams


def draw(logits, params, uniform=None, seed=0):
    rows = SamplingRows.build(params, [seed] * len(params), list(range(len(params))), logits.device)
    if uniform is None:
        uniform = torch.rand(len(params), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = fused_warp_draw(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, uniform.to(logits.device),
                          top_k_cut=rows.top_k_cut, top_p_cut=rows.top_p_cut, min_p_cut=rows.min_p_cut)
    return rows, got


def kept_by_kernel(logits, rows, got):
    """The kernel's kept set, from its threshold and max: s >= threshold and exp(s - max) >= min_p."""
    s = (logits.float() / rows.temperature[:, None]).clamp(max=FLOAT32_MAX)
    return (s >= got.threshold[:, None]) & (torch.exp(s - got.row_max[:, None]) >= rows.min_p[:, None])


def kept_by_reference(logits, rows):
    return torch.isfinite(warp_rows(logits.float(), rows))


CASES = {
    "temperature": [P(temperature=0.7), P(temperature=1.3)],
    "top_k": [P(top_k=5), P(temperature=0.8, top_k=40), P(top_k=1), P(top_k=100000), P(top_k=2 ** 32 + 3)],
    "top_p": [P(top_p=0.9), P(temperature=0.8, top_p=0.5), P(top_p=1.0), P(top_p=1e-6)],
    "min_p": [P(min_p=0.05), P(temperature=1.5, min_p=0.3), P(min_p=0.0)],
    "combined": [P(temperature=0.9, top_k=300, top_p=0.8, min_p=0.02), P(temperature=1.1, top_k=7, top_p=0.95),
                 P(top_p=0.7, min_p=0.1), P(top_k=2000, top_p=0.99)],
}


@pytest.mark.parametrize("vocab", [1000, CAP + 904], ids=["in-workspace", "past-workspace"])
@pytest.mark.parametrize("case", list(CASES))
def test_kept_sets_equal_the_reference_on_tie_free_rows(case, vocab, triton_device):
    params = CASES[case]
    logits = (torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(vocab)) * 2).to(triton_device)
    rows, got = draw(logits, params)
    want = kept_by_reference(logits, rows)
    assert torch.equal(kept_by_kernel(logits, rows, got), want)
    assert want.gather(1, got.tokens[:, None]).all()   # the drawn token is kept


def test_mixed_rows_with_greedy_rows_keep_the_reference_sets(triton_device):
    params = [P(temperature=0), P(top_k=12, top_p=0.9), P(temperature=0), P(temperature=0.6, min_p=0.2), P()]
    logits = (torch.randn(len(params), 3000, generator=torch.Generator().manual_seed(3)) * 3).to(triton_device)
    rows, got = draw(logits, params)
    sampled = [1, 3, 4]
    safe = rows.take(torch.tensor(sampled, device=triton_device))
    assert torch.equal(kept_by_kernel(logits[sampled], safe, FusedRows(got, sampled)),
                       kept_by_reference(logits[sampled], safe))
    assert got.tokens[[0, 2]].tolist() == [0, 0]   # greedy rows are the caller's (its argmax)


class FusedRows:
    """``got``'s entries at ``index``."""

    def __init__(self, got, index):
        self.threshold, self.row_max = got.threshold[index], got.row_max[index]


def test_a_tied_group_larger_than_the_workspace_is_searched_on_the_row(triton_device):
    """CAP + 100 tokens tie at the k-th largest value: the search's bracket never fits the workspace, so it
    runs on the row to the last bit; top-k keeps the whole group (as the reference), and so does top-p."""
    gen = torch.Generator().manual_seed(0)
    vocab, tied = CAP + 3000, CAP + 100
    logits = torch.cat([torch.full((tied,), 1.0), torch.rand(vocab - tied, generator=gen) * 4 - 2])
    logits = logits[torch.randperm(vocab, generator=gen)][None].repeat(2, 1).to(triton_device)
    rows, got = draw(logits, [P(top_k=int((logits[0] > 1).sum()) + 7), P(top_p=0.9)])
    mine, want = kept_by_kernel(logits, rows, got), kept_by_reference(logits, rows)
    assert torch.equal(mine[0], want[0]) and int(mine[0].sum()) == int((logits[0] >= 1).sum())
    assert (mine[1] >= want[1]).all() and (logits[1][mine[1] & ~want[1]] == 1.0).all()


def test_the_draw_is_the_first_kept_token_past_u_times_the_kept_mass(triton_device):
    vocab = 2000
    logits = torch.full((5, vocab), float("-inf"))
    logits[:, [10, 500, 1500]] = torch.tensor([0.0, 0.0, 1000.0 ** -1])   # ~ equal weights
    logits[:, 1999] = -30.0   # kept by no cut below, weight ~1e-13
    logits = logits.to(triton_device)
    uniform = torch.tensor([0.0, 0.2, 0.5, 0.9, 1 - 2 ** -53], dtype=torch.float64)
    _, got = draw(logits, [P(min_p=1e-6)] * 5, uniform)
    assert got.tokens.tolist() == [10, 10, 500, 1500, 1500]


def test_a_removed_token_is_never_drawn(triton_device):
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(16, 1500, generator=gen) * 2).to(triton_device)
    params = [P(top_k=3), P(top_p=0.3), P(min_p=0.4), P(top_k=50, top_p=0.6, min_p=0.01)] * 4
    uniform = torch.cat([torch.zeros(4), torch.full((4,), 1 - 2 ** -53), torch.rand(8, generator=gen)]).double()
    rows, got = draw(logits, params, uniform)
    assert kept_by_reference(logits, rows).gather(1, got.tokens[:, None]).all()


def test_ties_at_the_top_p_boundary_are_kept_whole_and_top_k_ties_as_the_reference(triton_device):
    """bf16 logits tie often: top-k keeps the reference's set (ties with the k-th kept by both); top-p keeps the
    reference's set plus the rest of the tied group at its boundary, nothing else."""
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(3, 2000, generator=gen) * 2).to(torch.bfloat16).to(triton_device)
    rows, got = draw(logits, [P(top_k=25), P(top_p=0.8), P(top_p=1e-9)])
    mine, want = kept_by_kernel(logits, rows, got), kept_by_reference(logits, rows)
    assert torch.equal(mine[0], want[0])
    s = logits.float()
    for i in (1, 2):
        assert (mine[i] >= want[i]).all()
        assert (s[i][mine[i] & ~want[i]] == got.threshold[i]).all()
    assert int(mine[2].sum()) == int((s[2] == s[2].max()).sum())   # every tied max (the reference keeps one)


def test_minus_zero_ties_with_zero(triton_device):
    logits = torch.linspace(-1, 1, 1001)
    logits[500:510] = torch.tensor([0.0, -0.0] * 5)
    logits = logits[None].to(triton_device)
    rows, got = draw(logits, [P(top_k=int((logits > 0).sum()) + 3)])   # the k-th largest is a zero: all ten kept
    assert torch.equal(kept_by_kernel(logits, rows, got), kept_by_reference(logits, rows))
    assert int(kept_by_kernel(logits, rows, got).sum()) == int((logits >= 0).sum())


def test_nan_and_all_minus_inf_rows_draw_the_last_id(triton_device):
    logits = torch.randn(4, 1200, generator=torch.Generator().manual_seed(7))
    logits[0, 17] = float("nan")
    logits[1] = float("-inf")
    logits[2, :600] = float("-inf")
    logits[3, 5] = float("inf")   # saturates at float32's largest: that token only
    rows, got = draw(logits.to(triton_device), [P(top_p=0.9)] * 4)
    assert got.tokens[:2].tolist() == [1199, 1199]
    assert 600 <= int(got.tokens[2]) < 1200 and int(got.tokens[3]) == 5


def test_bad_arguments_are_named():
    scores = torch.zeros(2, 10)
    zeros = dict(temperature=torch.ones(2), top_k=torch.zeros(2, dtype=torch.int64), top_p=torch.ones(2),
                 min_p=torch.zeros(2), uniform=torch.zeros(2, dtype=torch.float64))
    flags = dict(top_k_cut=False, top_p_cut=False, min_p_cut=False)
    with pytest.raises(ValueError, match="uniform must be"):
        fused_warp_draw(scores, **{**zeros, "uniform": torch.zeros(2)}, **flags)
    with pytest.raises(ValueError, match="scores must be"):
        fused_warp_draw(scores.t(), **zeros, **flags)


_COMPILE = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from treedec.kernels import sampling_kernel as K
    fn = K._fused_warp_draw_kernel
    pointers = dict(x_ptr="*bf16", temperature_ptr="*fp32", top_k_ptr="*i64", top_p_ptr="*fp32",
                    min_p_ptr="*fp32", uniform_ptr="*fp64", buf_ptr="*fp32", token_ptr="*i64",
                    threshold_ptr="*fp32", max_ptr="*fp32", stride_x="i32", n="i32", stride_temperature="i32",
                    stride_top_k="i32", stride_top_p="i32", stride_min_p="i32", stride_uniform="i32")
    for top_k, top_p, min_p in [(True, True, True), (False, True, False), (False, False, False)]:
        flags = dict(HAS_TOP_K=top_k, HAS_TOP_P=top_p, HAS_MIN_P=min_p, CAP=K.CAP, BLOCK=K.BLOCK)
        signature = {name: pointers.get(name, "constexpr") for name in fn.arg_names}
        constexprs = {(fn.arg_names.index(name),): value for name, value in flags.items()}
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
""")


def test_the_kernel_compiles_for_sm90_without_a_gpu():
    """The interpreter runs Python: the compiler's rules (a value an if-block redefines keeps its type, no
    non-constexpr globals) are checked only by compiling, which needs no GPU (Triton's frontend and ptxas)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 8, 64])
def test_llama3_vocabulary_on_the_gpu_equals_the_reference_and_captures(num_rows):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    vocab, device = 128256, torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(num_rows)
    logits = torch.randn(num_rows, vocab, generator=gen, device=device) * 3   # float32: no ties
    params = ([P(temperature=0.8, top_p=0.95), P(temperature=0.7, top_k=50), P(temperature=1.0, min_p=0.05),
               P(temperature=0.9, top_k=1000, top_p=0.9, min_p=0.01), P(temperature=0)] * num_rows)[:num_rows]
    rows = SamplingRows.build(params, list(range(num_rows)), [0] * num_rows, device)
    draws = torch.zeros(num_rows, dtype=torch.int64, device=device)
    fused = sample_rows(logits, rows, draws, kernel="triton")
    reference = sample_rows(logits, rows, draws, kernel="torch")
    assert (fused == reference).float().mean() >= 0.9, (fused, reference)
    sampled = torch.nonzero(rows.temperature > 0).reshape(-1)
    if len(sampled):
        safe = rows.take(sampled)
        uniform = torch.zeros(len(sampled), dtype=torch.float64, device=device)
        got = fused_warp_draw(logits[sampled], safe.temperature, safe.top_k, safe.top_p, safe.min_p, uniform,
                              top_k_cut=safe.top_k_cut, top_p_cut=safe.top_p_cut, min_p_cut=safe.min_p_cut)
        mine, want = kept_by_kernel(logits[sampled], safe, got), kept_by_reference(logits[sampled], safe)
        # the order of float additions moves a top-p boundary by a token at most
        assert ((mine != want).sum(dim=1) <= 1).all(), (mine != want).sum(dim=1)
        assert mine.gather(1, fused[sampled][:, None]).all()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sample_rows(logits, rows, draws, kernel="triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample_rows(logits, rows, draws, kernel="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fused)
