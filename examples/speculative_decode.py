#!/usr/bin/env python3
"""Greedy speculative decoding with prompt-lookup (n-gram) drafts on the random tiny model (CPU):
checks the tokens equal plain greedy decoding and prints the acceptance stats.

    python examples/speculative_decode.py
"""
from __future__ import annotations

import torch

from treedec.engine import Engine, greedy
from treedec.models import from_config
from treedec.search.speculative import PromptLookupDraft, speculative_generate


def main() -> None:
    model = from_config("tiny", seed=0, dtype=torch.float32, device="cpu")
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 3, 14, 15, 92, 65]
    engine = Engine(model, kv_tokens=2048, page_size=16, backend="torch")
    tokens, stats = speculative_generate(engine, prompt, PromptLookupDraft(max_ngram=3, num_draft_tokens=6,
                                                                           max_matches=2), 64)
    plain = Engine(model, kv_tokens=2048, page_size=16, backend="torch")
    prefilled = plain.prefill(prompt)
    ref = [int(greedy(prefilled.logits))]
    while len(ref) < len(tokens):
        plain.tree.extend(prefilled.node, ref[-1:])
        ref.append(int(greedy(plain.step().logits[0])))
    print(f"{len(tokens)} tokens in {stats.steps} verification steps ({stats.tokens_per_step:.2f} tokens/step); "
          f"accepted per step: {stats.accepted}")
    print(f"equal to plain greedy decoding: {tokens == ref}")


if __name__ == "__main__":
    main()
