"""The server's /tokenize, /detokenize (vLLM's request and response shapes) and /version routes, over raw httpx on
the loopback: the ids are the tokenizer's (and the chat template's) own, sizes are bounded before work, errors are
OpenAI's JSON naming the field."""
import httpx
import pytest

import treedec
from tests.serve.server import RunningServer, llm_recipe
from treedec.models.text import encode_prompt


@pytest.fixture(scope="module")
def server(tokenizer):
    running = RunningServer(llm_recipe(tokenizer), "tiny")
    yield running
    running.stop()


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def error_of(response, status, param):
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def test_tokenize_a_text_with_and_without_special_tokens(server, tokenizer):
    text = "The quick brown fox"
    got = post(server, "/tokenize", {"model": "tiny", "prompt": text}).json()
    want = tokenizer.encode(text)
    assert got == {"count": len(want), "max_model_len": 4096, "tokens": want, "token_strs": None}
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])


def test_tokenize_chat_messages_as_the_chat_template_renders_them(server, tokenizer):
    got = post(server, "/tokenize", {"model": "tiny", "messages": MESSAGES}).json()
    assert got["tokens"] == encode_prompt(tokenizer, MESSAGES, True) and got["count"] == len(got["tokens"])
    # the same ids a chat completion's prompt has
    chat = post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == got["count"]
    open_turn = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert open_turn["tokens"] == tokenizer.encode(text, add_special_tokens=False) != got["tokens"]
    special = post(server, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True}).json()
    assert special["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=True)


def test_detokenize_gives_the_tokenizer_s_text(server, tokenizer):
    ids = tokenizer.encode("Hello world! hello there")
    assert post(server, "/detokenize", {"model": "tiny", "tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_version(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": treedec.__version__}


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/tokenize", {"prompt": "word " * 5000}, 400, "prompt", "maximum context length is 4096 tokens. However, the "
                                                             "prompt has 10002 tokens"),
    ("/tokenize", {"prompt": "x" * 10**6}, 400, "prompt", "a text of more than"),   # (refused untokenized)
    ("/tokenize", {"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages",
     "maximum context length"),
    ("/tokenize", {"prompt": ""}, 400, "prompt", "non-empty"),
    ("/tokenize", {"prompt": "hi", "chat_template": "x"}, 400, "chat_template", "Extra inputs"),
    ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "text content"),
    ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "does not exist"),
    ("/detokenize", {"tokens": [5, 600]}, 400, "tokens",
     "token id 600 is out of vocabulary (the tokenizer's vocabulary has 400 tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "token id -1 is out of vocabulary"),
    ("/detokenize", {"tokens": [5] * 4097}, 400, "tokens", "at most 4096 token ids (the model's max_model_len), got "
                                                          "4097"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "list"),
    ("/detokenize", {"model": "nope", "tokens": [5]}, 404, "model", "does not exist"),
])
def test_bad_bodies_are_answered_with_the_field_named(server, path, body, status, param, message):
    error = error_of(post(server, path, body), status, param)
    assert message in error["message"], error["message"]


def test_the_max_model_len_is_the_llm_s(tokenizer):
    running = RunningServer(llm_recipe(tokenizer, kv_tokens=512, max_model_len=100), "tiny")
    try:
        assert post(running, "/tokenize", {"prompt": "hi"}).json()["max_model_len"] == 100
        assert httpx.get(f"{running.base_url}/models").json()["data"][0]["max_model_len"] == 100
        error = error_of(post(running, "/v1/completions", {"model": "tiny", "prompt": [5] * 90, "max_tokens": 20}),
                         400, "max_tokens")
        assert error["code"] == "context_length_exceeded" and "maximum context length is 100 tokens" in \
            error["message"]
    finally:
        running.stop()
