"""Parallel sampling and self-consistency on the tree engine (tiny random Llama, CPU)."""
import pytest
import torch

from treedec.engine import Engine
from treedec.programs.parallel_sampling import majority_vote, parallel_sample, self_consistency
from treedec.sampling.params import GREEDY, SAMPLING_EPS, SamplingParams, sample_tokens
from tests.engines import make_engine, plain_greedy, tiny_model

PROMPT = [5, 17, 99, 3, 42, 7, 300, 12, 64]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def tokens_of(result):
    return [s.tokens for s in result.samples]


def test_same_seed_same_samples(tiny):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    runs = [parallel_sample(make_engine(tiny), PROMPT, 6, 8, params, generator=seeded(seed)) for seed in (3, 3, 4)]
    assert tokens_of(runs[0]) == tokens_of(runs[1])
    assert tokens_of(runs[0]) != tokens_of(runs[2])
    assert len(set(map(tuple, tokens_of(runs[0])))) > 1          # the n samples differ from each other
    assert all(len(s.tokens) == 8 and s.stop_reason == "length" and s.node is None for s in runs[0].samples)


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=2.0, top_p=1e-6)])
def test_greedy_limits_give_n_copies_of_greedy_decoding(tiny, params):
    result = parallel_sample(make_engine(tiny), PROMPT, 4, 10, params, generator=seeded(0))
    assert tokens_of(result) == [plain_greedy(tiny, PROMPT, 10)] * 4


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_samples_share_the_prompt_pages(tiny, page_size):
    """Kept samples are children of the prompt's node: the request holds the prompt's pages
    once plus each sample's own, never n copies of the prompt."""
    prompt = list(range(100, 164))                       # 64 tokens
    engine = make_engine(tiny, page_size)
    pool = engine.pool
    result = parallel_sample(engine, prompt, 5, 6, generator=seeded(1), keep=True)
    prompt_pages = pool.pages_for(len(prompt))
    own_pages = sum(pool.pages_for(len(s.tokens)) for s in result.samples)
    assert pool.num_pages - pool.num_free_pages == prompt_pages + own_pages == result.stats.peak_pages
    assert prompt_pages + own_pages < 5 * prompt_pages
    tree = engine.tree
    assert tree.children(result.root) == [s.node for s in result.samples]
    for s in result.samples:
        assert tree.sequence(s.node) == prompt + s.tokens
    assert tree.layout().num_queries == 0                # every kept token is computed
    tree.check_invariants()
    tree.prune(result.root)
    assert pool.num_free_pages == pool.num_pages


def test_kept_samples_hold_their_computed_kv(tiny):
    """A kept sample's node can be continued: greedy decoding under it equals greedy decoding
    of the whole sequence from scratch."""
    engine = make_engine(tiny)
    result = parallel_sample(engine, PROMPT, 3, 5, SamplingParams(temperature=1.5), generator=seeded(2), keep=True)
    node = result.samples[1].node
    logits = engine.prefill([11], parent=node).logits
    assert int(logits.argmax()) == plain_greedy(tiny, PROMPT + result.samples[1].tokens + [11], 1)[0]


def test_eos_ends_samples_and_frees_them(tiny):
    greedy = plain_greedy(tiny, PROMPT, 6)
    eos = greedy[2]
    first_eos = greedy.index(eos)
    for keep in (False, True):
        engine = make_engine(tiny)
        result = parallel_sample(engine, PROMPT, 3, 6, SamplingParams(top_k=1), eos_token_id=[eos, 511], keep=keep)
        for s in result.samples:
            assert s.tokens == greedy[:first_eos + 1] and s.stop_reason == "eos"
        assert result.stats.steps == first_eos + keep    # a kept sample's EOS token is computed too
        assert (engine.pool.num_free_pages == engine.pool.num_pages) != keep


def test_default_eos_is_the_model_s(tiny, monkeypatch):
    greedy = plain_greedy(tiny, PROMPT, 6)
    eos = greedy[2]
    monkeypatch.setattr(tiny, "eos_token_ids", (eos,))
    result = parallel_sample(make_engine(tiny), PROMPT, 2, 6, SamplingParams(top_k=1))
    assert tokens_of(result) == [greedy[:greedy.index(eos) + 1]] * 2
    assert [s.stop_reason for s in result.samples] == ["eos", "eos"]
    result = parallel_sample(make_engine(tiny), PROMPT, 2, 6, SamplingParams(top_k=1), eos_token_id=None)
    assert tokens_of(result) == [greedy] * 2 and result.samples[0].stop_reason == "length"


def test_ended_samples_free_their_pages_while_others_run(tiny):
    """Sampled at temperature 1 with a frequent token as EOS: samples end at different steps,
    and a step computes only the samples still running."""
    engine = make_engine(tiny)
    probe = parallel_sample(engine, PROMPT, 8, 12, generator=seeded(5))
    eos = max(set(t for s in probe.samples for t in s.tokens[:6]),
              key=lambda t: sum(t in s.tokens[:6] for s in probe.samples))
    result = parallel_sample(engine, PROMPT, 8, 12, generator=seeded(5), eos_token_id=eos)
    lengths = [len(s.tokens) for s in result.samples]
    assert len(set(lengths)) > 1 and any(s.stop_reason == "eos" for s in result.samples)
    for s in result.samples:
        assert (s.stop_reason == "eos") == (s.tokens[-1] == eos) and eos not in s.tokens[:-1]
    # Step j computes the samples with more than j + 1 tokens (their token j + 1 is sampled from it).
    assert result.stats.queries_per_step == [sum(n > j + 1 for n in lengths) for j in range(max(lengths) - 1)]
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 12])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pipelined_sampling_gives_the_same_samples_and_tree(tiny, keep, max_new_tokens, temperature):
    """A pipelined run (each step launched before the draw before it is read) draws sample i's
    token with the same random number as an unpipelined one: same samples, same tree left."""
    probe = parallel_sample(make_engine(tiny), PROMPT, 8, 12, SamplingParams(temperature=temperature),
                            generator=seeded(5))
    eos = max(set(t for s in probe.samples for t in s.tokens[:6]),     # a frequent token: samples end apart
              key=lambda t: sum(t in s.tokens[:6] for s in probe.samples))
    runs = []
    for pipeline in (False, True):
        engine = make_engine(tiny)
        result = parallel_sample(engine, PROMPT, 8, max_new_tokens, SamplingParams(temperature=temperature),
                                 eos_token_id=eos,
                                 generator=seeded(5), keep=keep, pipeline=pipeline)
        tree = engine.tree
        tree.check_invariants()
        left = None if result.root is None else [tree.sequence(s.node) for s in result.samples]
        assert tree.layout().num_queries == 0
        runs.append((tokens_of(result), [s.stop_reason for s in result.samples], left,
                     engine.pool.num_free_pages))
        if keep:   # kept nodes hold computed K/V: greedy under one equals greedy from scratch
            s = max(result.samples, key=lambda s: len(s.tokens))
            logits = engine.prefill([11], parent=s.node).logits
            assert int(logits.argmax()) == plain_greedy(tiny, PROMPT + s.tokens + [11], 1)[0]
    assert runs[0] == runs[1]
    if max_new_tokens == 12 and temperature > 0:
        assert len({len(t) for t in runs[0][0]}) > 1 and "eos" in runs[0][1]


def test_sample_tokens_inverse_cdf_draws_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.0, 0.2]])).expand(4000, 4)
    uniform = torch.rand(4000, generator=seeded(0))
    drawn = sample_tokens(logits, SamplingParams(), uniform=uniform)
    torch.testing.assert_close(torch.bincount(drawn, minlength=4) / 4000, torch.tensor([0.5, 0.3, 0.0, 0.2]),
                               atol=0.03, rtol=0)
    edges = torch.tensor([0.0, 0.4999, 0.5, 0.7999, 0.8, 1 - 2 ** -24])
    assert sample_tokens(logits[:6], SamplingParams(), uniform=edges).tolist() == [0, 0, 1, 1, 3, 3]
    assert set(sample_tokens(logits, SamplingParams(top_k=1), uniform=uniform).tolist()) == {0}


def test_sample_tokens_respects_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    gen = seeded(0)
    assert set(sample_tokens(logits, SamplingParams(top_k=2), gen).tolist()) == {0, 1}
    assert set(sample_tokens(logits, SamplingParams(top_p=0.45), gen).tolist()) == {0}
    assert set(sample_tokens(logits, SamplingParams(top_p=0.75), gen).tolist()) == {0, 1}    # 0.5 + 0.3 reach 0.75
    assert set(sample_tokens(logits, SamplingParams(top_p=0.85), gen).tolist()) == {0, 1, 2}
    counts = torch.bincount(sample_tokens(logits, SamplingParams(), gen), minlength=4) / 4000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    cold = torch.bincount(sample_tokens(logits, SamplingParams(temperature=0.25), gen), minlength=4) / 4000
    assert cold[0] > 0.85                                # p ** 4, renormalized: 0.5 ** 4 / sum = 0.87


def test_sample_tokens_is_the_one_picker_greedy_and_k_distinct():
    logits = torch.tensor([[0.1, 0.7, 0.7, 0.2], [0.9, 0.1, 0.3, 0.4]])
    assert sample_tokens(logits, GREEDY).tolist() == [1, 0]          # ties: the first, as argmax
    assert int(sample_tokens(logits[0], GREEDY)) == 1                 # one row without its dimension
    assert sample_tokens(logits, GREEDY, k=2).tolist() == logits.topk(2).indices.tolist()
    drawn = sample_tokens(logits, SamplingParams(temperature=1.0), seeded(0), k=3)
    assert drawn.shape == (2, 3) and all(len(set(row)) == 3 for row in drawn.tolist())   # without replacement
    torch.testing.assert_close(drawn, torch.multinomial(torch.softmax(logits / 1.0, dim=-1), 3, replacement=False,
                                                        generator=seeded(0)))
    assert sample_tokens(logits[1:], SamplingParams(top_k=1), seeded(0), k=1).tolist() == [[0]]   # (ties are kept)
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        sample_tokens(logits, GREEDY, k=0)
    with pytest.raises(ValueError, match="uniform gives each row one number"):
        sample_tokens(logits, SamplingParams(), uniform=torch.zeros(2), k=2)


def test_majority_vote_ignores_none_and_breaks_ties_by_first_appearance():
    assert majority_vote(["7", None, "5", "7", "5", None]) == ("7", {"7": 2, "5": 2})
    assert majority_vote(["5", "7", "7", "5"]) == ("5", {"5": 2, "7": 2})
    assert majority_vote([None, 3, 4, 4]) == (4, {3: 1, 4: 2})
    assert majority_vote([None, None]) == (None, {})
    with pytest.raises(TypeError, match=r"answers\[1\] = \[1, 2\] is not hashable"):
        majority_vote([1, [1, 2]])


def test_self_consistency_votes_over_the_samples(tiny):
    def parity_of_first_token_unless_zero(tokens):
        return None if tokens[0] % 3 == 0 else ("even" if tokens[0] % 2 == 0 else "odd")

    engine = make_engine(tiny)
    result = self_consistency(engine, PROMPT, 12, parity_of_first_token_unless_zero, 4,
                              SamplingParams(temperature=2.0), generator=seeded(7))
    samples = result.samples.samples
    assert result.answers == [parity_of_first_token_unless_zero(s.tokens) for s in samples]
    assert None in result.answers and len(result.votes) == 2         # this seed exercises all three outcomes
    assert sum(result.votes.values()) == sum(a is not None for a in result.answers)
    assert (result.answer, result.votes) == majority_vote(result.answers)
    assert result.votes[result.answer] == max(result.votes.values())
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0


@pytest.mark.parametrize("make,message", [
    (lambda: SamplingParams(top_k=-3), "top_k must be an int >= 1, or None / -1 / 0 for no top-k cut, got int -3"),
    (lambda: SamplingParams(top_k=2.0), "top_k must be an int >= 1, or None / -1 / 0 for no top-k cut, got float"),
    (lambda: SamplingParams(min_p=-0.1), r"min_p must be a number in \[0, 1\]"),
    (lambda: SamplingParams(repetition_penalty=0.0), r"repetition_penalty must be a number in \[1.4012985e-45, "
                                                     r"3.4028235e\+38\] \(> 0 and finite in float32"),
    (lambda: SamplingParams(frequency_penalty=float("nan")), r"frequency_penalty must be a number in \[-2, 2\]"),
    (lambda: SamplingParams(max_tokens=0), "max_tokens must be an int >= 1"),
    (lambda: SamplingParams(logprobs=True), "logprobs must be None or an int >= 0"),
    (lambda: SamplingParams(logits_processors=[1]), "logits_processors must hold callables"),
    (lambda: SamplingParams(stop_token_ids=[-1]), "stop_token_ids must be token ids"),
    (lambda: SamplingParams(0.5), "takes 1 positional argument"),
    (lambda: SamplingParams(temperature=-0.1), r"temperature must be a number in \[0, 3.4028235e\+38\] \(finite in "
                                               r"float32; 0 is greedy\), got -0.1"),
    (lambda: SamplingParams(temperature=float("inf")), r"temperature must be a number in .*got inf"),
    (lambda: SamplingParams(top_p=0.0), r"top_p must be a number in \(0, 1\], got 0.0"),
    (lambda: SamplingParams(top_p=1.5), r"top_p must be a number in \(0, 1\], got 1.5"),
    (lambda: SamplingParams(top_p=float("nan")), r"top_p must be a number in \(0, 1\], got nan"),
])
def test_bad_sampling_params_raise(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_sampling_params_take_vllm_spellings():
    assert SamplingParams(top_k=-1).top_k is None and SamplingParams(top_k=0).top_k is None
    params = SamplingParams(stop="###", logits_processors=len)
    assert params.stop == ("###",) and params.logits_processors == (len,)
    assert not SamplingParams(temperature=0).reads_logits
    assert SamplingParams(temperature=0, repetition_penalty=1.2).reads_logits
    assert SamplingParams(temperature=0, logprobs=0).reads_logits and SamplingParams().reads_logits


@pytest.mark.parametrize("kwargs,message", [
    (dict(n=0), "n must be an int >= 1, got 0"),
    (dict(n=-1), "n must be an int >= 1, got -1"),
    (dict(n=2.5), "n must be an int >= 1, got 2.5"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(params={"temperature": 0.5}), "params must be a SamplingParams, got dict"),
    (dict(eos_token_id=512), r"eos_token_id must be token ids in \[0, 512\), got 512"),
    (dict(eos_token_id="eos"), r"eos_token_id must be 'model' \(the model's own EOS ids\), a token id"),
    (dict(keep="yes"), "keep must be a bool, got 'yes'"),
    (dict(pipeline=1), r"pipeline must be a bool or None \(on for a CUDA engine\), got 1"),
])
def test_bad_arguments_raise_and_change_nothing(tiny, kwargs, message):
    engine = make_engine(tiny)
    other = engine.prefill([1, 2, 3]).node
    free, steps = engine.pool.num_free_pages, engine.stats["steps"]
    with pytest.raises(ValueError, match=message):
        parallel_sample(engine, PROMPT, **(dict(n=2, max_new_tokens=3) | kwargs))
    with pytest.raises(ValueError, match="extract_answer must be callable"):
        self_consistency(engine, PROMPT, 2, "the answer", 3)
    assert engine.tree.roots == [other] and engine.tree.num_nodes == 1
    assert engine.pool.num_free_pages == free and engine.stats["steps"] == steps


def test_a_failing_run_frees_the_request(tiny):
    engine = Engine(tiny, kv_tokens=32, page_size=4, backend="torch")   # 8 pages: the prompt takes them all
    with pytest.raises(Exception, match="KV pool exhausted"):
        parallel_sample(engine, list(range(30)), 8, 4)
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_samples_that_fit_the_pool_a_few_at_a_time_all_run(tiny):
    """12 pages, the prompt takes 8: 4 of the 8 samples grow at once (each its own page), the others wait for
    their pages and run as the first ones end; the samples are those of a pool that holds all of them."""
    params = SamplingParams(temperature=1.0, seed=5)
    small = Engine(tiny, kv_tokens=48, page_size=4, backend="torch")
    got = parallel_sample(small, list(range(30)), 8, 4, params=params)
    want = parallel_sample(Engine(tiny, kv_tokens=512, page_size=4, backend="torch"), list(range(30)), 8, 4,
                           params=params)
    assert [s.tokens for s in got.samples] == [s.tokens for s in want.samples]
    assert small.tree.num_nodes == 0 and small.pool.num_free_pages == small.pool.num_pages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pipelined_sampling_on_a_graphed_gpu_engine():
    """On a GPU the draws are read back while the next step runs. Greedy (temperature 0): the
    same tokens and tree as unpipelined. Sampled: the same seed gives the same samples, and
    every kept sample holds its tokens, ended where its EOS is. (Sampled runs are not compared
    across pipelining in bf16: the step sizes differ after a sample ends, the logits then differ
    in their last bits, and a draw near a token's border may flip.)"""
    from treedec.models import from_config

    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    prompt = [(7 * i + 3) % 512 for i in range(700)]
    eos = list(range(0, 512, 9))

    def run(pipeline, params, seed=7):
        engine = Engine(model, kv_tokens=8192, page_size=16, cuda_graphs=True)
        result = parallel_sample(engine, prompt, 16, 24, params, generator=torch.Generator("cuda").manual_seed(seed),
                                 eos_token_id=eos, keep=True, pipeline=pipeline)
        assert not [k for k in engine.graph_stats if k.startswith("eager") and "max_queries" not in k]
        for s in result.samples:
            assert engine.tree.sequence(s.node) == prompt + s.tokens
            assert (s.stop_reason == "eos") == (s.tokens[-1] in eos) and not set(s.tokens[:-1]) & set(eos)
        engine.tree.check_invariants()
        return [s.tokens for s in result.samples]

    greedy = SamplingParams(temperature=0.0)
    assert run(True, greedy) == run(False, greedy)
    sampled = run(True, SamplingParams())
    assert sampled == run(True, SamplingParams()) and sampled != run(True, SamplingParams(), seed=8)
    assert len({len(t) for t in sampled}) > 1     # the EOS ids ended samples at different steps


# ================================================================ float32 safety (issue #48 item 4)


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 9.9e-6])
def test_a_temperature_below_the_sampling_eps_is_greedy(tiny, temperature):
    """vLLM samples greedily below _SAMPLING_EPS (1e-5); logits / 1e-45 overflows float32 (a NaN CDF)."""
    params = SamplingParams(temperature=temperature, n=2)
    assert params.temperature == 0.0 and params.greedy and SAMPLING_EPS == 1e-5
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    result = parallel_sample(make_engine(tiny), PROMPT, 2, 6, params, generator=seeded(0))
    assert tokens_of(result) == [plain_greedy(tiny, PROMPT, 6)] * 2


@pytest.mark.parametrize("kwargs", [dict(temperature=1e308), dict(presence_penalty=1e308),
                                    dict(frequency_penalty=-1e308), dict(presence_penalty=2.5),
                                    dict(repetition_penalty=1e-300), dict(repetition_penalty=1e39)])
def test_values_that_float32_cannot_hold_are_refused(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"{name} must be a number in \[.*\].*got {value:g}".replace("+", r"\+")):
        SamplingParams(**kwargs)
    assert SamplingParams(presence_penalty=2.0, frequency_penalty=-2.0).presence_penalty == 2.0


def test_the_inverse_cdf_draw_never_returns_an_id_past_the_vocabulary():
    """A row with no distribution (NaN logits) made the draw return vocab (an id the engine's check refused for
    the whole step); it is clamped on the device."""
    logits = torch.randn(3, 50)
    logits[1] = float("nan")
    picked = sample_tokens(logits, SamplingParams(), uniform=torch.tensor([0.5, 0.5, 0.999999]))
    assert picked.dtype == torch.int64 and int(picked.max()) < 50
    assert int(sample_tokens(logits[:1], SamplingParams(top_p=1e-300), uniform=torch.tensor([0.99]))) \
        == int(logits[0].argmax())
