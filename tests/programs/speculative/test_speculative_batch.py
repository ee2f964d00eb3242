"""Greedy speculative decoding of many requests in one forest (tiny random Llama, CPU), pipelined or not."""
import collections

import numpy as np
import pytest
import torch

from treedec.sampling.params import SamplingParams
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.models.medusa import MedusaHeads
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.runtime.requests import RequestSpec
from treedec.programs.speculative.drafts import DraftSource, PromptLookupDraft, TreeDraft
from treedec.programs.speculative.program import speculative_generate
from treedec.programs.speculative.draft_budget import DraftBudget
from treedec.programs.speculative.batch import speculative_batch
from treedec.tree.token_tree import TokenTree
from treedec.workloads.deft import medusa_tree
from tests.engines import make_engine, plain_greedy, tiny_model
from tests.programs.test_generate_batch import LetterTokenizer


def medusa_token_tree():
    return TokenTree(tuple(medusa_tree(32).parents.tolist()))


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def repeating_prompt(k, length=24):
    """A prompt with a repeated phrase, so that prompt-lookup drafts get accepted now and then."""
    phrase = [(13 * k + 7 * i + 3) % 512 for i in range(6)]
    return tuple((phrase * 5)[:length // 2] + [(k * 31 + i) % 512 for i in range(length // 2)])


def specs(count=5):
    return [RequestSpec(k, prompt_ids=repeating_prompt(k, 12 + 4 * k),
                        params=SamplingParams(max_tokens=10 + 3 * k, temperature=0.0))
            for k in range(count)]


@pytest.mark.parametrize("kv_tokens", [8192, 240])
@pytest.mark.parametrize("make_draft", [lambda spec: PromptLookupDraft(num_draft_tokens=5, max_matches=2),
                                        lambda spec: TreeDraft(medusa_token_tree(),
                                                               [(spec.id * 7 + i) % 512 for i in range(31)])])
@pytest.mark.slow
def test_batched_speculative_tokens_are_plain_greedy(tiny, kv_tokens, make_draft):
    engine = Engine(tiny, kv_tokens=kv_tokens, page_size=4, backend="torch")
    results, stats = speculative_batch(engine, specs(), make_draft, max_draft_tokens=32)
    for r, spec in zip(results, specs()):
        assert r.output_ids == plain_greedy(tiny, list(spec.prompt_ids), spec.params.max_tokens)
        assert r.stop_reason == "length" and len(r.stats["accepted"]) == r.stats["steps"]
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0
    assert (stats.waits > 0) == (kv_tokens == 240) and max(stats.programs_per_step) <= 5


def test_stops_cut_accepted_paths(tiny):
    tokenizer = LetterTokenizer()
    greedy = plain_greedy(tiny, tokenizer.encode("HELLOHELLO"), 16)
    text = tokenizer.decode(greedy)
    stop = text[5:7]
    eos = greedy[9] if greedy[9] not in greedy[:9] else None
    requests = [RequestSpec(0, prompt="HELLOHELLO",
                            params=SamplingParams(max_tokens=16, temperature=0.0, stop=(stop,))),
                RequestSpec(1, prompt="HELLOHELLO",
                            params=SamplingParams(max_tokens=16, temperature=0.0,
                                                  stop_token_ids=() if eos is None else (eos,)))]
    results, _ = speculative_batch(make_engine(tiny), requests, lambda spec: PromptLookupDraft(num_draft_tokens=6),
                                   tokenizer=tokenizer)
    cut = text.index(stop)
    assert results[0].stop_reason == "stop_string" and results[0].text == text[:cut]
    assert results[0].output_ids == greedy[:cut + len(stop)]
    if eos is not None:
        assert results[1].stop_reason == "eos" and results[1].output_ids == greedy[:10]


@pytest.mark.parametrize("requests,kwargs,error,message", [
    ([RequestSpec(0, prompt_ids=(1, 2),
                  params=SamplingParams(temperature=0.5))], {}, ValueError, "needs temperature=0 and n=1"),
    ([RequestSpec(0, prompt_ids=(1, 2),
                  params=SamplingParams(temperature=0.0, n=2))], {}, ValueError, "needs temperature=0 and n=1"),
    ([RequestSpec(0, prompt_ids=(1, 2),
                  params=SamplingParams(temperature=0.0, max_tokens=500))], {}, PoolExhaustedError,
     "may need .* KV pages, the pool has"),
    ([RequestSpec(0, prompt_ids=(1, 2), params=SamplingParams(temperature=0.0))], {"max_draft_tokens": 0}, ValueError,
     "max_draft_tokens must be an int >= 1"),
])
def test_bad_requests_raise_before_anything_runs(tiny, requests, kwargs, error, message):
    engine = Engine(tiny, kv_tokens=512, page_size=4, backend="torch")
    with pytest.raises(error, match=message):
        speculative_batch(engine, requests, lambda spec: PromptLookupDraft(), **kwargs)
    assert engine.tree.num_nodes == 0 and engine.stats["steps"] == 0


@pytest.mark.parametrize("in_step", [True, False])
def test_medusa_head_drafts_batch(tiny, in_step):
    """Drafts that read the target's hidden states (Medusa heads, inside the shared step or after it)
    batch: every request's tokens are plain greedy's."""
    engine = make_engine(tiny)
    heads = MedusaHeads.untrained(tiny, num_heads=2)
    results, stats = speculative_batch(engine, specs(4), lambda spec: MedusaDraft(heads, [[0], [1], [0, 0]], in_step))
    for r, spec in zip(results, specs(4)):
        assert r.output_ids == plain_greedy(tiny, list(spec.prompt_ids), spec.params.max_tokens)
    assert max(stats.programs_per_step) == 4
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_drafts_with_different_row_heads_are_refused_and_change_nothing(tiny):
    engine = make_engine(tiny)
    heads = [MedusaHeads.untrained(tiny, num_heads=2, seed=s) for s in (0, 1)]
    with pytest.raises(ValueError, match="requests 0 and 1 have drafts with different row heads"):
        speculative_batch(engine, specs(2), lambda spec: MedusaDraft(heads[spec.id], [[0], [0, 0]]))
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_a_draft_that_breaks_the_protocol_frees_everything(tiny):
    class Wrong(DraftSource):
        def propose(self, tokens):
            return medusa_token_tree(), list(np.zeros(32, dtype=int))   # root 0, not the last token

    engine = make_engine(tiny)
    with pytest.raises(ValueError, match="must return tokens\\[0\\] == the last sequence token"):
        speculative_batch(engine, specs(2), lambda spec: Wrong())
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


class _DuckDraft:
    """A propose method but no DraftSource: refused by its type, not probed for members."""

    def propose(self, tokens):
        return TokenTree.chain(0), [int(tokens[-1])]


@pytest.mark.parametrize("value", [_DuckDraft(), None, "ngram", PromptLookupDraft], ids=["duck", "none", "str", "class"])
def test_a_draft_that_is_not_a_draft_source_is_refused_by_its_type(tiny, value):
    engine = make_engine(tiny)
    name = type(value).__name__
    with pytest.raises(TypeError, match=rf"^draft must be a draft source, got {name}: subclass "
                                        rf"treedec\.programs\.speculative\.drafts\.DraftSource"):
        speculative_generate(engine, [1, 2, 3], value, 4)
    with pytest.raises(TypeError, match=rf"^request 1: draft\(spec\) must be a draft source, got {name}: subclass "
                                        rf"treedec\.programs\.speculative\.drafts\.DraftSource"):
        speculative_batch(engine, specs(2), lambda spec: PromptLookupDraft() if spec.id == 0 else value)
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_oracle_drafts_are_accepted_whole(tiny):
    """Chain drafts that know each request's greedy continuation: every step accepts all 4 draft
    tokens (the batch moves accepted K/V per request), and the tokens stay plain greedy's."""
    continuations = {spec.id: plain_greedy(tiny, list(spec.prompt_ids), spec.params.max_tokens + 8) for spec in specs()}

    def oracle(spec):
        prompt, future = list(spec.prompt_ids), continuations[spec.id]

        def next_four(sequence):
            done = len(sequence) - len(prompt)          # sequence[-1] is future[done - 1]
            return future[done:done + 4]
        return TreeDraft(TokenTree.chain(4), next_four)

    results, stats = speculative_batch(make_engine(tiny), specs(), oracle)
    for r, spec in zip(results, specs()):
        assert r.output_ids == continuations[spec.id][:spec.params.max_tokens]
        assert r.stats["accepted"][:-1] == [4] * (len(r.stats["accepted"]) - 1)
    assert stats.steps < max(spec.params.max_tokens for spec in specs()) / 4 + 2


def common_tokens_draft(spec):
    """A fixed-token TreeDraft (pipelines) whose tokens are the request's greedy continuation's most frequent, so
    that some steps accept."""
    ref = plain_greedy(tiny_model(), list(spec.prompt_ids), spec.params.max_tokens)
    common = [t for t, _ in collections.Counter(ref).most_common(3)]
    return TreeDraft(medusa_token_tree(), (common * 31)[:31])


@pytest.mark.slow
@pytest.mark.parametrize("kv_tokens, budget", [(8192, None), (300, None), (8192, 24)])
def test_pipelined_batches_equal_unpipelined_batches(tiny, kv_tokens, budget):
    """Every request of a batch runs pipelined (its span masked, its positions moved, its step read one step
    late): the tokens, accepted lengths and tree sizes of the unpipelined batch, with pages short (programs wait);
    with a draft budget cutting the fixed trees the same tokens (the shares follow acceptances read one step
    later, so the sizes may differ); nothing left in the pool."""
    runs = []
    for pipeline in (False, True):
        engine = Engine(tiny, kv_tokens=kv_tokens, page_size=4, backend="torch")
        results, stats = speculative_batch(engine, specs(), common_tokens_draft, max_draft_tokens=32,
                                           draft_budget=DraftBudget(step_tokens=budget), pipeline=pipeline)
        assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0
        assert all(r.stats["pipelined"] == pipeline for r in results)
        runs.append([(r.output_ids, r.stats["accepted"], r.stats["draft_sizes"], r.stop_reason) for r in results])
        if kv_tokens == 300:
            assert stats.waits > 0
    if budget is None:
        assert runs[0] == runs[1]
    assert [(r[0], r[3]) for r in runs[0]] == [(r[0], r[3]) for r in runs[1]]
    for (tokens, accepted, sizes, _), spec in zip(runs[1], specs()):
        assert tokens == plain_greedy(tiny, list(spec.prompt_ids), spec.params.max_tokens)
        if budget is not None:
            assert max(sizes) < 31
    assert sum(sum(a) for _, a, _, _ in runs[1]) > 0


def test_pipelined_batch_stops_on_strings_and_eos_as_unpipelined(tiny):
    tokenizer = LetterTokenizer()
    greedy = plain_greedy(tiny, tokenizer.encode("HELLOHELLO"), 16)
    text = tokenizer.decode(greedy)
    requests = [RequestSpec(0, prompt="HELLOHELLO",
                            params=SamplingParams(max_tokens=16, temperature=0.0, stop=(text[5:7],))),
                RequestSpec(1, prompt="HELLOHELLO",
                            params=SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(greedy[7],))),
                RequestSpec(2, prompt="HELLOHELLO", params=SamplingParams(max_tokens=5, temperature=0.0))]
    draft = lambda spec: TreeDraft(TokenTree.chain(4), greedy[:4])   # noqa: E731
    runs = []
    for pipeline in (False, True):
        engine = make_engine(tiny)
        results, _ = speculative_batch(engine, requests, draft, tokenizer=tokenizer, pipeline=pipeline)
        assert engine.pool.num_free_pages == engine.pool.num_pages
        runs.append([(r.output_ids, r.text, r.stop_reason, r.stats["accepted"]) for r in results])
    assert runs[0] == runs[1]
    assert [r[2] for r in runs[1]] == ["stop_string", "eos", "length"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pipelined_graphed_batch_equals_the_eager_unpipelined_batch():
    """Six requests over the permutation target (Medusa heads right two times in three), a 64-token Medusa tree
    each, on captured graphs with the cuda backend, pipelined, against the eager unpipelined batch: the same
    tokens, every request the target's greedy continuation; a budget cutting the trees; every page freed."""
    from tests.programs.speculative.test_pipeline import permutation_target
    model, heads, perm = permutation_target("cuda", torch.bfloat16)
    rng = np.random.default_rng(4)
    requests = [RequestSpec(i, prompt_ids=tuple(rng.integers(0, 512, 300 + 50 * i).tolist()),
                            params=SamplingParams(max_tokens=40, temperature=0.0)) for i in range(6)]
    paths = medusa_tree(64).paths
    runs = []
    for pipeline, graphs in ((False, False), (True, True)):
        engine = Engine(model, kv_tokens=16384, page_size=16, cuda_graphs=graphs)
        results, _ = speculative_batch(engine, requests, lambda spec: MedusaDraft(heads, paths), max_draft_tokens=64,
                                       draft_budget=DraftBudget(step_tokens=200), pipeline=pipeline)
        assert all(r.stats["pipelined"] == pipeline for r in results)
        assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0
        runs.append([r.output_ids for r in results])
    assert runs[0] == runs[1]
    for tokens, spec in zip(runs[1], requests):
        want = [int(perm[spec.prompt_ids[-1]])]
        while len(want) < len(tokens):
            want.append(int(perm[want[-1]]))
        assert tokens == want


@pytest.mark.slow
def test_pipelining_holds_at_any_batch_size_and_says_why_not(tiny):
    """pipeline=None or True: a batch of 17 requests (more than the per-request pipeline's old limit of 16) pipelines
    where the draft, the rule and the engine allow it (pipeline=True on the CPU; None gives the engine's reason:
    the CPU), with plain greedy's tokens either way."""
    many = [RequestSpec(k, prompt_ids=repeating_prompt(k, 12), params=SamplingParams(max_tokens=3, temperature=0.0))
            for k in range(17)]
    for pipeline in (None, True):
        engine = Engine(tiny, kv_tokens=8192, page_size=4, backend="torch")
        results, _ = speculative_batch(engine, many, common_tokens_draft, max_draft_tokens=32, pipeline=pipeline)
        assert all(r.stats["pipelined"] == bool(pipeline) for r in results)
        assert all(pipeline or "CPU" in r.stats["pipeline_note"] for r in results)
        for r, spec in zip(results, many):
            assert r.output_ids == plain_greedy(tiny, list(spec.prompt_ids), spec.params.max_tokens)
    from treedec.programs.speculative.program import SpeculativeProgram
    from treedec.sampling.stops import StopRule
    with pytest.raises(ValueError, match="pipeline_note says why pipeline is False"):
        SpeculativeProgram([1, 2], common_tokens_draft(many[0]), StopRule(max_new_tokens=2), pipeline_note="why")


@pytest.mark.parametrize("field, value", [("logits_processors", [lambda ids, scores: scores]), ("min_tokens", 2),
                                          ("logit_bias", {1: 2.0}), ("allowed_token_ids", [1, 2]),
                                          ("bad_words", ["x"]), ("detokenize", False),
                                          ("skip_special_tokens", False), ("spaces_between_special_tokens", False)])
def test_parameters_speculative_decoding_does_not_implement_are_refused_before_anything_runs(field, value):
    engine = make_engine(tiny_model())
    spec = RequestSpec("r", prompt_ids=(1, 2, 3), params=SamplingParams(temperature=0, max_tokens=4, **{field: value}))
    with pytest.raises(ValueError, match=f"request 'r': speculative decoding does not implement {field}="):
        speculative_batch(engine, [spec], lambda spec: PromptLookupDraft())
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


def test_truncate_prompt_tokens_is_applied_to_a_speculative_request():
    engine = make_engine(tiny_model())
    spec = RequestSpec("t", prompt_ids=(9, 1, 2, 3), params=SamplingParams(temperature=0, max_tokens=4,
                                                                           truncate_prompt_tokens=3))
    [result], _ = speculative_batch(engine, [spec], lambda spec: PromptLookupDraft())
    assert result.prompt_ids == [1, 2, 3] and result.output_ids == plain_greedy(tiny_model(), [1, 2, 3], 4)
