"""``bench/serve.py --single-stream``: one streamed request alone against the server, and the same program through
``LLM.generate`` in this process (the server stopped first, so both have the device to themselves).

The issue's target: the inter-token latency of a single streamed request within 1.1x of ``LLM.generate``'s step
time for the same prompt and ``max_tokens`` (the server adds nothing per token). ``LLM.generate``'s steps are
timed by stamping the return of every ``Engine.step`` of its engine (the prefill's steps included; the median
interval is the decode step), as ``bench/program_runs.StepClock`` does for the programs.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np

from bench.serve_stats import Record, itls, percentiles
from bench.serve_workloads import Session, Turn, random_words

__all__ = ["load_llm", "single_session", "single_stream_summary", "time_llm_generate", "time_offline_batches"]


@contextlib.contextmanager
def stamped_steps(llm, queries: list[int] | None = None):
    """While it is open, the wall time at the end of each of ``llm``'s engine steps, appended to the list it yields
    (the engine's ``step`` wrapped, and put back after); with ``queries``, each step's tokens (its tree's pending
    tokens when it is called) appended there."""
    ends: list[float] = []
    step, tree = llm.engine.step, llm.engine.tree

    def stamped(*args, **kwargs):
        if queries is not None:
            queries.append(tree.num_pending)
        out = step(*args, **kwargs)
        ends.append(time.perf_counter())
        return out

    llm.engine.step = stamped
    try:
        yield ends
    finally:
        llm.engine.step = step


def single_session(seed: int, input_words: int, output_tokens: int) -> Session:
    """The one request of a single-stream run: ``input_words`` random words, ``output_tokens`` to generate."""
    return Session("single", 0, 0, (Turn(random_words(np.random.default_rng([seed, 4]), input_words), output_tokens),))


def single_stream_summary(records: list[Record]) -> dict:
    """Per round: the request's median ITL, TPOT and TTFT (ms); over the rounds the medians of those."""
    rounds = []
    for r in records:
        gaps = itls(r.arrivals)
        rounds.append({"error": r.error, "ttft_ms": None if r.ttft is None else r.ttft * 1e3,
                       "itl_p50_ms": statistics.median(gaps) * 1e3 if gaps else None,
                       "itl_ms": percentiles(gaps, 1e3),
                       "tpot_ms": None if r.tpot is None else r.tpot * 1e3,
                       "completion_tokens": r.completion_tokens, "chunks": len(r.arrivals)})
    good = [r for r in rounds if r["error"] is None and r["itl_p50_ms"] is not None]
    median = lambda key: statistics.median(r[key] for r in good) if good and all(r[key] is not None for r in good) \
        else None   # noqa: E731
    return {"rounds": rounds, "itl_p50_ms": median("itl_p50_ms"), "tpot_ms": median("tpot_ms"),
            "ttft_ms": median("ttft_ms"), "failed": len(rounds) - len(good)}


def load_llm(model_spec: dict, speculative: str | None = None, drafter: str | None = None):
    """The LLM the server ran (``model_spec``: ``model`` (a name ``LLM`` loads) or ``config`` (a named size, random
    weights of ``seed``), with ``tokenizer``, ``device`` and ``dtype``, None for the defaults)."""
    import torch

    from treedec import LLM
    from treedec.models import from_config
    from treedec.programs.speculative import SpeculativeConfig

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}
    spec = None if speculative is None else SpeculativeConfig(method=speculative, model=drafter)
    if model_spec.get("config"):
        device = model_spec.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtypes[model_spec.get("dtype")] or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        model = from_config(model_spec["config"], seed=model_spec.get("seed", 0), dtype=dtype, device=device)
        return LLM(model, model_spec.get("tokenizer"), speculative_config=spec)
    return LLM(model_spec["model"], model_spec.get("tokenizer"), device=model_spec.get("device"),
               dtype=dtypes[model_spec.get("dtype")], speculative_config=spec)


def time_offline_batches(model_spec: dict, prompts: list[str], max_tokens: list[int], concurrency: int,
                         ignore_eos: bool) -> dict:
    """The offline scheduler over the same requests as a server run: ``LLM.generate`` of ``prompts`` (greedy, each
    its ``max_tokens``) in batches of ``concurrency`` (the server's requests in flight at most), after one small
    warm-up batch; every ``Engine.step`` stamped (the prefills' included). Returns the step intervals' median and
    mean (ms: the offline iteration ``bench/serve.py`` sets beside the engine core's), their percentiles, the steps,
    tokens and seconds; ``ms_per_token`` (the intervals' sum over the output tokens) and ``tokens_per_step``, which do
    not depend on how full the steps are; and ``decode_step_ms`` / ``decode_step_mean_ms``, the intervals whose step
    computed at most one token a request of its batch (no prompt chunk: the server's
    ``treedec_engine_decode_step_seconds`` span)."""
    from treedec import SamplingParams

    llm = load_llm(model_spec)
    gaps: list[float] = []
    decode: list[float] = []
    tokens, began = 0, None
    queries: list[int] = []
    with stamped_steps(llm, queries) as ends:
        llm.generate(prompts[:min(4, len(prompts))], SamplingParams(max_tokens=8, temperature=0,
                                                                     ignore_eos=ignore_eos), use_tqdm=False)
        began = time.perf_counter()
        for start in range(0, len(prompts), concurrency):
            ends.clear()
            queries.clear()
            batch = slice(start, start + concurrency)
            params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=ignore_eos) for m in max_tokens[batch]]
            outs = llm.generate(prompts[batch], params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            gaps += itls(ends)
            decode += [g for g, q in zip(itls(ends), queries[1:]) if q <= len(outs)]
    return {"step_ms": statistics.median(gaps) * 1e3 if gaps else None,
            "step_mean_ms": statistics.fmean(gaps) * 1e3 if gaps else None, "step_intervals_ms": percentiles(gaps, 1e3),
            "decode_step_ms": statistics.median(decode) * 1e3 if decode else None,
            "decode_step_mean_ms": statistics.fmean(decode) * 1e3 if decode else None, "decode_steps": len(decode),
            "ms_per_token": sum(gaps) * 1e3 / tokens if tokens else None,
            "tokens_per_step": tokens / len(gaps) if gaps else None,
            "steps": len(gaps), "tokens": tokens, "seconds": time.perf_counter() - began, "concurrency": concurrency,
            "requests": len(prompts), "device": str(llm.model.device)}


def time_llm_generate(model_spec: dict, prompt: str, max_tokens: int, rounds: int, ignore_eos: bool,
                      speculative: str | None, drafter: str | None) -> dict:
    """``LLM.generate`` of ``prompt`` (greedy, ``max_tokens``) one warm-up and ``rounds`` timed times: per round the
    median interval between engine steps (ms), the tokens, steps and seconds ``RequestOutput.stats`` reports, and
    ms per output token (the median step over the tokens a step gives); medians over the rounds.

    ``model_spec``: ``model`` (a name ``LLM`` loads) or ``config`` (a named size, random weights of ``seed``), with
    ``tokenizer``, ``device`` and ``dtype`` (None for the defaults), as the server was started."""
    from treedec import SamplingParams

    llm = load_llm(model_spec, speculative, drafter)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    timed = []
    with stamped_steps(llm) as ends:
        for r in range(rounds + 1):
            ends.clear()
            began = time.perf_counter()
            [out] = llm.generate([prompt], params, use_tqdm=False)
            if r == 0:
                continue   # warm-up (CUDA graph captures, allocator)
            gaps = itls(ends)
            tokens = len(out.outputs[0].token_ids)
            steps = out.stats.get("steps") or len(ends)
            step_ms = statistics.median(gaps) * 1e3 if gaps else None
            timed.append({"step_ms": step_ms, "step_intervals_ms": percentiles(gaps, 1e3), "tokens": tokens,
                          "steps": steps, "engine_steps": len(ends), "seconds": time.perf_counter() - began,
                          "stats_seconds": out.stats.get("seconds"),
                          "ms_per_token": None if step_ms is None or not tokens else step_ms * steps / tokens})
    pick = lambda key: statistics.median(t[key] for t in timed) if all(t[key] is not None for t in timed) \
        else None   # noqa: E731
    return {"rounds": timed, "step_ms": pick("step_ms"), "ms_per_token": pick("ms_per_token"),
            "tokens": timed[-1]["tokens"], "device": str(llm.model.device), "dtype": str(llm.model.dtype),
            "speculative": speculative}
