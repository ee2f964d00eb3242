"""Fixtures of the search tests: the tiny transformers Llama (the reference) and its treedec copy."""
import pytest

from tests.engines import tiny_hf_llama
from treedec.models import from_hf_model


@pytest.fixture(scope="session")
def hf():
    """The tiny random transformers Llama of :func:`tests.engines.tiny_hf_llama` (transformers' side)."""
    return tiny_hf_llama()


@pytest.fixture(scope="session")
def model(hf):
    """The same weights as a treedec model (fp32, CPU)."""
    return from_hf_model(hf)
