#!/usr/bin/env python3
"""Batched greedy decoding through ``generate_batch``: requests that share a system prompt.

Each request is a ``--system``-token system prompt (the same for all) and a ``--question``-token
question of its own, greedy, ``--new`` tokens. For each ``--requests`` count the batch runs
with prefix sharing (the system prompt's K/V stored once) and, with ``--compare-unshared``,
without it. Reported per run: the median wall time of the last decode steps (host work
included: drawing, stop rules, tree edits, planning), the step floor (weights + the KV the step
reads, over the measured copy bandwidth), KV pages at the peak, prompt tokens shared.

    python bench/batch.py                                  # GPU: llama3-8b bf16, 1/8/32/64 requests
    python bench/batch.py --speculative --requests 1,8,32 --system 0 --question 4000
    python bench/batch.py --smoke                          # CPU: tiny model (CI)

``--speculative``: each request (no system prompt shared unless ``--system``) runs greedy
speculative decoding with a fixed Medusa-64 ``TreeDraft`` (random draft tokens:
``speculative_batch``), every request's tree verified in one step; the floor counts each
request's prompt and tree. ``--medusa-heads``: the same tree drafted by random Medusa heads,
which run inside the shared step at every request's rows (one row head for the batch).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, versions, write_results  # noqa: E402
from bench.timing import copy_bandwidth  # noqa: E402
from treedec.engine import CudaGraphConfig, Engine, ModelConfig, from_config  # noqa: E402
from treedec.search.batch import generate_batch  # noqa: E402
from bench.programs import random_heads  # noqa: E402
from treedec.search.drafts import TreeDraft  # noqa: E402
from treedec.search.medusa import MedusaDraft  # noqa: E402
from treedec.search.speculative_batch import speculative_batch  # noqa: E402
from treedec.tree.token_tree import TokenTree  # noqa: E402
from treedec.workloads.deft import medusa_tree  # noqa: E402
from treedec.search.requests_file import RequestSpec  # noqa: E402


def run_batch(model, specs, share: bool, page_size: int, timed_steps: int, draft=None) -> dict:
    """One batch on a fresh graphed (GPU) engine: step times from the returns of its engine steps."""
    cuda = model.device.type == "cuda"
    tree_room = 0 if draft is None else 2 * 64 + 4 * page_size   # a tree of up to 64 tokens, and its pages
    # The pool sized to the requests (on a GPU too: memory past it stays free for the row heads' and the
    # large steps' activations).
    kv = sum(len(s.prompt_ids) + s.max_new_tokens + 2 * page_size + tree_room for s in specs)
    # Graphs up to every request's tree at once (32 Medusa-64 trees: 2048 queries).
    graphs = CudaGraphConfig(max_queries=max(256, 64 * len(specs))) if cuda else False
    engine = Engine(model, kv_tokens=kv, page_size=page_size, cuda_graphs=graphs)
    ends, queries, step, tree = [], [], engine.step, engine.tree

    def timed(*args, **kwargs):
        queries.append(tree.num_pending)
        out = step(*args, **kwargs)
        ends.append(time.perf_counter())
        return out

    engine.step = timed
    # Prompts enter 16 chunks a step (the scheduler's default, one chunk, lets the first requests
    # finish before the last ones start): the timed steps below are those with every request live.
    budget = 16 * engine.prefill_chunk
    if draft is None:
        results, stats = generate_batch(engine, specs, min_shared_prefix=None if share else 0, max_step_tokens=budget)
    else:
        results, stats = speculative_batch(engine, specs, draft, max_step_tokens=budget)
    decode = stats.steps - stats.prompt_steps
    # Steps that decode every request (one token each, or each request's whole tree).
    full = len(specs) * (1 if draft is None else 64)
    steady = [i for i in range(1, len(ends)) if queries[i] == full and queries[i - 1] == full]
    if not steady:
        raise RuntimeError(f"no step decoded all {len(specs)} requests together; raise --new")
    gaps = (np.asarray(ends)[steady] - np.asarray(ends)[[i - 1 for i in steady]])[-timed_steps:] * 1e3
    out = {"requests": len(specs), "shared": share, "step_ms": float(statistics.median(gaps)),
           "decode_steps": decode, "timed_steps": len(gaps), "peak_pages": stats.peak_pages, "shared_prefix_tokens": stats.shared_prefix_tokens,
           "waits": stats.waits, "eager": {k: v for k, v in engine.graph_stats.items() if k.startswith("eager")},
           "outputs": [r.output_ids for r in results]}
    del engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--requests", default="1,8,32,64", help="comma-separated batch sizes")
    parser.add_argument("--system", type=int, default=2000, help="system prompt tokens (shared)")
    parser.add_argument("--question", type=int, default=50, help="each request's own prompt tokens")
    parser.add_argument("--new", type=int, default=40, help="new tokens per request")
    parser.add_argument("--timed-steps", type=int, default=30, help="the last decode steps timed")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--compare-unshared", action="store_true", help="also run every batch without sharing")
    parser.add_argument("--speculative", action="store_true",
                        help="greedy speculative decoding with a fixed Medusa-64 tree draft (speculative_batch)")
    parser.add_argument("--medusa-heads", action="store_true",
                        help="with --speculative: draft the tree with random Medusa heads (in the step)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small sizes (CI)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.requests, args.system, args.question, args.new, args.timed_steps = "tiny", "1,4", 40, 5, 6, 3
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    config = ModelConfig.from_name(args.model)
    model = from_config(config, seed=0, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    rng = np.random.default_rng(0)
    system = rng.integers(0, config.vocab_size, args.system).tolist()
    bandwidth = copy_bandwidth(device)
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * model.dtype.itemsize
    runs = []
    for count in [int(x) for x in args.requests.split(",")]:
        specs = [RequestSpec(i, prompt_ids=tuple(system + rng.integers(0, config.vocab_size, args.question).tolist()),
                             max_new_tokens=args.new, temperature=0.0) for i in range(count)]
        draft = None
        if args.speculative and args.medusa_heads:
            medusa = medusa_tree(64)
            heads = random_heads(model, int(medusa.depth.max()), 0)
            draft = lambda spec: MedusaDraft(heads, medusa.paths)  # noqa: E731
        elif args.speculative:
            tree = TokenTree(tuple(medusa_tree(64).parents.tolist()))
            draft_tokens = rng.integers(0, config.vocab_size, tree.size - 1).tolist()
            draft = lambda spec: TreeDraft(tree, draft_tokens)  # noqa: E731
        for share in ([True, False] if args.compare_unshared and not args.speculative else [True]):
            run = run_batch(model, specs, share and not args.speculative, args.page_size, args.timed_steps, draft)
            # The KV a late step reads: the system prompt once (shared) or per request, and every
            # request's own tokens (and its draft tree).
            own = args.question + args.new + (64 if args.speculative else 0)
            kv = (args.system + count * own) if share and not args.speculative else count * (args.system + own)
            run["floor_ms"] = 1e3 * (model.weight_bytes() + kv * kv_bytes) / bandwidth
            run["x_floor"] = run["step_ms"] / run["floor_ms"]
            runs.append(run)
            kind = (f"speculative (Medusa-64 tree{', heads' if args.medusa_heads else ''})" if args.speculative
                    else f"{'shared' if share else 'unshared'} system prompt")
            print(f"{count} requests, {kind}: {run['step_ms']:.2f} ms per "
                  f"step ({run['x_floor']:.2f}x floor {run['floor_ms']:.2f}), peak {run['peak_pages']} pages", flush=True)
    if args.compare_unshared:
        # In bf16 the shared prefix's K/V (prefilled alone) differs in its last bits from the same
        # tokens prefilled with each question, and a random model's near-ties then flip argmaxes:
        # report how far the outputs agree, not only whether they do.
        for a, b in zip(runs[::2], runs[1::2]):
            pairs = list(zip(a["outputs"], b["outputs"]))
            equal = sum(x == y for x, y in pairs)
            agree = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x)) for x, y in pairs]
            a["outputs_equal_unshared"] = b["outputs_equal_shared"] = equal
            a["mean_tokens_before_first_difference"] = float(np.mean(agree))
            print(f"{a['requests']} requests: shared and unshared outputs {'equal' if equal == len(pairs) else 'differ'}"
                  f" ({equal} of {len(pairs)} equal; {np.mean(agree):.1f} of {args.new} tokens agree before the "
                  f"first difference)")
    results = {"device": device_name(device), "date": datetime.date.today().isoformat(), "versions": versions("triton"),
               "model": args.model, "smoke": args.smoke, "speculative": args.speculative,
               "medusa_heads": args.medusa_heads, "system_tokens": args.system,
               "question_tokens": args.question, "new_tokens": args.new, "copy_bandwidth_TBps": bandwidth / 1e12,
               "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
    write_results(results, args.out, "batch", args.smoke, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
