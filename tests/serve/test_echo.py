"""``echo`` and ``prompt_logprobs`` on the server (vLLM's), through the official openai client on the loopback:
equal to the offline LLM's prompt_logprobs, whole and streamed, errors naming the field."""
import openai
import pytest

from treedec import SamplingParams

PROMPT = "The quick brown fox"


def offline(reference, prompt=PROMPT, **params):
    [out] = reference.generate(prompt, SamplingParams(**{"max_tokens": 6, "temperature": 0.0, **params}),
                               use_tqdm=False)
    return out


def test_echo_puts_the_prompt_s_text_first_whole_and_streamed(client, reference, tokenizer):
    want = offline(reference).outputs[0].text
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, n=2)
    assert [c.text for c in got.choices] == [PROMPT + want] * 2
    chunks = [c for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                                       echo=True, stream=True) for c in chunk.choices]
    assert chunks[0].text == PROMPT and "".join(c.text for c in chunks) == PROMPT + want
    ids = tokenizer.encode(PROMPT)   # (token ids: their text, special tokens skipped as the output's are)
    as_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert as_ids.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True) + want


def test_echo_with_logprobs_gives_the_prompt_s_logprobs_first(client, reference, tokenizer):
    out = offline(reference, logprobs=2, prompt_logprobs=2)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2)
    lp = got.choices[0].logprobs
    prompt_ids, count = out.prompt_token_ids, len(out.prompt_token_ids)
    assert lp.tokens[:count] == [tokenizer.decode([t]) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:count] == pytest.approx(
        [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt_ids[1:])], abs=1e-5)
    assert lp.token_logprobs[count:] == pytest.approx(
        [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)], abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and len(lp.tokens) == count + len(out.outputs[0].token_ids)


def test_prompt_logprobs_equal_the_offline_llm_s(client, reference, tokenizer):
    out = offline(reference, prompt_logprobs=3)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"prompt_logprobs": 3})
    entries = got.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(out.prompt_token_ids)
    for entry, want, token in zip(entries[1:], out.prompt_logprobs[1:], out.prompt_token_ids[1:]):
        assert set(entry) == {str(t) for t in want} and str(token) in entry
        assert entry[str(token)]["logprob"] == pytest.approx(want[token].logprob, abs=1e-5)
        assert entry[str(token)]["rank"] == want[token].rank
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 1})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert "prompt_logprobs" not in chat.choices[0].model_extra


@pytest.mark.parametrize("call, param, message", [
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs", r"prompt_logprobs must be in \[0, 20\], got 21"),
    (dict(extra_body={"prompt_logprobs": 1}, stream=True), "prompt_logprobs", "not supported with stream=true"),
    (dict(echo=True, logprobs=1, stream=True), "logprobs", "not supported with stream=true"),
])
def test_bad_echo_and_prompt_logprobs_requests(client, call, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, **call)
    assert info.value.response.json()["error"]["param"] == param


def test_use_beam_search_gives_the_offline_beam_search_s_hypotheses_best_first(client, server, reference,
                                                                              tokenizer):
    from treedec import BeamSearchParams
    from tests.serve.server import free_again
    offline(reference)   # (a generate call restricts the engine to the tokenizer's 400 ids, as the server's is)
    [want] = reference.beam_search({"prompt": PROMPT}, BeamSearchParams(beam_width=3, max_tokens=6))
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3,
                                    extra_body={"use_beam_search": True, "return_token_ids": True})
    prompt_ids = got.choices[0].model_extra["prompt_token_ids"]
    assert [prompt_ids + c.model_extra["token_ids"] for c in got.choices] == [s.tokens for s in want.sequences]
    assert [c.index for c in got.choices] == [0, 1, 2]
    for choice, sequence in zip(got.choices, want.sequences):
        assert choice.finish_reason == sequence.finish_reason
        assert choice.text == tokenizer.decode(sequence.tokens, skip_special_tokens=True)[len(
            tokenizer.decode(prompt_ids, skip_special_tokens=True)):]
    assert got.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in got.choices)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          n=2, extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert len(chat.choices) == 2
    assert free_again(server) == 0


@pytest.mark.parametrize("call, param, message", [
    (dict(stream=True), "stream", "use_beam_search cannot be streamed"),
    (dict(temperature=0.7), "temperature", "use_beam_search takes temperature 0 only"),
    (dict(stop=["x"]), "stop", "stop is not supported with use_beam_search"),
    (dict(logprobs=1), "logprobs", "logprobs is not supported with use_beam_search"),
    (dict(seed=3), "seed", "seed is not supported with use_beam_search"),
])
def test_what_a_beam_search_does_not_take_is_refused_by_name(client, call, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, extra_body={"use_beam_search": True},
                                  **call)
    assert info.value.response.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError, match="length_penalty is a beam search's: it needs use_beam_search"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"length_penalty": 0.5})
