#!/usr/bin/env python3
"""Run one treedec backend on suite workloads in a loop, for a profiler (Nsight Compute) to watch.

Prints each workload's plan and (cuda backend) persistent schedule, checks the output against
the fp32 reference once, then runs ``--iters`` calls. Under ncu, profile one late call:

    ncu --kernel-name regex:tree_attn_partial --launch-skip 5 --launch-count 1 --set full \\
        -o prof python bench/profile_kernel.py --workloads spec_medusa64_p32k --iters 8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.suite import HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, SUITE, build_workload  # noqa: E402
from treedec import PlanConfig, TreeAttention  # noqa: E402
from treedec.attention import reference_tree_attention  # noqa: E402
from treedec.attention.backends.cuda_backend import plan_schedule  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="spec_medusa64_p32k", help=f"comma-separated, of {list(SUITE)}")
    parser.add_argument("--backend", default="cuda", choices=("triton", "cuda"))
    parser.add_argument("--chunk-size", type=int, default=None, help="flatten chunk size (default: the auto rule)")
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernel.py needs a CUDA device")
    device = torch.device("cuda")
    for name in args.workloads.split(","):
        if name not in SUITE:
            raise SystemExit(f"unknown workload {name!r}; workloads: {list(SUITE)}")
        workload = build_workload(name)
        layout = workload.layout
        q, k, v = workload.random_inputs(device)
        config = PlanConfig("flatten", args.chunk_size)
        attn = TreeAttention(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, backend=args.backend, plan_config=config,
                             device=device)
        plan = attn.plan(layout)
        out = attn.run(q, k, v, plan)
        ref, _ = reference_tree_attention(q, k, v, layout, attn.variant)
        rel = float((out.float() - ref).norm() / ref.norm())
        print(f"{name}: {plan.plan.summary()}; rel err {rel:.2e}")
        schedule = plan_schedule(plan)
        if schedule is not None:
            print(f"  schedule: {schedule.num_units} units on {schedule.num_ctas} CTAs, "
                  f"{schedule.tile_tokens}-token KV tiles, imbalance {schedule.imbalance():.3f}")
        for _ in range(args.iters):
            attn.run(q, k, v, plan)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
