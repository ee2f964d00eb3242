"""bench/fp8_gemv.py: the projections it times, and its refusal without a GPU (the kernel's CPU test is
tests/kernels/test_fp8_gemv.py)."""
import pytest
import torch

from bench.fp8_gemv import main, projections
from treedec.models import ModelConfig


def test_the_projections_are_one_layers_and_the_heads():
    assert projections(ModelConfig.from_name("llama3-8b")) == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
        "lm_head": (128256, 4096)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_says_what_it_needs():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main([])
