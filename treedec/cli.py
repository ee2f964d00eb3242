"""The ``treedec`` command line.

``treedec demo``: build a small forest (a speculative token tree and a few-shot branching
request), plan one step, run tree attention with the chosen backend and check it against
the dense fp32 reference.

``treedec replay <workload>``: replay a recorded decoding tree (ToT, Medusa, few-shot or a
schedule JSON file) through the engine and time every step; ``treedec plot``: chart the
results (see :mod:`treedec.replay`).

``treedec spec``: speculative decoding with a token-tree draft (n-gram, Medusa heads, a
draft model or a fixed tree) and greedy, typical or rejection-sampling acceptance; per-step
acceptance stats (see :mod:`treedec.search.spec_command`).

``treedec tot``: Tree-of-Thought search (BFS or DFS) on a Game-of-24 problem (see
:mod:`treedec.search.tot_command`).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np
import torch

from treedec.attention import PLANNERS, PlanConfig, TreeAttention, reference_tree_attention
from treedec.replay.command import add_plot_parser, add_replay_parser, run_plot, run_replay
from treedec.search.spec_command import add_spec_parser, run_spec
from treedec.search.tot_command import add_tot_parser, run_tot
from treedec.tree import PagedKVPool, SequenceTree


def build_demo_forest(pool: PagedKVPool, rng: np.random.Generator) -> SequenceTree:
    """Two requests with one decode step pending.

    Request 1 (speculative verification): a 300-token prompt and a random 24-token token
    tree under it, all 24 tree tokens pending. Request 2 (few-shot branching): a 200-token
    prompt with 4 branches of 20 tokens, each getting one new pending token.
    """
    tree = SequenceTree(pool)
    spec_root = tree.add_prompt(rng.integers(0, 32000, 300))
    fewshot_root = tree.add_prompt(rng.integers(0, 32000, 200))
    branches = tree.branch(fewshot_root, [rng.integers(0, 32000, 20) for _ in range(4)])
    tree.commit_step()  # prompts and branches are computed; now the step's new tokens:
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, 24)]
    tree.add_token_tree(spec_root, rng.integers(0, 32000, 24), parents)
    tree.extend_many({b: [int(rng.integers(0, 32000))] for b in branches})
    tree.check_invariants()
    return tree


DEMO_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEMO_TOLERANCE = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 3e-2}  # max abs error vs the fp32 reference


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    heads, kv_heads, head_dim = 8, 2, 64
    dtype = DEMO_DTYPES[args.dtype]
    pool = PagedKVPool(num_pages=-(-1024 // args.page_size) + 64, page_size=args.page_size, num_layers=1,
                       num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=args.device)
    tree = build_demo_forest(pool, rng)
    pool.k.normal_()
    pool.v.normal_()
    attn = TreeAttention(heads, kv_heads, head_dim, backend=args.backend,
                         plan_config=PlanConfig(args.planner, args.chunk_size, args.query_tile), device=args.device)
    attn.plan(tree)  # warm-up: the first call pays for imports and caches
    t0 = time.perf_counter()
    plan = attn.plan(tree)
    plan_us = (time.perf_counter() - t0) * 1e6
    q = torch.randn(plan.plan.num_queries, heads, head_dim).to(dtype=dtype, device=args.device)
    k_cache, v_cache = pool.layer(0)
    attn.run(q, k_cache, v_cache, plan)  # warm-up: kernel compiles and builds
    _synchronize(attn.device)
    t0 = time.perf_counter()
    out, lse = attn.run(q, k_cache, v_cache, plan, return_lse=True)
    _synchronize(attn.device)
    run_ms = (time.perf_counter() - t0) * 1e3
    ref, ref_lse = reference_tree_attention(q, k_cache, v_cache, plan.plan.layout, attn.sm_scale)
    return {
        "backend": attn.backend, "backend_reason": attn.backend_reason,
        "kernel_backend": plan.cache.get("backend"), "device": str(attn.device), "dtype": args.dtype,
        "requests": len(tree.roots), "nodes": tree.num_nodes, "forest_tokens": tree.num_tokens,
        "pages_used": pool.num_pages - pool.num_free_pages, "page_size": pool.page_size,
        **plan.plan.summary(), "plan_us": round(plan_us, 1), "run_ms": round(run_ms, 2),
        "max_abs_err_vs_reference": float((out.float() - ref).abs().max()),
        "max_lse_err_vs_reference": float((lse - ref_lse).abs().max()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treedec", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan and run one tree-attention step on a small random forest")
    demo.add_argument("--backend", default="auto", help="auto, reference, torch, triton or cuda")
    demo.add_argument("--planner", default="flatten", choices=PLANNERS)
    demo.add_argument("--chunk-size", type=int, default=None, help="default: chosen per step by the planner")
    demo.add_argument("--query-tile", type=int, default=None, help="default: about 64 rows per program")
    demo.add_argument("--page-size", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu", help="cpu or cuda (the triton and cuda backends need cuda)")
    demo.add_argument("--dtype", default="fp32", choices=sorted(DEMO_DTYPES),
                      help="K/V and q dtype (the cuda backend takes fp16 or bf16)")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_replay_parser(sub)
    add_plot_parser(sub)
    add_spec_parser(sub)
    add_tot_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.command == "replay":
        return run_replay(args)
    if args.command == "plot":
        return run_plot(args)
    if args.command == "spec":
        return run_spec(args)
    if args.command == "tot":
        return run_tot(args)
    summary = run_demo(args)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        width = max(map(len, summary))
        for key, value in summary.items():
            print(f"{key:<{width}}  {value}")
    ok = summary["max_abs_err_vs_reference"] < DEMO_TOLERANCE[args.dtype]
    print("OK: matches the dense fp32 reference" if ok else "MISMATCH against the dense fp32 reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
