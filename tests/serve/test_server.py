"""`treedec serve`'s app driven by the official openai client over the loopback: outputs equal LLM.generate / LLM.chat
for the same requests and seeds, streamed equals whole, OpenAI-style errors, a disconnect frees the request's pages,
/metrics counts what was served. The tiny random Llama on the CPU with a small local tokenizer."""
import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.server import RunningServer, free_again, llm_recipe, make_llm, wait_until
from treedec import LLM, SamplingParams


PROMPTS = ["The quick brown fox", "Hello world! hello there"]
CASES = [dict(max_tokens=12, temperature=0.0),
         dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, n=2),
         dict(max_tokens=9, temperature=1.0, top_k=20, seed=11, stop=["e"]),
         dict(max_tokens=8, temperature=0.7, seed=3, presence_penalty=0.5, repetition_penalty=1.2)]


EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")   # vLLM's, not OpenAI's


def api(**case):
    """The client's keyword arguments: vLLM's sampling extensions go in ``extra_body``."""
    extra = {k: case.pop(k) for k in EXTENSIONS if k in case}
    return {**case, "extra_body": {**case.pop("extra_body", {}), **extra}} if extra else case


def expected(reference, prompt, case, chat=False):
    params = SamplingParams(**{("stop" if k == "stop" else k): (tuple(v) if k == "stop" else v)
                               for k, v in case.items()})
    [out] = (reference.chat([{"role": "user", "content": prompt}], params, use_tqdm=False) if chat
             else reference.generate(prompt, params, use_tqdm=False))
    return [(o.text, o.finish_reason) for o in out.outputs], len(out.prompt_token_ids)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_completions_equal_llm_generate_whole_and_streamed(server, client, reference, case):
    want, prompt_tokens = expected(reference, PROMPTS[0], case)
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], **api(**case))
    assert got.object == "text_completion" and got.model == "tiny" and got.id.startswith("cmpl-")
    assert [(c.text, c.finish_reason) for c in sorted(got.choices, key=lambda c: c.index)] == want
    assert got.usage.prompt_tokens == prompt_tokens
    assert got.usage.completion_tokens >= sum(1 for text, _ in want)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    page = server.online.ready.page_size   # (a prompt sent before is read from the prefix cache: whole pages)
    assert got.usage.prompt_tokens_details.cached_tokens in (0, (prompt_tokens - 1) // page * page)

    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS[0], stream=True,
                                           stream_options={"include_usage": True}, **api(**case)):
        assert chunk.object == "text_completion"
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert [(texts[i], reasons[i]) for i in sorted(texts)] == want
    assert usage.completion_tokens == got.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // page * page   # sent just before


def test_several_prompts_and_token_id_prompts(client, reference, tokenizer):
    case = dict(max_tokens=6, temperature=0.0, n=2)
    got = client.completions.create(model="tiny", prompt=PROMPTS, **case)
    assert sorted(c.index for c in got.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in got.choices}
    for k, prompt in enumerate(PROMPTS):
        want, _ = expected(reference, prompt, case)
        assert [by_index[k * 2 + j] for j in range(2)] == [text for text, _ in want]
    ids = tokenizer.encode(PROMPTS[1])
    as_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert as_ids.choices[0].text == by_index[2]


@pytest.mark.parametrize("case", CASES[:3], ids=["greedy", "seeded-n2", "stop"])
def test_chat_equals_llm_chat_whole_and_streamed(client, reference, case):
    want, prompt_tokens = expected(reference, PROMPTS[1], case, chat=True)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    args = {("max_completion_tokens" if k == "max_tokens" else k): v for k, v in case.items()}
    got = client.chat.completions.create(model="tiny", messages=messages, **api(**args))
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert [(c.message.content, c.finish_reason) for c in got.choices] == want
    assert all(c.message.role == "assistant" for c in got.choices) and got.usage.prompt_tokens == prompt_tokens
    texts, reasons, roles = {}, {}, {}
    for chunk in client.chat.completions.create(model="tiny", messages=messages, stream=True, **api(**args)):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert [(texts[i], reasons[i]) for i in sorted(texts)] == want
    assert set(roles.values()) == {"assistant"} and len(roles) == len(want)


def test_logprobs_equal_llm_generate(client, reference, tokenizer):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    [out] = reference.generate(PROMPTS[0], params, use_tqdm=False)
    want = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want, abs=1e-5)
    assert lp.tokens == [tokenizer.decode([t]) for t in out.outputs[0].token_ids]
    assert all(len(top) >= 1 and max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-5)   # greedy
               for i, top in enumerate(lp.top_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)


@pytest.mark.parametrize("call, status, code", [
    (dict(temperature=-1.0), 400, None),
    (dict(max_tokens=0), 400, None),
    (dict(top_p=1.5), 400, None),
    (dict(n="two"), 400, None),
    (dict(suffix="x"), 400, None),
    (dict(extra_body={"frobnicate": 1}), 400, None),
    (dict(model="gpt-4"), 404, "model_not_found"),
    (dict(prompt="word " * 5000), 400, "context_length_exceeded"),
    (dict(max_tokens=10**6), 400, "context_length_exceeded"),
    (dict(prompt=[600]), 400, None),   # a token id past the vocabulary
], ids=["temperature", "max_tokens", "top_p", "n-type", "suffix", "unknown-field", "model", "long-prompt",
        "long-completion", "token-id"])
def test_errors_are_openai_json_and_change_nothing(client, server, call, status, code):
    before = free_again(server)
    args = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **call}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**api(**args))
    error = info.value
    assert error.status_code == status
    body = error.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"] and "Traceback" not in body["message"]
    assert body["code"] == code
    assert free_again(server) == before == 0


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": 5}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_models_health_unknown_route_and_body_limit(server):
    models = httpx.get(f"{server.base_url}/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 4096
    assert httpx.get(f"{server.url}/health").status_code == 200
    missing = httpx.get(f"{server.url}/v2/nothing")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    big = httpx.post(f"{server.base_url}/completions", content=b"{" + b" " * (33 * 2**20) + b"}",
                     headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    bad_json = httpx.post(f"{server.base_url}/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()


def test_a_client_disconnect_mid_stream_frees_the_pages(server):
    assert free_again(server) == 0
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.base_url}/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            wait_until(lambda: server.stats().num_running == 1)
            assert server.pages().held_pages > 0
    assert free_again(server) == 0   # aborted, not run to its 3000 tokens
    assert server.stats().num_running == 0


def test_a_client_disconnect_while_waiting_for_a_whole_response_frees_the_pages(server):
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, timeout=0.5)
    assert free_again(server, timeout=20) == 0


def metric_values(url):
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_count_the_requests(server, client):
    before = metric_values(server.url)
    assert before[("treedec_batch_invariant", ())] == 0   # (the mode is off)
    ok = ("treedec_requests_total", (("route", "/v1/completions"), ("status", "200")))
    client.completions.create(**api(model="tiny", prompt="hello", max_tokens=5, temperature=0, ignore_eos=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hello", temperature=-2)
    after = metric_values(server.url)
    assert after[ok] == before.get(ok, 0) + 1
    bad = ("treedec_requests_total", (("route", "/v1/completions"), ("status", "400")))
    assert after[bad] == before.get(bad, 0) + 1
    assert after[("treedec_generation_tokens_total", ())] == before[("treedec_generation_tokens_total", ())] + 5
    assert after[("treedec_prompt_tokens_total", ())] > before[("treedec_prompt_tokens_total", ())]
    assert after[("treedec_engine_step_seconds_count", ())] > before[("treedec_engine_step_seconds_count", ())]
    assert after[("treedec_time_to_first_token_seconds_count", ())] == \
        before[("treedec_time_to_first_token_seconds_count", ())] + 1
    stats = server.stats()   # the cache's reads: the scheduler's counts, and their ratio
    assert after[("treedec_scheduler_cached_tokens", ())] == stats.cached_tokens
    assert after[("treedec_scheduler_prompt_tokens", ())] == stats.prompt_tokens > 0
    assert after[("treedec_cache_hit_rate", ())] == pytest.approx(stats.cached_tokens / stats.prompt_tokens)
    cached = ("treedec_cached_prompt_tokens_total", ())
    assert after[cached] >= before.get(cached, 0)
    assert ("treedec_requests_running", ()) in after and ("treedec_requests_waiting", ()) in after
    assert free_again(server) == 0   # (every request ended: the pages not free are the prefix cache's)
    pages = metric_values(server.url)
    assert pages[("treedec_kv_cache_prefix_pages", ())] == server.pages().cache_pages
    assert pages[("treedec_kv_cache_free_pages", ())] + pages[("treedec_kv_cache_prefix_pages", ())] == \
        pages[("treedec_kv_cache_pages", ())], pages


def run_concurrently(server, count, max_tokens, timeout):
    """``count`` streamed completions at once (AsyncOpenAI): each one's text and finish reason."""
    async def one(client, k):
        text, reason = "", None
        stream = await client.completions.create(model="tiny", prompt=PROMPTS[k % 2] + f" {k % 7}",
                                                 max_tokens=max_tokens, temperature=0 if k % 3 else 0.9,
                                                 seed=k, stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return text, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0,
                                      timeout=timeout, http_client=httpx.AsyncClient(
                                          limits=httpx.Limits(max_connections=count))) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, k) for k in range(count))), timeout)
    return asyncio.run(main())


def check_load(server, reference, count, max_tokens, timeout):
    got = run_concurrently(server, count, max_tokens, timeout)
    assert len(got) == count and all(reason in ("stop", "length") for _, reason in got)
    for k in range(0, count, max(1, count // 12)):   # alone: the same request run by the reference LLM
        case = dict(max_tokens=max_tokens, temperature=0.0 if k % 3 else 0.9, seed=k)
        want, _ = expected(reference, PROMPTS[k % 2] + f" {k % 7}", case)
        assert got[k] == want[0], k
    assert free_again(server) == 0


def test_concurrent_streams_lose_nothing_and_free_every_page(server, reference):
    check_load(server, reference, 24, 8, 60)


@pytest.mark.slow
def test_200_concurrent_streams_lose_nothing_and_free_every_page(server, reference):
    check_load(server, reference, 200, 16, 300)


def test_overloaded_server_answers_503(tokenizer):
    """One request holds most of a small pool; the next one waits for admission (its prompt shares no prefix with
    the first's, which the prefix cache would let it read); one more is refused."""
    running = RunningServer(llm_recipe(tokenizer, kv_tokens=320), "tiny", max_queued_requests=1)
    try:
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60) as client:
            holder = client.completions.create(**api(model="tiny", prompt=list(range(3, 103)), max_tokens=150,
                                                     temperature=0, ignore_eos=True, stream=True))
            next(iter(holder))   # admitted and running
            waiting = client.completions.create(model="tiny", prompt=list(range(252, 2, -1)), max_tokens=1,
                                                temperature=0, stream=True)
            wait_until(lambda: running.stats().num_waiting == 1)
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model="tiny", prompt="hello", max_tokens=2)
            assert info.value.status_code == 503 and info.value.response.json()["error"]["code"] == "overloaded"
            holder.close()   # the waiting one is admitted once the holder's pages are freed
            assert [c.finish_reason for chunk in waiting for c in chunk.choices if c.finish_reason] == ["length"]
            with pytest.raises(openai.BadRequestError) as info:   # larger than the whole pool: it fails alone
                client.completions.create(model="tiny", prompt=[5] * 400, max_tokens=1)
            assert info.value.response.json()["error"]["code"] == "kv_cache_exceeded", info.value.response.json()
        assert free_again(running) == 0
    finally:
        running.stop()


def test_speculative_server_equals_plain_greedy_and_refuses_what_it_cannot_do(tokenizer, reference):
    running = RunningServer(llm_recipe(tokenizer, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
                            "s")
    try:
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60) as client:
            prompt = "hello there, hello there, hello there, hello"
            want, _ = expected(reference, prompt, dict(max_tokens=16, temperature=0.0))
            got = client.completions.create(model="s", prompt=prompt, max_tokens=16, temperature=0)
            assert [(c.text, c.finish_reason) for c in got.choices] == want
            streamed = "".join(c.text for chunk in client.completions.create(
                model="s", prompt=prompt, max_tokens=16, temperature=0, stream=True) for c in chunk.choices)
            assert streamed == want[0][0]
            sampled = client.completions.create(model="s", prompt=prompt, max_tokens=8, temperature=0.8, seed=4)
            again = client.completions.create(model="s", prompt=prompt, max_tokens=8, temperature=0.8, seed=4)
            assert sampled.choices[0].text == again.choices[0].text
            penalized = dict(max_tokens=12, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.4)
            want, _ = expected(reference, prompt, {**penalized, "repetition_penalty": 1.2, "logprobs": 2})
            got = client.completions.create(model="s", prompt=prompt, **penalized, logprobs=2,
                                            extra_body={"repetition_penalty": 1.2})
            assert [(c.text, c.finish_reason) for c in got.choices] == want   # (plain greedy's, same penalties)
            [wanted] = reference.generate(prompt, SamplingParams(**penalized, repetition_penalty=1.2, logprobs=2),
                                          use_tqdm=False)
            assert got.choices[0].logprobs.token_logprobs == pytest.approx(
                [e[t].logprob for e, t in zip(wanted.outputs[0].logprobs, wanted.outputs[0].token_ids)], abs=1e-4)
            sampled_min_p = client.completions.create(model="s", prompt=prompt, max_tokens=8, temperature=0.8, seed=4,
                                                      extra_body={"min_p": 0.05})
            assert sampled_min_p.choices[0].text == client.completions.create(
                model="s", prompt=prompt, max_tokens=8, temperature=0.8, seed=4, extra_body={"min_p": 0.05}
            ).choices[0].text
            with pytest.raises(openai.BadRequestError, match="speculative decoding"):
                client.completions.create(model="s", prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"min_tokens": 2})
            with pytest.raises(openai.BadRequestError, match="n=1"):
                client.completions.create(model="s", prompt=prompt, max_tokens=4, temperature=0, n=2)
            values = metric_values(running.url)
            assert values[("treedec_spec_verify_steps_total", ())] > 0
            assert values[("treedec_spec_acceptance_length_count", ())] >= 3
        assert free_again(running) == 0
    finally:
        running.stop()


@pytest.mark.slow
def test_real_smollm2_chat_completion_equals_llm_chat():
    from tests.engines import smollm2_or_skip
    folder = smollm2_or_skip()
    llm = LLM(str(folder), kv_tokens=4096, backend="torch")
    messages = [{"role": "user", "content": "Name three primes."}]
    [want] = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    running = RunningServer(llm, "smollm2")
    try:
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=120) as client:
            got = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        assert got.choices[0].message.content == want.outputs[0].text
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    finally:
        running.stop()


def test_a_conversation_resent_as_token_ids_reads_its_history_from_the_cache(server, client):
    """vLLM's ``return_token_ids`` gives each choice its prompt's and output's ids; a client re-sending the whole
    conversation as ids reads all of the last turn from the prefix cache but its last token (whole pages); a chat
    re-sending its messages reads at least the last turn's prompt."""
    page = server.online.ready.page_size
    history, last = list(range(3, 40)), None
    for turn in range(4):
        got = client.completions.create(model="tiny", prompt=history, max_tokens=9, temperature=0,
                                        extra_body={"return_token_ids": True})
        choice = got.choices[0].model_extra
        assert choice["prompt_token_ids"] == history and len(choice["token_ids"]) == got.usage.completion_tokens
        cached = got.usage.prompt_tokens_details.cached_tokens
        if last is not None:
            assert cached == min((len(last) - 1) // page, (len(history) - 1) // page) * page
        last = history + choice["token_ids"]
        history = last + list(range(100 + turn, 111 + turn))
    streamed = list(client.completions.create(model="tiny", prompt=history, max_tokens=5, temperature=0, stream=True,
                                              extra_body={"return_token_ids": True}))
    ends = [c.model_extra for chunk in streamed for c in chunk.choices if c.finish_reason]
    assert len(ends) == 1 and ends[0]["prompt_token_ids"] == history and len(ends[0]["token_ids"]) == 5
    messages = [{"role": "user", "content": "Tell me about rivers"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And lakes?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens - 1) // page * page


def test_a_server_over_an_llm_with_a_prefix_cache_keeps_that_one(tokenizer):
    """One cache per engine: an LLM made with enable_prefix_caching lends its cache to the server."""
    llm = make_llm(tokenizer, enable_prefix_caching=True)
    llm.generate({"prompt_token_ids": list(range(3, 30))}, SamplingParams(max_tokens=2), use_tqdm=False)
    running = RunningServer(llm, "tiny")
    try:
        assert running.online.core.online.scheduler.cache is llm.prefix_cache   # (the core in this process)
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60) as client:
            got = client.completions.create(model="tiny", prompt=list(range(3, 30)), max_tokens=2, temperature=0)
        assert got.usage.prompt_tokens_details.cached_tokens == 24   # the LLM's call cached it (pages of 4)
        assert free_again(running) == 0
    finally:
        running.stop()
