"""What the server bounds before a request's work is done (#48), through the real openai / httpx clients and raw
sockets on the loopback: every bad request is answered at once with OpenAI's JSON naming what was wrong, another
client's request is answered meanwhile with its text alone, and every page is free after."""
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.serve.server import (Bystander, RunningServer, alone, free_again, llm_recipe, make_llm, send_chunked,
                                wait_until)
from treedec.serve.limits import LOOPBACK_HOSTS, host_name


@pytest.fixture(scope="module")
def server(tokenizer):
    running = RunningServer(llm_recipe(tokenizer), "tiny", max_n=8, max_prompts=16, max_body_bytes=2**20,
                            read_timeout=0.5, allowed_hosts=LOOPBACK_HOSTS)
    yield running
    running.stop()


def refused(call, status: int, code: str | None = None, param: str | None = None) -> str:
    """Run ``call`` (it must fail with ``status``, ``code`` and ``param``); returns the error's message."""
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status, info.value.response.text
    error = info.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and (error["code"], error["param"]) == (code, param)
    return error["message"]


def raw(server, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` on a new connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def json_answer(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


# ---------------------------------------------------------------- item 1: n, and the pages a request may need


def test_a_huge_n_is_refused_at_once_and_the_others_go_on(server, client, reference):
    bystander = Bystander(server)
    started = time.perf_counter()
    message = refused(lambda: client.completions.create(model="tiny", prompt="hello", n=2 ** 31, max_tokens=4),
                      400, param="n")
    assert "at most 8" in message and "max_n" in message
    refused(lambda: client.completions.create(model="tiny", prompt="hello", n=8, max_tokens=4000, temperature=1),
            400, "kv_cache_exceeded")   # 8 x 1000 pages of the 1024
    assert time.perf_counter() - started < 2
    assert bystander.result() == alone(reference)
    assert free_again(server) == 0


def test_health_reports_an_engine_whose_iteration_runs_too_long(tokenizer, monkeypatch):
    """An iteration that hangs (here a step held back by the test) turns /health into 503 ``engine_stalled``; once it
    ends, /health is ok and the request is answered."""
    llm = make_llm(tokenizer)
    release, step = threading.Event(), llm.engine.step

    def held_step(*args, **kwargs):
        release.wait(30)
        return step(*args, **kwargs)

    running = RunningServer(llm, "tiny", engine_iteration_timeout=0.3)
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200
        monkeypatch.setattr(llm.engine, "step", held_step)
        answer = {}
        thread = threading.Thread(target=lambda: answer.update(httpx.post(
            f"{running.base_url}/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
            timeout=60).json()))
        thread.start()
        wait_until(lambda: running.online.iteration_seconds > 0.5)
        stalled = httpx.get(f"{running.url}/health")
        assert stalled.status_code == 503 and stalled.json()["error"]["code"] == "engine_stalled"
        assert "0.3 s" in stalled.json()["error"]["message"]
        release.set()
        thread.join(60)
        assert answer["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{running.url}/health").status_code == 200
        assert free_again(running) == 0
    finally:
        release.set()
        running.stop()


# ---------------------------------------------------------------- item 6: the queue counts outputs


def test_the_queue_counts_prompts_times_n_and_prompts_per_request_are_capped(tokenizer):
    running = RunningServer(llm_recipe(tokenizer, kv_tokens=320), "tiny", max_queued_requests=4, max_prompts=16)
    try:
        with openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60) as client:
            message = refused(lambda: client.completions.create(model="tiny", prompt=["a"] * 5000, max_tokens=2),
                              400, param="prompt")
            assert "at most 16 prompts" in message and "5000" in message
            refused(lambda: client.completions.create(model="tiny", prompt=["a", "b", "c"], n=2, max_tokens=2),
                    400, param="n")   # 6 outputs: more than the queue holds
            holder = client.completions.create(model="tiny", prompt=list(range(3, 103)), max_tokens=150,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            next(iter(holder))   # it holds most of the pool
            waiting = client.completions.create(model="tiny", prompt=[list(range(252, 2, -1)), [9] * 150], n=2,
                                                max_tokens=1, temperature=1, stream=True)
            wait_until(lambda: running.online.waiting_outputs == 4)   # one request, 2 prompts x n=2
            message = refused(lambda: client.completions.create(model="tiny", prompt="hello", max_tokens=2),
                              503, "overloaded")
            assert "4 outputs wait" in message
            holder.close()
            assert len([c for chunk in waiting for c in chunk.choices if c.finish_reason]) == 4
        assert running.online.waiting_outputs == 0 and free_again(running) == 0
    finally:
        running.stop()


# ---------------------------------------------------------------- item 7: the body's bytes as they arrive


def test_a_chunked_body_past_the_limit_is_refused_as_it_arrives(server, reference):
    """A chunked body has no Content-Length: it is counted as it arrives, 413 once past the limit and the connection
    closed, so the client cannot make the server read (or parse) 200 MB."""
    bystander = Bystander(server)
    sent, answer = send_chunked(server.port, b' "pad": "' + b"x" * (2**20 - 16) + b'",', first=b'{"model": "tiny",')
    status, body = json_answer(answer)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert sent < 16 * 2**20, sent   # (it stopped reading at 1 MiB: the socket buffers hold the rest)
    assert bystander.result() == alone(reference)
    assert free_again(server) == 0


# ---------------------------------------------------------------- item 14: posture


def test_a_loopback_server_answers_only_its_loopback_host_names(server):
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert httpx.get(f"{server.url}/health", headers={"host": host}).status_code == 200, host
    for host in ("evil.example", f"evil.example:{server.port}", "localhost.evil.example", "127.0.0.1.nip.io"):
        answer = httpx.get(f"{server.url}/v1/models", headers={"host": host})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_host", host
    assert [host_name(h) for h in ("LocalHost:80", "[::1]:1", "::1", "a.b")] == ["localhost", "[::1]", "::1", "a.b"]


def test_docs_are_off_unless_asked(server, tokenizer):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}").status_code == 404, path
    running = RunningServer(llm_recipe(tokenizer), "tiny", enable_docs=True)
    try:
        assert httpx.get(f"{running.url}/docs").status_code == 200
        assert "/v1/completions" in httpx.get(f"{running.url}/openapi.json").json()["paths"]
    finally:
        running.stop()


def test_a_body_that_stops_arriving_times_out(server, reference):
    """A client that sends its headers and part of its body, then nothing (half-open, or slow on purpose), gets 408
    after the read timeout (0.5 s here) instead of holding its request forever."""
    bystander = Bystander(server)
    started = time.perf_counter()
    status, body = json_answer(raw(server, b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: "
                                           b"application/json\r\ncontent-length: 100\r\n\r\n{\"model\": "))
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert 0.4 < time.perf_counter() - started < 5
    assert bystander.result() == alone(reference)
    assert free_again(server) == 0


def test_a_huge_model_name_is_not_echoed_back(client):
    message = refused(lambda: client.completions.create(model="m" * 10**5, prompt="hi", max_tokens=2), 404,
                      "model_not_found", "model")
    assert len(message) < 300 and "100000 characters" in message


# ---------------------------------------------------------------- item 15: messages


@pytest.mark.parametrize("body, words", [
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "not UTF-8"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 100_000 + b"}", "too many digits"),
], ids=["not-utf8", "deep", "long-integer"])
def test_a_body_that_cannot_be_parsed_says_why(server, body, words):
    answer = httpx.post(f"{server.base_url}/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text


def test_a_malformed_http_request_is_answered_with_openai_json(server):
    """uvicorn refuses a bad Content-Length before the app sees it; its answer is OpenAI's JSON too."""
    for request in (b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-length: abc\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-length: 1\r\ncontent-length: 2\r\n"
                    b"\r\n", b"GARBAGE\r\n\r\n"):
        status, body = json_answer(raw(server, request))
        assert status == 400 and body["error"]["code"] == "invalid_http_request", request


def test_the_errors_name_the_field_at_fault(client, server):
    chat = [{"role": "user", "content": "hi"}]
    message = refused(lambda: client.chat.completions.create(model="tiny", messages=chat, max_completion_tokens=-1),
                      400, param="max_completion_tokens")
    assert message.startswith("max_completion_tokens must be >= 1")
    refused(lambda: client.completions.create(model="tiny", prompt=[5, 600], max_tokens=2), 400, param="prompt")
    message = refused(lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                                        extra_body={"stop_token_ids": [10**6]}),
                      400, param="stop_token_ids")
    assert "stop_token_ids" in message
    assert free_again(server) == 0
