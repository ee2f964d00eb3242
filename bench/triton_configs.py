#!/usr/bin/env python3
"""Which stage-1 tile shape and chunk size make the triton backend fastest, per workload?

Sweeps query tile (rows per program = query_tile x GQA group), the launch config
(BLOCK_N, warps, stages) and the flatten chunk size over the suite of BENCH.md. Every
config is checked against the fp32 reference, then timed per call inside a CUDA graph
over 8 distinct KV copies (launch overhead amortized, no L2 reuse across calls). Writes
``<out>/<date>-<gpu>-triton-configs.json`` and prints the best config per workload.

    python bench/triton_configs.py [--workloads ...] [--chunk-sizes 256,512,1024,2048]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.suite import HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, SUITE, build_workload  # noqa: E402
from bench.timing import graphed_us  # noqa: E402
from treedec import PlanConfig, TreeAttention  # noqa: E402
from treedec.attention import AttentionVariant, reference_tree_attention  # noqa: E402
from treedec.attention.backends.triton_backend import TritonBackend, run_plan_triton  # noqa: E402
from treedec.kernels.triton_tree_attention import LaunchConfig  # noqa: E402

# (query_tile, launch config) candidates for G = 4: 64, 128 and 256 rows per program.
CANDIDATES = [
    (16, LaunchConfig(64, 4, 3)), (16, LaunchConfig(64, 4, 4)), (16, LaunchConfig(32, 4, 3)),
    (32, LaunchConfig(64, 8, 2)), (32, LaunchConfig(64, 8, 3)), (32, LaunchConfig(32, 8, 3)),
    (64, LaunchConfig(32, 8, 2)),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(SUITE))
    parser.add_argument("--chunk-sizes", default="256,512,1024,2048",
                        help="comma-separated; 'auto' = the planner's own choice")
    parser.add_argument("--candidates", default=None,
                        help="query_tile:block_n:warps:stages[:maxnreg],... (default: the built-in list)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--tag", default="", help="appended to the results file name, e.g. -warps")
    args = parser.parse_args()
    sizes = [None if c == "auto" else int(c) for c in args.chunk_sizes.split(",")]
    candidates = CANDIDATES if args.candidates is None else [
        (int(fields[0]), LaunchConfig(*(int(f) for f in fields[1:])))
        for fields in (c.split(":") for c in args.candidates.split(","))]
    names = args.workloads.split(",")
    variant = AttentionVariant()
    results = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
               "torch": torch.__version__, "workloads": {}}
    progress = tqdm(total=len(names) * len(sizes) * len(candidates), desc="configs", file=sys.stderr)
    for name in names:
        workload = build_workload(name)
        layout = workload.layout
        q, *first = workload.random_inputs("cuda")
        copies = [tuple(first)] + [workload.random_kv("cuda") for _ in range(7)]
        ref, _ = reference_tree_attention(q, *copies[0], layout, variant)
        rows = []
        for size in sizes:
            for query_tile, launch in candidates:
                progress.update()
                attn = TreeAttention(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, backend="triton",
                                     plan_config=PlanConfig("flatten", size, query_tile))
                plan = attn.plan(layout)
                row = {"chunk_size": plan.plan.chunk_size, "query_tile": query_tile, "block_n": launch.block_n,
                       "num_warps": launch.num_warps, "num_stages": launch.num_stages, "maxnreg": launch.maxnreg,
                       "work_items": plan.plan.num_items, "entries": plan.plan.num_entries}
                try:
                    prepared = TritonBackend(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, q.dtype, variant,
                                             launch=launch).prepare(plan)
                    out, _ = run_plan_triton(q, *copies[0], plan, variant, prepared=prepared)
                    row["rel_err"] = float((out.float() - ref).norm() / ref.norm())
                    if row["rel_err"] < 2e-3:
                        runs = [lambda k=k, v=v: run_plan_triton(q, k, v, plan, variant, validate=False, prepared=prepared)
                                for k, v in copies]
                        row["graphed_us"] = graphed_us(runs)
                except Exception as e:  # a config that does not compile or launch on this GPU
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
        results["workloads"][name] = rows
        ok = [r for r in rows if "graphed_us" in r]
        best = min(ok, key=lambda r: r["graphed_us"]) if ok else None
        progress.write(f"{name:20s} best {best}" if best else f"{name:20s} no config ran")
    progress.close()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{results['date']}-{results['device'].lower().replace(' ', '-')}-triton-configs{args.tag}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
