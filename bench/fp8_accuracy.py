#!/usr/bin/env python3
"""fp8 accuracy on a real model (issue #52's targets): fp8 weights and/or an fp8 KV cache against the float model.

For each of ``--prompts`` (16) English prompts through the model's tokenizer:

- **greedy**: ``--tokens`` (256) greedy tokens of the float model (``--dtype``, float KV) and of the fp8 one
  (``--quantization fp8`` and/or ``--kv-cache-dtype fp8``); ``agree_before_first_difference`` is the share of the
  tokens generated before the first one that differs (target >= 0.95, averaged over the prompts);
- **teacher-forced**: the float model's prompt + greedy text fed to both in one step, the next-token distribution at
  every position: the top-1 agreement (target >= 0.98) and the mean KL(float || fp8) (reported).

``--calibrate`` sets an fp8 pool's scales from the prompts first (``Engine.calibrate_kv_scales``; default: the
checkpoint's k_scale / v_scale, else 1.0). One JSON line per run to ``--out`` (default stdout) and a summary.

    python bench/fp8_accuracy.py --model smollm2 --kv-cache-dtype fp8                      # fp8 KV alone
    python bench/fp8_accuracy.py --model smollm2 --quantization fp8                        # fp8 weights alone
    python bench/fp8_accuracy.py --model gemma3-270m --quantization fp8 --kv-cache-dtype fp8 --calibrate
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from treedec.engine import Engine  # noqa: E402
from treedec.models import from_pretrained  # noqa: E402
from treedec.models.quantization import QUANTIZATIONS  # noqa: E402
from treedec.models.text import load_tokenizer  # noqa: E402
from treedec.programs.greedy import greedy_generate  # noqa: E402
from treedec.tree.kv_cache_dtype import KV_CACHE_DTYPES  # noqa: E402

PROMPTS = [
    "The history of the printing press begins", "Here is a short recipe for bread:", "Photosynthesis is the process",
    "Once upon a time, in a small village by the sea,", "The three laws of motion state that",
    "A good way to learn a new language is", "def fibonacci(n):", "The capital of France is Paris, and the capital of",
    "In 1969, astronauts landed on the Moon.", "To sort a list of numbers in Python, you can",
    "The weather today is", "Dear hiring manager, I am writing to apply for",
    "The main causes of the French Revolution",
    "Water boils at 100 degrees Celsius at sea level because", "Q: What is the largest planet? A:",
    "Machine learning models are trained by",
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def engine(model, kv_cache_dtype: str, tokens: int) -> Engine:
    return Engine(model, kv_tokens=tokens, page_size=16, kv_cache_dtype=kv_cache_dtype)


def teacher_forced(e: Engine, prompt: list[int], text: list[int]) -> torch.Tensor:
    """``[len(text), vocab]`` float32: the next-token logits after the prompt and after each text token but the
    last, in one step (the text's tokens as one continuation)."""
    root = e.prefill(prompt)
    first = root.logits.reshape(-1, root.logits.shape[-1])[-1:]
    e.tree.extend(root.node, text[:-1])
    rest = e.step().logits
    e.tree.prune(root.node)
    return torch.cat([first, rest]).float()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a known name, checkpoint folder or .gguf (treedec's --model)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the float model's (and the fp8 one's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--calibrate", action="store_true", help="calibrate the fp8 pool's scales on the prompts")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", default=None, help="a JSONL file (default: stdout)")
    args = p.parse_args(argv)
    if args.quantization is None and args.kv_cache_dtype == "auto":
        raise SystemExit("nothing to compare: give --quantization fp8 and/or --kv-cache-dtype fp8")
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    tokenizer = load_tokenizer(args.model)
    prompts = [tokenizer.encode(t) for t in (PROMPTS * 2)[:args.prompts]]
    reference_model = from_pretrained(args.model, dtype=dtype, device=device)
    test_model = from_pretrained(args.model, dtype=dtype, device=device, quantization=args.quantization) \
        if args.quantization else reference_model
    size = max(len(x) for x in prompts) + args.tokens + 64
    ref_engine, test_engine = engine(reference_model, "auto", size), engine(test_model, args.kv_cache_dtype, size)
    if args.calibrate:
        test_engine.calibrate_kv_scales(prompts)
    runs = []
    for prompt in prompts:
        want = greedy_generate(ref_engine, prompt, args.tokens, eos_token_id=None)
        ref_engine.tree.prune(ref_engine.tree.roots[0])
        got = greedy_generate(test_engine, prompt, args.tokens, eos_token_id=None)
        test_engine.tree.prune(test_engine.tree.roots[0])
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        ref, test = teacher_forced(ref_engine, prompt, want), teacher_forced(test_engine, prompt, want)
        logp, logq = ref.log_softmax(-1), test.log_softmax(-1)
        runs.append({"prompt_tokens": len(prompt), "agree_before_first_difference": first / len(want),
                     "teacher_forced_top1": float((ref.argmax(-1) == test.argmax(-1)).float().mean()),
                     "mean_kl": float((logp.exp() * (logp - logq)).sum(-1).mean())})
    summary = {"model": args.model, "dtype": args.dtype, "device": str(device), "quantization": args.quantization,
               "kv_cache_dtype": test_engine.kv_cache_dtype, "kv_scales": test_engine.kv_scale_source,
               "weights": test_model.linear_paths(), "prompts": len(runs), "tokens": args.tokens,
               **{k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k != "prompt_tokens"},
               "targets": {"agree_before_first_difference": 0.95, "teacher_forced_top1": 0.98}}
    lines = [json.dumps(r) for r in runs] + [json.dumps({"summary": summary})]
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    else:
        print("\n".join(lines))
    print(json.dumps(summary, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
