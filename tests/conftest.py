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


@pytest.fixture
def row_exact_dot(monkeypatch):
    """Under the Triton interpreter, ``tl.dot`` computes each row of its left operand on its own (a one-row
    ``np.matmul``), so that a row's bits depend on the row and the right operand alone, as a GPU's MMA gives them.
    The interpreter's ``np.matmul`` of the whole tile goes to the host BLAS, whose kernels may sum a row in another
    order by its position in the tile (OpenBLAS's sgemm on an AMD EPYC: rows past the first 8 of a 16-row tile
    differ from the same row computed alone), which bitwise tests of the kernels' own reduction order must not
    read. Nothing is patched on a GPU."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    whole = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim < 2 or a.data.shape[-2] == 1:
            return whole(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = np.broadcast_to(d.data, a.data.shape[:-1] + b.data.shape[-1:])
        rows = [whole(self, interpreter.TensorHandle(a.data[..., i:i + 1, :], a.dtype), b,
                      interpreter.TensorHandle(acc[..., i:i + 1, :], d.dtype), input_precision,
                      max_num_imprecise_acc).data for i in range(a.data.shape[-2])]
        return interpreter.TensorHandle(np.concatenate(rows, axis=-2), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
