"""The server over an fp8 (e4m3) KV pool (``LLM(kv_cache_dtype="fp8")``): completions and chat, whole and streamed,
equal the offline LLM on its own fp8 pool, and every page comes back."""
import warnings

import openai
import pytest

from tests.serve.server import RunningServer, free_again, make_llm
from treedec import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:an fp8 KV cache on the CPU")


def fp8_llm(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_llm(tokenizer, kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def server(tokenizer):
    running = RunningServer(fp8_llm(tokenizer), "tiny")
    yield running
    running.stop()


@pytest.mark.slow
def test_completions_and_chat_on_an_fp8_pool_equal_the_offline_llm(server, tokenizer):
    reference = fp8_llm(tokenizer)
    assert server.llm.engine.kv_cache_dtype == "fp8_e4m3"
    params = SamplingParams(max_tokens=8, temperature=0.0)
    [want] = reference.generate("the quick brown fox", params, use_tqdm=False)
    [chat] = reference.chat([{"role": "user", "content": "hello"}], params, use_tqdm=False)
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60) as client:
        got = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=8, temperature=0)
        assert got.choices[0].text == want.outputs[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="the quick brown fox", max_tokens=8, temperature=0, stream=True) if c.choices)
        assert streamed == want.outputs[0].text
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=8, temperature=0)
        assert answer.choices[0].message.content == chat.outputs[0].text
    assert free_again(server) == 0
