#!/usr/bin/env python3
"""ToT-BFS over many Game-of-24 tasks: all in one forest (``tot_batch``) vs one task at a time (``tot_bfs``).

Each task is a Game-of-24 puzzle (``Game24Task``, the shipped few-shot prompts; bytes as tokens
with random weights), searched by BFS with the same configuration: ``--k`` thoughts per kept
state, ``--n`` kept, ``--depth`` levels, ``--thought-tokens`` / ``--value-tokens`` per output
(random weights never write a stop string, so every output has exactly that many), the model
judging every thought (``check_steps=False``); task i searches puzzle i mod 16. Both modes run on one graphed
engine in the same run, warmed by one untimed batched run (graphs captured for every step size); reported: wall
time, tasks per second, engine steps, and the speedup (batched tasks/s over one-at-a-time tasks/s; issue #49's
targets: >= 12x for 16 tasks, >= 30x for 64). The forest's searches read one copy of their root prompts' common
start (the few-shot examples); one at a time, each search prefills its whole prompt.
In bf16 a step's rounding depends on what else it computes, so the two modes' searches may
pick other thoughts on near-ties: the number of tasks whose results agree is reported.

    python bench/tot_batch.py                  # GPU: llama3-8b bf16, 16 tasks
    python bench/tot_batch.py --tasks 64       # GPU: 64 tasks (each puzzle four times)
    python bench/tot_batch.py --tasks 64 --alone-tasks 16   # the baseline over each puzzle once
    python bench/tot_batch.py --smoke          # CPU: tiny model, 3 tasks (CI)
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, versions, write_results  # noqa: E402
from treedec.sampling.params import SamplingParams  # noqa: E402
from treedec.engine import CudaGraphConfig, Engine  # noqa: E402
from treedec.models import ModelConfig, from_config  # noqa: E402
from treedec.programs.tot.game24 import Game24Task  # noqa: E402
from treedec.programs.tot import BFSConfig, ByteTokenizer, tot_batch, tot_bfs  # noqa: E402

#: Sixteen Game-of-24 puzzles (four numbers each, each reaching 24).
PUZZLES = ([1, 1, 4, 6], [1, 1, 11, 11], [1, 1, 3, 8], [1, 2, 2, 6], [1, 2, 3, 4], [1, 3, 4, 6], [2, 2, 4, 6],
           [2, 3, 5, 12], [3, 3, 8, 8], [4, 4, 10, 10], [4, 9, 10, 13], [5, 5, 5, 9], [1, 4, 5, 6], [2, 5, 5, 10],
           [3, 4, 6, 6], [6, 6, 6, 6])


def outcome(result) -> tuple:
    return tuple((s.index, s.thoughts) for s in result.best), tuple(lv.thoughts for lv in result.levels)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tasks", type=int, default=16, help=f"searches (task i: puzzle i mod {len(PUZZLES)})")
    parser.add_argument("--alone-tasks", type=int, default=None,
                        help="time one at a time over the first N tasks only (default: all); the speedup compares "
                             "tasks a second. With N = 16 each puzzle runs once, as in the forest of 64 (each four "
                             "times): the baseline of 64 tasks then costs a quarter of the device time")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--thought-tokens", type=int, default=48)
    parser.add_argument("--value-tokens", type=int, default=12)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 3 small searches (CI)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.tasks, args.k, args.n, args.depth, args.thought_tokens, args.value_tokens = \
            "tiny", 3, 2, 1, 2, 4, 2
    if args.tasks < 1:
        parser.error(f"--tasks must be >= 1, got {args.tasks}")
    alone_tasks = args.tasks if args.alone_tasks is None else args.alone_tasks
    if not 1 <= alone_tasks <= args.tasks:
        parser.error(f"--alone-tasks must be in [1, --tasks = {args.tasks}], got {args.alone_tasks}")
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    model = from_config(ModelConfig.from_name(args.model), seed=0, dtype=torch.bfloat16 if cuda else torch.float32,
                        device=device)
    engine = Engine(model, kv_tokens=None if cuda else 1 << 16, page_size=16,
                    cuda_graphs=CudaGraphConfig(max_queries=512) if cuda else False)
    config = BFSConfig(k=args.k, n=args.n, depth=args.depth, sampling=SamplingParams(temperature=0.7), seed=0)
    tasks = [Game24Task(PUZZLES[i % len(PUZZLES)], check_steps=False, thought_max_tokens=args.thought_tokens,
                        value_max_tokens=args.value_tokens) for i in range(args.tasks)]
    tokenizer = ByteTokenizer()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    tot_batch(engine, tasks, tokenizer, config)   # warm-up: every step size's graph captured, kernels compiled
    sync()
    start = time.perf_counter()
    batched, stats = tot_batch(engine, tasks, tokenizer, config, progress=not args.smoke)
    sync()
    batched_s = time.perf_counter() - start
    steps_before = engine.stats["steps"]
    start = time.perf_counter()
    alone = [tot_bfs(engine, task, tokenizer, config) for task in tasks[:alone_tasks]]
    sync()
    alone_s = time.perf_counter() - start
    alone_steps = engine.stats["steps"] - steps_before
    agree = sum(outcome(a) == outcome(b) for a, b in zip(batched, alone))
    speedup = (args.tasks / batched_s) / (alone_tasks / alone_s)   # tasks a second, batched over alone
    print(f"{args.tasks} ToT-BFS tasks (k={args.k} n={args.n} depth={args.depth}, thoughts {args.thought_tokens} "
          f"tokens, values {args.value_tokens}): one forest {batched_s:.2f} s ({args.tasks / batched_s:.2f} tasks/s, "
          f"{stats.steps} steps), one at a time {alone_s:.2f} s for {alone_tasks} "
          f"({alone_tasks / alone_s:.2f} tasks/s, {alone_steps} steps): {speedup:.2f}x; {agree} of {alone_tasks} "
          f"searches agree")
    results = {"device": device_name(device), "date": datetime.date.today().isoformat(), "versions": versions("triton"),
               "model": args.model, "smoke": args.smoke, "tasks": args.tasks,
               "config": {"k": args.k, "n": args.n, "depth": args.depth, "thought_tokens": args.thought_tokens,
                          "value_tokens": args.value_tokens, "temperature": 0.7},
               "batched": {"seconds": batched_s, "tasks_per_s": args.tasks / batched_s, "steps": stats.steps,
                           "max_queries_per_step": max(stats.queries_per_step), "peak_pages": stats.peak_pages,
                           "waits": stats.waits, "preemptions": stats.preemptions},
               "one_at_a_time": {"tasks": alone_tasks, "seconds": alone_s, "tasks_per_s": alone_tasks / alone_s,
                             "steps": alone_steps},
               "speedup": speedup, "searches_agreeing": agree,
               "eager_steps": {k: v for k, v in engine.graph_stats.items() if k.startswith("eager")}}
    write_results(results, args.out, "tot-batch", args.smoke, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
