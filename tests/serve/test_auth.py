"""`treedec serve --api-key`: every route but /health and /metrics needs the bearer token (401 in OpenAI's error
shape otherwise, through the official openai client and raw httpx); --secure-metrics closes those two too; the key
is never in an error or a log."""
import logging

import httpx
import openai
import pytest

from tests.serve.server import RunningServer, llm_recipe, make_llm
from treedec.serve import build_app
from treedec.serve.auth import check_api_key

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tokenizer):
    running = RunningServer(llm_recipe(tokenizer), "tiny", api_key=KEY)
    yield running
    running.stop()


def unauthorized(response: httpx.Response) -> dict:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    assert KEY not in response.text
    return error


def test_the_openai_client_with_the_key_is_served_and_without_it_gets_401(server, caplog):
    with openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60) as client:
        got = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
        assert got.choices[0].finish_reason in ("stop", "length")
        assert [m.id for m in client.models.list()] == ["tiny"]
    for wrong in ("none", KEY[:-1], KEY + "x", KEY.upper()):
        with caplog.at_level(logging.DEBUG), \
                openai.OpenAI(base_url=server.base_url, api_key=wrong, max_retries=0, timeout=60) as client:
            with pytest.raises(openai.AuthenticationError) as info:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        unauthorized(info.value.response)
        assert KEY not in caplog.text and wrong not in caplog.text


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/v1/nothing"), ("GET", "/docs")])
@pytest.mark.parametrize("header", [None, "Bearer", "bearer wrong", f"Basic {KEY}", KEY, f"Bearer{KEY}"])
def test_every_route_but_the_probes_needs_the_key(server, method, path, header):
    headers = {} if header is None else {"authorization": header}
    unauthorized(httpx.request(method, server.url + path, headers=headers, json={"model": "tiny"}))


def test_the_probes_stay_open_and_the_scheme_is_case_insensitive(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    answer = httpx.get(f"{server.url}/version", headers={"authorization": f"bearer {KEY}"})
    assert answer.status_code == 200 and "version" in answer.json()
    # a 401 is counted as the other answers are
    assert 'treedec_requests_total{route="/v1/completions",status="401"}' in httpx.get(f"{server.url}/metrics").text


def test_secure_metrics_closes_the_probes(tokenizer):
    running = RunningServer(llm_recipe(tokenizer, kv_tokens=256), "tiny", api_key=KEY, secure_metrics=True)
    try:
        for path in ("/health", "/metrics"):
            unauthorized(httpx.get(running.url + path))
            assert httpx.get(running.url + path, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        running.stop()


@pytest.mark.parametrize("key, message", [
    ("", "api_key must be a non-empty string, got an empty string"),
    (5, "api_key must be a non-empty string, got int"),
    ("with space", "must not hold whitespace"),
    ("tab\tkey", "must not hold whitespace"),
    ("clé", "must be ASCII"),
])
def test_bad_keys_are_refused_without_showing_them(tokenizer, key, message):
    with pytest.raises(ValueError, match=message) as info:
        check_api_key(key)
    assert not (isinstance(key, str) and key and key in str(info.value))
    with pytest.raises(ValueError, match=message):
        build_app(make_llm(tokenizer, kv_tokens=64), "tiny", api_key=key)
    with pytest.raises(ValueError, match="secure_metrics puts /health and /metrics behind the API key"):
        build_app(make_llm(tokenizer, kv_tokens=64), "tiny", secure_metrics=True)
