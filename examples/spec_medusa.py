#!/usr/bin/env python3
"""Medusa speculative decoding on the random tiny model (CPU): heads saved and loaded in the
Medusa project's checkpoint layout, greedy acceptance checked against plain greedy decoding,
then Medusa's typical acceptance.

    python examples/spec_medusa.py

The heads here are untrained (Medusa's initialisation), so greedy acceptance is low; with
a real model pass its ``medusa_lm_head.safetensors`` directory to ``load_medusa_heads``.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from treedec.engine import Engine
from treedec.models import MedusaHeads, from_config, load_medusa_heads
from treedec.search.generate import greedy_generate
from treedec.search.speculative import MedusaDraft, TypicalAcceptance, speculative_generate


def main() -> None:
    model = from_config("tiny", seed=0, dtype=torch.float32, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(MedusaHeads.untrained(model, num_heads=4).medusa_head.state_dict(),
                   Path(tmp) / "medusa_lm_head.pt")
        heads = load_medusa_heads(tmp, model)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 3, 14, 15, 92, 65]
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]

    def engine() -> Engine:
        return Engine(model, kv_tokens=2048, page_size=16, backend="torch")

    tokens, stats = speculative_generate(engine(), prompt, MedusaDraft(heads, choices), 48)
    print(f"greedy: {stats.tokens_per_step:.2f} tokens/step over {stats.steps} steps; accepted {stats.accepted}")
    print(f"equal to plain greedy decoding: {tokens == greedy_generate(engine(), prompt, 48)}")
    tokens, stats = speculative_generate(engine(), prompt, MedusaDraft(heads, choices), 48,
                                         TypicalAcceptance(temperature=0.7, seed=0))
    print(f"typical: {stats.tokens_per_step:.2f} tokens/step (random weights are near-uniform: a high "
          f"entropy lowers the threshold, so almost every draft token passes)")


if __name__ == "__main__":
    main()
