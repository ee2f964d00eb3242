"""The engine core in its own process (treedec/core/engine_core.py, client.py, messages.py): the messages round-trip,
a killed core fails every request in flight with 503 ``engine_failed`` and stops the server, a core that cannot start
says why, and a load of requests with random aborts and disconnects loses and duplicates nothing and frees every
page."""
import asyncio
import functools
import os
import random
import signal
import time

import httpx
import openai
import pytest

from tests.serve.server import RunningServer, free_again, kill_core_under_two_requests, llm_recipe, wait_until
from treedec import SamplingParams
from treedec.programs.beam import BeamSearchParams
from treedec.core.client import EngineStartupError
from treedec.core.process_client import ProcessClient
from treedec.core.messages import (AbortRequests, AddRequest, CoreInput, CoreOutput, CoreReady, CoreStartupFailed,
                                    IterationOutputs, IterationStats, MessageCodec, OutputDelta, PagesQuery,
                                    PagesReport, PositionLogprobs, RequestFailure, RequestFinished, Shutdown,
                                    TokenDelta, dumps, loads)
from treedec.runtime.requests import RequestResult
from treedec.sampling.logits import Logprob

STATS = IterationStats(seconds=0.0125, steps=7, num_running=3, num_waiting=1, waiting_outputs=2, prompt_tokens=90,
                       cached_tokens=40, preemptions=1, free_pages=100, num_pages=128, queries=12)


@pytest.mark.parametrize("message", [
    AddRequest("cmpl-1-0", [1, 2, 3], dumps(SamplingParams(n=2, temperature=0.7, seed=-5, stop=["x"], logprobs=2)),
               stream_tokens=True),
    AddRequest("b", [4], dumps(SamplingParams(n=2, temperature=0.0)), dumps(BeamSearchParams(beam_width=2,
                                                                                             max_tokens=5))),
    AbortRequests(["a", "b"]), PagesQuery(3), Shutdown()])
def test_input_messages_round_trip(message):
    codec = MessageCodec(CoreInput)
    back = codec.decode(codec.encode(message))
    assert back == message and type(back) is type(message)
    if isinstance(message, AddRequest):   # (SamplingParams travel whole: every field, the ones added later too)
        assert loads(back.params) == loads(message.params)


def test_output_messages_round_trip():
    codec = MessageCodec(CoreOutput)
    result = RequestResult("r", 0, "hi", [1, 2], [5, 6], "ab", "length", {"cached_tokens": 0},
                           logprobs=[{5: Logprob(-0.5, 1)}, {6: Logprob(-1.0, 2), 7: Logprob(-0.7, 1)}],
                           cumulative_logprob=-1.5)
    entry = PositionLogprobs.of(result.logprobs[1])
    messages = [
        IterationOutputs(["r"], [TokenDelta("t", 0, [5], [entry], None, 3, [None, entry]),
                                 TokenDelta("t", 1, [2], None, "eos", 3)],
                         [OutputDelta("r", 0, "a", 1), OutputDelta("r", 1, "", 2, "eos", [5, 2])],
                         [RequestFinished("r", dumps([result])), RequestFinished("t", None)],
                         [RequestFailure("s", "ValueError", "prompt_ids: x")], STATS),
        CoreReady(name="tiny", max_model_len=4096, positions=4096, vocab_size=512, speculative=False, device="cpu",
                  kv_tokens=4096, kv_cache_dtype="bfloat16", page_size=4, batch_invariant=False, note="",
                  tokenizer=None, pid=7, eos_token_ids=[2]),
        CoreStartupFailed("FileNotFoundError", "no model at /x"),
        PagesReport(token=1, idle=True, num_nodes=0, held_pages=0, cache_pages=3, invariants=None)]
    for message in messages:
        back = codec.decode(codec.encode(message))
        assert back == message and type(back) is type(message)
    [got] = loads(codec.decode(codec.encode(messages[0])).finished[0].results)
    assert got == result
    back = codec.decode(codec.encode(messages[0])).tokens[0]   # (a position's logprobs as its dict, in its order)
    assert back.logprobs[0].to_dict() == result.logprobs[1] and list(back.logprobs[0].to_dict()) == [6, 7]


def _failing_llm(path):
    raise FileNotFoundError(f"no model at {path}")


def test_a_core_that_cannot_start_says_why_and_does_not_hang():
    client = ProcessClient(functools.partial(_failing_llm, "/nowhere/model"), startup_timeout=120)
    started = time.monotonic()
    with pytest.raises(EngineStartupError, match="no model at /nowhere/model") as info:
        client.launch()
    assert info.value.kind == "FileNotFoundError" and time.monotonic() - started < 120
    assert not client.process_handle.is_alive()


def test_a_killed_core_fails_every_request_in_flight_with_503_and_stops_the_server(tokenizer):
    running = RunningServer(llm_recipe(tokenizer), "tiny")
    try:
        pid = running.online.pid
        assert running.mode == "process" and pid != os.getpid()
        assert httpx.get(f"{running.url}/health").status_code == 200
        plain, _ = kill_core_under_two_requests(running)
        assert "Traceback" not in plain.text and "exit code -9" in plain.json()["error"]["message"]
        running.thread.join(30)   # the server stops by itself (treedec serve then exits 1)
        assert not running.thread.is_alive() and running.server.engine_failed is not None
        assert "exit code -9" in running.server.engine_failed
    finally:
        running.stop()


def test_health_and_new_requests_are_503_engine_failed_once_the_core_is_gone(tokenizer):
    running = RunningServer(llm_recipe(tokenizer), "tiny")
    try:
        running.server.should_exit = False
        running.online.on_dead = lambda error: None   # (kept serving, to ask it after the core is gone)
        os.kill(running.online.pid, signal.SIGKILL)
        wait_until(lambda: running.online.dead is not None, 30)
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failed"
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=30) as client:
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert info.value.status_code == 503 and info.value.response.json()["error"]["code"] == "engine_failed"
    finally:
        running.stop()


def _load(running, count: int, seed: int) -> list:
    """``count`` streamed requests at once (greedy; some n=2, some with a stop string), a third of them aborted or
    disconnected at a random point; returns (kind, choices' texts, finish reasons, their final texts) per request."""
    rng = random.Random(seed)

    async def one(client, k):
        n = 2 if k % 5 == 0 else 1
        fields = dict(model="tiny", prompt=f"The quick brown fox {k % 13}", max_tokens=rng.randint(4, 24),
                      temperature=0, n=n, stream=True, stop=[" the"] if k % 4 == 0 else None)
        cut = rng.randint(0, 6) if rng.random() < 0.33 else None
        texts, reasons, chunks = [""] * n, [None] * n, 0
        stream = await client.completions.create(**fields)
        async for chunk in stream:
            chunks += 1
            for c in chunk.choices:
                assert reasons[c.index] is None, f"request {k}: choice {c.index} got text after its end"
                texts[c.index] += c.text
                reasons[c.index] = c.finish_reason
            if cut is not None and chunks >= cut:
                await stream.close()   # (a client going away mid-stream: its request is aborted)
                return "cut", fields, texts, reasons
        return "done", fields, texts, reasons

    async def main():
        async with openai.AsyncOpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, k) for k in range(count)))
    return asyncio.run(main())


@pytest.mark.slow
def test_a_load_with_random_aborts_loses_nothing_duplicates_nothing_and_frees_every_page(tokenizer, reference):
    running = RunningServer(llm_recipe(tokenizer), "tiny")
    try:
        got = _load(running, 300, seed=5)
        done = [g for g in got if g[0] == "done"]
        assert len(done) > 150 and len(got) - len(done) > 50
        seen = {}
        for _, fields, texts, reasons in done:   # every completed request: the text it gets alone, each end once
            assert all(r in ("stop", "length") for r in reasons), reasons
            key = (fields["prompt"], fields["max_tokens"], fields["n"], tuple(fields["stop"] or ()))
            if key not in seen:
                [want] = reference.generate(fields["prompt"], SamplingParams(
                    max_tokens=fields["max_tokens"], temperature=0.0, n=fields["n"], stop=fields["stop"] or []),
                    use_tqdm=False)
                seen[key] = [o.text for o in want.outputs]
            assert texts == seen[key], (fields, texts, seen[key])
        assert free_again(running, timeout=60) == 0
        stats = running.stats()
        assert stats.num_running == stats.num_waiting == stats.waiting_outputs == 0
    finally:
        running.stop()
