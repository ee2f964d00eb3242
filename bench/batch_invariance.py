#!/usr/bin/env python3
"""Does a request give the same tokens whatever else is batched with it? Issue #53's targets on a real model, or on
a random-weights shape (``--random-weights``: the 8B shape's equalities).

Runs ``LLM.chat`` over ``--prompts`` chat prompts (a shared system prompt, then one question each) twice in one
process — the default mode and ``LLM(batch_invariant=True)`` — and counts, per mode:

- ``greedy``: the prompts in one batched call == each prompt alone (token ids, and the chosen tokens' logprobs
  bit for bit: equal logprobs of every chosen token mean equal logits up to the softmax; the tokens alone are
  counted too);
- ``sampled``: the first ``--sampled`` prompts with T 0.8, top-p 0.95 and a seed each, batched == alone;
- ``prefix_cache``: with ``enable_prefix_caching=True``, each of those prompts alone a second time (its prompt
  read from the cache: ``cached_tokens``) and once more batched == the uncached alone run;
- ``speculative``: ``speculative_config={"method": "ngram"}`` greedy, batched == plain greedy alone (tokens;
  speculative requests take no logprobs), or the reason the mode refused it.

``--random-weights``: the model is ``from_config(--config)`` (random weights, seeded; one model a mode) and the
prompts token ids (a shared 48-token prefix, then 8-80 tokens of each prompt's own), through ``LLM.generate``
with ``detokenize=False``; the counts are the same.

Also the batched greedy call's wall time in each mode (the mode's cost on this model; the 8B-shape cost is
``bench/programs.py --batch-invariant``'s). A count below all is a failure of the mode, not of the default one:
the default mode's counts are the "before" (issue #53: SmolLM2 bf16 on an H200 15/48 greedy, 3/16 sampled).

    python bench/batch_invariance.py --model smollm2                       # GPU: bf16, 48 prompts, 96 tokens
    python bench/batch_invariance.py --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --out bench/results
    python bench/batch_invariance.py --smoke                               # CPU: fp32, 3 prompts, 6 tokens
    python bench/batch_invariance.py --random-weights --config llama3-8b   # GPU: the 8B shape, bf16
    python bench/batch_invariance.py --random-weights --smoke              # CPU: the tiny shape (CI)

Results: ``<out>/<date>-<device>-batch-invariance[-tag].json`` (``--random-weights``: tag ``random-<config>`` unless
``--tag``) (device, versions, settings, every count, the first
differing token of each unequal pair).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, versions, write_results  # noqa: E402
from treedec import LLM, SamplingParams  # noqa: E402
from treedec.models import from_config  # noqa: E402
from treedec.models.config import MODEL_SIZES  # noqa: E402

SYSTEM = ("You are a careful assistant. Answer in plain sentences, give one short example where it helps, and do "
          "not repeat the question.")
TOPICS = ("a hash table", "photosynthesis", "the French revolution", "binary search", "inflation", "a compiler",
          "plate tectonics", "recursion", "the immune system", "public-key cryptography", "a black hole",
          "supply and demand", "TCP and UDP", "the water cycle", "gradient descent", "the Roman republic")
TASKS = ("Explain {} to a new student.", "Give three facts about {}.", "What is a common mistake about {}?")


def conversations(n: int) -> list[list[dict]]:
    """``n`` chat conversations: the shared system prompt, then a question over a topic and a task."""
    questions = [task.format(topic) for task in TASKS for topic in TOPICS]
    if n > len(questions):
        raise ValueError(f"--prompts must be at most {len(questions)}, got {n}")
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions[:n]]


def token_prompts(n: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of a random-weights run: a shared 48-token prefix, then 8-80 tokens of each's own."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, 48).tolist()
    return [prefix + rng.integers(0, vocab_size, int(rng.integers(8, 81))).tolist() for _ in range(n)]


@dataclass
class Source:
    """Where a run's requests come from: a checkpoint's chat (``model`` a name or path, ``prompts`` conversations)
    or a random-weights shape (``config`` a model-size name, ``prompts`` token ids, made once a mode)."""

    model: str | None
    config: str | None
    prompts: list
    dtype: torch.dtype | None = None
    device: str | None = None
    seed: int = 0

    def llm(self, args, invariant: bool, built, **options) -> LLM:
        """An LLM of one mode over the checkpoint, or over ``built`` (the mode's random model)."""
        if built is None:
            return LLM(self.model, dtype=args.dtype, device=args.device, batch_invariant=invariant,
                       kv_tokens=args.kv_tokens, **options)
        return LLM(built, batch_invariant=invariant, kv_tokens=args.kv_tokens, **options)

    def build(self):
        """The mode's random-weights model (None for a checkpoint: each LLM loads it)."""
        if self.config is None:
            return None
        return from_config(self.config, seed=self.seed, dtype=self.dtype, device=self.device)

    def ask(self, llm: LLM, prompts: list, params) -> list:
        """The outputs of ``prompts`` (a list of this source's prompts) in one call."""
        if self.config is None:
            return llm.chat(prompts, params, use_tqdm=False)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _key(output) -> tuple:
    """An output's tokens and, where it has them, its chosen tokens' logprobs (floats compared exactly)."""
    c = output.outputs[0]
    logprobs = None if c.logprobs is None else tuple(step[t].logprob for step, t in zip(c.logprobs, c.token_ids))
    return tuple(c.token_ids), logprobs


def compare(batched, alone) -> dict:
    """How many of the pairs are equal (tokens and logprobs bit for bit: ``equal``; tokens only:
    ``tokens_equal``), and where each unequal pair first differs (a token index; the length where all agree)."""
    first, tokens_equal = [], 0
    for b, a in zip(batched, alone):
        (bt, bl), (at, al) = _key(b), _key(a)
        tokens_equal += bt == at
        if (bt, bl) == (at, al):
            continue
        tokens = next((i for i, (x, y) in enumerate(zip(bt, at)) if x != y), min(len(bt), len(at)))
        logprob = None if bl is None or al is None else next(
            (i for i, (x, y) in enumerate(zip(bl, al)) if x != y), min(len(bl), len(al)))
        first.append({"tokens": tokens, "logprobs": logprob})
    return {"equal": len(batched) - len(first), "tokens_equal": tokens_equal, "of": len(batched),
            "first_difference": first}


def _free(llm) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_mode(args, invariant: bool, source: Source) -> dict:
    """Every count of one mode."""
    text = source.config is None
    greedy = SamplingParams(temperature=0, max_tokens=args.new, logprobs=0, detokenize=text)
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=args.new, logprobs=0,
                              detokenize=text) for i in range(args.sampled)]
    convs = source.prompts
    few = convs[:args.sampled]
    result = {}
    built = source.build()
    llm = source.llm(args, invariant, built)
    source.ask(llm, convs[:2], greedy)   # warm-up: graphs captured, kernels compiled
    start = time.perf_counter()
    batched = source.ask(llm, convs, greedy)
    result["batched_greedy_seconds"] = time.perf_counter() - start
    result["batched_greedy_tokens"] = sum(len(o.outputs[0].token_ids) for o in batched)
    alone = [source.ask(llm, [c], greedy)[0] for c in convs]
    result["greedy"] = compare(batched, alone)
    sampled_batched = source.ask(llm, few, sampled)
    sampled_alone = [source.ask(llm, [c], p)[0] for c, p in zip(few, sampled)]
    result["sampled"] = compare(sampled_batched, sampled_alone)
    _free(llm)

    llm = source.llm(args, invariant, built, enable_prefix_caching=True)
    miss = [source.ask(llm, [c], greedy)[0] for c in few]
    hit = [source.ask(llm, [c], greedy)[0] for c in few]
    hit_batched = source.ask(llm, few, greedy)
    result["prefix_cache"] = {"miss_vs_alone": compare(miss, alone[:len(few)]),
                              "hit_vs_alone": compare(hit, alone[:len(few)]),
                              "hit_batched_vs_alone": compare(hit_batched, alone[:len(few)]),
                              "cached_tokens_hit": sum(o.stats.get("cached_tokens", 0) for o in hit),
                              "prompt_tokens": sum(len(o.prompt_token_ids) for o in hit)}
    _free(llm)

    plain = SamplingParams(temperature=0, max_tokens=args.new)   # (speculative programs always detokenize)
    try:
        llm = source.llm(args, invariant, built, speculative_config={"method": "ngram"})
    except (ValueError, TypeError) as e:   # the mode's refusals are ValueErrors naming the option
        result["speculative"] = {"refused": str(e)}
    else:
        spec = source.ask(llm, few, plain)
        result["speculative"] = compare(spec, [_plain(o) for o in alone[:len(few)]])
        result["speculative"]["tokens_per_step"] = sum(o.stats.get("tokens_per_step", 1.0) for o in spec) / len(spec)
        _free(llm)
    _free(built)
    return result


def _plain(output):
    """``output`` without logprobs (speculative outputs carry none)."""
    c = output.outputs[0]
    return type(output)(output.request_id, output.prompt, output.prompt_token_ids, None,
                        [type(c)(c.index, c.text, c.token_ids, None, None, c.finish_reason, c.stop_reason)])


def _count(found: dict) -> str:
    return f"{found['equal']}/{found['of']} (tokens {found['tokens_equal']})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="smollm2", help="any name or path LLM takes (default smollm2)")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--device", default=None)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--sampled", type=int, default=16, help="prompts of the sampled, cache and speculative runs")
    parser.add_argument("--new", type=int, default=96, help="new tokens a request (it may end earlier at EOS)")
    parser.add_argument("--kv-tokens", type=int, default=65536)
    parser.add_argument("--modes", default="default,invariant")
    parser.add_argument("--random-weights", action="store_true",
                        help="a random-weights model of --config's shape, token-id prompts (no tokenizer)")
    parser.add_argument("--config", default=None,
                        help="--random-weights: the shape (a treedec.models.config name; default llama3-8b, "
                             "tiny with --smoke)")
    parser.add_argument("--seed", type=int, default=0, help="--random-weights: the weights' and prompts' seed")
    parser.add_argument("--smoke", action="store_true", help="CPU, 3 prompts, 6 tokens")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if args.config is not None and not args.random_weights:
        parser.error("--config names a random-weights shape: add --random-weights (a checkpoint is --model)")
    if args.smoke:
        args.device, args.prompts, args.sampled, args.new, args.kv_tokens = "cpu", 3, 2, 6, 4096
    modes = args.modes.split(",")
    if not modes or set(modes) - {"default", "invariant"}:
        parser.error(f"--modes takes default and/or invariant, got {args.modes!r}")
    if not 0 < args.sampled <= args.prompts:
        parser.error(f"--sampled must be in [1, --prompts], got {args.sampled}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.random_weights:
        args.config = args.config or ("tiny" if args.smoke else "llama3-8b")
        model_dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bf16": torch.bfloat16,
                       "fp32": torch.float32}.get(args.dtype)
        if model_dtype is None:
            parser.error(f"--random-weights takes --dtype auto, bf16 or fp32, got {args.dtype!r}")
        if args.config not in MODEL_SIZES:
            parser.error(f"--config must be one of {', '.join(MODEL_SIZES)}, got {args.config!r}")
        vocab = MODEL_SIZES[args.config].vocab_size
        source = Source(None, args.config, token_prompts(args.prompts, vocab, args.seed), model_dtype, str(device),
                        args.seed)
    else:
        source = Source(args.model, None, conversations(args.prompts))
    results = {"device": device_name(device), "versions": versions("triton", "transformers"),
               "date": time.strftime("%Y-%m-%d"), "settings": {k: v for k, v in vars(args).items() if k != "out"},
               "modes": {}}
    for mode in modes:
        found = results["modes"][mode] = run_mode(args, mode == "invariant", source)
        cache = found["prefix_cache"]
        print(f"{mode}: greedy batched == alone {_count(found['greedy'])}, sampled {_count(found['sampled'])}, "
              f"cache hit == miss "
              f"{cache['hit_vs_alone']['equal']}/{cache['hit_vs_alone']['of']} (hit batched "
              f"{cache['hit_batched_vs_alone']['equal']}; {cache['cached_tokens_hit']} of {cache['prompt_tokens']} "
              f"prompt tokens cached), speculative "
              + (f"refused: {found['speculative']['refused']}" if "refused" in found["speculative"] else
                 f"== plain {found['speculative']['equal']}/{found['speculative']['of']}")
              + f"; batched greedy {found['batched_greedy_seconds']:.2f} s for {found['batched_greedy_tokens']} tokens")
    if len(modes) == 2:
        d, i = (results["modes"][m]["batched_greedy_seconds"] for m in ("default", "invariant"))
        results["invariant_over_default_seconds"] = i / d
        print(f"the batched greedy call in the mode: {i / d:.2f}x the default mode's")
    tag = args.tag or (f"random-{args.config}" if args.random_weights else None)
    write_results(results, args.out, "batch-invariance", smoke=args.smoke, tag=tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
