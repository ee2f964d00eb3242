"""Fixtures of the server tests: the small local tokenizer, and an LLM of its own for the expected outputs."""
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
    from tests.serve.server import make_llm


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
