#!/usr/bin/env python3
"""Greedy speculative decoding with prompt-lookup (n-gram) drafts on the random tiny model (CPU):
checks the tokens equal plain greedy decoding and prints the acceptance stats.

    python examples/speculative_decode.py
    python examples/speculative_decode.py --model smollm2 --prompt "Repeat after me: the cat sat on the mat."

``--model`` takes what ``treedec``'s commands take (a known name, a .gguf file, a checkpoint
folder, a hub repo id in the local cache; ``--config``, ``--device``, ``--dtype`` too).
"""
from __future__ import annotations

import argparse

from treedec.commands.args import add_model_arguments, load_model, positive_int, seed_int
from treedec.engine import Engine, greedy
from treedec.models.text import load_tokenizer
from treedec.programs.speculative import PromptLookupDraft, speculative_generate

#: The random model's prompt: token ids with a repeated phrase, which prompt lookup finds.
PROMPT_IDS = [3, 14, 15, 92, 65, 35, 89, 79, 3, 14, 15, 92, 65]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt", help="the prompt text (needs --model with a tokenizer; default for random "
                                         "weights: token ids with a repeated phrase)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens at most (default 64)")
    parser.add_argument("--seed", type=seed_int, default=0, help="random weights (default 0)")
    args = parser.parse_args()

    model, _ = load_model(args)
    prompt = PROMPT_IDS if args.model is None else load_tokenizer(args.model)(args.prompt or "Hello")["input_ids"]
    kv_tokens = None if model.device.type == "cuda" else len(prompt) + args.max_tokens + 2048
    engine = Engine(model, kv_tokens=kv_tokens, page_size=16, backend="auto")
    tokens, stats = speculative_generate(engine, prompt, PromptLookupDraft(max_ngram=3, num_draft_tokens=6,
                                                                           max_matches=2), args.max_tokens,
                                         eos_token_id=None)
    plain = Engine(model, kv_tokens=kv_tokens, page_size=16, backend="auto")
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
