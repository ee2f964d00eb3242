"""``treedec replay`` and ``treedec plot``: argument parsing and the printed report."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from treedec.attention import PLANNERS
from treedec.workloads import WORKLOADS, workload_schedule

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_replay_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a recorded decoding tree through the engine and time every step",
                       description="Replay a workload schedule through the real model (the tree's shape is forced, "
                                   "the tokens are the model's greedy choices) and report per-step latency, its "
                                   "split, KV IO and KV pages.")
    p.add_argument("workload", help=f"one of {', '.join(WORKLOADS)}, or a schedule JSON file")
    add_model_arguments(p)
    p.add_argument("--backend", default="auto", help="auto, reference, torch, triton or cuda")
    p.add_argument("--planner", default="flatten", help="flatten, node, node_chunk or path")
    p.add_argument("--compare", help="comma-separated planners replayed one after another (overrides --planner)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, help="KV pool size; default the schedule's peak (from a dry run)")
    p.add_argument("--iterations", type=int, help="replay step 0 (the prompt) and this many steps after it")
    p.add_argument("--tree", type=int, help="ToT workloads: tree index (default the first complete tree)")
    p.add_argument("--record", type=int, default=0, help="Medusa workloads: record index")
    p.add_argument("--prompt-tokens", type=int, help="few-shot prompt length (default 4000); Medusa prompt length "
                                                      "(default the record's text length / 4)")
    p.add_argument("--branches", type=int, default=20, help="few-shot branches")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps replayed first (default 2)")
    p.add_argument("--profile-split", action="store_true",
                   help="on a GPU, time the attention with CUDA events around every layer's call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--save-schedule", help="write the schedule that is replayed as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="plot latency per iteration and its breakdown from replay results")
    p.add_argument("results", nargs="+", help="results JSON files of treedec replay or bench/replay.py")
    p.add_argument("--out", default="replay.png", help="image file (default replay.png)")


def run_replay(args: argparse.Namespace) -> int:
    from treedec.replay.runner import ReplayConfig, replay_results

    schedule = workload_schedule(args.workload, iterations=args.iterations, tree_index=args.tree, record=args.record,
                                 prompt_tokens=args.prompt_tokens, branches=args.branches)
    if args.save_schedule:
        schedule.save(args.save_schedule)
    planners = [p.strip() for p in args.compare.split(",") if p.strip()] if args.compare else [args.planner]
    unknown = [p for p in planners if p not in PLANNERS]
    if unknown:
        raise ValueError(f"planner(s) {unknown} unknown; planners: {list(PLANNERS)}")
    model, model_name = load_model(args)
    configs = [ReplayConfig(planner=p, backend=args.backend, page_size=args.page_size, kv_tokens=args.kv_tokens,
                            profile_split=args.profile_split, warmup_steps=args.warmup, seed=args.seed,
                            progress=not args.no_progress) for p in planners]
    results = replay_results(model, schedule, configs, model_name, args.workload)
    print_results(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"results: {args.out}")
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from treedec.replay.plot import plot_results

    results = []
    for path in args.results:
        data = json.loads(Path(path).read_text())
        # bench/replay.py writes one results document per family (and its profile_split twin)
        results.extend(data["families"].values() if "families" in data else [data])
    plot_results(results, args.out)
    print(f"figure: {args.out}")
    return 0


def add_model_arguments(p, model_help: str = "a local Hugging Face checkpoint directory",
                        config_help: str = "a named model size with random weights (default: tiny, on the CPU)") -> None:
    """``--model`` or ``--config``, ``--device`` and ``--dtype``: what :func:`load_model` reads."""
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", help=model_help)
    model.add_argument("--config", help=config_help)
    p.add_argument("--device", help="default: cpu for the tiny default, else cuda when available")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on a GPU, fp32 on the CPU")


def load_model(args: argparse.Namespace):
    """The model of ``--model`` / ``--config`` (default: tiny random weights on the CPU) and its name."""
    from treedec.engine import from_config, from_pretrained

    if args.model is None and args.config is None:
        device = torch.device(args.device or "cpu")
        name = "tiny"
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        name = args.model or args.config
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.model is not None:
        return from_pretrained(args.model, dtype=dtype, device=device), args.model
    return from_config(name, seed=args.seed, dtype=dtype, device=device), f"{name} (random weights)"


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
