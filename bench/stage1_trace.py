#!/usr/bin/env python3
"""Where a cuda stage-1 call spends its time: %globaltimer stamps per CTA (sm_90a kernel).

Builds the kernels with ``-DTREEDEC_WS_TRACE=1`` (its own build cache), runs each suite
workload with the cuda backend, and records, per CTA, when it began, when the producer had the
first record and the first tile's slot indices, when it issued the first copies and the last
END, when consumer 0 saw items 0-9 land and when it had stored its rows (slot names in
``ws_trace.cuh``, ``TraceSlot``). Times are microseconds from the earliest CTA start
of a call, in three modes: each call after an L2 flush (as bench/attention.py's eager timings),
each call with the plan arrays L2-hot, and the last of 8 calls captured back to back in a CUDA
graph. Prints the median and the slowest CTA per stamp and writes
``<date>-<device>-stage1-trace.json`` to ``--out``.

    python bench/stage1_trace.py --workloads tot_d5w10,spec_medusa64_p32k --out bench/results
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.families import WORKLOADS  # noqa: E402
from bench.suite import HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS  # noqa: E402

GRAPH_CALLS = 8  # calls per captured graph in the "graphed" mode

SLOTS = ["start", "record", "slots0", "issued0", "last_end"] + [f"item{i}" for i in range(10)] + ["stored"]


def trace_build_env() -> None:
    """Ask for the trace build (before the extension is first loaded in this process)."""
    flags = os.environ.get("TREEDEC_CUDA_FLAGS", "")
    if "TREEDEC_WS_TRACE" not in flags:
        os.environ["TREEDEC_CUDA_FLAGS"] = (flags + " -DTREEDEC_WS_TRACE=1").strip()
    os.environ.setdefault("TREEDEC_CACHE_DIR", str(Path.home() / ".cache" / "treedec-trace"))


def summarize(stamps: np.ndarray) -> dict:
    """stamps [reps, CTAs, slots] int64 ns (0: not stamped) -> per slot the median over calls of the
    median and the slowest CTA, in us from each call's earliest CTA start."""
    t = stamps.astype(np.float64)
    t[stamps == 0] = np.nan
    rel = (t - np.nanmin(t[:, :, 0], axis=1)[:, None, None]) / 1e3
    out = {}
    for s, name in enumerate(SLOTS):
        col = rel[:, :, s]
        if np.all(np.isnan(col)):
            continue
        out[name] = {"median_cta_us": float(np.nanmedian(np.nanmedian(col, axis=1))),
                     "slowest_cta_us": float(np.nanmedian(np.nanmax(col, axis=1)))}
    return out


def graphed_stamps(run, ext, trace: torch.Tensor, reps: int, calls: int = GRAPH_CALLS) -> np.ndarray:
    """Stamps of the last of ``calls`` back-to-back calls captured in one CUDA graph, per replay:
    [reps, CTAs, slots] (each call of the graph stamps the same buffer; the last one's stay)."""
    ext.set_trace(trace)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                run()
    finally:
        ext.set_trace(None)
    stamps = []
    for _ in range(reps):
        trace.zero_()
        graph.replay()
        torch.cuda.synchronize()
        stamps.append(trace.cpu().numpy())
    return np.stack(stamps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="tot_d5w10,spec_medusa64_p32k",
                        help="comma-separated, of the suite and the families (bench/families.py)")
    parser.add_argument("--planner", default="flatten", help="the planner (default flatten)")
    parser.add_argument("--chunk-size", type=int, default=None, help="chunk size (default: the automatic rule)")
    parser.add_argument("--reps", type=int, default=20, help="traced calls per workload and mode")
    parser.add_argument("--out", default=None, help="folder for the results JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("stage1_trace.py needs a CUDA device")
    names = args.workloads.split(",")
    for name in names:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; workloads: {list(WORKLOADS)}")
    trace_build_env()
    from treedec import PlanConfig, TreeAttention
    from treedec.kernels.cuda_tree_attention import extension

    device = torch.device("cuda")
    ext = extension(device)
    if not ext.trace_compiled():
        raise SystemExit("the kernels were built without TREEDEC_WS_TRACE=1 (an sm_90a GPU is needed for the trace)")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    results = {}
    for name in names:
        workload = WORKLOADS[name]()
        layout = workload.layout
        q, k, v = workload.random_inputs(device)
        attn = TreeAttention(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, backend="cuda",
                             plan_config=PlanConfig(args.planner, args.chunk_size), device=device)
        plan = attn.plan(layout)
        for _ in range(3):
            attn.run(q, k, v, plan)
        prepared = plan.prepared
        ctas = len(prepared.cta_unit_start) - 1
        trace = torch.zeros(ctas, ext.trace_slots(), dtype=torch.int64, device=device)
        by_mode = {}
        for mode in ("flushed", "l2_hot"):
            stamps = []
            for _ in range(args.reps):
                if mode == "flushed":
                    flush.zero_()
                trace.zero_()
                ext.set_trace(trace)
                attn.run(q, k, v, plan)
                ext.set_trace(None)
                torch.cuda.synchronize()
                stamps.append(trace.cpu().numpy())
            by_mode[mode] = summarize(np.stack(stamps))
        by_mode["graphed"] = summarize(graphed_stamps(lambda: attn.run(q, k, v, plan), ext, trace, args.reps))
        schedule = prepared.schedule
        results[name] = {"plan": plan.plan.summary(), "ctas": ctas, "units": schedule.num_units,
                         "kv_tile_tokens": schedule.tile_tokens, **by_mode}
        print(f"{name}: {schedule.num_units} units on {ctas} CTAs; us from the first CTA start "
              f"(median CTA / slowest CTA)")
        print("  stamp        " + "".join(f"{m:>22}" for m in by_mode))
        for slot in SLOTS:
            cells = [by_mode[m].get(slot) for m in by_mode]
            if all(c is None for c in cells):
                continue
            print(f"  {slot:12s}" + "".join(f"{c['median_cta_us']:11.2f}{c['slowest_cta_us']:11.2f}" if c else " " * 22
                                           for c in cells))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        device_name = torch.cuda.get_device_name(device)
        path = out / f"{date.today().isoformat()}-{device_name.lower().replace(' ', '-')}-stage1-trace.json"
        path.write_text(json.dumps({"device": device_name, "date": date.today().isoformat(),
                                    "versions": {"torch": torch.__version__},
                                    "flags": os.environ["TREEDEC_CUDA_FLAGS"], "slots": SLOTS,
                                    "workloads": results}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
