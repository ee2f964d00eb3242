#!/usr/bin/env python3
"""Where the host time of a program's step goes, on the machine it runs on (a GPU host).

Runs programs that ``bench/programs.py`` times (``bench/program_runs.py``) on a graphed engine with
the host functions a step passes through wrapped in timers; prints the mean milliseconds per step of each (nested
phases overlap: ``Engine.step`` contains ``make_plan``, ``GraphRunner.load``, ...). A phase that
reads the device's results (acceptance, drafting) includes the wait for the device.

    python bench/host_phases.py [--programs tree_verify,medusa_heads,eagle] [--prompt 4000] [--steps 24]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.program_runs import PROGRAM_FUNCTIONS, PROGRAMS, random_workload  # noqa: E402
from treedec.attention import StaticPlan, TreeAttention  # noqa: E402
from treedec.attention.backends import cuda_backend  # noqa: E402
from treedec.engine import CudaGraphConfig, Engine  # noqa: E402
from treedec.models import ModelConfig, from_config  # noqa: E402
from treedec.engine import step_chain  # noqa: E402
from treedec.engine.cuda_graphs import GraphRunner  # noqa: E402
from treedec.programs.speculative import acceptance, drafter_batch, drafts, eagle, eagle_chains, medusa  # noqa: E402
from treedec.programs.speculative import device_acceptance, verify_group, verify_rows  # noqa: E402
from treedec.tree import PagedKVPool, SequenceTree  # noqa: E402

#: (owner, attribute name, label) of every timed function.
PHASES = [
    (drafts.TreeDraft, "propose", "TreeDraft.propose"),
    (medusa.MedusaDraft, "propose", "MedusaDraft.propose"),
    (eagle.EagleDraft, "propose", "EagleDraft.propose (drafter steps inside)"),
    (eagle.EagleDraft, "collect", "EagleDraft.collect (every request's drafting: one flush a pass)"),
    (drafter_batch.DrafterGroup, "sync", "  DrafterGroup.sync (one drafter step for every request)"),
    (step_chain.StepChain, "run", "  StepChain.run (the drafting chains: host plans, one graph)"),
    (step_chain.StepChain, "_step", "    StepChain._step (a chain step's layout)"),
    (drafter_batch, "grown_tree", "  EAGLE tree from the candidates (after the one wait)"),
    (eagle_chains.EagleChains, "collect", "EagleChains.collect (pipelined chains: sync + chain for a pass)"),
    (acceptance.GreedyAcceptance, "accept", "GreedyAcceptance.accept (waits for the step)"),
    (device_acceptance, "greedy_outcomes", "greedy_outcomes (pipelined: a group's acceptance on the device)"),
    (verify_group.VerifyGroup, "place", "VerifyGroup.place (pipelined: a group's tree edits, K/V move, drafts)"),
    (verify_group.VerifyGroup, "after_step", "VerifyGroup.after_step (outcomes, then the step before read back)"),
    (verify_rows.VerifyRows, "record", "  VerifyRows.record (the group's outcomes read back: stops, stats)"),
    (Engine, "step", "Engine.step"),
    (Engine, "pending_rows", "Engine.pending_rows"),
    (TreeAttention, "plan_host", "  TreeAttention.plan_host (make_plan)"),
    (GraphRunner, "load", "  GraphRunner.load"),
    (StaticPlan, "write", "    StaticPlan.write"),
    (cuda_backend, "schedule_units", "      schedule_units (cuda backend)"),
    (GraphRunner, "run", "  GraphRunner.run"),
    (SequenceTree, "layout", "SequenceTree.layout"),
    (SequenceTree, "add_token_tree", "SequenceTree.add_token_tree"),
    (SequenceTree, "add_children", "SequenceTree.add_children"),
    (SequenceTree, "extend_many", "SequenceTree.extend_many"),
    (PagedKVPool, "copy_slots", "PagedKVPool.copy_slots"),
    (SequenceTree, "accept", "SequenceTree.accept"),
    (SequenceTree, "extend", "SequenceTree.extend"),
    (SequenceTree, "prune", "SequenceTree.prune"),
    (SequenceTree, "truncate", "SequenceTree.truncate"),
    (SequenceTree, "extend_computed", "SequenceTree.extend_computed"),
]


def wrap_phases(totals: dict[str, float]) -> None:
    for owner, name, label in PHASES:
        inner = getattr(owner, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - start

        setattr(owner, name, timed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", default="tree_verify,medusa_heads")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--prompt", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_phases times a graphed engine: it needs a CUDA device")
    unknown = sorted(set(args.programs.split(",")) - set(PROGRAMS))
    if unknown:
        raise SystemExit(f"unknown program(s) {unknown}; choose from {','.join(PROGRAMS)}")
    config = ModelConfig.from_name(args.model)
    model = from_config(config, seed=0, dtype=torch.bfloat16, device="cuda")
    rng = np.random.default_rng(0)
    work = random_workload(model, rng)
    prompt = rng.integers(0, config.vocab_size, args.prompt).tolist()
    totals: dict[str, float] = defaultdict(float)
    wrap_phases(totals)
    for program in args.programs.split(","):
        kv_tokens = 2 * args.prompt + 16384
        # (the EAGLE programs' drafter engines: graphed as the target's)
        work.drafter_engine = {"kv_tokens": kv_tokens, "page_size": 16, "cuda_graphs": CudaGraphConfig()}
        engine = Engine(model, kv_tokens=kv_tokens, page_size=16, cuda_graphs=CudaGraphConfig())
        PROGRAM_FUNCTIONS[program](engine, prompt, args.warmup, work)   # captures, compiles
        # Two runs of different lengths: their difference is `--steps` steps without the prefill.
        measured = []
        for steps in (args.warmup, args.warmup + args.steps):
            for root in engine.tree.roots:
                engine.tree.prune(root)
            totals.clear()
            torch.cuda.synchronize()
            start = time.perf_counter()
            run = PROGRAM_FUNCTIONS[program](engine, prompt, steps, work)
            torch.cuda.synchronize()
            measured.append((time.perf_counter() - start, run.steps, dict(totals)))
        (wall0, steps0, phases0), (wall1, steps1, phases1) = measured
        steps = steps1 - steps0
        print(f"{program}, {args.prompt}-token prompt: {1e3 * (wall1 - wall0) / steps:.2f} ms per step "
              f"(wall, {steps} steps); host phases, ms per step:")
        for _, _, label in PHASES:
            ms = 1e3 * (phases1.get(label, 0.0) - phases0.get(label, 0.0)) / steps
            if ms:
                print(f"  {label:50s} {ms:8.3f}")
        del engine
        gc.collect()   # the engine and its graph runner refer to each other
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
