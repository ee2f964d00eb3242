"""Structured outputs offline, through LLM.generate and the batch functions: JSON-schema outputs parse and validate,
regex / choice / grammar outputs match, batched == alone and pipelined == at once (the read-back a step late), rows
without a grammar unchanged beside rows with one, greedy speculative + grammar == greedy + grammar (tokens equal),
drafts the grammar rejects pruned before verification. The tiny random Llama with the small local tokenizer."""
import json
import random
import re

import pytest
import torch

from tests.engines import tiny_model
from tests.sampling.schemas import SCHEMAS, check_schema
from tests.tokenizers_local import build_tokenizer
from treedec import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from treedec.models.text import load_tokenizer
from treedec.programs.generate import generate_batch
from treedec.programs.speculative import PromptLookupDraft, speculative_batch
from treedec.programs.speculative.acceptance import RejectionSampling
from treedec.programs.speculative.grammar_filter import DraftFilter
from treedec.runtime import RequestSpec
from treedec.runtime.request import pages_in_use
from treedec.tree.token_tree import TokenTree

pytest.importorskip("xgrammar")

PROMPTS = ["The quick brown fox", "Hello world! hello there, stop; STOP and the end.", "café crème"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def llm(tokenizer):
    return LLM(tiny_model(), tokenizer, kv_tokens=8192, page_size=4, backend="torch")


def json_so(schema):
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def texts(outs):
    return [[(c.text, c.finish_reason, list(c.token_ids)) for c in o.outputs] for o in outs]


def test_json_schemas_validate_batched_equals_alone_and_plain_rows_unchanged(llm):
    params = [SamplingParams(temperature=1.0, seed=k, max_tokens=120, structured_outputs=json_so(s))
              for k, s in enumerate(SCHEMAS)]
    plain = SamplingParams(temperature=0.8, seed=99, max_tokens=12)
    batch = llm.generate(PROMPTS[:2] * 4 + [PROMPTS[2]], params + [plain], use_tqdm=False)
    for out, schema in zip(batch, SCHEMAS):
        [c] = out.outputs
        assert c.finish_reason == "stop", c.text
        check_schema(json.loads(c.text), schema)
    alone = [llm.generate(p, q, use_tqdm=False)[0] for p, q in zip(PROMPTS[:2] * 4 + [PROMPTS[2]], params + [plain])]
    assert texts(batch) == texts(alone)
    assert pages_in_use(llm.engine.pool) == 0


@pytest.mark.parametrize("so, valid", [
    (StructuredOutputsParams(regex=r"[0-9]{2,4}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{2,4}-[a-z]{2}", t)),
    (StructuredOutputsParams(choice=["yes", "no", "café au lait"]), lambda t: t in ("yes", "no", "café au lait")),
    (StructuredOutputsParams(grammar='root ::= ("up" | "down") " " [0-9]'), lambda t: re.fullmatch(r"(up|down) \d", t)),
    (StructuredOutputsParams(json_object=True, disable_any_whitespace=True), lambda t: t.startswith("{")),
], ids=["regex", "choice", "grammar", "json_object"])
def test_regex_choice_grammar_outputs_match_n_outputs_each_their_own_state(llm, so, valid):
    [out] = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.2, seed=7, max_tokens=60,
                                                    structured_outputs=so), use_tqdm=False)
    for c in out.outputs:
        if so.json_object and c.finish_reason == "length":   # (any object: a random model's strings run on)
            assert c.text.startswith("{")
            continue
        assert c.finish_reason == "stop" and valid(c.text), c.text
        if so.json_object:
            assert isinstance(json.loads(c.text), dict)


def test_pipelined_equals_at_once(llm):
    """On a GPU the draws are read back a step late: each lane's matcher is advanced at the read-back, before its
    next draw is masked (the same tokens as reading at once)."""
    specs = [RequestSpec(k, prompt=p, params=SamplingParams(temperature=1.0, seed=k, max_tokens=100,
                                                            structured_outputs=json_so(SCHEMAS[k % 4])))
             for k, p in enumerate(PROMPTS * 2)] + [RequestSpec("plain", prompt=PROMPTS[0],
                                                                params=SamplingParams(max_tokens=9, seed=1))]
    runs = [generate_batch(llm.engine, specs, llm.tokenizer, grammars=llm.grammars, pipeline=p)[0]
            for p in (False, True)]
    assert [(r.id, r.output_ids, r.stop_reason) for r in runs[0]] == \
        [(r.id, r.output_ids, r.stop_reason) for r in runs[1]]


def test_ignore_eos_ends_at_the_grammar_s_end(llm):
    [out] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                    structured_outputs=StructuredOutputsParams(choice=["ok"])),
                         use_tqdm=False)
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("ok", "stop")


REPEAT = "ab12 ab12 ab12 ab12 ab12 ab12 ab12 ab12 Hello world! hello there, stop"


@pytest.mark.parametrize("so", [json_so(SCHEMAS[0]), json_so(SCHEMAS[2]),
                                StructuredOutputsParams(regex=r"(ab12 ){2,9}x"),
                                StructuredOutputsParams(choice=["ab12 ab12 ab", "hello there"])],
                         ids=["json-object", "json-nested", "regex", "choice"])
def test_greedy_speculative_with_grammar_equals_greedy_with_grammar(llm, so):
    specs = [RequestSpec(k, prompt=p, params=SamplingParams(temperature=0, max_tokens=80, structured_outputs=so))
             for k, p in enumerate([REPEAT, PROMPTS[0]])]
    plain, _ = generate_batch(llm.engine, specs, llm.tokenizer, grammars=llm.grammars)
    fast, _ = speculative_batch(llm.engine, specs, lambda spec: PromptLookupDraft(num_draft_tokens=6), llm.tokenizer,
                                grammars=llm.grammars)
    assert [(r.output_ids, r.stop_reason) for r in plain] == [(r.output_ids, r.stop_reason) for r in fast]
    assert all(r.stop_reason == "eos" for r in fast)
    assert pages_in_use(llm.engine.pool) == 0


def test_speculative_drafts_the_grammar_rejects_are_pruned_and_accepted_ones_kept(llm, tokenizer):
    """A prompt-lookup draft copies the prompt's 'ab12 ab12 ...'; under a regex that allows three of them, the
    drafts are accepted up to there (accepted > 0), and a proposal's drafts past it are pruned with their subtrees
    before verification (the draft filter on a tree of two branches)."""
    so = StructuredOutputsParams(regex=r"(ab12 ){3}y")
    spec = RequestSpec(0, prompt=REPEAT, params=SamplingParams(temperature=0, max_tokens=40, structured_outputs=so))
    [fast], _ = speculative_batch(llm.engine, [spec], lambda s: PromptLookupDraft(num_draft_tokens=8), llm.tokenizer,
                                  grammars=llm.grammars)
    assert fast.text == "ab12 ab12 ab12 y" and sum(fast.stats["accepted"]) > 0

    grammar = llm.grammars.compile(so)
    f = DraftFilter(grammar, llm.engine.device, grammar.stop_token_ids)
    said = tokenizer.encode("ab12 ab12 ", add_special_tokens=False)
    f.advance(said)
    chain = tokenizer.encode("ab12 ab12 ", add_special_tokens=False)   # the second 'ab12 ' breaks the regex
    other = tokenizer.encode("y", add_special_tokens=False)             # 'y' after two is not allowed either
    tokens = [said[-1]] + chain + other
    parents = [-1] + list(range(len(chain))) + [0]
    tree, kept, _ = f.prune(TokenTree(parents), tokens, None)
    first = len(tokenizer.encode("ab12 ", add_special_tokens=False))
    assert kept == tokens[:1 + first] and tree.parents == tuple(range(-1, first))


def test_speculative_sampled_with_grammar_is_refused(llm):
    spec = RequestSpec(0, prompt=PROMPTS[0], params=SamplingParams(
        temperature=0.7, seed=1, structured_outputs=StructuredOutputsParams(choice=["a"])))
    with pytest.raises(ValueError, match="greedy"):
        speculative_batch(llm.engine, [spec], lambda s: PromptLookupDraft(), llm.tokenizer,
                          acceptance=lambda s: RejectionSampling(0.7, seed=1), grammars=llm.grammars)
    assert pages_in_use(llm.engine.pool) == 0


def test_beam_search_branches_carry_their_own_grammar_state(llm):
    """Each beam its own matcher (forked where a beam branches): with a choice of four, the three hypotheses are three
    distinct choices, each ended by EOS; with a regex every hypothesis matches it."""
    choices = ["yes", "no", "maybe", "café"]
    [out] = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=20, structured_outputs={
        "choice": choices}))
    got = [s.text[len(PROMPTS[0]):] for s in out.sequences]
    assert len(set(got)) == 3 and set(got) <= set(choices), got
    [out] = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=4, max_tokens=20, structured_outputs={
        "regex": r"[0-9]{2}-[a-z]{1,3}"}))
    assert all(re.fullmatch(r"[0-9]{2}-[a-z]{1,3}", s.text[len(PROMPTS[1]):]) for s in out.sequences)
    assert pages_in_use(llm.engine.pool) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_pipelined_graphed_outputs_are_valid_and_speculative_equals_plain(tokenizer):
    """On a GPU (bf16, CUDA graphs, the draws read back a step late): JSON outputs valid, the same tokens as the
    unpipelined run, and greedy speculative + grammar == greedy + grammar."""
    from treedec.models import from_config
    gpu = LLM(from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda"), tokenizer, kv_tokens=8192)
    specs = [RequestSpec(k, prompt=p, params=SamplingParams(temperature=0 if k % 2 else 1.0, seed=k, max_tokens=120,
                                                            structured_outputs=json_so(SCHEMAS[k % len(SCHEMAS)])))
             for k, p in enumerate(PROMPTS * 4)]
    runs = [generate_batch(gpu.engine, specs, tokenizer, grammars=gpu.grammars, pipeline=p)[0] for p in (True, False)]
    assert [r.output_ids for r in runs[0]] == [r.output_ids for r in runs[1]]
    for r, spec in zip(runs[0], specs):
        assert r.stop_reason == "eos", r.text
        check_schema(json.loads(r.text), json.loads(spec.params.structured_outputs.json))
    greedy = [s for s in specs if s.params.temperature == 0]
    fast, _ = speculative_batch(gpu.engine, greedy, lambda s: PromptLookupDraft(), tokenizer, grammars=gpu.grammars)
    assert [r.output_ids for r in fast] == [r.output_ids for r in runs[0] if r.id in {s.id for s in greedy}]


@pytest.mark.slow
def test_a_thousand_json_schema_requests_are_all_valid(llm):
    """1000 requests, random schemas of the fixed set, sampled, batched: every output is valid JSON of its schema
    (the tiny random model: its bounded schemas end; the real SmolLM2's run is in bench/README.md)."""
    rng = random.Random(0)
    chosen = [rng.randrange(len(SCHEMAS)) for _ in range(1000)]
    params = [SamplingParams(temperature=1.0, seed=k, max_tokens=160, structured_outputs=json_so(SCHEMAS[i]))
              for k, i in enumerate(chosen)]
    outs = llm.generate([PROMPTS[k % 3] for k in range(1000)], params, use_tqdm=False)
    for out, i in zip(outs, chosen):
        [c] = out.outputs
        assert c.finish_reason == "stop", (i, c.text)
        check_schema(json.loads(c.text), SCHEMAS[i])
