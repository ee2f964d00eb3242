#!/usr/bin/env python3
"""Does a request give the same tokens whatever else is batched with it? Issue #53's targets on a real model.

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

Also the batched greedy call's wall time in each mode (the mode's cost on this model; the 8B-shape cost is
``bench/programs.py --batch-invariant``'s). A count below all is a failure of the mode, not of the default one:
the default mode's counts are the "before" (issue #53: SmolLM2 bf16 on an H200 15/48 greedy, 3/16 sampled).

    python bench/batch_invariance.py --model smollm2                       # GPU: bf16, 48 prompts, 96 tokens
    python bench/batch_invariance.py --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --out bench/results
    python bench/batch_invariance.py --smoke                               # CPU: fp32, 3 prompts, 6 tokens

Results: ``<out>/<date>-<device>-batch-invariance[-tag].json`` (device, versions, settings, every count, the first
differing token of each unequal pair).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, versions, write_results  # noqa: E402
from treedec import LLM, SamplingParams  # noqa: E402

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


def _llm(args, invariant: bool, **options) -> LLM:
    return LLM(args.model, dtype=args.dtype, device=args.device, batch_invariant=invariant, kv_tokens=args.kv_tokens,
               **options)


def _free(llm) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_mode(args, invariant: bool, convs: list) -> dict:
    """Every count of one mode."""
    greedy = SamplingParams(temperature=0, max_tokens=args.new, logprobs=0)
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=args.new, logprobs=0)
               for i in range(args.sampled)]
    few = convs[:args.sampled]
    result = {}
    llm = _llm(args, invariant)
    llm.chat(convs[:2], greedy, use_tqdm=False)   # warm-up: graphs captured, kernels compiled
    start = time.perf_counter()
    batched = llm.chat(convs, greedy, use_tqdm=False)
    result["batched_greedy_seconds"] = time.perf_counter() - start
    result["batched_greedy_tokens"] = sum(len(o.outputs[0].token_ids) for o in batched)
    alone = [llm.chat(c, greedy, use_tqdm=False)[0] for c in convs]
    result["greedy"] = compare(batched, alone)
    sampled_batched = llm.chat(few, sampled, use_tqdm=False)
    sampled_alone = [llm.chat(c, p, use_tqdm=False)[0] for c, p in zip(few, sampled)]
    result["sampled"] = compare(sampled_batched, sampled_alone)
    _free(llm)

    llm = _llm(args, invariant, enable_prefix_caching=True)
    miss = [llm.chat(c, greedy, use_tqdm=False)[0] for c in few]
    hit = [llm.chat(c, greedy, use_tqdm=False)[0] for c in few]
    hit_batched = llm.chat(few, greedy, use_tqdm=False)
    result["prefix_cache"] = {"miss_vs_alone": compare(miss, alone[:len(few)]),
                              "hit_vs_alone": compare(hit, alone[:len(few)]),
                              "hit_batched_vs_alone": compare(hit_batched, alone[:len(few)]),
                              "cached_tokens_hit": sum(o.stats.get("cached_tokens", 0) for o in hit),
                              "prompt_tokens": sum(len(o.prompt_token_ids) for o in hit)}
    _free(llm)

    plain = SamplingParams(temperature=0, max_tokens=args.new)
    try:
        llm = _llm(args, invariant, speculative_config={"method": "ngram"})
    except (ValueError, TypeError) as e:   # the mode's refusals are ValueErrors naming the option
        result["speculative"] = {"refused": str(e)}
    else:
        spec = llm.chat(few, plain, use_tqdm=False)
        result["speculative"] = compare(spec, [_plain(o) for o in alone[:len(few)]])
        result["speculative"]["tokens_per_step"] = sum(o.stats.get("tokens_per_step", 1.0) for o in spec) / len(spec)
        _free(llm)
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
    parser.add_argument("--smoke", action="store_true", help="CPU, 3 prompts, 6 tokens")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.prompts, args.sampled, args.new, args.kv_tokens = "cpu", 3, 2, 6, 4096
    modes = args.modes.split(",")
    if not modes or set(modes) - {"default", "invariant"}:
        parser.error(f"--modes takes default and/or invariant, got {args.modes!r}")
    if not 0 < args.sampled <= args.prompts:
        parser.error(f"--sampled must be in [1, --prompts], got {args.sampled}")
    convs = conversations(args.prompts)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results = {"device": device_name(device), "versions": versions("triton", "transformers"),
               "date": time.strftime("%Y-%m-%d"), "settings": {k: v for k, v in vars(args).items() if k != "out"},
               "modes": {}}
    for mode in modes:
        found = results["modes"][mode] = run_mode(args, mode == "invariant", convs)
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
    write_results(results, args.out, "batch-invariance", smoke=args.smoke, tag=args.tag or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
