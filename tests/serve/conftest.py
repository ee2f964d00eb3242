"""Fixtures of the server tests: the small local tokenizer, and an LLM of its own for the expected outputs."""
import pytest

from tests.serve.server import make_llm
from tests.tokenizers_local import build_tokenizer
from treedec.models.text import load_tokenizer


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
