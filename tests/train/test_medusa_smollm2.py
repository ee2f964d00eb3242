"""Medusa heads trained for the real SmolLM2-135M-Instruct on a small set of the shipped prompts (CPU, slow): on
held-out prompts of the same kinds, greedy speculative decoding with Medusa's 64-token tree gives more than 1.5
tokens a step, and exactly plain greedy decoding's tokens. Skipped where the checkpoint cannot be had."""
from __future__ import annotations

import pytest
import torch

from tests.engines import smollm2_or_skip
from treedec.commands.requests_file import read_requests
from treedec.models import from_pretrained
from treedec.models.medusa import load_medusa_heads
from treedec.models.text import load_tokenizer
from treedec.sampling.params import SamplingParams
from treedec.train import (DEFAULT_PROMPTS, HELDOUT_PROMPTS, DistillConfig, MedusaTrainConfig, distill,
                           evaluate_medusa, save_medusa_heads, train_medusa)


@pytest.mark.slow
def test_trained_heads_accept_on_held_out_prompts(tmp_path):
    folder = smollm2_or_skip()
    torch.set_num_threads(1)   # a shared 2-core machine: one thread is faster (see the README)
    model = from_pretrained(folder, dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer(folder)
    data = tmp_path / "data"
    data.mkdir()
    config = DistillConfig(params=SamplingParams(temperature=0, max_tokens=96), progress=False)
    distill(model, read_requests(DEFAULT_PROMPTS)[:64], data, config, tokenizer, "smollm2")
    result = train_medusa(model, data, tmp_path, MedusaTrainConfig(epochs=2, batch_size=64), progress=False)
    assert sum(result.losses[-5:]) < sum(result.losses[:5])
    save_medusa_heads(result.heads, tmp_path, "smollm2")
    heads = load_medusa_heads(tmp_path, model)
    acceptance = evaluate_medusa(model, heads, read_requests(HELDOUT_PROMPTS)[:4], tokenizer, max_tokens=48,
                                 progress=False)
    assert acceptance.equal_to_greedy, acceptance.per_prompt
    assert acceptance.tokens_per_step > 1.5, acceptance.as_json()
