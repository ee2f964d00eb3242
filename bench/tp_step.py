#!/usr/bin/env python3
"""A Medusa-64 verify step at tensor-parallel size N vs TP=1, in one torchrun launch (random weights).

Every rank builds its part of the same random model (``from_config(..., tensor_parallel=tp)``),
prefills one prompt and times the verify step of ``bench/step.py`` (the 64 tokens of
``medusa_tree(64)`` under the prompt, logits of all 64 in token order, pruned again), each step
followed by a device synchronisation; the median over ``--reps`` per rank is reported, and the
step time is the slowest rank's. Then rank 0 alone builds the TP=1 model (same seed, same
weights) and times the same step (``--no-baseline`` skips it, e.g. for a model that does not fit
one GPU); the TP=N logits are compared with the TP=1 logits (relative Frobenius error).

Floors per rank: this rank's weight bytes, and weights + the prompt's K/V of its KV heads, over
the measured device copy bandwidth (BENCH.md).

    torchrun --nproc-per-node 2 bench/tp_step.py                    # GPU: llama3-8b bf16, prompt 4000
    torchrun --nproc-per-node 2 bench/tp_step.py --model llama3-70b-shape --no-baseline ...
    torchrun --nproc-per-node 2 bench/tp_step.py --smoke            # CPU, gloo: tiny fp32 (CI)

Methods (``--methods``): ``eager``, ``graph`` (CUDA graphs, the all-reduces captured in them),
``graph_compiled`` (also ``compile_model``). NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``).
Rank 0 writes ``<out>/<date>-<device>-tp-step[-smoke][-tag].json`` and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, results_path, versions  # noqa: E402
from bench.step import free_memory, rel_err, time_calls  # noqa: E402
from bench.timing import copy_bandwidth  # noqa: E402
from treedec.engine import Engine  # noqa: E402
from treedec.models import ModelConfig, from_config  # noqa: E402
from treedec.models.tensor_parallel import TensorParallel, init_tensor_parallel  # noqa: E402
from treedec.workloads.deft import medusa_tree  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METHODS = ["eager", "graph", "graph_compiled"]
# NCCL settings the lent GPU machines require (KINDS.md): NVLink multicast off.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def main(argv=None) -> int:
    args = parse_args(argv)
    for name, value in NCCL_ENV.items():
        os.environ[name] = value
    tp = init_tensor_parallel()   # NCCL on GPU LOCAL_RANK, or gloo on CPUs
    try:
        results = measure(tp, args)
        if tp.rank == 0:
            path = results_path(Path(args.out), results["device"], "tp-step", smoke=args.smoke, tag=args.tag)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1) + "\n")
            print(render_table(results))
            print(f"wrote {path}", file=sys.stderr)
    finally:
        dist.destroy_process_group()
    return 0


def measure(tp: TensorParallel, args: argparse.Namespace) -> dict:
    """Time the verify step at TP=``tp.size`` on every rank, then at TP=1 on rank 0; the results (the same
    dict on every rank but the TP=1 entries, which rank 0 holds)."""
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.model, args.dtype, args.reps, args.prompt = "tiny", "fp32", min(args.reps, 3), min(args.prompt, 200)
    methods = args.methods or (METHODS if device.type == "cuda" else ["eager"])
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; methods: {METHODS}")
    if device.type != "cuda" and any(m.startswith("graph") for m in methods):
        raise SystemExit("the CUDA-graph methods need a CUDA device")
    config, dtype = model_config(args.model), DTYPES[args.dtype]
    medusa = medusa_tree(args.tree)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, config.vocab_size, args.prompt).tolist()
    tree_ids = rng.integers(0, config.vocab_size, medusa.size).tolist()
    bandwidth = copy_bandwidth(device)
    results = {"device": device_name(device), "date": datetime.date.today().isoformat(),
               "versions": versions("triton"), "backend": dist.get_backend(tp.group), "tensor_parallel": tp.size,
               "smoke": args.smoke, "model": args.model, "dtype": args.dtype, "prompt": args.prompt,
               "tree": medusa.source, "tree_tokens": medusa.size, "reps": args.reps, "page_size": args.page_size,
               "copy_bandwidth_TBps": bandwidth / 1e12, "methods": {}}

    model = from_config(config, seed=args.seed, dtype=dtype, device=device, tensor_parallel=tp)
    floors = _floors(model, args.prompt, bandwidth)
    tp_logits = {}
    for method in methods:
        r, tp_logits[method] = _run(model, method, prompt, tree_ids, medusa, args, device)
        per_rank = tp.gather_objects(r)
        results["methods"][method] = {
            "tp_ms": max(x["ms"] for x in per_rank), "per_rank_ms": [x["ms"] for x in per_rank],
            "per_rank_wall_ms": [x["wall_ms"] for x in per_rank], "floors_per_rank": tp.gather_objects(floors)}
    del model
    free_memory(device)

    if args.baseline:
        if tp.rank == 0:
            model = from_config(config, seed=args.seed, dtype=dtype, device=device)
            floors = _floors(model, args.prompt, bandwidth)
            for method in methods:
                r, logits = _run(model, method, prompt, tree_ids, medusa, args, device)
                entry = results["methods"][method]
                entry.update(tp1_ms=r["ms"], tp1_floors=floors, ratio=entry["tp_ms"] / r["ms"],
                             rel_err_vs_tp1=rel_err(tp_logits[method], logits))
            del model
            free_memory(device)
        dist.barrier(group=tp.group)
    return results


def model_config(name: str) -> ModelConfig:
    """A named size of MODEL_SIZES, or ``llama3-70b-shape`` (Llama-3-70B's shape, for random weights)."""
    if name == "llama3-70b-shape":
        return ModelConfig.from_name("llama3-8b", hidden_size=8192, intermediate_size=28672, num_layers=80,
                                     num_heads=64, num_kv_heads=8)
    return ModelConfig.from_name(name)


def _run(model, method: str, prompt, tree_ids, medusa, args, device) -> tuple[dict, torch.Tensor]:
    """(timing of the verify step, its logits [tree, vocab] on the CPU) on a fresh engine."""
    engine = Engine(model, kv_tokens=len(prompt) + 2 * medusa.size + 4 * args.page_size, page_size=args.page_size,
                    cuda_graphs=method.startswith("graph"), compile_model=method == "graph_compiled")
    tree = engine.tree
    root = engine.prefill(prompt).node
    captured = {}

    def verify():
        ids = tree.add_token_tree(root, tree_ids, medusa.parents)
        captured["logits"] = engine.step(logits_rows=engine.pending_rows(ids)).logits
        tree.prune(ids[0])

    timing = time_calls(verify, args.reps, device)
    if engine.graph_stats:
        timing["graph_stats"] = dict(engine.graph_stats)
    return timing, captured["logits"].float().cpu()


def _floors(model, prompt: int, bandwidth: float) -> dict:
    """This rank's step floors in ms: its weights, and its weights + the prompt's K/V of its KV heads."""
    c = model.config   # a tensor-parallel model's config is its rank's shard
    kv = prompt * 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize
    weights = model.weight_bytes()
    return {"weight_bytes": weights, "kv_bytes": kv, "weights_ms": 1e3 * weights / bandwidth,
            "step_ms": 1e3 * (weights + kv) / bandwidth}


def render_table(results: dict) -> str:
    """Markdown: per method, the TP=N step (slowest rank), its floors, the TP=1 step and the ratio."""
    n = results["tensor_parallel"]
    lines = [f"{results['date']}, {n} x {results['device']} ({results['backend']}), {results['model']} "
             f"{results['dtype']}{' (SMOKE)' if results['smoke'] else ''}: Medusa-{results['tree_tokens']} verify "
             f"step over a {results['prompt']}-token prompt; medians of {results['reps']} steps.", "",
             f"| method | TP={n} ms (slowest rank) | per rank ms | x rank floor (weights + KV) | TP=1 ms | "
             f"TP={n} / TP=1 | rel. err vs TP=1 |", "|---|---|---|---|---|---|---|"]
    for name, r in results["methods"].items():
        floor = max(f["step_ms"] for f in r["floors_per_rank"])
        per_rank = ", ".join(f"{x:.3f}" for x in r["per_rank_ms"])
        tp1 = ["", "", ""] if "tp1_ms" not in r else \
            [f"{r['tp1_ms']:.3f}", f"{r['ratio']:.2f}", f"{r['rel_err_vs_tp1']:.1e}"]
        lines.append(f"| {name} | {r['tp_ms']:.3f} | {per_rank} | {r['tp_ms'] / floor:.2f} | {' | '.join(tp1)} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b",
                        help="a named size of treedec.models.MODEL_SIZES, or llama3-70b-shape")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--prompt", type=int, default=4000, help="prompt tokens under the token tree")
    parser.add_argument("--tree", type=int, default=64, help="Medusa token-tree size (workloads/deft/speculative)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all on a GPU, eager on a CPU)")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="skip the TP=1 run on rank 0 (a model that does not fit one GPU)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder for the results JSON")
    parser.add_argument("--tag", default=None, help="appended to the results file name")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 model, prompt <= 200 (CPU, CI)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
