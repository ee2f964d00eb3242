"""Structured outputs through the openai client against the server: response_format (json_object, json_schema),
vLLM's guided_* fields and structured_outputs, on /v1/completions and /v1/chat/completions; outputs valid and equal
to the offline LLM's with the same constraint; bad or oversized constraints refused with 400 naming the field,
failing only that request. The tiny random Llama with the small local tokenizer (its bounded schemas end)."""
import json
import re

import openai
import pytest

from tests.sampling.schemas import SCHEMAS, check_schema
from tests.serve.server import RunningServer, free_again, make_llm
from treedec import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")

PROMPT = "The quick brown fox"
GREEDY = dict(max_tokens=80, temperature=0.0)


def offline(reference, so, chat=False, **case):
    params = SamplingParams(**{**GREEDY, **case}, structured_outputs=so)
    [out] = (reference.chat([{"role": "user", "content": PROMPT}], params, use_tqdm=False) if chat
             else reference.generate(PROMPT, params, use_tqdm=False))
    return [(o.text, o.finish_reason) for o in out.outputs]


@pytest.mark.parametrize("schema", SCHEMAS[:3], ids=["object", "array", "nested"])
def test_json_schema_response_format_is_valid_and_equals_offline(client, reference, schema):
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    got = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], **GREEDY,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    text = got.choices[0].message.content
    check_schema(json.loads(text), schema)
    assert got.choices[0].finish_reason == "stop"
    assert [(text, "stop")] == offline(reference, so, chat=True)


def test_response_format_json_schema_and_json_object(client):
    schema = SCHEMAS[0]
    got = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=200, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    content = got.choices[0].message.content
    if got.choices[0].finish_reason == "stop":   # (any whitespace: a random model may spend its budget on it)
        check_schema(json.loads(content), schema)
    else:
        assert content.lstrip().startswith("{")
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0.0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert got.choices[0].text.lstrip().startswith("{")


def test_guided_regex_choice_grammar_on_completions_streamed_too(client, reference):
    cases = [({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             ({"guided_choice": ["yes", "no way", "maybe"]}, lambda t: t in ("yes", "no way", "maybe")),
             ({"guided_grammar": 'root ::= "a" [0-9] [0-9]? "!"'}, lambda t: re.fullmatch(r"a[0-9]{1,2}!", t))]
    for extra, valid in cases:
        (name, value), = extra.items()
        want = offline(reference, StructuredOutputsParams(**{name.removeprefix("guided_"): value}),
                       temperature=0.9, seed=4, n=2)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=80, temperature=0.9, seed=4, n=2,
                                        extra_body=extra)
        texts = [(c.text, c.finish_reason) for c in sorted(got.choices, key=lambda c: c.index)]
        assert texts == want and all(valid(t) and r == "stop" for t, r in texts), (extra, texts)
        streamed = {}
        for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=80, temperature=0.9,
                                               seed=4, n=2, stream=True, extra_body=extra):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        assert [streamed[i] for i in range(2)] == [t for t, _ in want]


@pytest.mark.parametrize("extra, param", [
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["x"] * 257}, "guided_choice"),
    ({"guided_regex": "a" * 5000}, "guided_regex"),
    ({"guided_json": {"type": "object", "description": "x" * 40000}}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
])
def test_bad_constraints_are_refused_and_change_nothing(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param, error
    assert "/project/" not in error["message"] and ".cc:" not in error["message"]   # (no paths of the engine)
    assert free_again(server) == 0
    ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.0)
    assert ok.choices[0].finish_reason == "length"


def test_a_speculative_server_gives_the_plain_server_s_structured_outputs(client, tokenizer):
    """Greedy, through a server decoding speculatively (n-gram drafts pruned by the grammar): the same choices as
    the plain server's; sampled requests with a grammar are refused there (greedy acceptance only)."""
    fast = RunningServer(make_llm(tokenizer, speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
                         "tiny")
    try:
        with openai.OpenAI(base_url=fast.base_url, api_key="none", max_retries=0, timeout=60) as spec_client:
            for extra in ({"guided_regex": r"(ab12 ){2,5}x"},
                          {"structured_outputs": {"json": SCHEMAS[0], "disable_any_whitespace": True}}):
                kwargs = dict(model="tiny", prompt="ab12 ab12 ab12 ab12 ab12", max_tokens=60, temperature=0.0,
                              extra_body=extra)
                want = client.completions.create(**kwargs).choices[0]
                got = spec_client.completions.create(**kwargs).choices[0]
                assert (got.text, got.finish_reason) == (want.text, want.finish_reason) and want.finish_reason == "stop"
            with pytest.raises(openai.BadRequestError, match="greedy"):
                spec_client.completions.create(model="tiny", prompt="ab", max_tokens=5, temperature=0.8,
                                               extra_body={"guided_choice": ["a", "b"]})
    finally:
        fast.stop()
