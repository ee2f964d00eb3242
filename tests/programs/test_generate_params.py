"""Generation with every field of SamplingParams against transformers' generate on the same tiny Llama (fp32,
CPU): penalties, min-p, user logits processors, logprobs and prompt logprobs, vLLM's min_tokens, bad_words,
logit_bias, allowed_token_ids against transformers' processors of the same meaning; pipelined == not; batched ==
alone."""
import math

import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor, PrefixConstrainedLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from treedec.engine import Engine
from treedec.models import from_hf_model
from treedec.programs.generate import generate_batch
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.programs.tot import ByteTokenizer
from tests.engines import tiny_hf_llama
from tests.tokenizers_local import build_tokenizer
from treedec.models.text import load_tokenizer

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
    """On a GPU with CUDA graphs: penalties (counts on the device), min-p, logprobs, a user processor and vLLM's
    token masks and biases give the same tokens and logprobs pipelined (tokens read after the next step is
    launched) as not."""
    gpu = from_hf_model(tiny_hf_llama().to(torch.bfloat16).cuda())
    params = [SamplingParams(temperature=0, max_tokens=NEW, repetition_penalty=1.3, logprobs=2),
              SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=NEW, min_p=0.1, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=NEW, logits_processors=[NoRepeatNGramLogitsProcessor(1)]),
              SamplingParams(temperature=0.8, seed=5, max_tokens=NEW, min_tokens=4, stop_token_ids=[7, 9],
                             logit_bias={3: 2.0, 11: -100.0}, allowed_token_ids=list(range(0, 256, 3)))]
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
    [processed] = [r for r in runs[0] if r.id == 2]
    assert len(set(processed.output_ids)) == len(processed.output_ids)   # the processor forbade repeats
    [masked] = [r for r in runs[0] if r.id == 3]
    assert set(masked.output_ids) <= set(range(0, 256, 3)) and not set(masked.output_ids[:4]) & {7, 9}


# ================================================================ vLLM's fields against transformers' processors (#48)


def plain_tokens(hf):
    return hf_generate(hf)[0]


@pytest.mark.parametrize("pipeline", [False, True])
def test_min_tokens_equals_transformers_min_new_tokens(hf, model, pipeline):
    """min_tokens keeps the stop ids from being drawn (transformers' MinNewTokensLengthLogitsProcessor) and
    the output then ends at the first of them, as transformers' generate with those EOS ids does."""
    plain = plain_tokens(hf)
    stops = [plain[1], plain[4]]
    processor = MinNewTokensLengthLogitsProcessor(len(PROMPT), 5, stops)
    tokens, _ = hf_generate(hf, logits_processor=LogitsProcessorList([processor]), eos_token_id=stops)
    tokens = tokens[:next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))]   # (then it pads)
    [result] = run(model, SamplingParams(temperature=0, max_tokens=NEW, min_tokens=5, stop_token_ids=stops),
                   pipeline=pipeline)
    assert result.output_ids == tokens and len(tokens) > 5 and not set(tokens[:5]) & set(stops)
    [early] = run(model, SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=stops))
    assert len(early.output_ids) == 2   # without min_tokens it stops at plain[1]


@pytest.mark.parametrize("pipeline", [False, True])
def test_bad_words_equal_transformers_no_bad_words(hf, model, pipeline):
    """bad_words, tokenized as vLLM does ("DW" -> [68, 87]; " DW" is 3 tokens, not kept), ban a word's last token
    after the rest of it: transformers' NoBadWordsLogitsProcessor on the same token sequences."""
    plain = plain_tokens(hf)
    assert plain[:2] == [68, 87] and 118 in plain and PROMPT[-1] != 68   # ("DW" opens the greedy output)
    params = SamplingParams(temperature=0, max_tokens=NEW, bad_words=["DW", " v"])
    assert params.bad_words_token_ids(ByteTokenizer()) == ((68, 87), (118,))
    processor = NoBadWordsLogitsProcessor([[68, 87], [118]], eos_token_id=None)
    tokens, _ = hf_generate(hf, logits_processor=LogitsProcessorList([processor]))
    [result] = run(model, params, pipeline=pipeline, tokenizer=ByteTokenizer())
    assert result.output_ids == tokens and tokens != plain and 118 not in tokens and tokens[1] != 87
    with pytest.raises(ValueError, match="bad_words .* need the checkpoint's tokenizer"):
        run(model, params)


@pytest.mark.parametrize("pipeline", [False, True])
def test_logit_bias_equals_transformers_sequence_bias(hf, model, pipeline):
    plain = plain_tokens(hf)
    bias = {plain[0]: -100.0, 5: 4.0, "9": 2.5}   # (JSON's keys are strings)
    processor = SequenceBiasLogitsProcessor({(plain[0],): -100.0, (5,): 4.0, (9,): 2.5})
    tokens, _ = hf_generate(hf, logits_processor=LogitsProcessorList([processor]))
    params = SamplingParams(temperature=0, max_tokens=NEW, logit_bias=bias)
    assert dict(params.logit_bias) == {plain[0]: -100.0, 5: 4.0, 9: 2.5}
    [result] = run(model, params, pipeline=pipeline)
    assert result.output_ids == tokens and tokens[0] != plain[0]


@pytest.mark.parametrize("pipeline", [False, True])
def test_allowed_token_ids_equal_transformers_prefix_constrained(hf, model, pipeline):
    allowed = [68, 20, 118, 5, 9, 200]
    processor = PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, num_beams=1)
    tokens, _ = hf_generate(hf, logits_processor=LogitsProcessorList([processor]))
    [result] = run(model, SamplingParams(temperature=0, max_tokens=NEW, allowed_token_ids=allowed), pipeline=pipeline)
    assert result.output_ids == tokens and set(tokens) <= set(allowed)
    sampled = run(model, SamplingParams(temperature=1.5, seed=4, n=3, max_tokens=NEW, allowed_token_ids=allowed))
    assert all(set(r.output_ids) <= set(allowed) for r in sampled)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(model):
    [cut] = run(model, SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=4))
    [short] = run(model, SamplingParams(temperature=0, max_tokens=6), prompt=PROMPT[-4:])
    assert cut.prompt_ids == PROMPT[-4:] and cut.output_ids == short.output_ids
    [whole] = run(model, SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=-1))
    assert whole.prompt_ids == PROMPT   # (-1: the model's positions)


def test_detokenize_and_special_tokens_options_shape_the_text(model, tmp_path):
    tok = ByteTokenizer()
    [text] = run(model, SamplingParams(temperature=0, max_tokens=4), tokenizer=tok)
    [ids_only] = run(model, SamplingParams(temperature=0, max_tokens=4, detokenize=False), tokenizer=tok)
    assert text.text == tok.decode(text.output_ids) and ids_only.text is None
    assert ids_only.output_ids == text.output_ids
    with pytest.raises(ValueError, match="need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    bpe = load_tokenizer(build_tokenizer(tmp_path / "bpe"))   # (its EOS </s> is id 2, a special token)
    forced = SamplingParams(temperature=0, max_tokens=3, logit_bias={2: 100.0})
    [skipped] = run(model, forced, tokenizer=bpe)
    [kept] = run(model, forced.replace(skip_special_tokens=False), tokenizer=bpe)
    assert skipped.output_ids == kept.output_ids == [2, 2, 2]
    assert skipped.text == "" and kept.text == "</s></s></s>"


@pytest.mark.parametrize("kwargs, message", [
    (dict(best_of=2), r"best_of=2 is not supported \(vLLM v1 does not support best_of either\)"),
    (dict(min_tokens=17), r"min_tokens must be at most max_tokens \(16\), got 17"),
    (dict(min_tokens=-1), r"min_tokens must be an int >= 0"),
    (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be a number in \[-100, 100\] \(OpenAI's range\), got 101"),
    (dict(logit_bias={"x": 1}), r"logit_bias keys must be token ids .*got str 'x'"),
    (dict(logit_bias=[1, 2]), r"logit_bias must be a mapping"),
    (dict(allowed_token_ids=[]), r"allowed_token_ids must be None \(every token\) or a non-empty list"),
    (dict(allowed_token_ids=[-1]), r"allowed_token_ids must be token ids"),
    (dict(bad_words=[""]), r"bad_words must be non-empty strings"),
    (dict(bad_words=["w"] * 129), r"bad_words must hold at most 128 strings, got 129"),
    (dict(truncate_prompt_tokens=0), r"truncate_prompt_tokens must be None, -1 .* or an int >= 1"),
    (dict(skip_special_tokens=1), r"skip_special_tokens must be true or false"),
])
def test_bad_vllm_fields_raise_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert SamplingParams(best_of=1).best_of == 1


def test_ids_past_the_vocabulary_are_refused_before_anything_runs(model):
    engine = Engine(model, kv_tokens=1024, page_size=4, backend="torch")
    for params, field in ((SamplingParams(allowed_token_ids=[3, 256]), "allowed_token_ids"),
                          (SamplingParams(logit_bias={999: 1.0}), "logit_bias")):
        with pytest.raises(ValueError, match=rf"request 0: {field} must hold token ids in \[0, 256\).*got \[\d+\]"):
            generate_batch(engine, [RequestSpec(0, prompt_ids=tuple(PROMPT), params=params)])
    assert engine.stats["steps"] == 0 and engine.tree.num_nodes == 0


def test_the_fields_through_llm_generate(model, tmp_path):
    """LLM.generate passes every new field through to the batch (its outputs equal generate_batch's), and refuses
    best_of by name as vLLM v1 does (a ValueError, not a TypeError)."""
    from treedec import LLM
    tok = ByteTokenizer()
    llm = LLM(model, tok, kv_tokens=1024, page_size=4, backend="torch")
    fields = [dict(min_tokens=3, stop_token_ids=[87]), dict(logit_bias={5: 3.0}), dict(allowed_token_ids=[5, 9, 68]),
              dict(bad_words=["DW"]), dict(truncate_prompt_tokens=5), dict(detokenize=False)]
    for f in fields:
        params = SamplingParams(temperature=0, max_tokens=6, **f)
        [out] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        [want] = run(model, params, tokenizer=tok)
        assert out.outputs[0].token_ids == want.output_ids and out.prompt_token_ids == want.prompt_ids, f
        assert (out.outputs[0].text is None) == (f.get("detokenize") is False)
    with pytest.raises(ValueError, match="best_of=3 is not supported"):   # (on construction, before any run)
        SamplingParams(best_of=3)
