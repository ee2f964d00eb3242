#!/usr/bin/env python3
"""DeFT-Flatten vs the Radix-style ``path`` planner, end to end, on each workload family (the DeFT paper's Table 5).

For each family -- a ToT-BFS trace (``tot-sorting``), a Medusa record (``medusa-64``) and
few-shot prompting (4000-token prompt, b = 30 branches) -- the same schedule is replayed
through the engine (Llama-3-8B shape, random weights, triton backend) once per planner,
twice: a ``profile_split`` run (attention time from CUDA events around every layer's
attention call), all planners first, then a timed run (decode latency: wall time per step,
ending with the tokens on the host). Each run starts with a few untimed warm-up steps (kernel compilation).
Reported per family and planner: mean and median decode step latency, attention ms per
step, planning and bookkeeping ms per step, KV IO per step; and the speedups of the first
planner over the others (decode latency, attention time).

    python bench/replay.py                    # GPU: llama3-8b, bf16, triton; about 4 minutes on an H100
    python bench/replay.py --families medusa --iterations 50
    python bench/replay.py --cuda-graphs --backend auto   # timed runs from CUDA graphs, as programs run
    python bench/replay.py --smoke            # CPU: tiny config, fp32, torch backend, a few steps (CI)

Results go to ``<out>/<date>-<device>-replay[-smoke][-<tag>].json`` (written after every
family); each family's entry is a ``treedec replay`` results document (``treedec plot``
draws it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.results_file import add_run_arguments, results_path  # noqa: E402
from treedec.models import from_config  # noqa: E402
from treedec.replay import ReplayConfig, replay_results  # noqa: E402
from treedec.workloads import workload_schedule  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: family -> (workload, decode iterations on the GPU, on --smoke)
FAMILIES = {"tot": ("tot-sorting", 200, 4), "medusa": ("medusa-64", 100, 4), "fewshot": ("fewshot", 200, 4)}


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.model, args.dtype, args.backend, args.warmup = "tiny", "fp32", "torch", 1
        args.prompt_tokens = args.prompt_tokens or 200
        args.branches = min(args.branches, 4)
    planners = [p.strip() for p in args.planners.split(",") if p.strip()]
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; families: {sorted(FAMILIES)}")
    model = from_config(args.model, seed=args.seed, dtype=DTYPES[args.dtype], device=device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"cuda_graphs": args.cuda_graphs, "device": device_name, "date": datetime.date.today().isoformat(), "smoke": args.smoke,
               "model": args.model, "dtype": args.dtype, "backend": args.backend, "planners": planners,
               "page_size": args.page_size, "versions": {"torch": torch.__version__}, "families": {},
               "speedups": {}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = results_path(out_dir, device_name, "replay", smoke=args.smoke, tag=args.tag)
    started = time.perf_counter()
    for family in families:
        workload, gpu_iterations, smoke_iterations = FAMILIES[family]
        iterations = args.iterations or (smoke_iterations if args.smoke else gpu_iterations)
        schedule = workload_schedule(workload, iterations=iterations, branches=args.branches,
                                     prompt_tokens=args.prompt_tokens if family == "fewshot" else None)
        common = dict(backend=args.backend, page_size=args.page_size, seed=args.seed, progress=args.progress)
        # The split runs go first: they warm up every planner's shapes (compiles, allocator), so
        # that no timed run pays for being first (seen on an H200: the first planner ~6% slower).
        split = replay_results(model, schedule, [ReplayConfig(planner=p, warmup_steps=args.warmup,
                                                              profile_split=True, **common) for p in planners],
                               args.model, workload)
        timed = replay_results(model, schedule, [ReplayConfig(planner=p, warmup_steps=args.warmup,
                                                              cuda_graphs=args.cuda_graphs, **common)
                                                 for p in planners], args.model, workload)
        results["families"][family] = timed
        results["families"][family + "-split"] = split
        results["speedups"][family] = _speedups(timed, split)
        path.write_text(json.dumps(results, indent=1) + "\n")  # after every family: a cut-off run keeps its part
        _report(family, timed, split, results["speedups"][family])
    results["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {path}", file=sys.stderr)
    return 0


def _per_step(run: dict, key: str) -> float | None:
    values = [s[key] for s in run["steps"] if s["kind"] == "decode"]
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(values)


def _speedups(timed: dict, split: dict) -> dict:
    """Per planner after the first: its decode latency and attention time over the first planner's."""
    base, base_split = timed["runs"][0], split["runs"][0]
    out = {"reference": base["planner"], "same_tokens": timed["same_tokens"] and split["same_tokens"]}
    for run, run_split in zip(timed["runs"][1:], split["runs"][1:]):
        attn, base_attn = _per_step(run_split, "attention_ms"), _per_step(base_split, "attention_ms")
        out[run["planner"]] = {
            "decode_speedup_mean": run["summary"]["decode_ms_mean"] / base["summary"]["decode_ms_mean"],
            "decode_speedup_median": run["summary"]["decode_ms_median"] / base["summary"]["decode_ms_median"],
            "attention_speedup": None if not attn or not base_attn else attn / base_attn,
        }
    return out


def _report(family: str, timed: dict, split: dict, speedups: dict) -> None:
    print(f"\n{family}: {timed['schedule']['name']} ({timed['schedule']['steps']} steps) on {timed['device']}",
          file=sys.stderr)
    print(f"{'planner':>10} {'decode mean ms':>15} {'median ms':>10} {'attn ms/step':>13} {'plan ms/step':>13} "
          f"{'book ms/step':>13} {'KV IO MB/step':>14}", file=sys.stderr)
    for run, run_split in zip(timed["runs"], split["runs"]):
        m = run["summary"]
        attn = _per_step(run_split, "attention_ms")
        io = _per_step(run, "kv_io_bytes")
        print(f"{run['planner']:>10} {m['decode_ms_mean']:>15.2f} {m['decode_ms_median']:>10.2f} "
              f"{'-' if attn is None else f'{attn:.2f}':>13} {_per_step(run, 'plan_ms'):>13.2f} "
              f"{_per_step(run, 'bookkeeping_ms'):>13.2f} {(io or 0) / 1e6:>14.1f}", file=sys.stderr)
    for planner, s in speedups.items():
        if isinstance(s, dict):
            attn = "-" if s["attention_speedup"] is None else f"{s['attention_speedup']:.2f}x"
            print(f"{speedups['reference']} over {planner}: decode {s['decode_speedup_mean']:.2f}x (mean), "
                  f"{s['decode_speedup_median']:.2f}x (median); attention {attn}", file=sys.stderr)
    print(f"greedy tokens identical across planners: {'yes' if speedups['same_tokens'] else 'NO'}", file=sys.stderr)


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny config, fp32, torch backend, 4 steps per family")
    p.add_argument("--model", default="llama3-8b", help="a named model size (random weights)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--backend", default="triton")
    p.add_argument("--planners", default="flatten,path", help="the first is the one the speedups are of")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--iterations", type=int, help="decode iterations per family (default: tot 200, medusa 100, "
                                                  "fewshot 200; --smoke 4)")
    p.add_argument("--prompt-tokens", type=int, help="few-shot prompt length (default 4000; --smoke 200)")
    p.add_argument("--branches", type=int, default=30, help="few-shot branches (default 30; --smoke at most 4)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each run (default 3)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="the timed runs replay CUDA graphs (the attention-split runs stay eager)")
    add_run_arguments(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
