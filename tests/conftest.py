"""Shared test setup: the Triton interpreter (with two fixes) on machines without CUDA."""
import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated (module import), so it is set
# here, before any test module imports treedec.kernels. On a CUDA machine the kernels
# are compiled and run on the GPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter_for_numpy_2_4() -> None:
    """Let the Triton <= 3.6 interpreter run ``range(0, loaded_scalar)`` loops on numpy >= 2.4.

    Its scalars are 1-element arrays and its ``tensor.__index__`` calls ``int()`` on them,
    which numpy 2.4 rejects (triton-lang/triton#9171, fixed upstream by #9172).
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "treedec_numpy_fix", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.treedec_numpy_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_triton_interpreter_bf16_dot() -> None:
    """Let the Triton interpreter run ``tl.dot`` on bfloat16 operands.

    It stores bfloat16 as uint16 bit patterns and its ``create_dot`` multiplies those
    (triton-lang/triton#11584: bf16 is unsupported in the interpreter). Widening the
    operands to float32 is exact, and the GPU multiplies bf16 exactly into fp32 too.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return
    original = InterpreterBuilder.create_dot
    if getattr(original, "treedec_bf16_fix", False):
        return

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot.treedec_bf16_fix = True
    InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter_for_numpy_2_4()
    _patch_triton_interpreter_bf16_dot()


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
