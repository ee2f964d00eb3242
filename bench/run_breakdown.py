#!/usr/bin/env python3
"""Where does one TreeAttention.run go? Host time per call and device time per kernel.

For each workload: the host wall time of ``run`` (many calls, one sync at the end), the
functions that take it (cProfile), and each kernel's device time (torch.profiler). Run on
a GPU machine:

    python bench/run_breakdown.py [--workloads spec_medusa64_p4k,tot_d5w10] [--chunk-size 512]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.families import WORKLOADS  # noqa: E402
from bench.suite import HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS  # noqa: E402
from treedec import PlanConfig, TreeAttention  # noqa: E402


def host_us_per_call(fn, calls: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def top_functions(fn, calls: int = 200, rows: int = 12) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def kernel_times_us(fn, calls: int = 20) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count:
            out[event.key[:60]] = event.self_device_time_total / calls
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="spec_medusa64_p4k,fewshot_b50_p16k,tot_d5w10",
                        help="comma-separated, of the suite and the families (bench/families.py)")
    parser.add_argument("--chunk-size", type=int, default=None, help="flatten chunk size (default: the automatic rule)")
    parser.add_argument("--backend", default="cuda", choices=("triton", "cuda", "auto"))
    parser.add_argument("--planner", default="flatten")
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    args = parser.parse_args()
    results = {}
    names = args.workloads.split(",")
    for name in names:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; workloads: {list(WORKLOADS)}")
    for name in names:
        workload = WORKLOADS[name]()
        layout = workload.layout
        attn = TreeAttention(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, backend=args.backend,
                             plan_config=PlanConfig(args.planner, args.chunk_size))
        plan = attn.plan(layout)
        q, k, v = workload.random_inputs("cuda", seed=None)
        run = lambda: attn.run(q, k, v, plan)  # noqa: E731
        host = host_us_per_call(run)
        kernels = kernel_times_us(run)
        results[name] = {"backend": args.backend, "host_us_per_call": host, "kernels_us": kernels, "plan": plan.plan.summary()}
        print(f"== {name}: {plan.plan.summary()}")
        print(f"host wall per run() call: {host:.1f} us; device time per call: "
              + ", ".join(f"{k} {v:.1f} us" for k, v in kernels.items()))
        print(top_functions(run))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
