"""What does a graphed engine step cost on the host, per phase?

The host side of ``Engine.step`` on its CUDA-graph path, on this CPU: a one-layer model with
Llama-3-8B attention heads (32 q heads, 8 KV heads, head dim 128), a 4000-token prompt with the
64-token Medusa tree pending under it, the cuda backend's host work (its plan settings on an H100:
132 CTAs; ``CudaBackend.without_kernels`` writes its schedule) and the forward stubbed out
(``GraphRunner.run`` returns preallocated outputs), so only host glue is timed. Each step adds the
token tree (untimed), steps with logits at the tree's rows, and prunes the tree (untimed). Thread
CPU time per phase, medians over the steps, in us (the machine may be shared: compare runs of one
session). ``--profile`` prints the cProfile of the steps.

    python bench/step_host_cost.py [--steps 300] [--profile] [--tag NAME]
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import json
import os
import pstats
import time
from collections import defaultdict

os.environ.setdefault("TRITON_INTERPRET", "1")  # the graphed path's engine needs a kernel backend; none runs here

import numpy as np
import torch

from treedec.attention import StaticPlan, TreeAttention
from treedec.attention.backends import cuda_backend
from treedec.attention.backends.cuda_backend import LIGHT_TILE_COST, CudaBackend, default_query_tile
from treedec.engine import Engine
from treedec.models import from_config
from treedec.models.config import ModelConfig
from treedec.engine.cuda_graphs import CudaGraphConfig, GraphRunner
from treedec.kernels.cuda_tree_attention import TILE_TOKENS
from treedec.tree import SequenceTree
from treedec.workloads.deft import medusa_tree

CTAS = 132  # an H100's persistent grid for the cuda kernels
# (owner, attribute, phase name): the functions timed, each inside Engine.step
PHASES = [(SequenceTree, "layout", "SequenceTree.layout"), (TreeAttention, "plan_host", "TreeAttention.plan_host"),
          (GraphRunner, "load", "GraphRunner.load"), (StaticPlan, "write", "StaticPlan.write"),
          (cuda_backend, "schedule_units", "schedule_units"), (GraphRunner, "run", "GraphRunner.run"),
          (Engine, "step", "Engine.step")]


def make_engine() -> Engine:
    """A one-layer, Llama-3-8B-headed engine whose graphed steps plan and write as the cuda backend's
    do on an H100, and whose forward is a stub."""
    config = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=64, num_layers=1, num_heads=32,
                         num_kv_heads=8, head_dim=128)
    model = from_config(config, dtype=torch.bfloat16, device="cpu")
    engine = Engine(model, kv_tokens=8192, backend="triton",
                    cuda_graphs=CudaGraphConfig(max_queries=256, capture=False))
    attn = engine.attn
    attn.backend = "cuda"
    attn.backend_impl = CudaBackend.without_kernels(32, 8, 128, torch.bfloat16, CTAS, TILE_TOKENS)
    attn.plan_config = dataclasses.replace(attn.plan_config, query_tile=default_query_tile(128, 4), num_sms=CTAS,
                                           persistent_ctas=CTAS, light_tile_cost=LIGHT_TILE_COST)
    # Narrow outputs: on a GPU the rows' gather is a launch, on this CPU a bf16 copy that would dominate.
    outputs = (torch.zeros(256, 16, dtype=torch.bfloat16), torch.zeros(256, 16, dtype=torch.bfloat16))
    engine.graph_runner.run = lambda entry, num_queries, row_inputs=None: tuple(t[:num_queries] for t in outputs)
    return engine


class PhaseTimer:
    """Thread CPU time of each phase's calls inside ``Engine.step``, summed per step."""

    def __init__(self):
        self.inside = False
        self.current: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, int]] = []
        self._saved = []

    def install(self, engine: Engine) -> None:
        for owner, attr, name in PHASES:
            target = engine.graph_runner if attr == "run" else owner
            original = getattr(target, attr)
            self._saved.append((target, attr, original))
            setattr(target, attr, self._wrap(original, name))

    def _wrap(self, fn, name):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            outer = name == "Engine.step"
            if not (outer or self.inside):
                return fn(*args, **kwargs)
            self.inside = True
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.thread_time_ns() - start
                self.inside = not outer
        return timed

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current.clear()

    def medians_us(self) -> dict[str, float]:
        names = [name for _, _, name in PHASES]
        return {n: round(float(np.median([s.get(n, 0) for s in self.steps])) / 1000, 1) for n in names}


def run_steps(engine: Engine, steps: int, timer: PhaseTimer | None = None,
              profiler: cProfile.Profile | None = None) -> None:
    tree = engine.tree
    root = tree.add_prompt(np.zeros(4000, dtype=np.int64))
    tree.commit_step()
    parents = medusa_tree(64).parents
    tokens = np.arange(len(parents), dtype=np.int64)
    for _ in range(steps):
        ids = tree.add_token_tree(root, tokens, parents)
        tree.layout()   # a scheduler's edits leave the layout made; the step reads it
        rows = engine.pending_rows(ids)
        if profiler is not None:
            profiler.enable()
        engine.step(logits_rows=rows)
        if profiler is not None:
            profiler.disable()
        if timer is not None:
            timer.end_step()
        tree.prune(ids[0])
        tree.commit_step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="print the cProfile of the steps instead")
    parser.add_argument("--tag", default="", help="a name for this run in the output (e.g. before/after)")
    args = parser.parse_args()
    engine = make_engine()
    if args.profile:
        run_steps(engine, 20)
        profiler = cProfile.Profile(time.thread_time)
        run_steps(engine, args.steps, profiler=profiler)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(35)
        return
    timer = PhaseTimer()
    timer.install(engine)
    run_steps(engine, 20)
    timer.steps.clear()
    run_steps(engine, args.steps, timer)
    print(json.dumps({"tag": args.tag, "steps": args.steps, "us_thread_cpu_median": timer.medians_us()}, indent=1))


if __name__ == "__main__":
    main()
