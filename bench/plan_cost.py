"""How long does planning a step take on the host?

Cases from issue 35's budgets for plan + static write + schedule on the GPU host: the 64-token
Medusa tree over a 4000-token prompt (<= 0.1 ms), a forest of 8 requests each with its own
4000-token prompt and 64-token Medusa tree (<= 0.3 ms), and a 1,000-node forest (<= 0.6 ms); and issue
49's decode step of 64 lanes over 64 requests' 4000-token prompts (256k KV tokens); and issue 53's decode step of 64
requests sharing a 2000-token system prompt (each its own 50-token question).
Times the parts of ``TreeAttention.plan``: the tree snapshot (``SequenceTree.layout``), the
planner (``make_plan``) and the index copy (``TreePlan.to``), each the median of many runs after
warm-up; and, on any machine, the cuda backend's host work of a graphed step per planner
implementation (numpy, compiled: ``treedec.attention.planner_impl``): ``make_plan`` with the
backend's settings on an H100/H200 (Llama-3-8B heads, 132 CTAs), ``schedule_units`` and the host
side of ``StaticPlan.write`` (padding and the schedule; the device copies excluded). With
``--device cuda`` it also times the whole ``TreeAttention.plan`` per kernel backend (plan, copy,
prepare: the cuda backend's schedule included) and the write of a plan into a static plan (what a
graphed step pays), and writes ``bench/results/<date>-plan-cost-<device>.json``.

    python bench/plan_cost.py [--repeats 300] [--planner flatten] [--device cuda] [--window 512]
    python bench/plan_cost.py --planner path --chunk-size 256 --batch-invariant   # the batch-invariant mode's plans

``--window W``: every plan clips the reads to a sliding window of W keys (``AttentionVariant(window=W)``): what the
plan of a windowed layer group costs (a Gemma 3 step makes one such plan and one plain one).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from treedec.attention import (PLANNERS, AttentionVariant, PlanBounds, PlanConfig, StaticPlan, make_plan, planner_impl,
                               schedule_units)
from treedec.attention.backends.cuda_backend import (LIGHT_TILE_COST, LONG_CHUNK_TILE_TOKENS, LONG_CHUNK_TOKENS,
                                                     CudaBackend, default_query_tile)
from treedec.attention.planner_choice import PLANNER_ENV
from treedec.errors import BackendUnavailableError
from treedec.kernels.cuda_tree_attention import ROWS_PER_UNIT, TILE_TOKENS
from treedec.tree import PagedKVPool, SequenceTree
from treedec.workloads.deft import medusa_tree


def medusa64_over_4k(page_size: int = 16) -> SequenceTree:
    """A 4000-token prompt with the 64-token Medusa tree pending under it."""
    tree = SequenceTree(PagedKVPool(1024, page_size, allocate_storage=False))
    root = tree.add_prompt(np.zeros(4000, dtype=np.int64))
    tree.commit_step()
    parents = medusa_tree(64).parents  # token 0 (the root token) has parent -1: it hangs under the prompt
    tree.add_token_tree(root, np.zeros(len(parents), dtype=np.int64), parents)
    return tree


def forest_8x_medusa64(page_size: int = 16) -> SequenceTree:
    """8 requests, each a 4000-token prompt with the 64-token Medusa tree pending under it."""
    tree = SequenceTree(PagedKVPool(4096, page_size, allocate_storage=False))
    parents = medusa_tree(64).parents
    roots = [tree.add_prompt(np.zeros(4000, dtype=np.int64)) for _ in range(8)]
    tree.commit_step()
    for root in roots:
        tree.add_token_tree(root, np.zeros(len(parents), dtype=np.int64), parents)
    return tree


def forest_1000_nodes(rng: np.random.Generator, page_size: int = 16) -> SequenceTree:
    """20 requests x 50 nodes: a 500-token prompt and a random tree of 49 thoughts (20-100 tokens);
    one pending decode token on every leaf."""
    tree = SequenceTree(PagedKVPool(8192, page_size, allocate_storage=False))
    for _ in range(20):
        nodes = [tree.add_prompt(np.zeros(500, dtype=np.int64))]
        for _ in range(49):
            parent = nodes[rng.integers(len(nodes))]
            nodes += tree.branch(parent, [np.zeros(rng.integers(20, 100), dtype=np.int64)])
    tree.commit_step()
    leaves = tree.live_leaves()
    tree.extend_many({leaf: [1] for leaf in leaves})
    return tree


def lanes_64x4k(page_size: int = 16) -> SequenceTree:
    """Issue 49's decode step of 64 lanes: 64 requests, each a 4000-token prompt and one leaf with a pending
    token (256k KV tokens, 64 queries)."""
    tree = SequenceTree(PagedKVPool(64 * 260, page_size, allocate_storage=False))
    roots = [tree.add_prompt(np.zeros(4000, dtype=np.int64)) for _ in range(64)]
    leaves = [tree.branch(r, [[0]])[0] for r in roots]
    tree.commit_step()
    tree.extend_many({leaf: [1] for leaf in leaves})
    return tree


def shared_prefix_64x2000(page_size: int = 16) -> SequenceTree:
    """Issue 53's decode step of 64 requests sharing a 2000-token system prompt: the prompt, 64 branches of a
    50-token question each, one pending token on each (64 queries over 5200 KV tokens)."""
    tree = SequenceTree(PagedKVPool(64 * 8 + 160, page_size, allocate_storage=False))
    root = tree.add_prompt(np.zeros(2000, dtype=np.int64))
    leaves = tree.branch(root, [np.zeros(50, dtype=np.int64)] * 64)
    tree.commit_step()
    tree.extend_many({leaf: [1] for leaf in leaves})
    return tree


def layout_from_scratch(tree: SequenceTree):
    """The tree's layout built from the tree alone: the object tree's ``_make_layout`` (every step's, an older
    checkout's tree run for the numbers before); the array tree's gathered from its node table, with no
    last layout to make it from (its first, or after a truncation; a step's layout after edits is made from
    the last one: ``tree_edit_cost.py`` times those)."""
    make = getattr(tree, "_make_layout", None)
    if make is not None:
        return make()
    tree._cache.forget_slots()
    tree._layout = None
    return tree.layout()


def time_us(fn, repeats: int) -> dict:
    for _ in range(10):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples = np.array(samples) * 1e6
    return {"median_us": round(float(np.median(samples)), 1), "min_us": round(float(samples.min()), 1)}


# The cuda backend on an H100/H200 with Llama-3-8B heads (bf16): what cuda_plan_config fills in on sm_90a.
HEADS, KV_HEADS, HEAD_DIM, CTAS = 32, 8, 128, 132
CUDA_CONFIG = PlanConfig(query_tile=default_query_tile(HEAD_DIM, HEADS // KV_HEADS), num_kv_heads=KV_HEADS,
                         persistent_ctas=CTAS, light_tile_cost=LIGHT_TILE_COST)
BUDGETS_US = {"medusa64_over_4k_prompt": 100.0, "forest_8x_medusa64": 300.0, "forest_1000_nodes": 600.0}  # issue 35


@contextlib.contextmanager
def planner_implementation(name: str):
    """TREEDEC_PLANNER=name inside the block."""
    before = os.environ.get(PLANNER_ENV)
    os.environ[PLANNER_ENV] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ[PLANNER_ENV]
        else:
            os.environ[PLANNER_ENV] = before


def measure_cuda_host(tree: SequenceTree, repeats: int, variant: AttentionVariant) -> dict:
    """The cuda backend's host work of a graphed step, per planner implementation (None where it cannot run,
    with why): ``make_plan`` (CUDA_CONFIG), ``schedule_units``, the host side of ``StaticPlan.write`` into the
    plan's bucket (the schedule included) and plan + write (``total``), medians in us."""
    layout, group = tree.layout(), HEADS // KV_HEADS
    out = {}
    for impl in ("numpy", "compiled"):
        with planner_implementation(impl):
            try:
                planner_impl()
            except BackendUnavailableError as err:
                out[impl] = {"unavailable": str(err)}
                continue
            plan = make_plan(layout, CUDA_CONFIG, group, variant)
            tile = LONG_CHUNK_TILE_TOKENS if plan.max_chunk_len >= LONG_CHUNK_TOKENS else TILE_TOKENS  # sm_90a's rule
            backend = CudaBackend.without_kernels(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, CTAS, tile)
            static = StaticPlan(PlanBounds.for_plan(plan), backend, torch.device("cpu"))
            static.write(plan)
            out[impl] = {
                "make_plan": time_us(lambda: make_plan(layout, CUDA_CONFIG, group, variant), repeats),
                "schedule": time_us(lambda: schedule_units(plan, group, KV_HEADS, CTAS, ROWS_PER_UNIT[HEAD_DIM], tile),
                                    repeats),
                "static_write": time_us(lambda: static._stage(plan, None), repeats),
                "total": time_us(lambda: static._stage(make_plan(layout, CUDA_CONFIG, group, variant), None), repeats)}
    return out


def measure(name: str, tree: SequenceTree, config: PlanConfig, repeats: int, device: str,
            variant: AttentionVariant = AttentionVariant()) -> dict:
    layout = tree.layout()
    plan = make_plan(layout, config, variant=variant)
    row = {"case": name, "nodes": tree.num_nodes, **plan.summary(), "kv_tokens_read": plan.kv_tokens_read()}
    # The snapshot built from scratch (tree.layout() is cached until the next operation).
    row["layout"] = time_us(lambda: layout_from_scratch(tree), repeats)
    row["make_plan"] = time_us(lambda: make_plan(layout, config, variant=variant), repeats)
    row["to_device_cpu"] = time_us(lambda: plan.to("cpu"), repeats)
    row["total"] = time_us(lambda: make_plan(layout_from_scratch(tree), config, variant=variant).to("cpu"), repeats)
    row["cuda_host"] = measure_cuda_host(tree, repeats, variant)
    if device == "cuda":
        row.update(measure_on_gpu(tree, repeats, variant))
    return row


def measure_on_gpu(tree: SequenceTree, repeats: int, variant: AttentionVariant) -> dict:
    """TreeAttention.plan per kernel backend (Llama-3-8B heads, bf16), eagerly and into a static plan."""
    from treedec import TreeAttention
    from treedec.attention import PlanBounds
    from treedec.attention import get_backend

    out = {}
    for backend in ("triton", "cuda"):
        if get_backend(backend).why_unavailable(torch.device("cuda")) is not None:
            out[f"plan_{backend}"] = out[f"plan_into_static_{backend}"] = None
            continue
        attn = TreeAttention(32, 8, 128, backend=backend, device="cuda", dtype=torch.bfloat16, variant=variant)
        # From the layout snapshot: a step's host work is the layout column plus these.
        layout = tree.layout()
        out[f"plan_{backend}"] = time_us(lambda: attn.plan(layout), repeats)
        static = attn.static_plan(PlanBounds.for_plan(make_plan(tree.layout(), attn.plan_config, 4, variant)))
        out[f"plan_into_static_{backend}"] = time_us(lambda: attn.plan(layout, into=static), repeats)
        torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--planner", default="flatten", choices=PLANNERS)
    parser.add_argument("--chunk-size", type=int, default=None, help="default: the planner's automatic choice")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: also time TreeAttention.plan per kernel backend, eager and into a static plan")
    parser.add_argument("--window", type=int, default=None, help="plan for a sliding window of this many keys")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="PlanConfig(batch_invariant=True): the batch-invariant mode's plans (needs --planner path "
                             "and a --chunk-size, as Engine(batch_invariant=True) plans with 256)")
    args = parser.parse_args()
    if args.batch_invariant and (args.planner != "path" or args.chunk_size is None):
        parser.error(f"--batch-invariant plans with --planner path and a fixed --chunk-size, got --planner "
                     f"{args.planner} --chunk-size {args.chunk_size}")
    config = PlanConfig(args.planner, args.chunk_size, 16, batch_invariant=args.batch_invariant)
    variant = AttentionVariant(window=args.window)
    rows = [
        measure("medusa64_over_4k_prompt", medusa64_over_4k(), config, args.repeats, args.device, variant),
        measure("forest_8x_medusa64", forest_8x_medusa64(), config, args.repeats, args.device, variant),
        measure("forest_1000_nodes", forest_1000_nodes(np.random.default_rng(0)), config, args.repeats, args.device,
                variant),
        measure("lanes_64x4k", lanes_64x4k(), config, args.repeats, args.device, variant),
        measure("shared_prefix_64x2000", shared_prefix_64x2000(), config, args.repeats, args.device, variant),
    ]
    impl = planner_impl()
    print(f"planner: {impl.name} ({impl.reason})")
    print(f"{'case':<26}{'nodes':>6}{'queries':>8}{'tokens':>8}{'read':>8}{'layout':>9}{'plan':>9}{'copy':>8}"
          f"{'total':>9}  (median us; tokens: the plan's KV, read: per KV head, each chunk once a work item)")
    for r in rows:
        print(f"{r['case']:<26}{r['nodes']:>6}{r['queries']:>8}{r['tree_tokens']:>8}{r['kv_tokens_read']:>8}"
              f"{r['layout']['median_us']:>9}"
              f"{r['make_plan']['median_us']:>9}{r['to_device_cpu']['median_us']:>8}{r['total']['median_us']:>9}")
        for key in ("plan_triton", "plan_into_static_triton", "plan_cuda", "plan_into_static_cuda"):
            if key in r:
                print(f"    {key:<26}{'n/a' if r[key] is None else r[key]['median_us']:>9}")
    print(f"\ncuda host work of a graphed step (median us; budget on the GPU host: issue 35)\n"
          f"{'case':<26}{'planner':>10}{'plan':>9}{'schedule':>10}{'write':>9}{'total':>9}{'budget':>8}")
    for r in rows:
        for name, parts in r["cuda_host"].items():
            if "unavailable" in parts:
                print(f"{r['case']:<26}{name:>10}  unavailable: {parts['unavailable']}")
                continue
            print(f"{r['case']:<26}{name:>10}" + "".join(f"{parts[k]['median_us']:>{w}}" for k, w in
                                                         (("make_plan", 9), ("schedule", 10), ("static_write", 9),
                                                          ("total", 9))) + f"{BUDGETS_US.get(r['case'], float('nan')):>8.0f}")
    result = {"date": datetime.date.today().isoformat(), "host": platform.node(), "cpu": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "numpy": np.__version__, "planner": args.planner, "chunk_size": args.chunk_size,
              "batch_invariant": args.batch_invariant,
              "planner_impl": {"name": impl.name, "reason": impl.reason}, "window": args.window, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    result["device"] = args.device
    if args.device == "cuda":
        result["gpu"], result["torch"] = torch.cuda.get_device_name(), torch.__version__
    tag = ("" if args.window is None else f"-w{args.window}") + ("-bi" if args.batch_invariant else "")
    path = args.out / f"{result['date']}-plan-cost-{args.device}{tag}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
