#!/usr/bin/env python3
"""Where does the engine core's iteration spend host time that the offline scheduler does not? (issue #51)

The same requests, token-id prompts, greedy and ``ignore_eos``, run twice over one ``tiny`` model (2 layers,
vocabulary 512; its forward stubbed by default, zero logits as ``bench/host_cost.py``'s stub, so a step's time
is host time): through ``LLM.generate`` (the offline scheduler, all admitted at once)
and through the engine core (:class:`~treedec.core.engine_core.EngineCore` in this process, every request submitted
at once as one input batch, token ids streamed, each iteration's :class:`~treedec.core.messages.IterationOutputs`
msgspec-encoded as the core's process does before it sends it). Both are timed on the SAME span: the interval
between the returns of two consecutive ``Engine.step`` calls (``bench/serve_single.stamped_steps``), which holds
everything the host does between two steps: for the core its per-request stream deliveries, its flush, its
encoding. The core's own iteration time (what ``treedec_engine_step_seconds`` reports: the scheduler's iterate
alone, its flush left out) is reported beside it.

Python calls per step (``sys.setprofile`` / ``threading.setprofile`` counting "call" and "c_call" events, every
thread) over the whole run, divided by the engine steps, and the functions the core calls more often than offline,
per step (the top ``--top`` differences), say where the extra work is.

    python bench/core_host.py                       # 64 requests, 32-token prompts, 64 new tokens, CPU
    python bench/core_host.py --requests 8 --new 16 --rounds 1 --tag smoke
    python bench/core_host.py --device cuda --real-forward   # GPU: graphed and pipelined, as LLM runs there
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.results_file import device_name, versions, write_results  # noqa: E402
from bench.serve_single import stamped_steps  # noqa: E402
from bench.serve_stats import itls, percentiles  # noqa: E402
from treedec import LLM, SamplingParams  # noqa: E402
from treedec.core.engine_core import EngineCore  # noqa: E402
from treedec.core.messages import AddRequest, CoreOutput, IterationOutputs, MessageCodec, dumps  # noqa: E402
from treedec.models import from_config  # noqa: E402
from treedec.models.base import ForwardOutput  # noqa: E402


def make_llm(device: str, kv_tokens: int, stub: bool) -> LLM:
    """The tiny model's LLM, its forward stubbed (zero logits: only host work is left) unless ``stub`` is False."""
    llm = LLM(from_config("tiny", seed=0, dtype=torch.float32, device=device), None,
              cuda_graphs=False if device == "cpu" else None, kv_tokens=kv_tokens)   # (a GPU: the LLM's default)
    if stub:
        c = llm.model.config

        def eager(plan, tokens, positions, slots, rows, device_tokens=None, features=None, spans=(), token_rows=None):
            n = len(tokens) if rows is None else len(rows)
            return ForwardOutput(torch.zeros(n, c.vocab_size), torch.zeros(len(tokens), c.hidden_size))

        llm.engine.eager_forward = eager
    return llm


def requests(n: int, prompt: int, new: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(5, 500, prompt).tolist() for _ in range(n)]
    return prompts, [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True) for _ in range(n)]


class CallCounter:
    """Counts every Python and C call, per (file, function), on every thread while it is on."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()

    def _hook(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            self.counts[(Path(code.co_filename).name, code.co_name)] += 1
        elif event == "c_call":
            self.counts[("<c>", getattr(arg, "__qualname__", str(arg)))] += 1

    def __enter__(self):
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def run_offline(llm: LLM, prompts, params) -> tuple[list[float], int]:
    with stamped_steps(llm) as ends:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return list(ends), sum(len(o.outputs[0].token_ids) for o in outs)


def run_core(llm: LLM, prompts, params, tag: str, timeout: float = 600.0):
    """The requests through an in-process engine core; returns the step ends, the tokens streamed, the core's own
    iteration seconds and the bytes its messages encode to."""
    codec = MessageCodec(CoreOutput)
    left, done = set(), threading.Event()
    tokens, seconds, sizes = [0], [], []

    def sink(message: IterationOutputs) -> None:
        sizes.append(len(codec.encode(message)))   # (the process's send: its encoding)
        if message.stats.seconds:
            seconds.append(message.stats.seconds)
        for delta in message.tokens:
            tokens[0] += len(delta.token_ids)
        for failure in message.failed:
            raise AssertionError(f"request {failure.request_id} failed: {failure.message}")
        for delta in message.tokens:
            if delta.end is not None:
                left.discard(delta.request_id)
        if not left:
            done.set()

    with stamped_steps(llm) as ends:
        core = EngineCore(llm, sink, prefix_cache=False)
        try:
            ids = [f"{tag}-{i}" for i in range(len(prompts))]
            left.update(ids)
            core.handle([AddRequest(rid, p, dumps(sp), stream_tokens=True) for rid, p, sp in zip(ids, prompts, params)])
            if not done.wait(timeout):
                raise TimeoutError(f"{len(left)} requests unfinished after {timeout} s")
        finally:
            core.shutdown(timeout=10)
        return list(ends), tokens[0], seconds, sizes


def summary(ends: list[float], tokens: int) -> dict:
    gaps = itls(ends)
    return {"steps": len(ends), "tokens": tokens, "step_ms": statistics.median(gaps) * 1e3,
            "step_mean_ms": statistics.fmean(gaps) * 1e3, "step_intervals_ms": percentiles(gaps, 1e3),
            "span_s": ends[-1] - ends[0], "ms_per_token": (ends[-1] - ends[0]) * 1e3 / tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--new", type=int, default=64, help="new tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each, alternating")
    p.add_argument("--top", type=int, default=25, help="functions the core calls more often than offline")
    p.add_argument("--device", default="cpu")
    p.add_argument("--real-forward", action="store_true", help="run the tiny model's forward (default: stubbed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="core-host")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    prompts, params = requests(args.requests, args.prompt, args.new, args.seed)
    llm = make_llm(args.device, args.requests * (args.prompt + args.new) + 4096, not args.real_forward)
    run_offline(llm, prompts[:4], params[:4])   # warm-up
    run_core(llm, prompts[:4], params[:4], "warm")
    rounds = {"offline": [], "core": []}
    for r in range(args.rounds):
        ends, tokens = run_offline(llm, prompts, params)
        rounds["offline"].append(summary(ends, tokens))
        ends, tokens, seconds, sizes = run_core(llm, prompts, params, f"r{r}")
        rounds["core"].append({**summary(ends, tokens), "core_iteration_ms": statistics.fmean(seconds) * 1e3,
                               "core_iteration_p50_ms": statistics.median(seconds) * 1e3,
                               "message_bytes_mean": statistics.fmean(sizes)})
        print(f"round {r}: offline {rounds['offline'][-1]['step_ms']:.3f} ms, core "
              f"{rounds['core'][-1]['step_ms']:.3f} ms (its own metric {rounds['core'][-1]['core_iteration_ms']:.3f})",
              file=sys.stderr)
    calls = {}
    for name, run in (("offline", lambda: run_offline(llm, prompts, params)),
                      ("core", lambda: run_core(llm, prompts, params, "calls"))):
        with CallCounter() as counter:
            ends = run()[0]
        calls[name] = (counter.counts, len(ends))
    per_step = {k: {f"{f}:{n}": c / steps for (f, n), c in counts.items()} for k, (counts, steps) in calls.items()}
    extra = {key: per_step["core"][key] - per_step["offline"].get(key, 0.0) for key in per_step["core"]}
    top = sorted(extra.items(), key=lambda kv: -kv[1])[:args.top]
    med = lambda kind, key: statistics.median(x[key] for x in rounds[kind])   # noqa: E731
    results = {"device": device_name(torch.device(args.device)), "versions": versions(),
               "settings": vars(args), "rounds": rounds,
               "offline_step_ms": med("offline", "step_ms"), "core_step_ms": med("core", "step_ms"),
               "core_iteration_ms": med("core", "core_iteration_p50_ms"),
               "core_over_offline": med("core", "step_ms") / med("offline", "step_ms"),
               "offline_ms_per_token": med("offline", "ms_per_token"), "core_ms_per_token": med("core", "ms_per_token"),
               "python_calls_per_step": {k: sum(v.values()) for k, v in per_step.items()},
               "extra_calls_per_step": {k: round(v, 2) for k, v in top}}
    path = write_results(results, args.out, "core-host", tag=args.tag)
    print(f"offline step {results['offline_step_ms']:.3f} ms, core step {results['core_step_ms']:.3f} ms "
          f"(core/offline {results['core_over_offline']:.3f}x; the core's own iteration metric "
          f"{results['core_iteration_ms']:.3f} ms); calls a step: offline "
          f"{results['python_calls_per_step']['offline']:.0f}, core {results['python_calls_per_step']['core']:.0f}")
    for key, value in top:
        print(f"  {value:8.2f}  {key}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
