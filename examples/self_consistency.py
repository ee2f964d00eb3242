#!/usr/bin/env python3
"""Self-consistency on treedec: n samples of one prompt as n branches of its node (the prompt's
KV is stored once), an answer extracted from each, and a majority vote.

    python examples/self_consistency.py                                  # random tiny model (CPU)
    python examples/self_consistency.py --model smollm2 \\
        --prompt "Q: What is 17 * 3? Think step by step, then give the number. A:"

``--model`` takes what ``treedec``'s commands take (a known name, a .gguf file, a checkpoint
folder, a hub repo id in the local cache; ``--config``, ``--device``, ``--dtype`` too). With a
checkpoint the answer is the last integer in the decoded sample. The random tiny model
has no tokenizer: its "answer" is the first token id below 16 in the sample (meaningless, but
the sampling, the None answers and the vote run exactly as with a real model).
"""
from __future__ import annotations

import argparse
import re
import time

import torch

from treedec.commands.args import add_model_arguments, load_model, positive_float, positive_int, seed_int
from treedec.engine import Engine
from treedec.models import load_tokenizer
from treedec.programs.parallel_sampling import self_consistency
from treedec.sampling.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt", default="Q: What is 17 * 3? Think step by step, then give the number. A:")
    parser.add_argument("-n", type=positive_int, default=16, help="samples")
    parser.add_argument("--max-tokens", type=positive_int, default=48)
    parser.add_argument("--temperature", type=positive_float, default=0.8)
    parser.add_argument("--top-p", type=positive_float, default=0.95)
    parser.add_argument("--seed", type=seed_int, default=0, help="random weights and sampling (default 0)")
    args = parser.parse_args()

    model, _ = load_model(args)
    if args.model is not None:
        tokenizer = load_tokenizer(args.model)
        prompt_ids, eos = tokenizer(args.prompt)["input_ids"], tokenizer.eos_token_id

        def extract_answer(tokens: list[int]) -> str | None:
            numbers = re.findall(r"-?\d+", tokenizer.decode(tokens, skip_special_tokens=True))
            return numbers[-1] if numbers else None
    else:
        prompt_ids, eos = [ord(c) % model.config.vocab_size for c in args.prompt], None

        def extract_answer(tokens: list[int]) -> str | None:
            return next((str(t) for t in tokens if t < 16), None)

    cuda = model.device.type == "cuda"
    engine = Engine(model, kv_tokens=None if cuda else 8192)
    generator = torch.Generator(device=model.device).manual_seed(args.seed)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)

    t0 = time.perf_counter()
    result = self_consistency(engine, prompt_ids, args.n, extract_answer, args.max_tokens, params,
                              eos_token_id=eos, generator=generator)
    elapsed = time.perf_counter() - t0
    stats = result.samples.stats
    print(f"{args.n} samples, {stats.steps + 1} steps in {elapsed:.2f} s; peak {stats.peak_pages} KV pages "
          f"(the prompt's {engine.pool.pages_for(len(prompt_ids))} once, not {args.n} times)")
    for i, (sample, answer) in enumerate(zip(result.samples.samples, result.answers)):
        print(f"sample {i:2d} ({sample.stop_reason}, {len(sample.tokens)} tokens): answer {answer}")
    print(f"votes: {result.votes}")
    print(f"majority answer: {result.answer}")


if __name__ == "__main__":
    main()
