#!/usr/bin/env python3
"""How long one 64-token KV tile takes a cuda stage-1 unit, by how many rows it computes.

Trees: a prompt and N one-token branches with a query each (N queries x 4 heads = rows per KV
head; <= 64 rows run on one of the sm_90a kernel's two consumer warpgroups, more on both), cut
into even chunks so that 16 or 128 CTAs of the persistent grid work (8 KV heads x 2 or 16
chunks). Each tree is timed at 8192 and 16384 tokens; the difference over the added tiles per
unit is the time per tile, without the fixed start, store and merge. Eager (L2 flushed) and
CUDA-graph times, as bench/attention.py takes them.

``--flags=...`` builds the kernels with extra TREEDEC_CUDA_FLAGS (the ring knobs of
``ws_config.cuh``) in their own cache dir. Every output is checked against the reference.

    python bench/tile_pace.py --out bench/results [--flags=-DTREEDEC_WS_STAGES=5 --tag stages5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, results_path, versions  # noqa: E402
from bench.suite import NUM_KV_HEADS, fewshot  # noqa: E402
from bench.timing import graphed_us, time_us  # noqa: E402

TOKENS = (8192, 16384)
QUERIES = (8, 16, 17, 32)   # 32 / 64 rows per KV head (one consumer), 68 / 128 (two)
CTAS = (16, 128)
GRAPH_KV_COPIES, GRAPH_CALLS = 8, 32


def per_tile_us(short_us: float, long_us: float, chunks: int) -> float:
    """Time per added tile of each unit: the two trees differ by (TOKENS[1] - TOKENS[0]) / chunks tokens per unit."""
    return (long_us - short_us) / ((TOKENS[1] - TOKENS[0]) // chunks // 64)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flags", default="", help="extra TREEDEC_CUDA_FLAGS (own build cache)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/tile_pace.py needs a CUDA GPU (the cuda backend's sm_90a kernel)", file=sys.stderr)
        return 2
    if args.flags:
        os.environ["TREEDEC_CUDA_FLAGS"] = (os.environ.get("TREEDEC_CUDA_FLAGS", "") + " " + args.flags).strip()
        os.environ.setdefault("TREEDEC_CACHE_DIR", str(Path.home() / ".cache" / ("treedec-" + (args.tag or "flags"))))
    from treedec.attention import AttentionVariant, PlanConfig, make_plan, reference_tree_attention
    from treedec.attention.backends.cuda_backend import CudaBackend, run_plan_cuda

    device = torch.device("cuda")
    variant = AttentionVariant()
    rows = []
    for ctas in CTAS:
        chunks = ctas // NUM_KV_HEADS
        for queries in QUERIES:
            row = {"ctas": ctas, "queries": queries, "rows_per_kv_head": queries * 4}
            for tokens in TOKENS:
                workload = fewshot("tile-pace", tokens - queries, queries, 1)
                q, k, v = workload.random_inputs(device)
                plan = make_plan(workload.layout, PlanConfig(chunk_size=tokens // chunks, query_tile=32,
                                                             persistent_ctas=132), group_size=4)
                if plan.num_chunks != chunks:
                    raise AssertionError(f"{plan.num_chunks=} != {chunks=}")
                device_plan = plan.to(device)
                prepared = CudaBackend(q.shape[1], k.shape[2], q.shape[2], q.dtype, variant, device).prepare(device_plan)
                out, _ = run_plan_cuda(q, k, v, device_plan, variant, prepared=prepared)
                ref, _ = reference_tree_attention(q, k, v, workload.layout, variant)
                rel = float((out.float() - ref).norm() / ref.norm())
                if not rel < 2e-3:
                    raise AssertionError(f"{queries} queries, {tokens} tokens: relative error {rel:.3g}")
                copies = [(torch.randn_like(k), torch.randn_like(v)) for _ in range(GRAPH_KV_COPIES)]
                row[f"eager_us_{tokens}"] = time_us(lambda: run_plan_cuda(q, k, v, device_plan, variant, False, prepared),
                                                  device)
                row[f"graphed_us_{tokens}"] = graphed_us(
                    [lambda k_i=k_i, v_i=v_i: run_plan_cuda(q, k_i, v_i, device_plan, variant, False, prepared)
                     for k_i, v_i in copies], GRAPH_CALLS)
            for mode in ("eager", "graphed"):
                row[f"{mode}_us_per_tile"] = per_tile_us(row[f"{mode}_us_{TOKENS[0]}"], row[f"{mode}_us_{TOKENS[1]}"],
                                                         chunks)
            rows.append(row)
            print(f"{ctas:4d} CTAs  {queries:3d} queries ({queries * 4:3d} rows): "
                  f"{row['eager_us_per_tile']:.3f} us/tile eager, {row['graphed_us_per_tile']:.3f} graphed", flush=True)
    name = device_name(device)
    path = results_path(Path(args.out), name, "tile-pace", tag=args.tag or None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": name, "versions": versions("triton"), "flags": args.flags,
                                "kv_heads": NUM_KV_HEADS, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
