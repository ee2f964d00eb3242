#!/usr/bin/env python3
"""What does one more request cost the host per step? Step time against batch size, per program kind.

Runs each program kind batched over ``--requests`` (default 1, 8, 32, 64) on the ``tiny`` model (2 layers,
vocabulary 512), where a step's device work is small, so its time is host time: on a GPU with CUDA graphs
(the steps pipelined where the program pipelines), and on the CPU with the model's forward stubbed out
(``bench/host_cost.py``'s stub: zero logits of the right shapes, so only host work is left). Reported per kind
and size: the median wall time of the decode steps once every request is admitted (host work included), and
per kind the least-squares slope of those medians against the number of requests — the host cost of one
request per step (``us_per_request_step``: issue #49's targets, greedy <= 3 us, sampled <= 5 us). Wall times on a
shared machine vary; the Python function calls and torch calls of a decode step (cProfile over ``--profile-steps``
steps of one more run; ToT: over every step of the search after the first two, since its host work sits at its
events, a thought's or an evaluation's end, a selection, which a window of thought steps misses) do not: their
slopes are reported too (``python_calls_per_request_step``, ``torch_calls_per_request_step``).

Kinds (``--programs``):

- ``greedy``: ``generate_batch``, temperature 0;
- ``sampled``: temperature 0.8, top-p 0.95, a seed per request (the issue's "sampled" target);
- ``sampled_all``: every sampling field at once: temperature, top-k, top-p, min-p, repetition / presence /
  frequency penalties, a seed;
- ``speculative``: ``speculative_batch`` with a fixed Medusa-64 ``TreeDraft`` (random draft tokens), greedy,
  pipelined on the CPU too (the verify table's batched steps: their host cost is the one that counts);
  ``--draft-budget T`` shares T verify tokens a step (roots included) among the batch (the budget's per-group host
  work measured);
- ``tot``: ``tot_batch`` over Game-of-24 tasks (BFS, k=3, n=2, depth 2, byte tokens), one task a request.

Every request has a ``--prompt``-token random prompt and ``--new`` new tokens (``ignore_eos``: each runs its
whole budget). Written to ``<out>/<date>-<device>-host-scaling.json`` (device, versions, date, the settings).

    python bench/host_scaling.py                       # GPU: tiny model, graphed, 1/8/32/64 requests
    python bench/host_scaling.py --device cpu          # CPU: forward stubbed
    python bench/host_scaling.py --device cpu --pipeline   # ... generation pipelined, as on a GPU
    python bench/host_scaling.py --smoke               # CPU, small sizes (CI)
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
import numpy as np
import torch

if not torch.cuda.is_available():   # the CPU's graphed path needs a kernel backend, made but never launched
    os.environ.setdefault("TRITON_INTERPRET", "1")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, versions, write_results  # noqa: E402
from treedec.engine import CudaGraphConfig, Engine  # noqa: E402
from treedec.models import from_config  # noqa: E402
from treedec.programs.generate import generate_batch  # noqa: E402
from treedec.runtime.requests import RequestSpec  # noqa: E402
from treedec.sampling.params import SamplingParams  # noqa: E402
from treedec.programs.speculative.batch import speculative_batch  # noqa: E402
from treedec.programs.speculative.draft_budget import DraftBudget  # noqa: E402
from treedec.programs.speculative.drafts import TreeDraft  # noqa: E402
from treedec.programs.tot import BFSConfig, ByteTokenizer, tot_batch  # noqa: E402
from treedec.programs.tot.game24 import Game24Task  # noqa: E402
from treedec.tree.token_tree import TokenTree  # noqa: E402
from treedec.workloads.deft import medusa_tree  # noqa: E402

KINDS = ("greedy", "sampled", "sampled_all", "speculative", "tot")
PUZZLES = ([1, 1, 4, 6], [1, 1, 11, 11], [1, 1, 3, 8], [1, 2, 2, 6], [1, 2, 3, 4], [1, 3, 4, 6], [2, 2, 4, 6],
           [2, 3, 5, 12], [3, 3, 8, 8], [4, 4, 10, 10], [4, 9, 10, 13], [5, 5, 5, 9], [1, 4, 5, 6], [2, 5, 5, 10],
           [3, 4, 6, 6], [6, 6, 6, 6])


def params_of(kind: str, new: int, seed: int) -> SamplingParams:
    if kind == "greedy" or kind == "speculative":
        return SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    if kind == "sampled":
        return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=new, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
                          presence_penalty=0.2, frequency_penalty=0.1, seed=seed, max_tokens=new, ignore_eos=True)


class Steps:
    """Stamps each engine step's return (no device synchronisation: pipelined steps keep running ahead); with
    ``profile``, profiles the host work between the returns of steps ``profile[0]`` and ``profile[1]`` (None: to the
    end of the run, :meth:`stop`)."""

    def __init__(self, engine: Engine, profile: tuple[int, int] | None = None):
        self.engine, self.ends, self.window = engine, [], profile
        self.profiler = None if profile is None else cProfile.Profile()
        step = engine.step

        def timed(*args, **kwargs):
            out = step(*args, **kwargs)
            self.ends.append(time.perf_counter())
            if profile is not None and len(self.ends) == profile[0]:
                self.profiler.enable()
            elif profile is not None and len(self.ends) == profile[1]:   # (None: to the end of the run)
                self.profiler.disable()
            return out

        engine.step = timed

    def stop(self) -> None:
        """The run ended: a profile to its end stops here."""
        if self.profiler is not None and self.window[1] is None:
            self.profiler.disable()
            self.window = (self.window[0], len(self.ends))

    @property
    def profiled(self) -> int:
        """How many steps were profiled (:meth:`calls` counts their calls)."""
        return self.window[1] - self.window[0]

    def calls(self) -> tuple[int, int]:
        """(Python function calls, torch calls) in the profiled steps."""
        stats = pstats.Stats(self.profiler).stats
        total = sum(entry[1] for entry in stats.values())
        torch_calls = sum(entry[1] for (path, _, name), entry in stats.items() if "torch" in path or "torch" in name)
        return total, torch_calls

    def median_ms(self, skip: int) -> float:
        """The median interval between the steps after the first ``skip`` (admission and prompt steps)."""
        gaps = np.diff(self.ends[skip:])
        if len(gaps) == 0:
            raise RuntimeError(f"too few steps to time: {len(self.ends)} in all, {skip} skipped")
        return 1e3 * float(statistics.median(gaps))


def run_kind(kind: str, engine: Engine, requests: int, args, rng: np.random.Generator) -> int:
    """Runs one batch of ``kind``; returns how many leading steps are admission / prompts (not timed)."""
    vocab = engine.model.config.vocab_size
    specs = [RequestSpec(f"r{i}", prompt_ids=tuple(rng.integers(0, vocab, args.prompt).tolist()),
                         params=params_of(kind, args.new, seed=i)) for i in range(requests)]
    if kind in ("greedy", "sampled", "sampled_all"):
        generate_batch(engine, specs, pipeline=engine.device.type == "cuda" or args.pipeline)
        return 2   # one prompt step (every prompt fits one chunk), then the first decode step's launch
    if kind == "speculative":
        tree = TokenTree(tuple(medusa_tree(64).parents.tolist()))
        tokens = rng.integers(0, vocab, tree.size - 1).tolist()
        budget = None if args.draft_budget is None else DraftBudget(step_tokens=args.draft_budget)
        speculative_batch(engine, specs, lambda spec: TreeDraft(tree, tokens), pipeline=True, draft_budget=budget)
        return 2
    tasks = [Game24Task(PUZZLES[i % len(PUZZLES)], check_steps=False, thought_max_tokens=args.new,
                        value_max_tokens=8) for i in range(requests)]
    config = BFSConfig(k=3, n=2, depth=2)
    tot_batch(engine, tasks, ByteTokenizer(), config)
    return 2


def make_engine(model, device: torch.device, kv_tokens: int) -> Engine:
    if device.type == "cuda":
        return Engine(model, kv_tokens=kv_tokens, cuda_graphs=True)
    # (imported here: bench/host_cost.py turns the triton interpreter on, which a GPU run must never see)
    from bench.host_cost import stub_forwards
    engine = Engine(model, kv_tokens=kv_tokens, backend="triton", cuda_graphs=CudaGraphConfig(capture=False))
    stub_forwards(engine)
    return engine


def slope_us(sizes: list[int], ms: list[float]) -> float:
    """The least-squares slope of ``ms`` against ``sizes``, in us per request."""
    if len(sizes) < 2:
        return float("nan")
    return 1e3 * float(np.polyfit(np.asarray(sizes, float), np.asarray(ms, float), 1)[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", default=",".join(KINDS), help=f"comma-separated kinds: {', '.join(KINDS)}")
    parser.add_argument("--requests", default="1,8,32,64", help="batch sizes (comma-separated)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=48, help="new tokens per output")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size (the median is reported)")
    parser.add_argument("--profile-steps", type=int, default=8,
                        help="decode steps whose calls are counted (tot: every step of the search after the first two)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default cuda when available)")
    parser.add_argument("--pipeline", action="store_true",
                        help="CPU: pipeline the generation kinds as a GPU run does (the draws read back one step "
                             "behind: the host path the GPU's graphed steps take)")
    parser.add_argument("--draft-budget", type=int, default=None,
                        help="speculative: verify tokens a step for the batch (DraftBudget's step_tokens; default the "
                             "batch's automatic budget: no limit on the CPU)")
    parser.add_argument("--smoke", action="store_true", help="CPU, sizes 1 and 4, 12 new tokens, one run (CI)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tag", default=None, help="added to the results file's name")
    args = parser.parse_args(argv)
    if args.draft_budget is not None and args.draft_budget < 1:
        parser.error(f"--draft-budget is draft tokens a step for the batch, >= 1: got {args.draft_budget}")
    if args.smoke:
        args.device, args.requests, args.new, args.repeats = "cpu", "1,4", 12, 1
    kinds = args.programs.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"--programs: unknown kind(s) {unknown}; choose from {', '.join(KINDS)}")
    sizes = [int(s) for s in args.requests.split(",")]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and torch.cuda.is_available():
        parser.error("--device cpu stubs the forward through the triton interpreter: run it on a machine without a GPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = from_config("tiny", seed=0, device=device, dtype=dtype)
    # every request's prompt and outputs at once (ToT: k thoughts and their values per kept state)
    kv_tokens = max(sizes) * (args.prompt + 8 * (args.new + 64) + 2048)
    mode = "graphed, pipelined" if device.type == "cuda" else \
        "forward stubbed" + (", pipelined" if args.pipeline else "")
    print(f"host scaling: tiny model on {device_name(device)} ({mode}), {args.prompt}-token prompts, "
          f"{args.new} new tokens; median step ms", flush=True)
    results = {}
    for kind in kinds:
        ms, calls, torch_calls = [], [], []
        for requests in sizes:
            runs = []
            for repeat in range(args.repeats + (device.type == "cuda")):   # (GPU: one warm-up run, graphs captured)
                engine = make_engine(model, device, kv_tokens)
                clock = Steps(engine)
                skip = run_kind(kind, engine, requests, args, np.random.default_rng(repeat))
                if device.type == "cuda" and repeat == 0:
                    continue
                runs.append(clock.median_ms(skip))
            ms.append(statistics.median(runs))
            engine = make_engine(model, device, kv_tokens)
            window = (2, None) if kind == "tot" else (3, 3 + args.profile_steps)
            clock = Steps(engine, profile=window)
            run_kind(kind, engine, requests, args, np.random.default_rng(0))
            clock.stop()
            if len(clock.ends) < clock.window[1] or clock.profiled < 1:
                raise RuntimeError(f"{kind}: {len(clock.ends)} steps, too few to profile {args.profile_steps}")
            total, in_torch = clock.calls()
            calls.append(total / clock.profiled)
            torch_calls.append(in_torch / clock.profiled)
            print(f"  {kind:12s} {requests:3d} requests: {ms[-1]:8.3f} ms/step, {calls[-1]:8.0f} Python calls "
                  f"({torch_calls[-1]:.0f} torch) a step", flush=True)
        results[kind] = {"ms_per_step": dict(zip(map(str, sizes), ms)), "us_per_request_step": slope_us(sizes, ms),
                         "python_calls_per_step": dict(zip(map(str, sizes), calls)),
                         "python_calls_per_request_step": slope_us(sizes, calls) / 1e3,
                         "torch_calls_per_request_step": slope_us(sizes, torch_calls) / 1e3}
        r = results[kind]
        print(f"  {kind:12s} slope: {r['us_per_request_step']:.1f} us, {r['python_calls_per_request_step']:.1f} Python "
              f"calls, {r['torch_calls_per_request_step']:.1f} torch calls per request per step", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_results({"benchmark": "host_scaling", "date": datetime.date.today().isoformat(),
                   "device": "cpu" if device.type == "cpu" else device_name(device), "versions": versions("triton"),
                   "mode": mode, "model": "tiny", "prompt_tokens": args.prompt, "new_tokens": args.new,
                   "requests": sizes, "repeats": args.repeats, "draft_budget": args.draft_budget, "results": results},
                  args.out, "host-scaling", smoke=args.smoke, tag=args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
