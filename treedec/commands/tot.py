"""``treedec tot``: Tree-of-Thought search (BFS or DFS) on a Game-of-24 problem, or on many tasks batched.

    treedec tot                                        # tiny random model on the CPU, bytes as tokens
    treedec tot --numbers 3 3 8 8 --algorithm dfs --threshold 1
    treedec tot --model /models/Llama-3.1-8B-Instruct --k 5 --n 5 --out tot.json
    treedec tot --tasks puzzles.jsonl --out results.jsonl            # every task's search in one forest
    treedec tot --task mytasks:Crossword --tasks grids.jsonl --out results.jsonl

Prints one line per BFS level (DFS expansion): thoughts, tokens, engine steps, wall time,
tokens/s and KV pages; then the best states. ``--out`` writes the results JSON: the run's
settings and :meth:`ToTResult.to_json`. With ``--tasks`` (a JSONL file of task arguments, see
:mod:`treedec.commands.tot_tasks`) all searches run batched (:func:`~treedec.programs.tot.program.tot_batch`),
one line each is printed and ``--out`` is a JSONL file, one result per task, each appended as
its search finishes (so in the order they finish; a run that fails keeps every finished
search's line: :mod:`treedec.commands.batch_io`).

``--task module:Class`` imports that module, which runs its code: see
:mod:`treedec.commands.tot_tasks` for the trust model and the import path.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

from treedec.sampling.params import SamplingParams
from treedec.attention import PLANNERS
from treedec.commands.args import (MODEL_HELP, add_model_arguments, backend_arg, check_backend, engine_options,
                                   existing_file, finite_float, load_model, nonnegative_float, output_file,
                                   positive_int, seed_int)
from treedec.commands.batch_io import ResultsWriter, request_name
from treedec.commands.kv_memory import command_engine
from treedec.engine.pool_sizing import CPU_POOL_TOKENS
from treedec.commands.tot_tasks import DEFAULT_TASK, load_task_class, read_tasks
from treedec.programs.tot.game24 import Game24Task
from treedec.models.text import has_tokenizer, load_tokenizer
from treedec.programs.tot import (SELECTIONS, BFSConfig, ByteTokenizer, DFSConfig, HFTokenizer, ToTResult, ToTTask,
                                tot_batch, tot_bfs, tot_dfs)
from treedec.runtime.request import position_limit
from treedec.programs.tot.task import check_task



def add_tot_parser(sub) -> None:
    p = sub.add_parser("tot", help="Tree-of-Thought search (BFS or DFS) on a Game-of-24 problem",
                       description="Tree-of-Thought search on the Game of 24: each level's thoughts decode "
                                   "together in one engine step per token and are judged together by value "
                                   "prompts under their own nodes; the thoughts not kept are pruned.")
    p.add_argument("--numbers", type=positive_int, nargs=4, metavar="N",
                   help="the four numbers of the Game of 24 (default 4 9 10 13)")
    p.add_argument("--tasks", type=existing_file,
                   help="JSONL, one search per line: the task's arguments, e.g. {\"id\": \"p1\", \"numbers\": "
                        "[4, 9, 10, 13]}; all searched in one forest")
    p.add_argument("--task", default=DEFAULT_TASK, metavar="MODULE:CLASS",
                   help="the task class, a ToTTask subclass (default the Game of 24); importing MODULE runs its "
                        "code (the current directory is searched after the installed modules)")
    p.add_argument("--algorithm", choices=("bfs", "dfs"), default="bfs")
    p.add_argument("--k", type=positive_int, default=3, help="thoughts per expanded state (default 3)")
    p.add_argument("--n", type=positive_int, default=2, help="BFS: states kept per level (default 2)")
    p.add_argument("--depth", type=positive_int, default=4,
                   help="thoughts on a path: three steps and the answer (default 4)")
    p.add_argument("--selection", choices=SELECTIONS, default="greedy", help="BFS: how the n states are kept")
    p.add_argument("--threshold", type=finite_float, default=1.0,
                   help="DFS: thoughts valued below it are pruned (default 1: 'likely' or better)")
    p.add_argument("--max-expansions", type=positive_int, default=20, help="DFS: states expanded at most (default 20)")
    p.add_argument("--temperature", type=nonnegative_float, default=0.7,
                   help="thought sampling; 0: top-k first tokens, argmax")
    p.add_argument("--value-samples", type=positive_int, default=1, help="outputs per evaluation (values summed)")
    p.add_argument("--value-temperature", type=nonnegative_float, default=0.0)
    p.add_argument("--thought-max-tokens", type=positive_int, help="default the task's (48)")
    p.add_argument("--value-max-tokens", type=positive_int, help="default the task's (12)")
    p.add_argument("--no-check-steps", action="store_true",
                   help="have the model judge malformed or wrong steps too (random weights write nothing valid)")
    add_model_arguments(p, model_help=f"{MODEL_HELP} (its tokenizer, if it has one)",
                        config_help="a named model size with random weights (default: tiny, on the CPU); "
                                    "bytes as tokens", batch_invariant=True)
    p.add_argument("--backend", type=backend_arg, default="auto", help="auto, reference, torch, triton or cuda")
    p.add_argument("--planner", choices=PLANNERS, help="default flatten (with --batch-invariant: path, its own)")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--kv-tokens", type=positive_int,
                   help="KV pool size in tokens (default: on the CPU one context of the model a search, at most "
                        f"{CPU_POOL_TOKENS}; on a GPU what free memory holds)")
    p.add_argument("--seed", type=seed_int, default=0, help="random weights and sampling (default 0)")
    p.add_argument("--out", type=output_file,
                   help="write the results JSON here (with --tasks: JSONL, one line per task; its folder must exist)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_tot(args: argparse.Namespace) -> int:
    from treedec.attention import PlanConfig

    # Everything the user typed is checked before a model is loaded.
    cls = load_task_class(args.task)
    tasks = _tasks(args, cls)
    common = dict(k=args.k, depth=args.depth, sampling=SamplingParams(temperature=args.temperature),
                  value_samples=args.value_samples,
                  value_sampling=SamplingParams(temperature=args.value_temperature), seed=args.seed)
    if args.algorithm == "bfs":
        config = BFSConfig(n=args.n, selection=args.selection, **common)
    else:
        config = DFSConfig(threshold=args.threshold, max_expansions=args.max_expansions, **common)
    if args.batch_invariant and args.planner is not None:
        raise ValueError(f"--batch-invariant plans attention with the path planner and a fixed chunk: leave "
                         f"--planner {args.planner} out")
    plan_config = None if args.batch_invariant else PlanConfig(planner=args.planner or "flatten")
    check_backend(args)

    model, model_name = load_model(args)
    tokenizer, tokenizer_name = _search_tokenizer(args.model, model.config.vocab_size)
    # on the CPU a search's pool is one context of the model (a search's tree, its thoughts and value prompts, took
    # 800 tokens of SmolLM2's 8192 on the Game of 24; past the pool programs wait for pages)
    engine = command_engine(model, args.kv_tokens, args.page_size,
                            None if len(tasks) == 1 else [position_limit(model)] * len(tasks),
                            plan_config=plan_config, **engine_options(args))
    device = model.device
    settings = {
        "command": "tot", "date": datetime.date.today().isoformat(), "task_class": args.task,
        "config": {"kind": type(config).__name__, **dataclasses.asdict(config)},
        "model": model_name, "tokenizer": tokenizer_name, "dtype": str(model.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": engine.attn.backend, "planner": engine.attn.plan_config.planner, "page_size": args.page_size,
        "kv_pool_tokens": engine.kv_capacity_tokens, "kv_cache_dtype": engine.kv_cache_dtype,
        "batch_invariant": engine.batch_invariance is not None,
    }
    if args.tasks is not None:
        return _run_tasks(args, engine, tasks, tokenizer, config, settings)
    [(_, task, arguments)] = tasks
    search = tot_bfs if args.algorithm == "bfs" else tot_dfs
    result = search(engine, task, tokenizer, config, progress=not args.no_progress)
    results = {**settings, "task": _describe(task, arguments),
               "pages_free_at_end": engine.pool.num_free_pages == engine.pool.num_pages, "result": result.to_json()}
    print_tot(results, result)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"results: {args.out}")
    return 0


def _tasks(args: argparse.Namespace, cls) -> list[tuple[str, ToTTask, dict]]:
    """The searches' ``(id, task, arguments)``: the tasks file's, or one task from the flags."""
    lengths = {name: value for name in ("thought_max_tokens", "value_max_tokens")
               if (value := getattr(args, name)) is not None}

    def configure(task: ToTTask) -> None:
        for name, value in lengths.items():
            setattr(task, name, value)
        if args.no_check_steps:
            if not hasattr(task, "check_steps"):
                raise ValueError(f"--no-check-steps: {type(task).__name__} has no check_steps setting")
            task.check_steps = False
        check_task(task)

    if args.tasks is not None:
        if args.numbers is not None:
            raise ValueError("--numbers goes with a single Game-of-24 search; with --tasks give each line's numbers")
        return read_tasks(args.tasks, cls, configure)
    if cls is Game24Task:
        arguments = {"numbers": list(args.numbers or (4, 9, 10, 13))}
    elif args.numbers is not None:
        raise ValueError(f"--numbers is the Game of 24's; --task {args.task} takes its arguments from --tasks")
    else:
        arguments = {}
    task = cls(**arguments)
    configure(task)
    return [("0", task, arguments)]


def _describe(task: ToTTask, arguments: dict) -> dict:
    out = {"name": "game24" if isinstance(task, Game24Task) else type(task).__name__, **arguments,
           "thought_max_tokens": task.thought_max_tokens, "value_max_tokens": task.value_max_tokens}
    if isinstance(task, Game24Task):
        out["check_steps"] = task.check_steps
    return out


def _run_tasks(args: argparse.Namespace, engine, tasks: list, tokenizer, config, settings: dict) -> int:
    """Every task's search in one forest; a line per task, each task's results line appended as it finishes."""
    def done(index: int, result: ToTResult) -> None:
        task_id, task, arguments = tasks[index]
        if writer is not None:
            writer.write(task_id, [{"id": task_id, "task": _describe(task, arguments), "result": result.to_json()}])

    writer = None if args.out is None else ResultsWriter(args.out, {task_id: request_name(task_id)
                                                                    for task_id, _, _ in tasks}, noun="task")
    with writer or contextlib.nullcontext():
        results, stats = tot_batch(engine, [task for _, task, _ in tasks], tokenizer, config,
                                   progress=not args.no_progress, on_task_done=done)
    solved = 0
    for (task_id, task, arguments), result in zip(tasks, results):
        solved += result.solved is not None
        best = result.solved or (result.best[0] if result.best else None)
        print(f"{task_id}: {'solved' if result.solved else 'not solved'}, {len(result.levels)} levels, "
              f"{result.tokens_generated} tokens, best value {best.value if best else float('nan'):.3g}"
              + (f": {' | '.join(repr(t)[:40] for t in best.thoughts)}" if best else ""))
    print(f"{len(tasks)} tasks ({settings['config']['kind']}) in {stats.seconds:.2f} s "
          f"({len(tasks) / max(stats.seconds, 1e-9):.2f} tasks/s), {stats.steps} batched steps (up to "
          f"{max(stats.programs_per_step, default=0)} searches a step), {solved} solved; peak {stats.peak_pages} KV "
          f"pages, all free at the end: {engine.pool.num_free_pages == engine.pool.num_pages}")
    if args.out:
        print(f"results: {args.out}")
    return 0


def print_tot(results: dict, result: ToTResult, file=None) -> None:
    """The run's settings, one line per level / expansion, and the best states."""
    file = file or sys.stdout
    name = "ToT-BFS" if result.algorithm == "bfs" else "ToT-DFS"
    task = results["task"]
    what = f"the Game of 24 {task['numbers']}" if task["name"] == "game24" else task["name"]
    print(f"{name} on {what}: {results['model']} {results['dtype']} on "
          f"{results['device']}, {results['backend']} attention ({results['planner']}), page size "
          f"{results['page_size']}; prompt {result.prompt_tokens} tokens", file=file)
    header = ("depth", "states", "thoughts", "kept", "thought tok", "value tok", "steps", "wall s", "tok/s",
              "peak pages", "pages after", "best value")
    rows = [(str(s.depth), str(s.states), str(s.thoughts), str(s.kept), str(s.thought_tokens), str(s.value_tokens),
             str(s.steps), f"{s.wall_s:.2f}", f"{s.tokens_per_s:.0f}", str(s.pages_peak), str(s.pages_after),
             f"{s.best_value:.3g}") for s in result.levels]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)), file=file)
    print(f"{result.tokens_generated} tokens generated in {result.wall_s:.2f} s (prefill included); "
          f"solved: {'yes' if result.solved else 'no'}", file=file)
    shown = ([result.solved] if result.solved else []) + result.best[:3]
    for state in shown:
        print(f"  value {state.value:.3g} {list(state.index)}: " + " | ".join(repr(t)[:60] for t in state.thoughts),
              file=file)


def _search_tokenizer(model: str | None, vocab_size: int):
    """``--model``'s tokenizer when it has one (:func:`~treedec.models.text.load_tokenizer`), else
    :class:`ByteTokenizer` (which needs a vocabulary of >= 256); with the name the results file gives it."""
    if model is not None and has_tokenizer(model):
        return HFTokenizer(load_tokenizer(model)), model
    if vocab_size < 256:
        raise ValueError(f"the byte tokenizer needs a vocabulary of at least 256 tokens, the model has {vocab_size}")
    return ByteTokenizer(), "bytes"
