#!/usr/bin/env python3
"""Tokens per verification step of each draft source on a real model and real text (CPU).

The model is SmolLM2-135M-Instruct (the tests' real checkpoint: bench/real_checkpoint.py fetches
and converts it once). Each chat prompt is decoded greedily with speculative decoding by every
draft source; greedy acceptance, so every source emits the same tokens (checked) and only the
tokens per step differ:

- ``ngram``: prompt lookup (``PromptLookupDraft``), 8 tokens per match, 2 matches;
- ``draft-model``: the model drafting for itself (``DraftModelDraft``, depth 4, top-k 4, 16
  tokens): the ceiling a perfect draft model reaches with these tree sizes;
- ``medusa-untrained``: untrained Medusa heads (Medusa's initialisation: every head predicts the
  next token), the floor of head-based drafts;
- ``eagle-untrained``, ``eagle3-untrained``: EAGLE-1 and EAGLE-3 drafters with random weights
  (``EagleDrafter.random``; EAGLE-3 reads layers 2, 15, 27 and drafts over 8192 random tokens of
  the 49152), on the draft model's tree sizes: the floor of EAGLE drafts, before any training.

    python bench/acceptance_real.py              # about two and a half minutes on 2 CPU cores
    python bench/acceptance_real.py --new 64 --out bench/results
    python bench/acceptance_real.py --smoke     # one prompt, 6 tokens (CI)

Results: ``<out>/<date>-cpu-acceptance-real.json`` with every prompt's tokens per step per source.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import versions, write_results  # noqa: E402
from bench.real_checkpoint import smollm2_checkpoint  # noqa: E402
from treedec.engine import Engine  # noqa: E402
from treedec.models import from_pretrained  # noqa: E402
from treedec.models.eagle_drafter import EagleDrafter  # noqa: E402
from treedec.models.text import encode_prompt, load_tokenizer  # noqa: E402
from treedec.programs.speculative.draft_model import DraftModelDraft  # noqa: E402
from treedec.programs.speculative.drafts import PromptLookupDraft  # noqa: E402
from treedec.programs.speculative.eagle import EagleDraft  # noqa: E402
from treedec.models.medusa import MedusaHeads  # noqa: E402
from treedec.programs.speculative.medusa import MedusaDraft  # noqa: E402
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.program import speculative_generate  # noqa: E402

CHATS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarize in three sentences: the water cycle moves water between the oceans, the air and the land. "
    "Water evaporates from the oceans, condenses into clouds and falls as rain or snow, which flows back "
    "to the oceans in rivers.",
    "List the planets of the solar system in order from the Sun, one per line.",
    "Explain what a hash table is to a new programmer.",
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=48, help="new tokens per prompt")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tag", default=None)
    parser.add_argument("--smoke", action="store_true", help="one prompt, 6 tokens (CI)")
    args = parser.parse_args(argv)
    chats = CHATS[:1] if args.smoke else CHATS
    if args.smoke:
        args.new = 6
    folder = smollm2_checkpoint()
    model = from_pretrained(folder, dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer(folder)

    def engine(of=model) -> Engine:
        return Engine(of, kv_tokens=8192, page_size=16, backend="torch")

    eagle = EagleDrafter.random(model, "eagle", seed=0)
    eagle3 = EagleDrafter.random(model, "eagle3", seed=0, draft_vocab_size=8192)

    sources = {
        "ngram": lambda: PromptLookupDraft(num_draft_tokens=8, max_matches=2),
        "draft-model": lambda: DraftModelDraft(engine(), depth=4, top_k=4, total_tokens=16),
        "medusa-untrained": lambda: MedusaDraft(MedusaHeads.untrained(model, num_heads=4)),
        "eagle-untrained": lambda: EagleDraft(engine(eagle), depth=4, top_k=4, total_tokens=16),
        "eagle3-untrained": lambda: EagleDraft(engine(eagle3), depth=4, top_k=4, total_tokens=16),
    }
    rows = []
    for text in chats:
        prompt = encode_prompt(tokenizer, [{"role": "user", "content": text}], True)
        reference = greedy_generate(engine(), prompt, args.new)
        row = {"prompt": text, "prompt_tokens": len(prompt), "new_tokens": len(reference), "sources": {}}
        for name, make in sources.items():
            tokens, stats = speculative_generate(engine(), prompt, make(), args.new)
            if tokens != reference:
                raise RuntimeError(f"{name}: greedy speculative decoding differs from plain greedy on {text[:40]!r}")
            row["sources"][name] = {"steps": stats.steps, "tokens_per_step": stats.tokens_per_step,
                                    "accepted_mean": statistics.fmean(stats.accepted) if stats.accepted else 0.0,
                                    "draft_tokens_mean": statistics.fmean(stats.draft_sizes) if stats.draft_sizes
                                    else 0.0}
        rows.append(row)
        print(f"{text[:40]!r:44} " + "  ".join(f"{n} {s['tokens_per_step']:.2f}" for n, s in row["sources"].items()),
              flush=True)
    means = {name: statistics.fmean(r["sources"][name]["tokens_per_step"] for r in rows) for name in sources}
    print("mean tokens per step: " + ", ".join(f"{n} {v:.2f}" for n, v in means.items()))
    results = {"device": "cpu", "date": datetime.date.today().isoformat(), "versions": versions(),
               "model": "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantized to float32)", "acceptance": "greedy",
               "new_tokens": args.new, "prompts": rows, "mean_tokens_per_step": means}
    write_results(results, args.out, "acceptance-real", args.smoke, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
