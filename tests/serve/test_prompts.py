"""Prompts through the server (#48 items 2 and 9): a text too long for the model's context is refused before it is
tokenized; the tokenizer and the chat template run off the event loop (the server answers others meanwhile); a
hostile chat template is stopped within its time, memory and size budget with a 400 naming it."""
import threading
import time

import httpx
import openai
import pytest

from tests.serve.server import Bystander, RunningServer, alone, free_again, llm_recipe
from treedec import SamplingParams
from treedec.models.text import load_tokenizer
from treedec.serve.prompts import longest_token_chars

#: Hostile branches picked by the first message's content; any other conversation renders normally.
HOSTILE = ("{% set c = messages[0]['content'] %}"
           "{% if c == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% elif c == 'huge' %}{{ 'a' * 10**10 }}"
           "{% elif c == 'long' %}{{ 'a' * 10**6 }}"
           "{% elif c == 'raise' %}{{ raise_exception('no ' + c) }}"
           "{% else %}{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
           "<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def server(tokenizer):
    running = RunningServer(llm_recipe(tokenizer), "tiny")
    yield running
    running.stop()


def post(server, path, body, timeout=60):
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=timeout)


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(server, tokenizer, reference, monkeypatch):
    limit = 4096 * longest_token_chars(tokenizer)   # 4096 positions x 7 characters
    assert server.app.state.server.encoder.max_chars == limit
    calls = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: calls.append(len(text)) or encode(text, **kw))
    bystander = Bystander(server)
    for prompt in ("word " * 10**6, "x" * (limit + 1)):   # 5 MB (under the 8 MiB body limit), and one past
        started = time.perf_counter()
        answer = post(server, "/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert f"more than {limit} characters cannot fit" in error["message"] and time.perf_counter() - started < 2
    chat = post(server, "/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "y" * limit}, {"role": "user", "content": "y"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert all(n < 100 for n in calls), calls   # (the bystander's prompt only)
    monkeypatch.undo()
    assert bystander.result() == alone(reference)
    assert free_again(server) == 0


def test_the_tokenizer_runs_off_the_event_loop(server, tokenizer, reference, monkeypatch):
    """A prompt whose tokenizing takes 2 s (held back by the test) does not hold the server: /health, /v1/models and
    another client's stream are answered meanwhile."""
    tokenizer = server.online.tokenizer   # (the frontend's: in process mode a copy of the core's)
    encode, release = tokenizer.encode, threading.Event()

    def slow(text, **kw):
        if text.startswith("SLOW"):
            release.wait(2)
        return encode(text, **kw)

    monkeypatch.setattr(tokenizer, "encode", slow)
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(post(server, "/completions", {
        "model": "tiny", "prompt": "SLOW hello", "max_tokens": 3}).json()))
    thread.start()
    time.sleep(0.2)
    started = time.perf_counter()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/models").status_code == 200
    bystander = Bystander(server, max_tokens=6)
    assert bystander.result(10) == alone(reference, 6)
    assert time.perf_counter() - started < 1.5 and thread.is_alive()
    release.set()
    thread.join(30)
    assert answer["usage"]["completion_tokens"] == 3
    assert free_again(server) == 0


def test_a_hostile_chat_template_is_stopped_and_named(tokenizer_folder, reference):
    hostile = load_tokenizer(tokenizer_folder)
    hostile.chat_template = HOSTILE
    running = RunningServer(llm_recipe(hostile), "tiny", chat_template_timeout=1.0)
    try:
        bystander = Bystander(running)
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60) as client:
            for content, words, most in (("loop", "took more than 1 s", 10), ("huge", "memory", 10),
                                         ("long", "1000000 characters", 10), ("raise", "no raise", 10)):
                started = time.perf_counter()
                with pytest.raises(openai.BadRequestError) as info:
                    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                   max_tokens=2)
                error = info.value.response.json()["error"]
                assert error["code"] == "chat_template_failed" and error["param"] == "messages", error
                assert "chat template" in error["message"] and words in error["message"], error
                assert time.perf_counter() - started < most
                assert httpx.get(f"{running.url}/health", timeout=2).status_code == 200
            ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, temperature=0)   # (a new worker after the kills)
            [want] = reference.chat([{"role": "user", "content": "hi"}],
                                    SamplingParams(max_tokens=3, temperature=0.0),
                                    use_tqdm=False)
            assert ok.choices[0].message.content == want.outputs[0].text
        assert bystander.result() == alone(reference)
        assert free_again(running) == 0
    finally:
        running.stop()
