"""``treedec replay`` and ``treedec plot``: argument parsing and the printed report."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from treedec.attention import PLANNERS
from treedec.commands.args import (add_model_arguments, backend_arg, check_backend, existing_file, load_model,
                                   nonnegative_int, output_file, planner_list, positive_int, read_json, seed_int,
                                   workload_arg)
from treedec.commands.kv_memory import check_kv_pool, out_of_memory_as_error
from treedec.workloads import TOT_FILES, WORKLOADS, workload_schedule

# ================================================================ replay and plot


def add_replay_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a recorded decoding tree through the engine and time every step",
                       description="Replay a workload schedule through the real model (the tree's shape is forced, "
                                   "the tokens are the model's greedy choices) and report per-step latency, its "
                                   "split, KV IO and KV pages.")
    p.add_argument("workload", type=workload_arg, help=f"one of {', '.join(WORKLOADS)}, or a schedule JSON file")
    add_model_arguments(p)
    p.add_argument("--backend", type=backend_arg, default="auto", help="auto, reference, torch, triton or cuda")
    p.add_argument("--planner", default="flatten", choices=PLANNERS, help="default flatten")
    p.add_argument("--compare", type=planner_list,
                   help="comma-separated planners replayed one after another (overrides --planner)")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--kv-tokens", type=positive_int, help="KV pool size; default the schedule's peak (from a dry run)")
    p.add_argument("--iterations", type=positive_int, help="replay step 0 (the prompt) and this many steps after it")
    p.add_argument("--tree", type=nonnegative_int, help="ToT workloads: tree index (default the first complete tree)")
    p.add_argument("--record", type=nonnegative_int, default=0, help="Medusa workloads: record index")
    p.add_argument("--prompt-tokens", type=positive_int,
                   help="few-shot prompt length (default 4000); Medusa prompt length (default the record's text "
                        "length / 4)")
    p.add_argument("--branches", type=positive_int, default=20, help="few-shot branches")
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps replayed first (default 2)")
    p.add_argument("--profile-split", action="store_true",
                   help="on a GPU, time the attention with CUDA events around every layer's call")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="on a GPU, replay the engine's steps from CUDA graphs (not with --profile-split)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="random weights, and the token ids of the replayed tree (default 0)")
    p.add_argument("--out", type=output_file, help="write the results JSON here, every step's times (its folder must "
                                                   "exist; without it only the table is printed)")
    p.add_argument("--save-schedule", type=output_file,
                   help="write the schedule that is replayed as JSON here (its folder must exist)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="plot latency per iteration and its breakdown from replay results")
    p.add_argument("results", nargs="+", type=existing_file,
                   help="results JSON files of treedec replay --out or bench/replay.py")
    p.add_argument("--out", type=output_file, default="replay.png",
                   help="image file; its extension picks the format (default replay.png)")


def run_replay(args: argparse.Namespace) -> int:
    from treedec.replay.runner import ReplayConfig, replay_results

    try:
        schedule = workload_schedule(args.workload, iterations=args.iterations, tree_index=args.tree,
                                     record=args.record, prompt_tokens=args.prompt_tokens, branches=args.branches)
    except IndexError as e:  # the builders' range check of a tree / record index against the file
        raise ValueError(f"{'--tree' if args.workload in TOT_FILES else '--record'}: {e}") from e
    planners = args.compare or [args.planner]
    check_backend(args)
    if args.save_schedule:
        schedule.save(args.save_schedule)
    model, model_name = load_model(args)
    pool = ("the KV pool of the schedule's peak" if args.kv_tokens is None else
            check_kv_pool(model, args.kv_tokens, args.page_size, kv_cache_dtype=args.kv_cache_dtype))
    configs = [ReplayConfig(planner=p, backend=args.backend, page_size=args.page_size, kv_tokens=args.kv_tokens,
                            profile_split=args.profile_split, warmup_steps=args.warmup, seed=args.seed,
                            progress=not args.no_progress, cuda_graphs=args.cuda_graphs,
                            kv_cache_dtype=args.kv_cache_dtype) for p in planners]
    with out_of_memory_as_error(f"replaying {args.workload} ({pool})", "lower --kv-tokens, or use a smaller --dtype"):
        results = replay_results(model, schedule, configs, model_name, args.workload)
    print_results(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"results: {args.out}")
    else:
        print("(the results JSON, every step's times, which treedec plot draws: --out FILE)", file=sys.stderr)
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from treedec.replay.plot import check_image_format, plot_results, results_documents

    check_image_format(args.out)
    results = []
    for path in args.results:
        results.extend(results_documents(read_json(path, "results file"), path))
    plot_results(results, args.out)
    print(f"figure: {args.out}")
    return 0


def print_results(results: dict, file=None) -> None:
    """One line per run: decode latency, its split, KV IO, pages, tokens."""
    file = file or sys.stdout
    s = results["schedule"]
    print(f"{results['workload']}: {s['name']}, {s['steps']} steps; {results['model']} {results['dtype']} on "
          f"{results['device']}, page size {results['page_size']}", file=file)
    header = ("planner", "backend", "steps", "mean ms", "attn ms", "plan ms", "book ms", "other ms", "KV IO GB",
              "peak pages", "tokens", "freed")
    rows = []
    for run in results["runs"]:
        m = run["summary"]

        def ms(key):
            return "-" if m[key] is None else f"{m[key]:.1f}"

        rows.append((run["planner"], run["backend"], str(m["decode_steps"]),
                     "-" if m["decode_ms_mean"] is None else f"{m['decode_ms_mean']:.2f}",
                     ms("attention_ms_total"), ms("plan_ms_total"), ms("bookkeeping_ms_total"), ms("other_ms_total"),
                     f"{(m['kv_io_bytes_total'] or 0) / 1e9:.3f}", str(m["peak_kv_pages"]),
                     str(m["tokens_generated"]), "yes" if m["pages_free_at_end"] else "NO"))
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)), file=file)
    print("(ms columns are totals over the decode steps)", file=file)
    if len(results["runs"]) > 1:
        print("greedy tokens identical across runs: " + ("yes" if results["same_tokens"] else "NO"), file=file)
