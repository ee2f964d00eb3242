"""The logits-processing building blocks (treedec.sampling.logits) against transformers' own logits processors on the
same logits: repetition penalty == ``RepetitionPenaltyLogitsProcessor``, min-p == ``MinPLogitsWarper``, the warper
chain == transformers' Temperature + TopK + TopP + MinP warpers (and == today's ``sampling_probs`` at min_p 0),
user processors run as transformers runs them, logprobs == ``log_softmax`` in float64; on the real SmolLM2
checkpoint, treedec's logits give transformers' ``generate`` logprobs (slow)."""
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from tests.engines import smollm2_or_skip
from treedec.sampling.logits import (LogitsProcessorError, Logprob, apply_logits_processors, apply_penalties,
                                   count_tokens_, drawable_rows, min_p_filter, output_token_counts, prompt_logprobs,
                                   token_logprobs, token_mask, warp_scores)
from treedec.sampling.params import SamplingParams, sampling_probs

VOCAB = 64
PROMPT = [3, 7, 7, 12, 40, 3, 63, 0]
OUTPUTS = [[], [5], [7, 7, 7], [12, 5, 5, 9, 63, 9], [1, 2, 3, 1, 2, 3, 1]]   # repeats; some also in the prompt


def random_logits(m=len(OUTPUTS), vocab=VOCAB, seed=0):
    """Logits of mixed signs with ties (tokens 5 and 7 equal, token 8 and 9 at exactly 0, a tie at the maximum in
    the last row) so every branch of the penalty formulas is taken."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, vocab, generator=g) * 3
    logits[:, 5] = logits[:, 7]
    logits[:, 8:10] = 0.0
    logits[-1, 20] = logits[-1, 21] = logits[-1].max() + 1
    return logits


def hf_repetition(logits, penalty, prompt=PROMPT, outputs=OUTPUTS):
    """HF's processor row by row: its input_ids are the prompt and the output so far."""
    proc = RepetitionPenaltyLogitsProcessor(penalty=float(penalty))
    return torch.cat([proc(torch.tensor([prompt + out]), logits[i:i + 1].clone()) for i, out in enumerate(outputs)])


def openai_presence_frequency(logits, presence, frequency, outputs=OUTPUTS):
    """OpenAI's (and vLLM's) formula written out, in float64: ``logit -= frequency * count + presence * (count > 0)``
    with ``count`` the token's occurrences in the output (not the prompt). transformers has no processor for them:
    ``grep -rn presence_penalty`` in the installed transformers (5.24) finds it only in the serving CLI's list of
    OpenAI fields it does not support."""
    expected = logits.double().clone()
    for i, out in enumerate(outputs):
        for token in set(out):
            expected[i, token] -= frequency * out.count(token) + presence
    return expected


def penalties(logits, **kwargs):
    return apply_penalties(logits, token_mask(PROMPT, VOCAB, name="prompt_ids"), output_token_counts(OUTPUTS, VOCAB),
                           **kwargs)


# ================================================================ penalties


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits = random_logits()
    ours = penalties(logits, repetition_penalty=penalty)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, hf_repetition(logits, penalty))        # the same float32 ops: exactly equal


@pytest.mark.parametrize("presence, frequency", [(0.7, 0.0), (0.0, 0.4), (1.5, -0.3), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_equal_the_openai_formula(presence, frequency):
    logits = random_logits()
    ours = penalties(logits, presence_penalty=presence, frequency_penalty=frequency)
    torch.testing.assert_close(ours.double(), openai_presence_frequency(logits, presence, frequency),
                               atol=1e-5, rtol=0)
    assert torch.equal(ours[0], logits[0])            # an empty output: presence and frequency change nothing
    assert torch.equal(ours[:, PROMPT[4]], logits[:, PROMPT[4]])   # a prompt-only token is not penalized


def test_all_penalties_together_apply_repetition_first():
    logits = random_logits(seed=1)
    ours = penalties(logits, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    expected = openai_presence_frequency(hf_repetition(logits, 1.3), 0.5, 0.25)
    torch.testing.assert_close(ours.double(), expected, atol=1e-5, rtol=0)


def test_no_penalty_returns_the_logits_as_a_new_float32_tensor():
    logits = random_logits()
    out = penalties(logits)
    assert torch.equal(out, logits) and out.data_ptr() != logits.data_ptr()
    half = penalties(logits.bfloat16(), repetition_penalty=1.2)
    assert half.dtype == torch.float32
    assert torch.equal(half, hf_repetition(logits.bfloat16().float(), 1.2))


def test_a_prompt_mask_per_row():
    logits = random_logits(m=2)
    mask = torch.cat([token_mask([1, 2], VOCAB), token_mask([3], VOCAB)])
    out = apply_penalties(logits, mask, output_token_counts([[], []], VOCAB), repetition_penalty=2.0)
    assert torch.equal(out, torch.cat([hf_repetition(logits[:1], 2.0, [1, 2], [[]]),
                                       hf_repetition(logits[1:], 2.0, [3], [[]])]))


def test_counts_kept_on_the_device_equal_counts_of_the_histories():
    counts = output_token_counts(OUTPUTS, VOCAB)
    assert counts.dtype == torch.int32 and counts.shape == (len(OUTPUTS), VOCAB)
    assert counts[3, 5].item() == 2 and counts[2, 7].item() == 3 and counts[0].sum().item() == 0
    drawn = torch.tensor([4, 5, 7, 63, 1])
    assert count_tokens_(counts, drawn) is counts
    histories = [out + [t] for out, t in zip(OUTPUTS, drawn.tolist())]
    assert torch.equal(counts, output_token_counts(histories, VOCAB))
    # several tokens a row, only the accepted prefix counted (speculative decoding)
    spec = torch.tensor([[2, 2, 9]] * len(OUTPUTS))
    accepted = torch.arange(3).unsqueeze(0) < torch.tensor([0, 1, 2, 3, 3]).unsqueeze(1)
    count_tokens_(counts, spec, accepted)
    histories = [h + [2, 2, 9][:n] for h, n in zip(histories, [0, 1, 2, 3, 3])]
    assert torch.equal(counts, output_token_counts(histories, VOCAB))


def test_bad_penalty_arguments_raise_naming_them():
    logits = random_logits()
    with pytest.raises(ValueError, match=r"repetition_penalty must be a number in \[1.4012985e-45, 3.4028235e\+38\] "
                                         r"\(> 0 and finite in float32\), got 0.0"):
        penalties(logits, repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"repetition_penalty must be a number in .*got 1e-300"):
        penalties(logits, repetition_penalty=1e-300)   # (0 in float32: a division by zero)
    with pytest.raises(ValueError, match="presence_penalty must be a number in"):
        penalties(logits, presence_penalty=float("nan"))
    with pytest.raises(ValueError, match="frequency_penalty must be a number in"):
        penalties(logits, frequency_penalty=1e308)   # (inf in float32: 0 * inf is NaN)
    with pytest.raises(ValueError, match="prompt_mask must be bool"):
        apply_penalties(logits, torch.zeros(1, VOCAB), output_token_counts(OUTPUTS, VOCAB))
    with pytest.raises(ValueError, match="output_counts must be an int tensor"):
        apply_penalties(logits, token_mask(PROMPT, VOCAB, name="prompt_ids"), torch.zeros(2, VOCAB, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"prompt_ids must be in \[0, 63\], got prompt_ids\[0\] = 64"):
        token_mask([VOCAB], VOCAB, name="prompt_ids")
    with pytest.raises(ValueError, match=r"token_ids_per_row\[1\] must be in \[0, 63\]"):
        output_token_counts([[1], [70]], VOCAB)
    with pytest.raises(ValueError, match="valid must be bool"):
        count_tokens_(output_token_counts(OUTPUTS, VOCAB), torch.zeros(len(OUTPUTS), dtype=torch.int64),
                      torch.ones(len(OUTPUTS)))


# ================================================================ min-p and the warper chain


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_min_p_equals_transformers(min_p, temperature):
    scores = random_logits(seed=2) / temperature       # min-p is applied to temperature-scaled scores
    ours = min_p_filter(scores, min_p)
    assert torch.equal(ours, MinPLogitsWarper(min_p)(None, scores.clone()))
    assert torch.isfinite(ours).any(dim=-1).all()      # the most likely token stays (both tied ones at min_p 1)
    assert torch.isfinite(ours[-1, 20:22]).all()


CHAINS = [(1.0, None, 1.0, 0.1), (0.7, 20, 1.0, 0.05), (1.3, None, 0.9, 0.2), (0.5, 10, 0.8, 0.3),
          (2.0, 40, 0.95, 0.0), (1.0, 3, 0.5, 0.9)]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", CHAINS)
def test_warp_scores_equal_transformers_warpers_in_their_order(temperature, top_k, top_p, min_p):
    """Tolerance: the kept tokens are the same and their scores equal exactly (both divide by the temperature and
    mask); the probabilities within 1e-6 absolute (softmax of the same scores)."""
    logits = torch.randn(16, 512, generator=torch.Generator().manual_seed(3)) * 2.5
    chain = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []) + \
        ([TopPLogitsWarper(top_p)] if top_p < 1 else []) + [MinPLogitsWarper(min_p)]
    theirs = LogitsProcessorList(chain)(None, logits.clone())
    ours = warp_scores(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, 1.0), (0.6, 5, 1.0), (1.4, None, 0.7),
                                                       (0.9, 30, 0.85), (1.0, 64, 0.999)])
def test_warp_scores_at_min_p_0_are_todays_sampling_probs(temperature, top_k, top_p):
    logits = random_logits(seed=4)
    expected = sampling_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(warp_scores(logits, temperature, top_k, top_p).softmax(dim=-1), expected)
    assert torch.equal(warp_scores(logits, temperature, top_k, top_p, min_p=0.0).softmax(dim=-1), expected)


def test_bad_warper_arguments_raise_naming_them():
    logits = random_logits()
    for kwargs, message in [(dict(temperature=0.0), r"temperature must be a number in \[1e-05, 3.4028235e\+38\] "
                                                         r"\(below 1e-5 sampling is greedy"),
                            (dict(temperature=1e308), r"temperature must be a number in .*got 1e\+308"),
                            (dict(temperature=1.0, top_k=0), "top_k must be an int >= 1"),
                            (dict(temperature=1.0, top_p=0.0), r"top_p must be a number in \(0, 1\]"),
                            (dict(temperature=1.0, min_p=1.5), r"min_p must be a finite number in \[0, 1\]")]:
        with pytest.raises(ValueError, match=message):
            warp_scores(logits, **kwargs)


# ================================================================ user logits processors


def test_a_transformers_processor_runs_on_each_row_with_its_history():
    logits = random_logits()
    histories = [PROMPT + out for out in OUTPUTS]
    before = logits.clone()
    proc = NoRepeatNGramLogitsProcessor(2)
    ours = apply_logits_processors([proc], histories, logits)
    theirs = torch.cat([proc(torch.tensor([h]), logits[i:i + 1].clone()) for i, h in enumerate(histories)])
    assert torch.equal(ours, theirs) and torch.equal(logits, before)
    assert torch.isinf(ours[2, 7])         # row 2 ends "7 7": the bigram "7 7" would repeat
    assert torch.equal(apply_logits_processors([], histories, logits), logits)


def test_processors_apply_in_order_each_on_the_previous_output():
    logits = random_logits(m=2)
    seen = []

    def double(input_ids, scores):
        seen.append(input_ids.tolist())
        return scores * 2

    out = apply_logits_processors([double, lambda ids, s: s + ids.shape[1]], [[1, 2], [3]], logits)
    torch.testing.assert_close(out, logits * 2 + torch.tensor([[2.0], [1.0]]), atol=0, rtol=0)
    assert seen == [[[1, 2]], [[3]]]


@pytest.mark.parametrize("processor, message", [
    (lambda ids, s: s[0], r"<lambda> must return a float tensor \(1, 64\) on cpu \(row 0\), got torch.float32 \(64,\)"),
    (lambda ids, s: s.long(), "must return a float tensor .* got torch.int64"),
    (lambda ids, s: None, "must return a float tensor .* got None"),
    (lambda ids, s: 1 / 0, "<lambda> raised on row 0: ZeroDivisionError"),
])
def test_a_bad_processor_gets_an_error_naming_it(processor, message):
    with pytest.raises(LogitsProcessorError, match=message):
        apply_logits_processors([processor], [[1]], random_logits(m=1))


def test_processor_errors_name_the_class_and_the_row():
    class Broken:
        """Fails on a row with a history (row 1 here), as a processor with a bug for some inputs does."""
        def __call__(self, input_ids, scores):
            if input_ids.shape[1]:
                raise KeyError("boom")
            return scores

    with pytest.raises(LogitsProcessorError, match="Broken raised on row 1: KeyError") as e:
        apply_logits_processors([Broken()], [[], [1]], random_logits(m=2))
    assert isinstance(e.value.__cause__, KeyError)
    with pytest.raises(TypeError, match="must be callable"):
        apply_logits_processors([3], [[1]], random_logits(m=1))
    with pytest.raises(ValueError, match=r"one token list per row of logits \(1\), got 2"):
        apply_logits_processors([Broken()], [[1], [2]], random_logits(m=1))


# ================================================================ logprobs


def test_token_logprobs_equal_log_softmax_in_float64():
    logits = random_logits(seed=5)
    tokens = torch.tensor([5, 7, 20, 63, 21])            # 5 and 7 tie; the last row's 20 and 21 tie at the top
    out = token_logprobs(logits, tokens, k=4)
    exact = logits.double().log_softmax(dim=-1)
    torch.testing.assert_close(out.logprobs.double(), exact.gather(1, tokens[:, None])[:, 0], atol=1e-5, rtol=0)
    expected_ranks = (exact > exact.gather(1, tokens[:, None])).sum(dim=1) + 1
    assert torch.equal(out.ranks, expected_ranks) and out.ranks[-1] == 1
    assert out.ranks[0] == token_logprobs(logits[:1], torch.tensor([7])).ranks[0]      # tied tokens share a rank
    top = exact.topk(4, dim=-1)
    torch.testing.assert_close(out.top_logprobs.double(), top.values, atol=1e-5, rtol=0)
    assert torch.equal(exact.gather(1, out.top_ids), top.values)        # the same tokens (ties in any order)
    assert out.top_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    no_top = token_logprobs(logits.bfloat16(), tokens)
    assert no_top.top_ids.shape == (5, 0) and no_top.logprobs.dtype == torch.float32


def test_to_dicts_are_vllms_per_position_dicts():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]))
    dicts = token_logprobs(logits, torch.tensor([2, 1]), k=1).to_dicts()
    assert dicts[0].keys() == {0, 2} and dicts[0][2].rank == 3
    assert dicts[0][0] == Logprob(pytest.approx(-0.6931, abs=1e-4), 1)
    assert dicts[1].keys() == {1} and dicts[1][1].rank == 1


@pytest.mark.parametrize("rows_given", ["L-1", "L"])
def test_prompt_logprobs_score_each_token_under_the_position_before(rows_given):
    prompt = [4, 9, 9, 1, 30]
    logits = random_logits(m=len(prompt), seed=6)
    out = prompt_logprobs(logits[:len(prompt) - 1] if rows_given == "L-1" else logits, prompt, k=2)
    exact = logits.double().log_softmax(dim=-1)
    expected = torch.stack([exact[j, prompt[j + 1]] for j in range(len(prompt) - 1)])
    torch.testing.assert_close(out.logprobs.double(), expected, atol=1e-5, rtol=0)
    assert out.token_ids.tolist() == prompt[1:] and out.top_ids.shape == (4, 2)
    assert prompt_logprobs(logits[:0], [4]).logprobs.shape == (0,)      # one token: nothing to score
    with pytest.raises(ValueError, match=r"\[L-1, V\] or \[L, V\] with L = 5"):
        prompt_logprobs(logits[:2], prompt)


def test_bad_logprobs_arguments_raise():
    logits = random_logits()
    with pytest.raises(ValueError, match="tokens must be int"):
        token_logprobs(logits, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="k must be at most the vocabulary size 64"):
        token_logprobs(logits, torch.zeros(len(OUTPUTS), dtype=torch.int64), k=65)


# ================================================================ the real checkpoint (slow)


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2_or_skip()


@pytest.mark.slow
def test_logprobs_equal_transformers_generate_on_smollm2(checkpoint):
    """Greedy ``generate`` with ``output_logits`` (the raw logits; ``output_scores`` are the same at greedy with no
    processors) against treedec's engine teacher-forced on transformers' tokens: the chosen tokens' logprobs and the
    top-5 within 1e-4 absolute (fp32 on both sides, reading the same de-quantized weights), ranks 1 (greedy), and the
    prompt's logprobs from one forward of the prompt against transformers' forward."""
    from transformers import AutoModelForCausalLM

    from treedec.engine import Engine
    from treedec.models import from_pretrained
    from treedec.models.text import encode_prompt, load_tokenizer

    new_tokens = 8
    prompt = encode_prompt(load_tokenizer(checkpoint), [{"role": "user", "content": "Name three colors."}], True)
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                                output_scores=True, output_logits=True, return_dict_in_generate=True)
        hf_prompt_logits = hf_model(torch.tensor([prompt])).logits[0]
    generated = out.sequences[0, len(prompt):]
    assert len(generated) == new_tokens
    hf_logits = torch.cat(out.logits)                                         # [8, V]
    torch.testing.assert_close(torch.cat(out.scores), hf_logits, atol=0, rtol=0)
    theirs = hf_logits.double().log_softmax(dim=-1)

    engine = Engine(from_pretrained("smollm2", dtype=torch.float32, device="cpu"), kv_tokens=1024,
                    page_size=16, backend="torch")
    prefilled = engine.prefill(prompt)
    rows = [prefilled.logits]
    for token in generated[:-1].tolist():                                     # teacher-forced: transformers' tokens
        engine.tree.extend(prefilled.node, [token])
        rows.append(engine.step().logits[0])
    ours = token_logprobs(torch.stack(rows), generated, k=5)
    torch.testing.assert_close(ours.logprobs.double(), theirs.gather(1, generated[:, None])[:, 0], atol=1e-4, rtol=0)
    assert ours.ranks.tolist() == [1] * new_tokens
    top = theirs.topk(5, dim=-1)
    assert torch.equal(ours.top_ids, top.indices)
    torch.testing.assert_close(ours.top_logprobs.double(), top.values, atol=1e-4, rtol=0)

    engine.tree.add_prompt(prompt)                                            # every prompt row's logits
    ours_prompt = prompt_logprobs(engine.step().logits, prompt, k=2)
    theirs_prompt = prompt_logprobs(hf_prompt_logits, prompt, k=2)
    torch.testing.assert_close(ours_prompt.logprobs, theirs_prompt.logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours_prompt.top_logprobs, theirs_prompt.top_logprobs, atol=1e-4, rtol=0)


# ================================================================ float32 safety (issue #48 items 4-5)


def test_a_top_p_that_is_zero_in_float32_keeps_the_most_likely_token():
    """top_p=1e-300 passes (0, 1] but is 0 in float32: every token's mass before it is >= 0, so the old cut
    dropped the most likely token too (an all -inf row: a NaN softmax, a draw of id == vocab)."""
    logits = random_logits()
    scores = warp_scores(logits, 0.7, top_p=1e-300)
    kept = torch.isfinite(scores)
    assert kept.sum(dim=-1).tolist() == [1] * len(OUTPUTS)                       # one token a row (ties: one of them)
    assert torch.equal(logits[kept], logits.max(dim=-1).values)
    assert not scores.softmax(dim=-1).isnan().any()


def test_warped_and_penalized_logits_never_overflow_float32():
    """A huge temperature over -inf padded logits, a tiny one over huge logits, a subnormal repetition penalty:
    finite logits saturate at float32's largest, masked ones stay -inf, nothing is NaN or +inf."""
    logits = random_logits()
    logits[:, -8:] = float("-inf")                              # a padded vocabulary (Engine.restrict_vocab)
    for scores in (warp_scores(logits, 3e38), warp_scores(logits * 1e35, 1e-5),
                   penalties(logits, repetition_penalty=1e-44), penalties(logits * 1e37, repetition_penalty=1e-30)):
        assert not scores.isnan().any() and not (scores == float("inf")).any()
        assert torch.equal(scores[:, -8:], logits[:, -8:])
        assert scores.softmax(dim=-1)[:, :-8].isfinite().all()
    big = penalties(torch.full((len(OUTPUTS), VOCAB), 3e38), repetition_penalty=0.5, frequency_penalty=-2.0)
    assert big.isfinite().all() and big.max() == 3.4028234663852886e38


def test_drawable_rows_flags_rows_with_nothing_to_draw_from():
    scores = random_logits()
    scores[1, 3] = float("nan")
    scores[2, 0] = float("inf")
    scores[3] = float("-inf")
    assert drawable_rows(scores).tolist() == [True, False, False, False, True]
    assert scores[1:4].softmax(dim=-1).isnan().any(dim=-1).all()   # (what a draw from them would read)
