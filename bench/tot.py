#!/usr/bin/env python3
"""A ToT-BFS program end to end: treedec's flatten planner vs the per-path baseline (planner ``path``) in one run.

The search follows the DeFT paper's multi-step reasoning template (width 10 at each depth,
the best thought kept): a 1000-token prompt; 4 levels, each decoding k = 10 thoughts of 300
tokens together under the one kept state (n = 1), judging each with a 16-token value prompt
under its own node and a 4-token answer, keeping the best and pruning the rest. Random
weights never write a stop string, so every thought has exactly 300 tokens and both
planners run the same tree shape (greedy decoding; bf16 rounding may still pick other
tokens). Llama-3-8B shape, random weights, bf16, triton backend, eager steps.

Per planner, one untimed warm-up search (one level, 16-token thoughts: kernel compilation),
then ``--reps`` timed searches, the planners taking turns. Reported: time per search (the
prompt's prefill included), its decode levels, steps, tokens/s, and the speedup of the
first planner: (other planner's mean time) / (first planner's mean time).

    python bench/tot.py                 # GPU: llama3-8b, bf16, triton; about 5 minutes on an H100
    python bench/tot.py --reps 1 --thought-tokens 100
    python bench/tot.py --smoke         # CPU: tiny, fp32, torch backend, small search (CI)

Results go to ``<out>/<date>-<device>-tot[-smoke][-<tag>].json`` (written after every rep).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import random
import statistics
import string
import sys
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.results_file import add_run_arguments, device_name, results_path, versions  # noqa: E402
from treedec.sampling.params import SamplingParams  # noqa: E402
from treedec.attention import PlanConfig  # noqa: E402
from treedec.engine import Engine  # noqa: E402
from treedec.models import from_config  # noqa: E402
from treedec.programs.tot import BFSConfig, ByteTokenizer, ToTResult, ToTTask, tot_bfs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: the search's shape on the GPU and on --smoke
SHAPES = {
    "gpu": dict(k=10, n=1, depth=4, prompt_tokens=1000, thought_tokens=300, value_prompt_tokens=16, value_tokens=4),
    "smoke": dict(k=3, n=1, depth=2, prompt_tokens=64, thought_tokens=8, value_prompt_tokens=8, value_tokens=2),
}
_VALUE_TEXT = "\nHow promising is the step above (sure/likely/impossible)? "


class FixedShapeTask(ToTTask):
    """A task of fixed token counts (byte tokens): a pseudo-random ASCII prompt, no stop strings, a
    value prompt of ``value_prompt_tokens`` bytes; the value is a hash of the output, so which
    thought is kept varies from level to level as it would with a real judge."""

    thought_stop = ()
    value_stop = ()

    def __init__(self, prompt_tokens: int, thought_tokens: int, value_prompt_tokens: int, value_tokens: int,
                 seed: int = 0):
        rng = random.Random(seed)
        self.prompt = "".join(rng.choice(string.ascii_letters + " .,\n") for _ in range(prompt_tokens))
        self.value_text = (_VALUE_TEXT * (value_prompt_tokens // len(_VALUE_TEXT) + 1))[:value_prompt_tokens]
        self.thought_max_tokens, self.value_max_tokens = thought_tokens, value_tokens

    def root_prompt(self) -> str:
        return self.prompt

    def value_prompt(self, thoughts: tuple[str, ...]) -> str:
        return self.value_text

    def parse_value(self, thoughts: tuple[str, ...], outputs: list[str]) -> float:
        return sum(zlib.crc32(out.encode()) / 2 ** 32 for out in outputs)


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape = dict(SHAPES["smoke" if args.smoke else "gpu"])
    if args.smoke:
        args.model, args.dtype, args.backend, args.reps = "tiny", "fp32", "torch", min(args.reps, 1)
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    planners = [p.strip() for p in args.planners.split(",") if p.strip()]
    if args.reps < 1 or not planners:
        raise SystemExit(f"need --reps >= 1 and at least one planner, got --reps {args.reps}, "
                         f"--planners {args.planners!r}")
    task = FixedShapeTask(shape["prompt_tokens"], shape["thought_tokens"], shape["value_prompt_tokens"],
                          shape["value_tokens"], seed=args.seed)
    config = BFSConfig(k=shape["k"], n=shape["n"], depth=shape["depth"], sampling=SamplingParams(temperature=0.0),
                       seed=args.seed)
    warm_task = FixedShapeTask(shape["prompt_tokens"], min(16, shape["thought_tokens"]), shape["value_prompt_tokens"],
                               shape["value_tokens"], seed=args.seed)
    warm_config = BFSConfig(k=shape["k"], n=shape["n"], depth=1, sampling=SamplingParams(temperature=0.0),
                            seed=args.seed)
    # The pool holds the prompt, the kept path, a level's thoughts and their evaluations, with slack.
    peak = shape["prompt_tokens"] + shape["depth"] * shape["thought_tokens"] + shape["k"] * shape["n"] * (
        shape["thought_tokens"] + shape["value_prompt_tokens"] + shape["value_tokens"] + 2 * args.page_size)
    kv_tokens = args.kv_tokens or 2 * peak + 64 * args.page_size

    model = from_config(args.model, seed=args.seed, dtype=DTYPES[args.dtype], device=device)
    engines = {p: Engine(model, kv_tokens=kv_tokens, page_size=args.page_size, backend=args.backend,
                         plan_config=PlanConfig(planner=p), cuda_graphs=args.cuda_graphs) for p in planners}
    tokenizer = ByteTokenizer()
    results = {"device": device_name(device), "date": datetime.date.today().isoformat(),
               "versions": versions("triton"), "smoke": args.smoke, "model": args.model, "dtype": args.dtype,
               "backend": engines[planners[0]].attn.backend, "cuda_graphs": args.cuda_graphs,
               "page_size": args.page_size, "kv_tokens": kv_tokens,
               "planners": planners, "reps": args.reps, "search": {**shape, "temperature": 0.0, "selection": "greedy"},
               "runs": {p: {"search_s": []} for p in planners}, "speedup": {}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = results_path(out_dir, results["device"], "tot", smoke=args.smoke, tag=args.tag)
    started = time.perf_counter()
    for planner, engine in engines.items():
        tot_bfs(engine, warm_task, tokenizer, warm_config)
    for rep in range(args.reps):
        for planner, engine in engines.items():
            _synchronize(device)
            t0 = time.perf_counter()
            result = tot_bfs(engine, task, tokenizer, config, progress=args.progress)
            _synchronize(device)
            _record(results["runs"][planner], result, time.perf_counter() - t0, engine)
            print(f"rep {rep} {planner}: {results['runs'][planner]['search_s'][-1]:.3f} s", file=sys.stderr)
        base = statistics.fmean(results["runs"][planners[0]]["search_s"])
        results["speedup"] = {p: statistics.fmean(results["runs"][p]["search_s"]) / base for p in planners[1:]}
        path.write_text(json.dumps(results, indent=1) + "\n")   # after every rep: a cut-off run keeps its part
    results["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(results, indent=1) + "\n")
    _report(results)
    print(f"results: {path}", file=sys.stderr)
    return 0


def _record(run: dict, result: ToTResult, seconds: float, engine: Engine) -> None:
    run["search_s"].append(seconds)
    run["search_s_mean"] = statistics.fmean(run["search_s"])
    run["search_s_min"] = min(run["search_s"])
    run["decode_s"] = sum(level.wall_s for level in result.levels)
    run["steps"] = sum(level.steps for level in result.levels)
    run["tokens_generated"] = result.tokens_generated
    run["levels"] = [asdict(level) for level in result.levels]
    run["best_thoughts_sha256"] = hashlib.sha256(json.dumps([s.thoughts for s in result.best]).encode()).hexdigest()
    run["pages_free_at_end"] = engine.pool.num_free_pages == engine.pool.num_pages
    run["graph_stats"] = dict(engine.graph_stats)  # captures / replays / eager steps and why


def _report(results: dict) -> None:
    s = results["search"]
    print(f"\nToT-BFS k={s['k']} n={s['n']} depth={s['depth']}, {s['thought_tokens']}-token thoughts over a "
          f"{s['prompt_tokens']}-token prompt; {results['model']} {results['dtype']} on {results['device']}, "
          f"{results['backend']} backend", file=sys.stderr)
    print(f"{'planner':>10} {'search s (mean)':>16} {'min s':>8} {'decode s':>9} {'steps':>6} {'ms/step':>8} "
          f"{'tok/s':>8}", file=sys.stderr)
    for planner, run in results["runs"].items():
        print(f"{planner:>10} {run['search_s_mean']:>16.3f} {run['search_s_min']:>8.3f} {run['decode_s']:>9.3f} "
              f"{run['steps']:>6} {1e3 * run['decode_s'] / run['steps']:>8.2f} "
              f"{run['tokens_generated'] / run['decode_s']:>8.0f}", file=sys.stderr)
    for planner, ratio in results["speedup"].items():
        print(f"{results['planners'][0]} over {planner}: {ratio:.2f}x (time per search)", file=sys.stderr)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny config, fp32, torch backend, a small search")
    p.add_argument("--model", default="llama3-8b", help="a named model size (random weights)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--backend", default="triton")
    p.add_argument("--planners", default="flatten,path", help="the first is the one the speedups are of")
    p.add_argument("--k", type=int, help="thoughts per kept state (default 10)")
    p.add_argument("--n", type=int, help="states kept per level (default 1)")
    p.add_argument("--depth", type=int, help="levels (default 4)")
    p.add_argument("--prompt-tokens", type=int, help="default 1000")
    p.add_argument("--thought-tokens", type=int, help="tokens per thought (default 300)")
    p.add_argument("--value-prompt-tokens", type=int, help="default 16")
    p.add_argument("--value-tokens", type=int, help="tokens of an evaluation's answer (default 4)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay captured CUDA graphs for the engine steps (GPU, triton backend)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, help="KV pool per engine (default twice the search's peak)")
    p.add_argument("--reps", type=int, default=3, help="timed searches per planner (default 3; --smoke 1)")
    add_run_arguments(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
