"""A crashed engine core started again (``ProcessClient(max_restarts=N)``, ``treedec serve --max-core-restarts N``):
its requests in flight are answered 503 ``engine_failed``, those sent while the new core is built 503
``engine_restarting`` (``/health`` too), the new core answers the next ones as the first did and frees every page;
a crash past the last restart ends the server as without restarts."""
import os
import signal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.server import RunningServer, free_again, kill_core_under_two_requests, llm_recipe, wait_until
from treedec import SamplingParams
from treedec.core.process_client import ProcessClient


def _metric(url: str, name: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return next(s.value for f in families for s in f.samples if s.name == name)


def _greedy(client, prompt: str = "The quick brown fox") -> str:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_max_restarts_is_checked():
    with pytest.raises(ValueError, match="max_restarts must be an int >= 0, got -1"):
        ProcessClient(llm_recipe(None), max_restarts=-1)


def test_a_crashed_core_is_started_again_and_answers_as_before(tokenizer, reference):
    running = RunningServer(llm_recipe(tokenizer), "tiny", max_restarts=1)
    try:
        [want] = reference.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0.0,
                                                                          ignore_eos=True), use_tqdm=False)
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60) as client:
            assert _greedy(client) == want.outputs[0].text
            assert httpx.get(f"{running.url}/health").json() == {"status": "ok", "engine_restarts": 0}
            first = running.online.pid
            kill_core_under_two_requests(running)
            # the new core is being built (a spawned process importing torch: seconds): refused meanwhile
            assert running.online.restarting and not running.online.alive
            health = httpx.get(f"{running.url}/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_restarting", health.text
            with pytest.raises(openai.APIStatusError) as info:
                _greedy(client)
            assert info.value.status_code == 503 and info.value.response.json()["error"]["code"] == "engine_restarting"
            wait_until(lambda: running.online.alive, 120)
            assert running.online.pid != first and running.thread.is_alive()
            assert _greedy(client) == want.outputs[0].text   # (the same model and options: the same answer)
            assert httpx.get(f"{running.url}/health").json() == {"status": "ok", "engine_restarts": 1}
            assert _metric(running.url, "treedec_engine_core_restarts") == 1
            assert free_again(running, timeout=30) == 0
            os.kill(running.online.pid, signal.SIGKILL)   # the restart is spent: the server stops, as without one
            running.thread.join(30)
            assert not running.thread.is_alive() and "after 1 restart(s)" in running.server.engine_failed
    finally:
        running.stop()


def test_a_server_stopped_while_its_core_is_rebuilt_ends_the_new_core_too(tokenizer):
    running = RunningServer(llm_recipe(tokenizer), "tiny", max_restarts=1)
    try:
        os.kill(running.online.pid, signal.SIGKILL)
        wait_until(lambda: running.online.restarting, 30)
    finally:
        running.stop()   # (while the new core is being built: it is told to end once it is)
    assert not running.thread.is_alive() and running.server.engine_failed is None
    handle = running.online.process_handle
    assert handle is not None and not handle.is_alive() and handle.exitcode == 0, handle
