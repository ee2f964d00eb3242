"""vLLM's streaming, stop and token-id behaviours through the official openai client against the server on the
loopback: the chunk that ends a choice carries its last text; with n > 1 each choice ends in its own chunk when it
ends; ``continuous_usage_stats``; a stop token's text left out; chat's ``prompt_token_ids`` at the top level; int64
seeds; out-of-vocabulary prompt ids named."""
import openai
import pytest

from tests.serve.server import RunningServer, llm_recipe
from treedec import SamplingParams

PROMPT = "The quick brown fox"


def reference_outputs(reference, **params):
    [out] = reference.generate(PROMPT, SamplingParams(**params), use_tqdm=False)
    return out.outputs


def test_the_chunk_that_ends_a_choice_carries_its_last_text(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = [c for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True})
              for c in chunk.choices]
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    assert [c.finish_reason for c in chunks].count("length") == 1 and chunks[-1].finish_reason == "length"
    assert chunks[-1].text != ""   # (not an empty chunk after the text)
    messages = [{"role": "user", "content": PROMPT}]
    deltas = [c for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}) for c in chunk.choices]
    assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == "length" and deltas[-1].delta.content


def test_each_of_n_choices_ends_in_its_own_chunk_when_it_ends(client, reference):
    """A seed whose n=4 outputs end at different lengths (stop string "e"): every chunk holds one choice, each
    choice's finish comes once, with its last text, and a short choice's finish comes before a longer one's last
    text (not all at once at the end)."""
    case = dict(max_tokens=24, temperature=1.0, n=4, stop=["e"])
    seed = next(s for s in range(100) if len({len(o.token_ids) for o in reference_outputs(
        reference, **case, seed=s)}) > 1)
    want = reference_outputs(reference, **case, seed=seed)
    chunks = [c for chunk in client.completions.create(model="tiny", prompt=PROMPT, seed=seed, stream=True,
                                                       **{**case, "stop": case["stop"]}) for c in chunk.choices]
    texts = {i: "".join(c.text for c in chunks if c.index == i) for i in range(4)}
    assert [texts[i] for i in range(4)] == [o.text for o in want]
    ends = [k for k, c in enumerate(chunks) if c.finish_reason is not None]
    assert sorted(chunks[k].index for k in ends) == [0, 1, 2, 3]
    assert all(chunks[k].finish_reason == want[chunks[k].index].finish_reason for k in ends)
    assert all(not any(c.index == chunks[k].index for c in chunks[k + 1:]) for k in ends)   # its end is its last
    shortest = min(range(4), key=lambda i: len(want[i].token_ids))
    longest = max(range(4), key=lambda i: len(want[i].token_ids))
    end_of_shortest = next(k for k in ends if chunks[k].index == shortest)
    assert any(c.index == longest for c in chunks[end_of_shortest + 1:])


def test_continuous_usage_stats_gives_every_chunk_its_usage(client, reference):
    case = dict(max_tokens=10, temperature=0.0)
    [want] = reference_outputs(reference, **case, ignore_eos=True)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **case,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    assert all(chunk.usage is not None for chunk in chunks)
    running = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
    assert running == sorted(running) and running[-1] == len(want.token_ids) and running[0] >= 1
    assert all(chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
               for chunk in chunks)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(want.token_ids)
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, temperature=0, stream=True,
                                               stream_options={"include_usage": True,
                                                               "continuous_usage_stats": True}))
    assert chat[0].usage.completion_tokens == 0 and all(chunk.usage is not None for chunk in chat)
    with pytest.raises(openai.BadRequestError, match="continuous_usage_stats needs stream_options.include_usage"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stream=True,
                                  stream_options={"continuous_usage_stats": True})


def test_a_stop_token_s_text_is_left_out_unless_include_stop_str_in_output(client, reference, tokenizer):
    greedy = reference_outputs(reference, max_tokens=12, temperature=0.0, ignore_eos=True)[0].token_ids
    stop = next(t for t in greedy[2:] if tokenizer.decode([t]))   # a token with a text of its own
    cut = greedy.index(stop) + 1
    for include in (False, True):
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [stop],
                                                    "include_stop_str_in_output": include,
                                                    "return_token_ids": True})
        [choice] = got.choices
        assert choice.finish_reason == "stop" and choice.model_extra["token_ids"] == greedy[:cut]
        prompt_ids = choice.model_extra["prompt_token_ids"]
        shown = greedy[:cut] if include else greedy[:cut - 1]
        assert choice.text == tokenizer.decode(prompt_ids + shown)[len(tokenizer.decode(prompt_ids)):]
        streamed = "".join(c.text for chunk in client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "stop_token_ids": [stop], "include_stop_str_in_output": include})
            for c in chunk.choices)
        assert streamed == choice.text


def test_chat_return_token_ids_puts_the_prompt_s_ids_at_the_top_level(client, tokenizer):
    messages = [{"role": "user", "content": "Tell me about rivers"}]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, n=2,
                                         extra_body={"return_token_ids": True})
    prompt_ids = got.model_extra["prompt_token_ids"]
    assert len(prompt_ids) == got.usage.prompt_tokens
    for choice in got.choices:
        assert "prompt_token_ids" not in choice.model_extra and len(choice.model_extra["token_ids"]) >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    ends = [c for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert len(ends) == 1 and ends[0].model_extra["token_ids"] == got.choices[0].model_extra["token_ids"]
    assert "prompt_token_ids" not in ends[0].model_extra


@pytest.mark.parametrize("seed", [-1, -5, -2**63])
def test_a_negative_seed_is_taken_and_reproducible(client, reference, seed):
    case = dict(max_tokens=8, temperature=1.0)
    want = reference_outputs(reference, **case, seed=seed)[0].text
    got = [client.completions.create(model="tiny", prompt=PROMPT, seed=seed, **case).choices[0].text
           for _ in range(2)]
    assert got == [want, want]
    with pytest.raises(openai.BadRequestError, match=r"seed must be an int in \[-2\*\*63, 2\*\*63\)"):
        client.completions.create(model="tiny", prompt=PROMPT, seed=-2**63 - 1, **case)


def test_an_out_of_vocabulary_prompt_id_is_named(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5, 600, 7], max_tokens=2)
    error = info.value.response.json()["error"]
    assert error["param"] == "prompt" and "token id 600 is out of vocabulary" in error["message"] and \
        "vocabulary has 512 tokens" in error["message"]


def test_a_speculative_server_gives_continuous_usage_stats(tokenizer, reference):
    """A speculative request's chunks carry their usage too (its tokens so far, growing by each step's accepted)."""
    running = RunningServer(llm_recipe(tokenizer, kv_tokens=1024, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2}), "s")
    try:
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60) as client:
            [want] = reference_outputs(reference, max_tokens=10, temperature=0.0, ignore_eos=True)
            chunks = list(client.completions.create(model="s", prompt=PROMPT, max_tokens=10, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True},
                                                    stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True}))
            assert "".join(c.text for chunk in chunks for c in chunk.choices) == want.text
            running_tokens = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
            assert running_tokens == sorted(running_tokens) and running_tokens[0] >= 1
            assert running_tokens[-1] == chunks[-1].usage.completion_tokens == len(want.token_ids)
            chunks = [c for chunk in client.completions.create(model="s", prompt=PROMPT, max_tokens=6, temperature=0,
                                                               stream=True, extra_body={"ignore_eos": True})
                      for c in chunk.choices]
            assert chunks[-1].finish_reason == "length" and [c.finish_reason for c in chunks].count("length") == 1
            with pytest.raises(openai.BadRequestError, match="use_beam_search runs on a server without speculative"):
                client.completions.create(model="s", prompt=PROMPT, max_tokens=2, n=2,
                                          extra_body={"use_beam_search": True})
            with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):   # (refused by name)
                client.completions.create(model="s", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 1})
            sampled = client.completions.create(model="s", prompt=PROMPT, max_tokens=6, temperature=0.9, seed=-3)
            again = client.completions.create(model="s", prompt=PROMPT, max_tokens=6, temperature=0.9, seed=-3)
            assert sampled.choices[0].text == again.choices[0].text
    finally:
        running.stop()
