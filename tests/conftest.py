"""Shared test setup: the Triton interpreter on machines without CUDA."""
import os
import sys

import pytest
import torch

# The shared test helpers (engines.py, trees.py, tokenizers_local.py) sit here, beside this file; the tests
# live one or two folders down (tests/<package>/test_<module>.py), so this folder goes on the path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Triton reads TRITON_INTERPRET when a kernel is decorated (module import), so it is set
# here, before any test module imports treedec.kernels. On a CUDA machine the kernels
# are compiled and run on the GPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: exercises the Triton kernels (interpreted on the CPU)")


@pytest.fixture
def triton_device() -> torch.device:
    """Where the Triton kernels run: the GPU if there is one, else the CPU interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    return torch.device("cpu")
