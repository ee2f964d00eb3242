#!/usr/bin/env python3
"""The batched sampler's device time: ``sample_rows`` over ``L`` rows of a ``V``-token vocabulary, by field.

Each case draws one token per row from fresh random logits (bf16, as a model's LM head gives them) with the
batch's rows all under one set of parameters: greedy; temperature; temperature + top-p; + top-k; + min-p;
the penalties; every field; under each ``--kernel`` of the warp and draw (``torch``: the reference; ``triton``: the
fused kernel; ``auto``: what ``sample_rows`` takes on the device, printed). Times are ``triton.testing.do_bench``
medians (CUDA; L2 flushed between calls) or perf_counter medians (CPU) of the whole call, as the lanes' step runs
it (no host sync inside it); on CUDA also the per-call time of 32 calls replayed from one CUDA graph (``graphed``:
no launch cost, as the lanes' graphed step runs it; at small L eager times are mostly host launches).

    python bench/sampler.py                         # GPU: L = 1, 8, 64; V = 128256 (Llama 3)
    python bench/sampler.py --kernel torch,triton --cases greedy,top_p,all
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
from bench.timing import graphed_us, time_us  # noqa: E402
from treedec.sampling.params import SamplingParams  # noqa: E402
from treedec.sampling.sampler import SAMPLER_KERNELS, SamplingRows, resolve_sampler_kernel, sample_rows  # noqa: E402

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


def time_case(params: SamplingParams, rows: int, vocab: int, device: torch.device, seed: int,
              kernel: str) -> dict[str, float]:
    """Microseconds of one ``sample_rows`` call over ``rows`` rows of ``vocab`` logits under ``params`` with the
    warp-and-draw ``kernel``: ``eager`` (a call as it is launched) and, on CUDA, ``graphed`` (replayed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, device=device).mul_(3).to(torch.bfloat16)
    table = SamplingRows.build([params] * rows, [params.seed or 0] * rows, list(range(rows)), device)
    draws = torch.zeros(rows, dtype=torch.int64, device=device)
    prompt_mask = torch.rand(rows, vocab, generator=gen, device=device) < 0.01
    counts = torch.randint(0, 3, (rows, vocab), generator=gen, device=device) * (
        torch.rand(rows, vocab, generator=gen, device=device) < 0.001)

    def call():
        return sample_rows(logits, table, draws, prompt_mask, counts, kernel=kernel)

    times = {"eager": time_us(call, device)}
    if device.type == "cuda":
        times["graphed"] = graphed_us([call])
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64", help="comma-separated row counts")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--kernel", default="auto",
                        help=f"comma-separated warp-and-draw kernels, of {', '.join(SAMPLER_KERNELS)}")
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
    try:
        kernels = {k: resolve_sampler_kernel(k, device) for k in args.kernel.split(",")}
    except (ValueError, RuntimeError) as error:
        parser.error(f"--kernel: {error}")
    rows = [int(r) for r in args.rows.split(",")]
    results = {"device": device_name(device), "versions": versions("triton"), "vocab": args.vocab,
               "rows": rows, "kernels": kernels, "us": {}}
    print(f"sample_rows on {results['device']}, vocab {args.vocab}: microseconds a call"
          + "".join(f"; --kernel {k} is {v}" for k, v in kernels.items() if k != v))
    timings = ("eager", "graphed") if device.type == "cuda" else ("eager",)
    print(f"{'case':<14}{'kernel':<8}{'timing':<9}" + "".join(f"{f'L={r}':>10}" for r in rows))
    for name in cases:
        for kernel in dict.fromkeys(kernels.values()):
            times = [time_case(CASES[name], r, args.vocab, device, args.seed, kernel) for r in rows]
            results["us"].setdefault(name, {})[kernel] = {t: [row[t] for row in times] for t in timings}
            for t in timings:
                print(f"{name:<14}{kernel:<8}{t:<9}" + "".join(f"{row[t]:>10.1f}" for row in times), flush=True)
    write_results(results, args.out, "sampler", smoke=args.smoke, tag=args.tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
