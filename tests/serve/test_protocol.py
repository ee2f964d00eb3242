"""The server's sampling fields (treedec.serve.protocol) through the official openai client on the loopback: OpenAI's
logit_bias and vLLM's extra fields (min_tokens, bad_words, allowed_token_ids, skip_special_tokens,
spaces_between_special_tokens, truncate_prompt_tokens) give LLM.generate's outputs for the same parameters; bounded
stop strings and degenerate sampling values are refused with 400 naming the field, or run as vLLM runs them
(issue #48). The tiny random Llama on the CPU with a small local tokenizer."""
import time

import openai
import pytest

from tests.engines import tiny_model
from tests.tokenizers_local import build_tokenizer
from treedec import LLM, SamplingParams
from treedec.models.text import load_tokenizer
from treedec.serve.protocol import MAX_STOP_STRINGS, CompletionRequest, ServeError

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


def make_llm(tokenizer):
    return LLM(tiny_model(), tokenizer, kv_tokens=4096, page_size=4, backend="torch")


@pytest.fixture(scope="module")
def reference(tokenizer):
    return make_llm(tokenizer)


def served(client, **fields):
    """The completion's (text, token ids) with ``fields`` (OpenAI's as arguments, vLLM's in extra_body)."""
    openai_fields = {k: fields.pop(k) for k in ("logit_bias", "stop", "temperature", "top_p", "presence_penalty")
                     if k in fields}
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=fields.pop("max_tokens", 8),
                                    **openai_fields, extra_body={"return_token_ids": True, **fields})
    [choice] = got.choices
    return choice.text, choice.token_ids


def generated(reference, **fields):
    [out] = reference.generate(PROMPT, SamplingParams(**{"max_tokens": 8, **fields}), use_tqdm=False)
    [c] = out.outputs
    return c.text, c.token_ids


def greedy_ids(reference):
    return generated(reference, temperature=0.0)[1]


@pytest.mark.parametrize("fields", [
    dict(logit_bias={"5": 100}),
    dict(logit_bias={"5": -100, "40": 7.5}),
    dict(min_tokens=6),
    dict(allowed_token_ids=[40, 41, 42, 2]),
    dict(bad_words=["`", "quick"]),
    dict(skip_special_tokens=False, logit_bias={"2": 100}),
    dict(spaces_between_special_tokens=False, skip_special_tokens=False, logit_bias={"2": 50}),
    dict(truncate_prompt_tokens=2),
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_sampling_fields_equal_llm_generate(server, client, reference, fields):
    bias = fields.get("logit_bias")
    params = {**fields, **({"logit_bias": {int(k): v for k, v in bias.items()}} if bias else {})}
    want = generated(reference, temperature=0.0, **params)
    assert served(client, temperature=0.0, **fields) == want
    assert want[1] != greedy_ids(reference) or fields.get("min_tokens")   # (the field changed the output)


def test_the_fields_change_what_they_say(client, reference):
    text, token_ids = served(client, temperature=0.0, logit_bias={"5": 100})
    assert token_ids == [5] * 8
    _, allowed = served(client, temperature=0.0, allowed_token_ids=[40, 41, 42])
    assert set(allowed) <= {40, 41, 42}
    text, _ = served(client, temperature=0.0, skip_special_tokens=False, logit_bias={"2": 100})
    assert text == "</s>" * 8


@pytest.mark.parametrize("fields, param, message", [
    (dict(stop=["a", "b", "c", "d", "e"]), "stop", f"stop must hold at most {MAX_STOP_STRINGS} strings, got 5"),
    (dict(stop=["x" * 10**6]), "stop", "stop[0] must be at most 1024 characters, got 1000000"),
    (dict(temperature=1e308), "temperature", "temperature must be a number in [0, 3.4028235e+38]"),
    (dict(presence_penalty=1e308), "presence_penalty", "presence_penalty must be a number in [-2, 2]"),
    (dict(repetition_penalty=1e-300), "repetition_penalty", "repetition_penalty must be a number in"),
    (dict(logit_bias={"5": 1000}), "logit_bias", "logit_bias[5] must be a number in [-100, 100]"),
    (dict(logit_bias={"five": 1}), "logit_bias", "logit_bias keys must be token ids"),
    (dict(logit_bias={"100000": 1}), None, "logit_bias must hold token ids in [0, 512)"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "allowed_token_ids must be None"),
    (dict(min_tokens=9), "min_tokens", "min_tokens must be at most max_tokens (8), got 9"),
    (dict(bad_words=[""]), "bad_words", "bad_words must be non-empty strings"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens", "truncate_prompt_tokens must be None, -1"),
])
def test_bad_sampling_fields_are_400_naming_the_field(server, client, fields, param, message):
    fields = dict(fields)   # (the case's own: it runs once per engine mode)
    start = time.perf_counter()
    extra = {k: fields.pop(k) for k in ("repetition_penalty", "allowed_token_ids", "min_tokens", "bad_words",
                                        "truncate_prompt_tokens") if k in fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, **fields, extra_body=extra)
    error = e.value.body
    assert message in error["message"] and error["param"] == param
    assert time.perf_counter() - start < 5
    assert server.pages().held_pages == 0


@pytest.mark.parametrize("fields", [dict(temperature=1e-45), dict(temperature=5e-324),
                                    dict(temperature=0.7, top_p=1e-300, seed=3)])
def test_degenerate_sampling_values_run_as_vllm_runs_them(client, reference, fields):
    """Below vLLM's _SAMPLING_EPS a request is greedy; a top_p that is 0 in float32 keeps the most likely token
    (before: a NaN CDF, and an id == vocab that failed the request, or every request of the step)."""
    assert served(client, **fields)[1] == greedy_ids(reference)


def test_logit_bias_and_best_of_as_the_protocol_reads_them():
    body = CompletionRequest(model="m", prompt="x", logit_bias={"7": -100.0, "8": 2})
    assert dict(body.sampling_params(4).logit_bias) == {7: -100.0, 8: 2.0}
    with pytest.raises(ServeError, match="best_of must equal n"):
        CompletionRequest(model="m", prompt="x", best_of=3).sampling_params(4)
    assert body.sampling_params(4).truncated([1, 2, 3], 10) == [1, 2, 3]
    cut = CompletionRequest(model="m", prompt="x", truncate_prompt_tokens=-1)
    assert cut.sampling_params(4).truncated([1, 2, 3], 2) == [2, 3]
