"""The default size of a CPU KV pool (:func:`treedec.engine.pool_sizing.cpu_pool_tokens`) and the check of a pool
against the memory available: what the requests need, one request of the context, the cap, the memory."""
import pytest

from tests.engines import tiny_model
from treedec.engine import Engine
from treedec.engine.pool_sizing import CPU_POOL_TOKENS, cpu_pool_tokens, kv_bytes_per_token

GIB = 1 << 30


@pytest.fixture
def memory(monkeypatch):
    """Set the memory available_memory reports (default: plenty)."""
    def set_available(nbytes):
        monkeypatch.setattr("treedec.engine.pool_sizing.available_memory", lambda device: nbytes)
    set_available(64 * GIB)
    return set_available


def test_the_requests_worst_cases_all_at_once(memory):
    size = cpu_pool_tokens(tiny_model(), 16, 4096, [33, 100])
    assert size.tokens == 48 + 112 and "the 2 requests' worst case" in size.reason
    assert cpu_pool_tokens(tiny_model(), 16, 4096, [40]).reason.startswith("the request's worst case: ")


def test_many_requests_are_capped_and_wait_for_pages_but_the_largest_always_fits(memory):
    size = cpu_pool_tokens(tiny_model(), 16, 4096, [1000] * 100)
    assert size.tokens == CPU_POOL_TOKENS and f"at most {CPU_POOL_TOKENS}" in size.reason
    size = cpu_pool_tokens(tiny_model(), 16, 100_000, [50_000, 16])
    assert size.tokens == 50_000 and "(50016 tokens), at most the largest request's" in size.reason


def test_unknown_requests_get_one_request_of_the_context(memory):
    assert cpu_pool_tokens(tiny_model(), 16, 4096).tokens == 4096 + 16   # the prompt's last page, the output's first
    size = cpu_pool_tokens(tiny_model(), 16, 131072)
    assert size.tokens == CPU_POOL_TOKENS + 16 and "at most 32768 of max_model_len 131072" in size.reason


def test_the_pool_is_cut_to_the_memory_available_or_refused(memory):
    per_token = kv_bytes_per_token(tiny_model())
    memory(1000 * per_token)
    size = cpu_pool_tokens(tiny_model(), 16, 4096, [200, 800])
    assert size.tokens == 896 and "cut to 90% of the" in size.reason   # 900 tokens' worth, in whole pages
    with pytest.raises(MemoryError, match="a KV pool of 2000 tokens .* does not fit in 90% of the"):
        cpu_pool_tokens(tiny_model(), 16, 4096, [2000])


def test_an_engine_refuses_a_pool_past_the_memory_before_allocating(memory):
    memory(GIB)
    with pytest.raises(MemoryError, match=r"kv_tokens 1099511627776 asks for a KV pool of .*, but 1.0 GiB is "
                                          r"available on cpu; lower kv_tokens"):
        Engine(tiny_model(), kv_tokens=2**40)
