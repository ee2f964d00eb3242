"""Fixtures of the server tests: the small local tokenizer, an LLM of its own for the expected outputs, and a module's
default server (the tiny model, default limits) with an openai client of it, in both engine modes (the core in a
process of its own, ``treedec serve``'s default, and in the server's process); a module that needs other limits
defines its own ``server`` (the core in its own process)."""
import pytest

from tests.tokenizers_local import build_tokenizer
from treedec.models.text import load_tokenizer

try:   # the server's packages (the serve extra) and the openai client (the test extra) drive these tests
    import fastapi  # noqa: F401
    import openai  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError:   # (not collected where they are missing, e.g. a GPU machine with torch alone)
    collect_ignore_glob = ["test_*.py"]
else:
    import openai as _openai

    from tests.serve.server import ENGINES, RunningServer, make_llm


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_folder):
    return load_tokenizer(tokenizer_folder)


@pytest.fixture(scope="session")
def reference(tokenizer):
    """An LLM of its own for the expected outputs (a server's engine is its thread's alone)."""
    return make_llm(tokenizer)


@pytest.fixture(scope="module", params=sorted(ENGINES))
def server(tokenizer, request):
    """A server of the tiny model with the default limits, for the module's tests: in each engine mode."""
    running = RunningServer(ENGINES[request.param](tokenizer), "tiny")
    yield running
    running.stop()


@pytest.fixture
def client(server):
    """The openai client of the module's ``server`` (no retries: a test sees every refusal)."""
    with _openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60) as c:
        yield c
