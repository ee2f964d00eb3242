"""Medusa training on a GPU (bf16 autocast over fp32 heads; the data made with CUDA-graphed decode steps): the tiny
model's loss goes down and the heads, loaded in bf16, decode exactly plain greedy's tokens. Run by the lead on an
H200 (``pytest -m gpu tests/train``)."""
from __future__ import annotations

import random

import pytest
import torch

from treedec.models import from_config
from treedec.models.medusa import load_medusa_heads
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.train import DistillConfig, MedusaTrainConfig, distill, evaluate_medusa, save_medusa_heads, train_medusa

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_medusa_heads_train_on_the_gpu_and_decode_greedy_tokens(tmp_path):
    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    rng = random.Random(0)
    requests = [RequestSpec(i, prompt_ids=tuple(rng.randrange(1, 500) for _ in range(8))) for i in range(32)]
    data = tmp_path / "data"
    data.mkdir()
    distill(model, requests, data, DistillConfig(params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                                 progress=False))
    result = train_medusa(model, data, tmp_path, MedusaTrainConfig(epochs=8, batch_size=64, lr=5e-3), progress=False)
    assert result.heads.medusa_head[0][-1].weight.device.type == "cuda"
    assert sum(result.losses[-3:]) < 0.8 * sum(result.losses[:3])
    save_medusa_heads(result.heads, tmp_path, "tiny", dtype=model.dtype)
    heads = load_medusa_heads(tmp_path, model)
    acceptance = evaluate_medusa(model, heads, requests[:4], None, max_tokens=24, progress=False)
    assert acceptance.equal_to_greedy, acceptance.per_prompt
