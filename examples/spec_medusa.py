#!/usr/bin/env python3
"""Medusa speculative decoding on the random tiny model (CPU): heads saved and loaded in the
Medusa project's checkpoint layout, greedy acceptance checked against plain greedy decoding,
then Medusa's typical acceptance.

    python examples/spec_medusa.py
    python examples/spec_medusa.py --model smollm2 --prompt "Name three primes."

The heads here are untrained (Medusa's initialisation), so greedy acceptance is low; with
a real model pass its ``medusa_lm_head.safetensors`` directory to ``load_medusa_heads``.
``--model`` takes what ``treedec``'s commands take (a known name, a .gguf file, a checkpoint
folder, a hub repo id in the local cache; ``--config``, ``--device``, ``--dtype`` too).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from treedec.commands.args import add_model_arguments, load_model, positive_int, seed_int
from treedec.engine import Engine
from treedec.models import MedusaHeads, load_medusa_heads
from treedec.models.text import load_tokenizer
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative import MedusaDraft, TypicalAcceptance, speculative_generate

#: The random model's prompt (token ids).
PROMPT_IDS = [3, 14, 15, 92, 65, 35, 89, 79, 3, 14, 15, 92, 65]
CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt", help="the prompt text (needs --model with a tokenizer; default for random "
                                         "weights: token ids)")
    parser.add_argument("--max-tokens", type=positive_int, default=48, help="new tokens at most (default 48)")
    parser.add_argument("--seed", type=seed_int, default=0, help="random weights and typical acceptance (default 0)")
    args = parser.parse_args()

    model, _ = load_model(args)
    prompt = PROMPT_IDS if args.model is None else load_tokenizer(args.model)(args.prompt or "Hello")["input_ids"]
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(MedusaHeads.untrained(model, num_heads=4).medusa_head.state_dict(),
                   Path(tmp) / "medusa_lm_head.pt")
        heads = load_medusa_heads(tmp, model)

    def engine() -> Engine:
        cuda = model.device.type == "cuda"
        return Engine(model, kv_tokens=None if cuda else len(prompt) + args.max_tokens + 2048, page_size=16)

    tokens, stats = speculative_generate(engine(), prompt, MedusaDraft(heads, CHOICES), args.max_tokens,
                                         eos_token_id=None)
    print(f"greedy: {stats.tokens_per_step:.2f} tokens/step over {stats.steps} steps; accepted {stats.accepted}")
    print(f"equal to plain greedy decoding: "
          f"{tokens == greedy_generate(engine(), prompt, args.max_tokens, eos_token_id=None)}")
    tokens, stats = speculative_generate(engine(), prompt, MedusaDraft(heads, CHOICES), args.max_tokens,
                                         TypicalAcceptance(temperature=0.7, seed=args.seed), eos_token_id=None)
    print(f"typical: {stats.tokens_per_step:.2f} tokens/step (random weights are near-uniform: a high "
          f"entropy lowers the threshold, so almost every draft token passes)")


if __name__ == "__main__":
    main()
