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
Speculative batches verify each step at most ``--draft-budget`` tokens in all, roots included (default ``auto``:
256 on a GPU), shared among the requests by their measured acceptance (``treedec.programs.speculative.draft_budget``);
the results record the budget, the mean queries of the timed steps and the emitted tokens a second.
``--eagle eagle|eagle3``: every request drafts with an ``EagleDraft`` (EAGLE-2 trees of
``--eagle-depth`` layers, top-k ``--eagle-top-k``, 63 draft tokens, or every candidate if fewer)
over ONE random EAGLE-1 / EAGLE-3 drafter (``bench/program_runs.py``'s: EAGLE-3 with a 32000-token
draft vocabulary) on ONE drafter engine shared by the batch (graphed as the target's; its pool
holds every request's prompt, new tokens and chains: EAGLE requests compute their whole prompt on
the drafter too). Its floor adds the drafter's weights once per drafter step of a proposal
(``--eagle-depth`` of them), as ``bench/programs.py`` does: what one drafter step for all requests
per layer would read. ``--eagle-tree chains``: fixed chains instead (``EagleDraft(tree="chains")``: the
root's top-k children extended to ``--eagle-depth`` tokens by argmax, top-k * depth draft tokens, drafted
on the device for every request of a pass at once, pipelined). ``--smoke --eagle eagle3`` runs
the tiny model with 3 layers (EAGLE-3 reads three distinct target layers; tiny has two).
``--draft-model``: every request drafts with a ``DraftModelDraft`` (EAGLE-2 trees of depth 4, top-k 4,
16 draft tokens) over ONE random Llama-3.2-1B-shape draft model (``llama3.2-1b``; ``tiny`` with other
weights in the smoke) on ONE draft engine, the requests drafting together (one draft step per tree layer
for all); its floor adds, per draft step of a proposal, the draft model's weights and the K/V it reads.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, versions, write_results  # noqa: E402
from bench.timing import copy_bandwidth  # noqa: E402
from treedec.engine import CudaGraphConfig, Engine  # noqa: E402
from treedec.models import ModelConfig, from_config  # noqa: E402
from treedec.programs.generate import generate_batch  # noqa: E402
from bench.program_runs import random_drafter, random_heads  # noqa: E402
from treedec.models.eagle_drafter import EagleDrafter  # noqa: E402
from treedec.programs.speculative.draft_model import DraftModelDraft  # noqa: E402
from treedec.programs.speculative.drafts import DraftSource, TreeDraft  # noqa: E402
from treedec.programs.speculative.eagle import EagleDraft  # noqa: E402
from treedec.programs.speculative.medusa import MedusaDraft  # noqa: E402
from treedec.programs.speculative.draft_budget import DraftBudget  # noqa: E402
from treedec.programs.speculative.batch import speculative_batch  # noqa: E402
from treedec.tree.token_tree import TokenTree  # noqa: E402
from treedec.workloads.deft import medusa_tree  # noqa: E402
from treedec.runtime.requests import RequestSpec  # noqa: E402
from treedec.sampling.params import SamplingParams  # noqa: E402


TREE_TOKENS = 64   # the Medusa-64 tree; EAGLE's 63 draft tokens and the root


@dataclass
class BatchDraft:
    """What every request of a ``--speculative`` batch drafts with."""

    kind: str                  # "tree", "medusa_heads", "eagle", "eagle3" or "draft_model"
    tree_tokens: int           # tokens of each proposed tree, its root included
    depth: int
    source: Callable[[RequestSpec, Engine | None], DraftSource]   # (request, the drafter engine) -> its draft
    top_k: int | None = None
    drafter: torch.nn.Module | None = None   # EAGLE, draft model: the one drafter of the batch
    eagle_tree: str | None = None         # EAGLE: "dynamic" (EAGLE-2 trees) or "chains"

    def record(self) -> dict:
        """The draft as the results JSON names it."""
        out = {"kind": self.kind, "tree_tokens": self.tree_tokens, "depth": self.depth, "top_k": self.top_k}
        if self.drafter is not None:
            out["drafter_weight_bytes"] = self.drafter.weight_bytes()
        if isinstance(self.drafter, EagleDrafter):
            out |= {"eagle_tree": self.eagle_tree, "draft_vocab_size": self.drafter.draft_vocab_size}
        return out


def make_draft(args, model, rng: np.random.Generator, drafter: EagleDrafter | None) -> BatchDraft:
    """The ``--speculative`` draft of ``args`` for ``model`` (a fixed tree's random tokens from ``rng``)."""
    if args.draft_model:
        return BatchDraft("draft_model", 17, 4, lambda spec, engine: DraftModelDraft(
            engine, depth=4, top_k=4, total_tokens=16), 4, drafter)
    if args.eagle and args.eagle_tree == "chains":
        k, depth = args.eagle_top_k, args.eagle_depth
        return BatchDraft(args.eagle, 1 + k * depth, depth, lambda spec, engine: EagleDraft(
            engine, depth=depth, top_k=k, tree="chains"), k, drafter, "chains")
    if args.eagle:
        k, depth = args.eagle_top_k, args.eagle_depth
        # EAGLE-2 keeps the best of the top_k + (depth - 1) * top_k^2 candidates its chains make.
        tokens = 1 + min(TREE_TOKENS - 1, k + (depth - 1) * k * k)
        return BatchDraft(args.eagle, tokens, depth, lambda spec, engine: EagleDraft(
            engine, depth=depth, top_k=k, total_tokens=tokens - 1), k, drafter, "dynamic")
    medusa = medusa_tree(TREE_TOKENS)
    if args.medusa_heads:
        heads = random_heads(model, int(medusa.depth.max()), 0)
        return BatchDraft("medusa_heads", medusa.size, int(medusa.depth.max()),
                          lambda spec, engine: MedusaDraft(heads, medusa.paths))
    tree = TokenTree(tuple(medusa.parents.tolist()))
    draft_tokens = rng.integers(0, model.config.vocab_size, tree.size - 1).tolist()
    return BatchDraft("tree", tree.size, int(medusa.depth.max()), lambda spec, engine: TreeDraft(tree, draft_tokens))


def run_batch(model, specs, share: bool, page_size: int, timed_steps: int, draft: BatchDraft | None = None,
              draft_budget: int | str | None = "auto", pipeline: bool | None = None,
              compile_model: bool = False, profile: int = 0, batch_invariant: bool = False) -> dict:
    """One batch on a fresh graphed (GPU) engine (and, for EAGLE, a fresh drafter engine): step times
    from the returns of the target engine's steps (a pipelined step returns when it is launched: in the
    steady state the gaps are the step times all the same). ``profile`` K > 0: ``torch.profiler`` over K
    steps with every request decoding (after 3 such steps of warm-up), its kernel summary under
    ``"profile"`` (the timed steps then include the profiled ones: time them in a separate run)."""
    cuda = model.device.type == "cuda"
    # a tree of up to its tree_tokens, and its pages
    tree_room = 0 if draft is None else 2 * draft.tree_tokens + 4 * page_size
    # The pool sized to the requests (on a GPU too: memory past it stays free for the row heads' and the
    # large steps' activations).
    kv = sum(len(s.prompt_ids) + s.params.max_tokens + 2 * page_size + tree_room for s in specs)
    # Graphs up to every request's tree at once (32 Medusa-64 trees: 2048 queries).
    graphs = CudaGraphConfig(max_queries=max(256, 64 * len(specs))) if cuda else False
    engine = Engine(model, kv_tokens=kv, page_size=page_size, cuda_graphs=graphs,
                    compile_model=compile_model and cuda, batch_invariant=batch_invariant)
    drafter = None
    if draft is not None and draft.drafter is not None:
        # Every request's sequence on the drafter (its whole prompt, new tokens, a tree's overshoot)
        # and its chains' scratch slots (top_k chains of depth - 1 tokens), with their partial pages.
        chains = draft.top_k * (draft.depth - 1)
        drafter_kv = sum(len(s.prompt_ids) + s.params.max_tokens + draft.tree_tokens + chains + 4 * page_size
                         for s in specs)
        drafter = Engine(draft.drafter, kv_tokens=drafter_kv, page_size=page_size, cuda_graphs=graphs)
    ends, queries, step, tree = [], [], engine.step, engine.tree
    full, most = len(specs), len(specs) * (1 if draft is None else draft.tree_tokens)
    profiler = _StepProfiler(profile, model.device) if profile else None

    def timed(*args, **kwargs):
        queries.append(tree.num_pending)
        if profiler is not None:
            profiler.before(full <= queries[-1] <= most)
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
        budgeting = DraftBudget(step_tokens=draft_budget)
        results, stats = speculative_batch(engine, specs, lambda spec, on=drafter: draft.source(spec, on),
                                           max_step_tokens=budget, draft_budget=budgeting, pipeline=pipeline,
                                           max_draft_tokens=draft.tree_tokens)
    decode = stats.steps - stats.prompt_steps
    # Steps that decode every request (one token each, or a tree each, cut to the draft budget): every
    # request in the step, no prompt chunk in it (`full`, `most` above).
    # (the scheduler's steps are the engine's last ones: a shared prefix's prefill comes before them)
    live = [0] * (len(ends) - len(stats.programs_per_step)) + stats.programs_per_step
    steady = [i for i in range(1, len(ends)) if live[i] == live[i - 1] == full and full <= queries[i] <= most
              and full <= queries[i - 1] <= most]
    if not steady:
        raise RuntimeError(f"no step decoded all {len(specs)} requests together; raise --new")
    gaps = (np.asarray(ends)[steady] - np.asarray(ends)[[i - 1 for i in steady]])[-timed_steps:] * 1e3
    out = {"requests": len(specs), "shared": share, "step_ms": float(statistics.median(gaps)),
           "decode_steps": decode, "timed_steps": len(gaps), "peak_pages": stats.peak_pages, "shared_prefix_tokens": stats.shared_prefix_tokens,
           "waits": stats.waits, "eager": {k: v for k, v in engine.graph_stats.items() if k.startswith("eager")},
           "outputs": [r.output_ids for r in results]}
    if draft is not None:
        timed = [queries[i] for i in steady][-timed_steps:]
        accepted = [a for r in results for a in r.stats["accepted"]]
        out |= {"draft_budget": budgeting.resolve(model.device), "mean_step_queries": float(np.mean(timed)),
                "mean_accepted": float(np.mean(accepted)), "pipelined": results[0].stats["pipelined"],
                "pipeline_note": results[0].stats["pipeline_note"],
                # emitted tokens a second in the timed steps: each request's accepted tokens and its bonus token
                "tokens_per_s": len(specs) * (1 + float(np.mean(accepted))) / (out["step_ms"] / 1e3)}
    if profiler is not None:
        out["profile"] = profiler.summary()
    if drafter is not None:
        out["drafter_eager"] = {k: v for k, v in drafter.graph_stats.items() if k.startswith("eager")}
    del engine, drafter
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


class _StepProfiler:
    """``torch.profiler`` over ``steps`` consecutive decoding steps, started after 3 of them (warm-up)."""

    WARMUP = 3

    def __init__(self, steps: int, device: torch.device):
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof, self.steps, self.seen, self.started, self.wall = profile(activities=activities), steps, 0, None, None

    def before(self, decoding: bool) -> None:
        """Called before each engine step; ``decoding``: every request decodes in it."""
        if self.wall is not None:
            return
        if self.started is not None and (self.seen - self.WARMUP == self.steps or not decoding):
            self._stop()
            return
        if decoding:
            if self.seen == self.WARMUP:
                self.prof.start()
                self.started = time.perf_counter()
            self.seen += 1

    def _stop(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.stop()
        self.wall = (time.perf_counter() - self.started, self.seen - self.WARMUP)

    def summary(self) -> dict:
        from bench.program_profile import kernel_summary
        if self.wall is None and self.started is not None:
            self._stop()   # the batch ended while profiling
        if self.wall is None:
            raise RuntimeError(f"--profile {self.steps}: fewer than {self.WARMUP} + {self.steps} steps decoded every "
                               f"request together ({self.seen}); raise --new")
        seconds, steps = self.wall
        summary = kernel_summary(self.prof, steps, top=15)
        return {"steps": steps, "wall_ms": 1e3 * seconds / steps,
                "gpu_idle_ms": 1e3 * seconds / steps - summary["gpu_busy_ms"]} | summary


def _budget(text: str) -> int | str | None:
    """``--draft-budget``: 'auto', 'none' or a positive int."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto', 'none' or a positive int, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--requests", default="1,8,32,64", help="comma-separated batch sizes")
    parser.add_argument("--system", type=int, default=2000, help="system prompt tokens (shared)")
    parser.add_argument("--question", type=int, default=50, help="each request's own prompt tokens")
    parser.add_argument("--new", type=int, default=40, help="new tokens per request")
    parser.add_argument("--timed-steps", type=int, default=30, help="the last decode steps timed")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="> 0: sampled requests (each seeded by its index; with --top-p), not greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="--temperature > 0: the top-p cut")
    parser.add_argument("--compare-unshared", action="store_true", help="also run every batch without sharing")
    parser.add_argument("--speculative", action="store_true",
                        help="greedy speculative decoding with a fixed Medusa-64 tree draft (speculative_batch)")
    parser.add_argument("--medusa-heads", action="store_true",
                        help="with --speculative: draft the tree with random Medusa heads (in the step)")
    parser.add_argument("--eagle", choices=["eagle", "eagle3"], default=None,
                        help="with --speculative: EAGLE-2 trees from one random EAGLE-1 / EAGLE-3 drafter")
    parser.add_argument("--eagle-tree", choices=["dynamic", "chains"], default="dynamic",
                        help="--eagle: EAGLE-2 trees (dynamic) or fixed chains drafted on the device (chains)")
    parser.add_argument("--eagle-depth", type=int, default=None, help="--eagle: tree layers (default EAGLE-2's 5)")
    parser.add_argument("--eagle-top-k", type=int, default=None,
                        help="--eagle: nodes expanded per layer (default EAGLE-2's 8)")
    parser.add_argument("--draft-model", action="store_true",
                        help="with --speculative: EAGLE-2 trees from one random Llama-3.2-1B-shape draft model")
    parser.add_argument("--draft-budget", default="auto", type=_budget,
                        help="--speculative: verify tokens a step for the whole batch, roots included "
                             "(treedec.programs.speculative.draft_budget): 'auto' (256 on a GPU, no limit on the CPU), "
                             "'none' or an int")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="--speculative: never pipeline the steps (speculative_batch's default: where the draft "
                             "allows it on a GPU)")
    parser.add_argument("--compile-model", action=argparse.BooleanOptionalAction, default=True,
                        help="on a GPU: the target's graphed forward through torch.compile "
                             "(Engine(compile_model=True), as bench/programs.py's graphs_model; default on; "
                             "the drafters stay uncompiled)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the target's engines in the batch-invariant mode (Engine(batch_invariant=True), issue "
                             "#53: its cost); compiled as the default mode is (--compile-model: Inductor keeps the "
                             "mode's GEMMs and norms whole, custom ops)")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="also run each batch once more under torch.profiler over K steps with every request "
                             "decoding (GPU kernels by time, idle time per step: under 'profile' in the results)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small sizes (CI)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    if args.eagle and (not args.speculative or args.medusa_heads):
        parser.error(f"--eagle {args.eagle} is a --speculative draft, in place of --medusa-heads: give "
                     f"--speculative and drop --medusa-heads (got --speculative={args.speculative}, "
                     f"--medusa-heads={args.medusa_heads})")
    if args.draft_model and (not args.speculative or args.medusa_heads or args.eagle):
        parser.error("--draft-model is a --speculative draft, in place of --medusa-heads and --eagle")
    if not args.eagle and (args.eagle_depth, args.eagle_top_k) != (None, None):
        parser.error(f"--eagle-depth and --eagle-top-k shape EAGLE drafts: give --eagle eagle|eagle3 with them "
                     f"(got --eagle-depth {args.eagle_depth}, --eagle-top-k {args.eagle_top_k})")
    if args.speculative and args.temperature > 0:
        parser.error("--temperature samples plain decoding's requests; --speculative verifies greedily here")
    args.eagle_depth = 5 if args.eagle_depth is None else args.eagle_depth
    args.eagle_top_k = 8 if args.eagle_top_k is None else args.eagle_top_k
    if args.eagle_depth < 1 or args.eagle_top_k < 1:
        parser.error(f"--eagle-depth and --eagle-top-k must be >= 1, got {args.eagle_depth} and {args.eagle_top_k}")
    if args.smoke:
        args.model, args.requests, args.system, args.question, args.new, args.timed_steps = "tiny", "1,4", 40, 5, 6, 3
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    config = ModelConfig.from_name(args.model)
    if args.eagle == "eagle3" and config.num_layers < 3:
        if not args.smoke:
            parser.error(f"--eagle eagle3 reads three distinct target layers; --model {args.model} has "
                         f"{config.num_layers}: pick a larger model or --eagle eagle")
        config = dataclasses.replace(config, num_layers=3)   # the smoke's tiny model, one layer more
    model = from_config(config, seed=0, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    drafter = random_drafter(model, args.eagle, 0) if args.eagle else None
    if args.draft_model:
        drafter = from_config("tiny" if args.smoke else "llama3.2-1b", seed=1, dtype=model.dtype, device=device)
    draft_kv_bytes = 0 if drafter is None or not args.draft_model else (
        2 * drafter.config.num_layers * drafter.config.num_kv_heads * drafter.config.head_dim * model.dtype.itemsize)
    rng = np.random.default_rng(0)
    system = rng.integers(0, config.vocab_size, args.system).tolist()
    bandwidth = copy_bandwidth(device)
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * model.dtype.itemsize
    runs = []
    for count in [int(x) for x in args.requests.split(",")]:
        specs = [RequestSpec(i, prompt_ids=tuple(system + rng.integers(0, config.vocab_size, args.question).tolist()),
                             params=SamplingParams(max_tokens=args.new, temperature=args.temperature,
                                                   top_p=args.top_p, seed=i if args.temperature > 0 else None))
                 for i in range(count)]
        draft = make_draft(args, model, rng, drafter) if args.speculative else None
        for share in ([True, False] if args.compare_unshared and not args.speculative else [True]):
            run = run_batch(model, specs, share and not args.speculative, args.page_size, args.timed_steps, draft,
                            args.draft_budget, False if args.no_pipeline else None,
                            compile_model=args.compile_model and cuda, batch_invariant=args.batch_invariant)
            if args.profile:
                run["profile"] = run_batch(model, specs, share and not args.speculative, args.page_size,
                                           args.timed_steps, draft, args.draft_budget,
                                           False if args.no_pipeline else None,
                                           compile_model=args.compile_model and cuda, profile=args.profile,
                                           batch_invariant=args.batch_invariant)["profile"]
            # The KV a late step reads: the system prompt once (shared) or per request, and every
            # request's own tokens (and its draft tree).
            own = args.question + args.new + (draft.tree_tokens if args.speculative else 0)
            kv = (args.system + count * own) if share and not args.speculative else count * (args.system + own)
            # The drafter's weights once per drafter step of a proposal (one step for all requests per layer);
            # a draft model's K/V of every request's sequence at each of those steps too.
            weights = model.weight_bytes() + (0 if drafter is None else draft.depth * drafter.weight_bytes())
            draft_kv = 0 if not draft_kv_bytes else draft.depth * count * (args.system + args.question + args.new)
            run["weight_bytes"] = weights
            run["floor_ms"] = 1e3 * (weights + kv * kv_bytes + draft_kv * draft_kv_bytes) / bandwidth
            run["x_floor"] = run["step_ms"] / run["floor_ms"]
            runs.append(run)
            if args.eagle:
                kind = (f"speculative ({'EAGLE-3' if args.eagle == 'eagle3' else 'EAGLE-1'} depth {draft.depth}, "
                        f"top-k {draft.top_k}, {draft.tree_tokens}-token {args.eagle_tree} trees)")
            elif args.draft_model:
                kind = f"speculative (draft model {'tiny' if args.smoke else 'llama3.2-1b'}, depth 4, top-k 4, 16 tokens)"
            elif args.speculative:
                kind = f"speculative (Medusa-64 tree{', heads' if args.medusa_heads else ''})"
            else:
                kind = f"{'shared' if share else 'unshared'} system prompt"
            extra = "" if draft is None else (f", budget {run['draft_budget'] or 'none'}, {run['mean_step_queries']:.0f} "
                                              f"queries a step, {run['tokens_per_s']:.0f} tokens/s")
            print(f"{count} requests, {kind}: {run['step_ms']:.2f} ms per "
                  f"step ({run['x_floor']:.2f}x floor {run['floor_ms']:.2f}), peak {run['peak_pages']} pages{extra}",
                  flush=True)
            if "profile" in run:
                print(f"  profile: {json.dumps(run['profile'])}", flush=True)
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
               "model": args.model, "smoke": args.smoke, "compile_model": args.compile_model and cuda,
               "batch_invariant": args.batch_invariant,
               "speculative": args.speculative,
               "medusa_heads": args.medusa_heads, "draft": None if draft is None else draft.record(),
               "draft_model": ("tiny" if args.smoke else "llama3.2-1b") if args.draft_model else None,
               "model_layers": config.num_layers, "target_weight_bytes": model.weight_bytes(),
               "system_tokens": args.system, "temperature": args.temperature, "top_p": args.top_p,
               "question_tokens": args.question, "new_tokens": args.new, "copy_bandwidth_TBps": bandwidth / 1e12,
               "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
    write_results(results, args.out, "batch", args.smoke, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
