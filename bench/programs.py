#!/usr/bin/env python3
"""Programs end to end (BENCH.md section 3): wall time per step of the programs users call.

Each program runs through its public function on a fresh :class:`~treedec.engine.Engine`
(Llama-3-8B shape, random bf16 weights by default), after a prompt of each ``--prompts`` length:

- ``greedy``: ``generate.greedy_generate``, one token per step (pipelined on a GPU unless
  ``--no-pipeline``);
- ``tree_verify``: ``speculative_generate`` with a ``TreeDraft`` of the fixed Medusa-64 tree
  (``workloads/deft/speculative/tree_size64.json``) and fixed random draft tokens (pipelined on a GPU
  unless ``--no-pipeline``);
- ``medusa_heads``: ``speculative_generate`` with a ``MedusaDraft`` over the same tree and
  random Medusa heads (one per tree level), the heads' drafting included in the step (pipelined on a
  GPU unless ``--no-pipeline``: step i + 1 launched before step i's tokens are read);
- ``parallel_sample``: ``sampling.parallel_sample`` with ``--samples`` (16) samples, temperature 1
  (pipelined on a GPU unless ``--no-pipeline``);
- ``eagle`` / ``eagle3``: ``speculative_generate`` with an ``EagleDraft`` over a random EAGLE-1 / EAGLE-3
  drafter (EAGLE-3: a 32000-token draft vocabulary, as the EAGLE-3 Llama-3.1 release) on an engine of
  its own (graphed with the target's method), EAGLE-2 trees of ``--eagle-depth`` (5) layers, top-k
  ``--eagle-top-k`` (8), ``--tree - 1`` draft tokens: a step is the drafting (one drafter step to take
  the target's states, one per further tree layer) and the verification;
- ``eagle_chains`` / ``eagle3_chains``: the same drafters with ``EagleDraft(tree="chains")``: the root's
  ``--eagle-top-k`` best children, each extended to ``--eagle-depth`` tokens by argmax (a fixed tree of
  top-k * depth draft tokens, drafted on the device), pipelined on a GPU unless ``--no-pipeline``.

A step is the time between the returns of two consecutive engine steps of the program: its
host work (drafting, acceptance, sampling, tree edits, planning) and the step itself. The
engine's ``step`` is wrapped on the instance to stamp ``time.perf_counter()`` when it returns,
without synchronising: a program that reads each step's outputs waits for the device there
anyway, and a pipelined one (all but ``eagle`` / ``eagle3`` on a GPU launch step
i + 1 before they read step i's tokens) would lose its overlap to a synchronisation; in the steady state the interval
between returns is the time per step either way. The first ``--warmup`` steps (CUDA-graph
captures) are dropped; the median of the next ``--steps`` is reported. Only
``speculative_generate`` has a per-step hook (``on_step``); ``greedy_generate`` and
``parallel_sample`` have none, hence the wrapper.

Step floor = (weight bytes + KV bytes the step reads) / device copy bandwidth
(``bench/timing.copy_bandwidth``, read + write): the model's ``weight_bytes()`` (plus the
Medusa heads' for ``medusa_heads``; plus, for ``eagle*``, the drafter's ``weight_bytes()`` once per
drafter step of a proposal, ``--eagle-depth`` of them) and, per step, every token of the tree it attends to
(prompt, tokens so far, the step's own tokens) at 2 * layers * kv_heads * head_dim * dtype
bytes, averaged over the timed steps. ``eager steps``: steps of the program (the prefill's
long chunks excluded) that the CUDA-graph methods ran eagerly, with their reasons in the JSON;
within the graph limits there must be none.

Methods: ``eager``, ``graphs`` (``Engine(cuda_graphs=True)``), ``graphs_model`` (``Engine(cuda_graphs=True,
compile_model=True)``: the whole graphed forward through ``torch.compile``, attention as a custom op),
and ``eager``/``graphs`` again after ``model.compile_pointwise()`` (``*_compiled``; they run last:
the fusion is for good).
``--hf`` adds ``hf_sdpa``: transformers (sdpa, 4D tree mask, on views of the same weights,
``bench/step.py``'s helpers) running the same *step* as ``greedy`` (a one-token decode) and
``tree_verify`` (a Medusa-64 verify), repeated over a cropped cache rather than as a program;
it has no counterpart for ``medusa_heads`` or ``parallel_sample``. Its rows carry the yardstick
for treedec-vs-transformers differences, ``verify_logits_rel_err``: the relative difference of
one verify step's logits between transformers sdpa and transformers eager attention, and
between treedec (a graphed engine) and each. A run that fails is recorded under ``errors``
and the others still run.

    python bench/programs.py                      # GPU: llama3-8b bf16, prompts 4000,32000, eager/graphs/compiled
    python bench/programs.py --hf --prompts 4000 --programs greedy,tree_verify
    python bench/programs.py --smoke              # CPU: tiny fp32, prompt 200, a few steps (CI)
    python bench/programs.py --model gemma3-12b --programs greedy --prompts 1000   # GPU: a Gemma 3 shape
    python bench/programs.py --smoke --model gemma3-270m --programs greedy --methods eager   # ... on the CPU
    python bench/programs.py --programs greedy --prompts 32000 --quantization fp8 --kv-cache-dtype fp8 --tag fp8   # #52

``--tensor-parallel N`` splits the model over the N ranks of ``torchrun --nproc-per-node N
bench/programs.py ...`` (:mod:`treedec.models.tensor_parallel`; NCCL on GPUs, gloo on CPUs): every
rank runs every program, the floors count each rank's own weights and KV heads, rank 0 writes
``...-programs[-<tag>]-tpN.json``; not with ``--hf`` or the EAGLE programs.

``--smoke`` runs on the CPU; its ``graphs`` method runs the padded static buffers without
capture (``CudaGraphConfig(capture=False)``, Triton kernels under ``TRITON_INTERPRET=1``),
for ``greedy`` only: the interpreter takes ~10 s for the 200-token prefill alone.
``--profile K`` adds to every engine run a breakdown of its last K steps from
``torch.profiler`` (a separate, untimed pass of the same program): per step, the GPU time of
GEMMs, attention and other kernels, the GPU idle time (the step's wall time less its busy
time: host work the GPU waits for) and the host time of ``Engine.step`` (planning, graph
loading, launching, and any wait for the device inside it). The kinds sum kernel durations:
the cuda backend's merge starts as a programmatic dependent of stage 1 and waits inside, so
attention can sum to more than its share of the busy time.

Results go to ``<out>/<date>-<device>-programs[-smoke][-<tag>].json`` (written after every
run); the table is printed last.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.program_profile import profile_program  # noqa: E402
from bench.program_runs import (EAGLE_PROGRAMS, PROGRAM_FUNCTIONS, PROGRAMS, StepClock, Workload,  # noqa: E402
                                program_engine, random_workload)
from bench.programs_hf import bench_hf  # noqa: E402
from bench.results_file import device_name, results_path, versions  # noqa: E402
from bench.step import free_memory  # noqa: E402
from bench.timing import copy_bandwidth, methods_in_order  # noqa: E402
from treedec.models import ModelConfig, from_config  # noqa: E402
from treedec.models.batch_invariant import make_batch_invariant  # noqa: E402
from treedec.engine.pool_sizing import kv_bytes_per_token as pool_bytes_per_token  # noqa: E402
from treedec.tree.kv_cache_dtype import KV_CACHE_DTYPES  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# In this order: the *_compiled methods fuse the model's pointwise ops for good.
METHODS = ["hf_sdpa", "eager", "graphs", "graphs_model", "eager_compiled", "graphs_compiled"]
SMOKE_GRAPH_PROGRAMS = ["greedy"]


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.smoke:   # (a --model given is kept: e.g. --model gemma3-270m, a Gemma 3 shape on the CPU)
        args.model, args.dtype = args.model or "tiny", "fp32"
        if args.programs == PROGRAMS:   # EAGLE-3 reads three distinct target layers; tiny has two
            args.programs = [p for p in PROGRAMS if EAGLE_PROGRAMS.get(p) != "eagle3"]
        args.prompts = args.prompts or [200]
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
        if not torch.cuda.is_available():   # where there is a GPU the kernels are compiled for it instead
            # The kernels read it when they are first imported (lazily, by the first triton engine).
            os.environ.setdefault("TRITON_INTERPRET", "1")
    args.model = args.model or "llama3-8b"
    args.prompts = args.prompts or [4000, 32000]
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    methods = args.methods or (["eager", "graphs", "graphs_compiled"] if device.type == "cuda" else ["eager"])
    if args.smoke and not args.methods:
        methods = ["eager", "graphs"]
    if args.hf and "hf_sdpa" not in methods:
        methods = ["hf_sdpa"] + methods
    for name, given, known in (("method", methods, METHODS), ("program", args.programs, PROGRAMS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise SystemExit(f"unknown {name}(s) {unknown}; choose from {','.join(known)}")
    if device.type != "cuda" and not args.smoke and any(m.startswith("graphs") for m in methods):
        raise SystemExit("the graphs methods need a CUDA device (or --smoke, which runs them uncaptured on the CPU)")
    tp = _tensor_parallel(args, methods)
    if tp is not None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    lead = tp is None or tp.rank == 0   # the one rank that prints and writes (every rank runs everything)

    config = ModelConfig.from_name(args.model)
    longest = max(args.prompts) + 1024   # the prompt, the timed steps and a draft tree's depth, with room
    if longest > config.max_position:
        # Random weights: the shape's context length is a choice (Llama 3.1 has 131072 positions); the engine
        # checks every request against it, so a 32000-token prompt needs it raised.
        print(f"{args.model}: max_position {config.max_position} -> {longest} for the {max(args.prompts)}-token "
              "prompt (random weights)")
        config = dataclasses.replace(config, max_position=longest)
    rng = np.random.default_rng(args.seed)
    prompt_ids = {p: rng.integers(0, config.vocab_size, p).tolist() for p in args.prompts}
    model = from_config(config, seed=args.seed, dtype=DTYPES[args.dtype], device=device, tensor_parallel=tp,
                        quantization=args.quantization)
    config = model.config   # with tensor parallelism: this rank's heads and columns (its floors are per rank)
    if args.batch_invariant:   # (before linear_paths is recorded; every engine then keeps the model's kernel)
        make_batch_invariant(model)
    work = random_workload(model, rng, args.tree, args.samples, args.seed, False if args.no_pipeline else None)
    work.eagle_depth, work.eagle_top_k = args.eagle_depth, args.eagle_top_k
    medusa = work.medusa
    bandwidth = copy_bandwidth(device)
    heads_bytes = sum(p.numel() * p.element_size() for p in work.heads.parameters())
    results = {
        "device": device_name(device), "date": datetime.date.today().isoformat(),
        "versions": versions("transformers", "triton"), "smoke": args.smoke, "model": args.model,
        "dtype": args.dtype, "quantization": args.quantization, "batch_invariant": args.batch_invariant,
        "linear_paths": model.linear_paths(),
        "weight_bytes": model.weight_bytes(), "medusa_heads_bytes": heads_bytes, "kv_cache_dtype": args.kv_cache_dtype,
        "kv_bytes_per_token": pool_bytes_per_token(model, args.kv_cache_dtype),
        "copy_bandwidth_TBps": bandwidth / 1e12, "tree": os.path.relpath(medusa.source, REPO),
        "tree_tokens": medusa.size,
        "medusa_heads": work.heads.num_heads, "samples": args.samples, "pipeline": not args.no_pipeline,
        "steps": args.steps, "warmup": args.warmup,
        "page_size": args.page_size, "tensor_parallel": args.tensor_parallel, "runs": [],
    }
    tp_note = f", tensor parallel over {tp.size} ranks (this rank's weights)" if tp is not None else ""
    if lead:
        quantized = f" ({args.quantization} weights: {model.linear_paths()})" if args.quantization else ""
        print(f"{results['device']}: {args.model} {args.dtype}{quantized}, KV cache {args.kv_cache_dtype}, "
              f"{model.weight_bytes() / 1e9:.2f} GB of weights (+{heads_bytes / 1e9:.2f} GB Medusa heads), copy "
              f"bandwidth {bandwidth / 1e12:.2f} TB/s{tp_note}",
              file=sys.stderr)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag if tp is None else "-".join(filter(None, [args.tag, f"tp{tp.size}"]))
    path = results_path(out_dir, results["device"], "programs", smoke=args.smoke, tag=tag)

    def record(run: dict) -> None:
        results["runs"].append(run)
        if not lead:
            return
        path.write_text(json.dumps(results, indent=1) + "\n")  # after every run: a cut-off run keeps its part
        print(f"{run['program']} p{run['prompt']} {run['method']}: {run['ms']:.2f} ms/step, "
              f"{run['x_floor']:.2f}x floor, eager steps {run.get('eager_steps')}", file=sys.stderr)
        if "profile" in run:
            print(f"  profile: {json.dumps(run['profile'])}", file=sys.stderr)

    def fail(key: str, e: Exception) -> None:
        traceback.print_exc()
        results.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"[:2000]
        if lead:
            path.write_text(json.dumps(results, indent=1) + "\n")

    if "hf_sdpa" in methods:
        try:
            for run in bench_hf(work, prompt_ids, args, bandwidth, results["kv_bytes_per_token"]):
                record(run)
        except Exception as e:  # recorded, and the other methods still run
            fail("hf_sdpa", e)
        free_memory(device)
    for method in methods_in_order(model, METHODS, methods):
        programs = args.programs
        if args.smoke and method.startswith("graphs"):
            programs = [p for p in programs if p in SMOKE_GRAPH_PROGRAMS]
        for program in programs:
            for p in args.prompts:
                try:
                    record(_bench_program(program, method, work, prompt_ids[p], args, bandwidth,
                                          results["kv_bytes_per_token"], heads_bytes))
                except Exception as e:
                    fail(f"{method}/{program}/{p}", e)
                free_memory(device)
    if lead:
        print(f"wrote {path}", file=sys.stderr)
        print(render_table(results))
    return 0


def _tensor_parallel(args, methods):
    """``--tensor-parallel N``: this process's rank of the torchrun group (None for 1), after checking
    that the run can split (no transformers peer, no EAGLE drafter: they hold the whole model)."""
    if args.tensor_parallel == 1:
        return None
    if "hf_sdpa" in methods:
        raise SystemExit("--tensor-parallel runs treedec's engine only: drop --hf / hf_sdpa")
    eagle = [p for p in args.programs if p in EAGLE_PROGRAMS]
    if eagle:
        raise SystemExit(f"--tensor-parallel: the EAGLE programs {eagle} are not supported (the drafter is not split)")
    from bench.tp_step import NCCL_ENV
    from treedec.models import init_tensor_parallel
    os.environ.update(NCCL_ENV)   # NVLink multicast off, as the lent GPU machines require
    tp = init_tensor_parallel(seed=args.seed)
    if tp.size != args.tensor_parallel:
        raise SystemExit(f"--tensor-parallel {args.tensor_parallel} needs `torchrun --nproc-per-node "
                         f"{args.tensor_parallel}`; this run has {tp.size} process(es)")
    return tp


# ===================================================================== timing


def _bench_program(program: str, method: str, work: Workload, prompt: list[int], args, bandwidth: float,
                   kv_bytes_per_token: int, heads_bytes: int) -> dict:
    """One program on a fresh engine: the median step after warm-up, its floor, the steps run eagerly."""
    model = work.model
    engine = program_engine(method, work, prompt, args, program)
    prefill_steps = math.ceil(len(prompt) / engine.prefill_chunk)
    with StepClock(engine) as clock:
        run = PROGRAM_FUNCTIONS[program](engine, prompt, args.warmup + args.steps, work)
    assert len(clock.ends) == prefill_steps + run.steps + run.rolled_back, \
        f"{len(clock.ends)=}, {prefill_steps=}, {run.steps=}, {run.rolled_back=}"
    intervals = 1e3 * np.diff(clock.ends[prefill_steps - 1:prefill_steps + run.steps])   # [run.steps] ms
    timed = slice(min(args.warmup, run.steps - 1), run.steps)
    ms = intervals[timed]
    kv = float(np.mean(run.kv_tokens[timed]))
    weight_bytes = model.weight_bytes() + (heads_bytes if program == "medusa_heads" else 0)
    if program in EAGLE_PROGRAMS:
        weight_bytes += work.eagle_depth * work.drafter(EAGLE_PROGRAMS[program]).weight_bytes()
    floor_ms = 1e3 * (weight_bytes + kv * kv_bytes_per_token) / bandwidth
    out = {"program": program, "prompt": len(prompt), "method": method, "ms": float(np.median(ms)),
           "mean_ms": float(ms.mean()), "min_ms": float(ms.min()), "steps": len(ms),
           "warmup": timed.start, "step_ms": [round(float(x), 3) for x in intervals],
           "prefill_s": clock.ends[prefill_steps - 1] - clock.start, "kv_tokens": kv, "weight_bytes": weight_bytes,
           "floor_ms": floor_ms, "x_floor": float(np.median(ms)) / floor_ms,
           "attention_backend": engine.attn.backend, "kv_pool_tokens": engine.kv_capacity_tokens}
    if method.startswith("graphs"):
        program_stats = clock.graph_stats[-1] - clock.graph_stats[prefill_steps - 1]   # the prefill's excluded
        out["graph_stats"] = dict(program_stats)
        out["eager_steps"] = sum(v for k, v in program_stats.items() if k.startswith("eager"))
    if args.profile:
        out["profile"] = profile_program(program, method, work, prompt, args)
    if "pipelined" in run.extra:
        out["pipelined"], out["pipeline_note"] = run.extra["pipelined"], run.extra["pipeline_note"]
    if "accepted" in run.extra:
        accepted = run.extra["accepted"][timed]
        out["accepted_per_step"] = float(statistics.mean(accepted))
        out["tokens_per_step"] = out["accepted_per_step"] + 1
        out["draft_ms"] = statistics.median(run.extra["draft_ms"][timed])
        out["verify_ms"] = statistics.median(run.extra["verify_ms"][timed])
    if "drafter_graph_stats" in run.extra:
        out["drafter_graph_stats"] = run.extra["drafter_graph_stats"]
    return out


# ===================================================================== report


def render_table(results: dict) -> str:
    """Markdown table: per program, prompt and method, the median step time and its floor."""
    lines = [
        f"{results['date']}, {results['device']}, {results['model']} {results['dtype']}"
        f"{' (SMOKE)' if results['smoke'] else ''}: weights {results['weight_bytes'] / 1e9:.2f} GB, copy bandwidth "
        f"{results['copy_bandwidth_TBps']:.2f} TB/s; medians of {results['steps']} steps after {results['warmup']} "
        f"warm-up steps, host work included.",
        "",
        "| program | prompt | method | ms/step | floor ms | x floor | eager steps | tokens/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {name: i for i, name in enumerate(PROGRAMS)} | {name: 10 + i for i, name in enumerate(METHODS)}
    for r in sorted(results["runs"], key=lambda r: (order[r["program"]], r["prompt"], order[r["method"]])):
        eager = r.get("eager_steps", "-")
        tokens = r.get("tokens_per_step")
        lines.append(f"| {r['program']} | {r['prompt']} | {r['method']} | {r['ms']:.2f} | {r['floor_ms']:.2f} | "
                     f"{r['x_floor']:.2f} | {eager} | {'' if tokens is None else f'{tokens:.2f}'} |")
    for name, error in results.get("errors", {}).items():
        lines.append(f"\n{name} failed: {error.splitlines()[0] if error else ''}")
    return "\n".join(lines)


def _parse_args(argv):
    def ints(s):
        return [int(x) for x in s.split(",")]

    def names(s):
        return s.split(",")

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a named size of treedec.models.MODEL_SIZES, any family's "
                        "(default llama3-8b; tiny with --smoke; e.g. gemma3-4b, gemma3-12b, qwen3-8b, phi3-mini-4k)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="quantize the projections when the model is built (fp8 e4m3, per output row; the "
                             "paths each layer runs are printed and recorded)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="what the target's KV pool stores: auto (--dtype) or fp8 (e4m3: the floor counts its "
                             "bytes)")
    parser.add_argument("--prompts", type=ints, default=None, help="prompt lengths (default 4000,32000; smoke 200)")
    parser.add_argument("--programs", type=names, default=list(PROGRAMS), help=f"subset of {','.join(PROGRAMS)}")
    parser.add_argument("--methods", type=names, default=None,
                        help=f"subset of {','.join(METHODS)} (default eager,graphs,graphs_compiled on a GPU; "
                             f"smoke eager,graphs)")
    parser.add_argument("--hf", action="store_true", help="add hf_sdpa (transformers) for greedy and tree_verify")
    parser.add_argument("--steps", type=int, default=32, help="timed steps per run (smoke: at most 3)")
    parser.add_argument("--warmup", type=int, default=4, help="steps dropped first (smoke: at most 1)")
    parser.add_argument("--samples", type=int, default=16, help="parallel_sample's n")
    parser.add_argument("--tree", type=int, default=64, help="Medusa tree size (workloads/deft/speculative)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the model over N ranks (run under `torchrun --nproc-per-node N`; NCCL on "
                             "GPUs, gloo on CPUs); floors are per rank; rank 0 writes the results")
    parser.add_argument("--eagle-depth", type=int, default=5, help="eagle*: tree layers (EAGLE-2's 5)")
    parser.add_argument("--eagle-top-k", type=int, default=8, help="eagle*: nodes expanded per layer (EAGLE-2's 8)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch-invariant", action="store_true",
                        help="every engine in the batch-invariant mode (Engine(batch_invariant=True)): its cost")
    parser.add_argument("--backend", default="auto", help="the engine's attention backend on a GPU (auto, triton, cuda)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder for the results JSON")
    parser.add_argument("--tag", default=None, help="appended to the results file name")
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU, for CI")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="greedy, tree_verify, medusa_heads, parallel_sample, eagle*_chains: read each step's "
                             "tokens back before planning the next (pipeline=False)")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="also profile the last K steps of each run (a separate pass; GPU kernel kinds, idle time)")
    args = parser.parse_args(argv)
    if args.tensor_parallel < 1:
        parser.error(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    return args


if __name__ == "__main__":
    sys.exit(main())
