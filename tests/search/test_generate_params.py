"""Generation with every field of SamplingParams against transformers' generate on the same tiny Llama (fp32,
CPU): penalties, min-p, user logits processors, logprobs and prompt logprobs; pipelined == not; batched == alone."""
import math

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, NoRepeatNGramLogitsProcessor

from treedec.engine import Engine
from treedec.models import from_hf_model
from treedec.search.batch import generate_batch
from treedec.search.requests_file import RequestSpec
from treedec.search.sampling import SamplingParams
from tests.engines import tiny_hf_llama

PROMPT = [158, 198, 212, 41, 0, 98, 171, 81, 122, 158, 198]
NEW = 12


def run(model, params, prompt=PROMPT, pipeline=False, **kwargs):
    engine = Engine(model, kv_tokens=1024, page_size=4, backend="torch")
    results, _ = generate_batch(engine, [RequestSpec(0, prompt_ids=tuple(prompt), params=params)], pipeline=pipeline,
                                **kwargs)
    assert engine.pool.num_free_pages == engine.pool.num_pages
    return results


def hf_generate(hf, prompt=PROMPT, **kwargs):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True,
                      **kwargs)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).double()


class OpenAIPenalties(LogitsProcessor):
    """Presence and frequency penalties as OpenAI / vLLM define them (transformers has no processor for them):
    ``logit -= frequency * count + presence * (count > 0)``, counts over the output only."""

    def __init__(self, prompt_length, presence, frequency):
        self.start, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids[:, self.start:], torch.ones_like(
            input_ids[:, self.start:], dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_repetition_penalty_equals_transformers(hf, model, penalty, pipeline):
    tokens, _ = hf_generate(hf, repetition_penalty=penalty)
    [result] = run(model, SamplingParams(temperature=0, max_tokens=NEW, repetition_penalty=penalty), pipeline=pipeline)
    assert result.output_ids == tokens
    plain, _ = hf_generate(hf)
    assert plain != tokens   # the penalty changed the output: the test would see it ignored


@pytest.mark.parametrize("pipeline", [False, True])
def test_greedy_presence_and_frequency_penalties_equal_their_formula(hf, model, pipeline):
    tokens, _ = hf_generate(hf, logits_processor=LogitsProcessorList([OpenAIPenalties(len(PROMPT), 0.5, 0.8)]))
    [result] = run(model, SamplingParams(temperature=0, max_tokens=NEW, presence_penalty=0.5, frequency_penalty=0.8),
                   pipeline=pipeline)
    assert result.output_ids == tokens and tokens != hf_generate(hf)[0]


def test_a_transformers_logits_processor_runs_as_given(hf, model):
    tokens, _ = hf_generate(hf, no_repeat_ngram_size=1)
    [result] = run(model, SamplingParams(temperature=0, max_tokens=NEW,
                                         logits_processors=[NoRepeatNGramLogitsProcessor(1)]))
    assert result.output_ids == tokens and tokens != hf_generate(hf)[0]


@pytest.mark.parametrize("pipeline", [False, True])
def test_logprobs_equal_transformers_raw_logits_log_softmax(hf, model, pipeline):
    tokens, logits = hf_generate(hf)
    reference = logits.log_softmax(dim=-1)
    [result] = run(model, SamplingParams(temperature=0, max_tokens=NEW, logprobs=3), pipeline=pipeline)
    assert result.output_ids == tokens and len(result.logprobs) == NEW
    for step, (entry, token) in enumerate(zip(result.logprobs, tokens)):
        top = reference[step].topk(3).indices.tolist()
        assert set(entry) == {token, *top}                      # the chosen token and the 3 most likely
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(reference[step, t].item(), abs=1e-5)
            assert lp.rank == 1 + int((reference[step] > reference[step, t]).sum())
    assert result.cumulative_logprob == pytest.approx(sum(reference[i, t].item() for i, t in enumerate(tokens)),
                                                      abs=1e-4)


def test_prompt_logprobs_equal_transformers_forward(hf, model):
    with torch.no_grad():
        reference = hf(torch.tensor([PROMPT])).logits[0].double().log_softmax(dim=-1)
    [result] = run(model, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(PROMPT)
    for j, entry in enumerate(result.prompt_logprobs[1:], start=1):
        assert PROMPT[j] in entry and len(entry) in (2, 3)
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(reference[j - 1, t].item(), abs=1e-5)


def test_min_p_keeps_only_tokens_near_the_most_likely(model):
    params = SamplingParams(temperature=1.0, min_p=0.3, max_tokens=NEW, n=4, seed=5, logprobs=1)
    results = run(model, params)
    for r in results:
        for entry, token in zip(r.logprobs, r.output_ids):
            best = max(lp.logprob for lp in entry.values())
            assert entry[token].logprob >= best + math.log(0.3) - 1e-6
    unrestricted = run(model, params.replace(min_p=0.0))
    assert [r.output_ids for r in unrestricted] != [r.output_ids for r in results]


def test_penalized_sampled_requests_batched_equal_alone(model):
    params = [SamplingParams(temperature=0.9, max_tokens=NEW, n=2, seed=1, repetition_penalty=1.2, min_p=0.05),
              SamplingParams(temperature=0, max_tokens=NEW - 3, frequency_penalty=0.4, logprobs=0),
              SamplingParams(temperature=0.7, max_tokens=NEW, seed=2, presence_penalty=1.0, top_k=20)]
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:]]
    engine = Engine(model, kv_tokens=1024, page_size=4, backend="torch")
    batched, _ = generate_batch(engine, [RequestSpec(i, prompt_ids=tuple(p), params=s)
                                         for i, (p, s) in enumerate(zip(prompts, params))])
    alone = [r for p, s in zip(prompts, params) for r in run(model, s, prompt=p)]
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]
    for b, a in zip(batched, alone):   # (batched rows may round differently in the last bits)
        assert (b.logprobs is None) == (a.logprobs is None)
        for eb, ea in zip(b.logprobs or [], a.logprobs or []):
            assert eb.keys() == ea.keys()
            assert all(eb[t].logprob == pytest.approx(ea[t].logprob, abs=1e-5) for t in eb)


def test_a_failing_logits_processor_names_itself_and_frees_everything(model):
    def broken(input_ids, scores):
        raise RuntimeError("boom")
    engine = Engine(model, kv_tokens=1024, page_size=4, backend="torch")
    with pytest.raises(Exception, match="broken"):
        generate_batch(engine, [RequestSpec(0, prompt_ids=tuple(PROMPT),
                                            params=SamplingParams(max_tokens=4, logits_processors=[broken]))])
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_field_on_a_graphed_gpu_engine_pipelined_equals_unpipelined(model):
    """On a GPU with CUDA graphs: penalties (counts on the device), min-p, logprobs and a user processor give
    the same tokens and logprobs pipelined (tokens read after the next step is launched) as not."""
    gpu = from_hf_model(tiny_hf_llama().to(torch.bfloat16).cuda())
    params = [SamplingParams(temperature=0, max_tokens=NEW, repetition_penalty=1.3, logprobs=2),
              SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=NEW, min_p=0.1, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=NEW, logits_processors=[NoRepeatNGramLogitsProcessor(1)])]
    specs = [RequestSpec(i, prompt_ids=tuple(PROMPT[i:]), params=p) for i, p in enumerate(params)]
    runs = []
    for pipeline in (False, True):
        engine = Engine(gpu, kv_tokens=4096, page_size=16, cuda_graphs=True)
        results, _ = generate_batch(engine, specs, pipeline=pipeline)
        assert engine.pool.num_free_pages == engine.pool.num_pages
        runs.append(results)
    assert [r.output_ids for r in runs[0]] == [r.output_ids for r in runs[1]]
    for a, b in zip(*runs):
        assert (a.logprobs is None) == (b.logprobs is None)
        for ea, eb in zip(a.logprobs or [], b.logprobs or []):
            assert ea.keys() == eb.keys() and all(abs(ea[t].logprob - eb[t].logprob) < 1e-3 for t in ea)
    assert len(set(runs[0][2].output_ids)) == len(runs[0][2].output_ids)   # the processor forbade repeats
