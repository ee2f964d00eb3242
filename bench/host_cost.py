#!/usr/bin/env python3
"""How much host work does each program do per step, with the model's forward taken away?

Runs the programs ``bench/programs.py`` times (``bench/program_runs.py``: greedy, tree_verify,
medusa_heads, parallel_sample) on the CPU through the CUDA-graph path (``CudaGraphConfig(capture=False)``:
plans written into static plans, the step's inputs into their buffers, exactly as a graphed step on a GPU) with the
forward over the static buffers replaced by one that returns zero logits and hidden states
of the right shapes. What is left per step is the program's and the engine's host work: tree
edits, acceptance, sampling, layout, planning, the static-plan write. On a GPU that work
runs while the device waits (the programs read every step's logits), so it adds to the step.

The ``cuda`` backend cannot be made without a GPU; ``--config cuda`` plans with its planner
settings (persistent grid of ``--ctas`` CTAs, 128-row units) and adds its host-side schedule
(``schedule_units``) to every step, which is what graphed steps pay on an H100/H200 (auto: cuda).

    python bench/host_cost.py [--programs tree_verify] [--prompt 4000] [--steps 50] [--profile 25]

Prints ms per step (median of ``--repeats`` runs) and, with ``--profile N``, the N functions
with the most own time (cProfile) of one more run.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend is made, never launched

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.program_runs import EAGLE_PROGRAMS, PROGRAM_FUNCTIONS, PROGRAMS, random_workload  # noqa: E402
from treedec.attention.backends.cuda_backend import LIGHT_TILE_COST, ROWS_PER_UNIT, default_query_tile  # noqa: E402
from treedec.attention.persistent_schedule import schedule_units  # noqa: E402
from treedec.engine import CudaGraphConfig, Engine  # noqa: E402
from treedec.models import ModelConfig, from_config  # noqa: E402
from treedec.models.base import ForwardOutput  # noqa: E402


def stub_forwards(engine: Engine) -> None:
    """Replace the engine's forwards (eager, e.g. the prefill's chunks, and over a static plan) by
    ones that return zero ``(logits, hidden)`` of the right shapes (and the row heads' outputs
    over those, which the graphed forward computes too)."""
    c, dtype = engine.model.config, engine.model.dtype

    def outputs(rows: int):
        return torch.zeros(rows, c.vocab_size, dtype=dtype), torch.zeros(rows, c.hidden_size, dtype=dtype)

    def static_outputs(rows: int):
        logits, hidden = outputs(rows)
        return (logits, hidden, *(engine.row_head(name)(hidden) for name in engine.row_heads))

    def eager(plan, tokens, positions, slots, rows, device_tokens=None, features=None, spans=(), token_rows=None):
        logits, _ = outputs(len(tokens) if rows is None else len(rows))
        return ForwardOutput(logits, outputs(len(tokens))[1])

    engine.eager_forward = eager
    engine.graph_runner.forward = lambda entry: static_outputs(entry.static.bounds.max_queries)


def make_engine(model, prompt_len: int, config: str, ctas: int) -> Engine:
    engine = Engine(model, kv_tokens=2 * prompt_len + 8192, backend="triton",
                    cuda_graphs=CudaGraphConfig(capture=False))
    stub_forwards(engine)
    if config == "cuda":
        c = model.config
        group = c.num_heads // c.num_kv_heads
        # what cuda_plan_config fills in on an H100/H200 (it asks the device for the grid size)
        engine.attn.plan_config = dataclasses.replace(
            engine.attn.plan_config, query_tile=default_query_tile(c.head_dim, group), persistent_ctas=ctas,
            light_tile_cost=LIGHT_TILE_COST)
        write = engine.graph_runner.load

        def load(plans, *args):   # add the cuda backend's per-step host schedule (one a layer group)
            for plan in plans:
                schedule_units(plan, group, c.num_kv_heads, ctas, ROWS_PER_UNIT[c.head_dim], 64)
            return write(plans, *args)

        engine.graph_runner.load = load
    return engine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # EAGLE programs run a drafter engine whose forwards this stub does not replace: not host work alone.
    parser.add_argument("--programs", default=",".join(p for p in PROGRAMS if p not in EAGLE_PROGRAMS))
    parser.add_argument("--model", default="llama3-8b", help="named size: its attention heads shape the plans")
    parser.add_argument("--prompt", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", choices=["triton", "cuda"], default="cuda",
                        help="planner settings (and host schedule) of this kernel backend")
    parser.add_argument("--ctas", type=int, default=132, help="persistent CTAs of --config cuda (132: H100/H200)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N most expensive functions")
    args = parser.parse_args(argv)

    config = ModelConfig.from_name(args.model)
    # Weights are never read (the forward is a stub): one layer and a small vocabulary keep the
    # setup small and the logits' device work (argmax, sampling, the Medusa heads) cheap on the
    # CPU, as it is on a GPU; the heads (GQA group, head dim) that planning depends on stay.
    config = dataclasses.replace(config, num_layers=1, vocab_size=1024, intermediate_size=256)
    model = from_config(config, seed=0, dtype=torch.bfloat16, device="cpu")
    rng = np.random.default_rng(0)
    work = random_workload(model, rng)
    prompt = rng.integers(0, config.vocab_size, args.prompt).tolist()
    print(f"host work per step, forward stubbed, {args.model} heads, {args.prompt}-token prompt, "
          f"{args.config} planner settings")
    sys.stdout.flush()
    for program in args.programs.split(","):
        times = []
        for _ in range(args.repeats + 1):
            engine = make_engine(model, args.prompt, args.config, args.ctas)
            ends = []
            step = engine.step

            def timed(*a, **k):
                out = step(*a, **k)
                ends.append(time.perf_counter())
                return out

            engine.step = timed
            PROGRAM_FUNCTIONS[program](engine, prompt, args.steps, work)
            times.append(1e3 * statistics.median(np.diff(ends[-args.steps:])))
        print(f"{program}: {statistics.median(times[1:]):.3f} ms/step (runs {', '.join(f'{t:.3f}' for t in times[1:])})",
              flush=True)
        if args.profile:
            engine = make_engine(model, args.prompt, args.config, args.ctas)
            profile = cProfile.Profile()
            profile.enable()
            PROGRAM_FUNCTIONS[program](engine, prompt, args.steps, work)
            profile.disable()
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile)
            print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
