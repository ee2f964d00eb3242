#!/usr/bin/env python3
"""The batched sampler's device time: ``sample_rows`` over ``L`` rows of a ``V``-token vocabulary, by field.

Each case draws one token per row from fresh random logits (bf16, as a model's LM head gives them) with the
batch's rows all under one set of parameters: greedy; temperature; temperature + top-p; + top-k; + min-p;
the penalties; every field. Times are ``triton.testing.do_bench`` medians (CUDA; L2 flushed between calls)
or perf_counter medians (CPU) of the whole call, as the lanes' step runs it (no host sync inside it).

    python bench/sampler.py                         # GPU: L = 1, 8, 64; V = 128256 (Llama 3)
    python bench/sampler.py --rows 64 --vocab 32000
    python bench/sampler.py --smoke                 # CPU, small (CI)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import add_run_arguments, device_name, versions, write_results  # noqa: E402
from bench.timing import time_us  # noqa: E402
from treedec.sampling.params import SamplingParams  # noqa: E402
from treedec.sampling.sampler import SamplingRows, sample_rows  # noqa: E402

#: name -> the SamplingParams every row of the case draws with
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8, seed=0),
    "top_p": SamplingParams(temperature=0.8, top_p=0.95, seed=0),
    "top_k": SamplingParams(temperature=0.8, top_k=50, seed=0),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=0),
    "min_p": SamplingParams(temperature=0.8, min_p=0.05, seed=0),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5,
                                frequency_penalty=0.5, seed=0),
    "all": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                          presence_penalty=0.5, frequency_penalty=0.5, seed=0),
}


def time_case(params: SamplingParams, rows: int, vocab: int, device: torch.device, seed: int) -> float:
    """Microseconds of one ``sample_rows`` call over ``rows`` rows of ``vocab`` logits under ``params``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, device=device).mul_(3).to(torch.bfloat16)
    table = SamplingRows.build([params] * rows, [params.seed or 0] * rows, list(range(rows)), device)
    draws = torch.zeros(rows, dtype=torch.int64, device=device)
    prompt_mask = torch.rand(rows, vocab, generator=gen, device=device) < 0.01
    counts = torch.randint(0, 3, (rows, vocab), generator=gen, device=device) * (
        torch.rand(rows, vocab, generator=gen, device=device) < 0.001)
    return time_us(lambda: sample_rows(logits, table, draws, prompt_mask, counts), device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64", help="comma-separated row counts")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--smoke", action="store_true", help="CPU, rows 1,4, vocab 1000")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown --cases {unknown}; known: {', '.join(CASES)}")
    if args.smoke:
        args.rows, args.vocab = "1,4", 1000
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rows = [int(r) for r in args.rows.split(",")]
    results = {"device": device_name(device), "versions": versions("triton"), "vocab": args.vocab,
               "rows": rows, "us": {}}
    print(f"sample_rows on {results['device']}, vocab {args.vocab}: microseconds a call")
    print(f"{'case':<14}" + "".join(f"{f'L={r}':>10}" for r in rows))
    for name in cases:
        results["us"][name] = [time_case(CASES[name], r, args.vocab, device, args.seed) for r in rows]
        print(f"{name:<14}" + "".join(f"{us:>10.1f}" for us in results["us"][name]), flush=True)
    write_results(results, args.out, "sampler", smoke=args.smoke, tag=args.tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
