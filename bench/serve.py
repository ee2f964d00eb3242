#!/usr/bin/env python3
"""The server benchmark (issue #38): a client replaying request mixes against ``treedec serve`` over loopback.

It starts the server itself (``--model NAME`` or ``--config SIZE`` [``--tokenizer``], ``--speculative``,
``--drafter``, more ``--server-args``; 127.0.0.1, a free port, its log beside the results; stopped at the end) or
targets a running one (``--url``). Requests go through the official ``openai`` client (``AsyncOpenAI``), streamed
with ``stream_options={"include_usage": True}``: every piece of text's arrival is stamped. The workloads
(:mod:`bench.serve_workloads`, generated locally from ``--seed``: no downloads):

- ``sharegpt``: ``--num-prompts`` completions, prompt words and output tokens lognormal (medians ``--input-len`` /
  ``--output-len``, spread ``--len-sigma``), clipped to ``--context``;
- ``multiturn``: ``--conversations`` chats of ``--turns`` turns; each turn re-sends the conversation so far and a
  new user message, after the previous answer arrived (the prefix cache's case);
- ``multiturn-ids``: the same shape as token ids (``--system-len`` / ``--user-len`` ids), sent to ``/v1/completions``
  with vLLM's ``return_token_ids``: each turn re-sends the exact ids of the conversation, answers included, as a
  client holding ids does. ``multiturn`` re-sends the answers' text, which the chat template re-encodes: where a
  model generated a token split the tokenizer would not make (common: a random model's, and some of a real one's),
  the cache's match ends there;
- ``tot``: ``--tot-problems`` long shared problem statements, ``--tot-branches`` continuations of each sent at once.

Batches (a request, a conversation's first turn, a problem's branches) arrive as a Poisson process of ``--rate``
per second (``inf``: all at once), at most ``--max-concurrency`` requests in flight; greedy (``--temperature 0``)
and ``ignore_eos`` (every request generates its ``max_tokens``; ``--no-ignore-eos`` lets EOS stop it). Reported per
workload: requests/s and output tokens/s, TTFT, ITL (the gaps between a request's streamed chunks), TPOT and
end-to-end latency (mean, p50, p90, p99, ms), errors (every failed request counted by message), prompt-cache
reuse (sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of prompt tokens; for ``multiturn`` also over the
turns after the first: the issue's target is >= 90%), and what the workload moved in the server's ``/metrics``
(counters' deltas, histograms' means: step time, acceptance length, cache hits).

``--offline``: after the server stopped, the ``sharegpt`` workload's requests again through ``LLM.generate`` in this
process, in batches of ``--max-concurrency`` (:func:`bench.serve_single.time_offline_batches`): its step interval
(median, mean) beside the server's engine-core iteration (``treedec_engine_step_seconds``' mean over the run, from
``/metrics``: the core sends its iteration time in its per-iteration message), and their ratio (the issue's target:
<= 1.1). The mean iteration alone is not a fair comparison (:func:`offline_comparison`): the server keeps
``--max-concurrency`` requests in flight with arrivals spread over its run, so its steps hold more tokens than the
offline batches' (which admit 64 at once, then decode an emptying batch); so also the engine time per output token
(the same prompts and outputs: the same work), the tokens a step, and the decode-only steps' means
(``treedec_engine_decode_step_seconds`` against the offline steps with no prompt chunk). Each workload is measured
after four small warm-up requests of its own text (graph captures and kernel compilation stay out of its metrics, as
the offline side's warm-up batch keeps them out of its steps).

``--single-stream``: one streamed request alone (``--input-len`` words, ``--output-len`` tokens; one warm-up and
``--rounds``), then, with the server stopped, ``LLM.generate`` of the same prompt in this process
(:mod:`bench.serve_single`); the ratio of the server's median ITL to ``LLM.generate``'s median step is the
issue's target (<= 1.1). ``--compare-speculative SPEC``: everything twice, without and with ``--speculative
SPEC`` (``--drafter``), two server starts, tabulated together.

    python bench/serve.py --config llama3-8b --tokenizer smollm2 --rate 8              # GPU: the three workloads
    python bench/serve.py --config llama3-8b --tokenizer smollm2 --workloads sharegpt --num-prompts 256 --offline
    python bench/serve.py --config llama3-8b --tokenizer smollm2 --single-stream
    python bench/serve.py --model smollm2 --compare-speculative ngram --workloads multiturn
    python bench/serve.py --url http://127.0.0.1:8000 --workloads sharegpt --rate 4     # a running server
    python bench/serve.py --model smollm2 --smoke                                       # a few small requests

Writes ``<out>/<date>-<device>-serve[-smoke][-tag].json`` (settings, versions, the server's command and log
file, per workload the summary, the metric changes and every request), a PNG of the latency CDFs beside it,
and prints a table last.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import shlex
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.results_file import add_run_arguments, device_name, results_path, versions, write_results  # noqa: E402
from bench.serve_client import ServerProcess, read_metrics, replay, server_model  # noqa: E402
from bench.serve_single import (single_session, single_stream_summary, time_llm_generate,  # noqa: E402
                                time_offline_batches)
from bench.serve_stats import Record, itls, metric_changes, parse_metrics, summarize  # noqa: E402
from bench.serve_workloads import WORKLOADS, multiturn, multiturn_ids, sharegpt, tot  # noqa: E402

#: ``--smoke``'s sizes: a few short requests of each workload (a CPU and a tiny model).
SMOKE = dict(num_prompts=4, input_len=12, output_len=6, conversations=2, turns=3, user_len=8, answer_len=6,
             system_len=8, tot_problems=1, tot_branches=3, tot_problem_len=24, tot_branch_len=4, tot_output_len=6,
             rounds=2, context=512, max_output=16, max_token_id=390)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [args.speculative] if args.compare_speculative is None else [None, args.compare_speculative]
    device = device_name(torch.device("cuda")) if torch.cuda.is_available() else "cpu"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stem = results_path(Path(args.out), device, "serve", args.smoke, args.tag).with_suffix("")
    results = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "versions": versions("openai", "fastapi", "uvicorn", "transformers"), "argv": sys.argv[1:] if argv is None
               else list(argv), "settings": settings(args), "servers": [], "runs": [], "single_stream": [],
               "offline": []}
    all_records: dict[str, list[Record]] = {}
    for spec in modes:
        label = f"speculative {spec}" if spec else "no speculation"
        print(f"== {label}", file=sys.stderr)
        server = None if args.url else ServerProcess(server_args(args, spec), Path(f"{stem}-server-{spec or 'plain'}.log"),
                                                     args.startup_timeout)
        with server or nullcontext():
            url = args.url or server.url
            if server is not None:
                print(f"server up in {server.startup_seconds:.1f} s: {' '.join(server.command)}", file=sys.stderr)
            if args.single_stream:
                served = asyncio.run(run_single(args, url))
            else:
                for name in args.workloads:
                    run, records = asyncio.run(run_workload(args, url, name))
                    results["runs"].append({"speculative": spec, **run})
                    all_records[f"{name}{f' +{spec}' if spec else ''}"] = records
        if server is not None:
            results["servers"].append({"speculative": spec, "command": server.command, "log": str(server.log),
                                       "startup_s": server.startup_seconds, "exit_status": server.process.returncode})
        if args.single_stream:
            entry = {"speculative": spec, "server": served}
            if args.no_llm or (args.model is None and args.config is None):
                entry["llm_generate"] = None
                entry["llm_skipped"] = "--no-llm" if args.no_llm else "no --model / --config to load in process"
            else:
                print(f"LLM.generate in process ({label})", file=sys.stderr)
                entry["llm_generate"] = time_llm_generate(model_spec(args), served["prompt"], args.output_len,
                                                          args.rounds, args.ignore_eos, spec, args.drafter)
                llm = entry["llm_generate"]
                entry["itl_ratio"] = ratio(served["itl_p50_ms"], llm["step_ms"])
                entry["tpot_ratio"] = ratio(served["tpot_ms"], llm["ms_per_token"])
            results["single_stream"].append(entry)
        if args.offline and not args.single_stream and spec is None and "sharegpt" in args.workloads:
            print("LLM.generate of the sharegpt requests in process (the offline scheduler)", file=sys.stderr)
            sessions = sessions_of(args, "sharegpt")
            offline = time_offline_batches(model_spec(args), [s.turns[0].text for s in sessions],
                                           [s.turns[0].max_tokens for s in sessions], args.max_concurrency,
                                           args.ignore_eos)
            [run] = [r for r in results["runs"] if r["workload"] == "sharegpt" and r["speculative"] is None]
            results["offline"].append(offline_comparison(run, offline))
    path = write_results(results, args.out, "serve", args.smoke, args.tag)
    if all_records:
        plot_cdfs(all_records, path.with_suffix(".png"))
    print_table(results)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = p.add_argument_group("the server")
    which = target.add_mutually_exclusive_group(required=True)
    which.add_argument("--url", help="a running server's base URL (not started nor stopped here)")
    which.add_argument("--model", help="start treedec serve --model NAME (a known name, a checkpoint folder, ...)")
    which.add_argument("--config", help="start treedec serve --config SIZE (random weights; give --tokenizer)")
    target.add_argument("--tokenizer", help="treedec serve --tokenizer (with --config)")
    target.add_argument("--device", help="treedec serve --device (and LLM.generate's)")
    target.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="treedec serve --dtype (and LLM.generate's)")
    target.add_argument("--speculative", help="treedec serve --speculative METHOD (ngram, eagle3, ...)")
    target.add_argument("--drafter", help="treedec serve --drafter PATH (the speculative method's weights)")
    target.add_argument("--compare-speculative", metavar="SPEC",
                        help="run everything without and with --speculative SPEC (two server starts)")
    target.add_argument("--server-args", default="", help="more treedec serve arguments, one shell-quoted string")
    target.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    load = p.add_argument_group("the load")
    load.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    load.add_argument("--rate", type=float, default=float("inf"), help="batches per second, Poisson (inf: all at once)")
    load.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                      help="let EOS end a request (default: every request generates its max_tokens)")
    load.add_argument("--context", type=int, default=4096, help="prompt words + output tokens are clipped to it")
    load.add_argument("--num-prompts", type=int, default=200, help="sharegpt: requests")
    load.add_argument("--input-len", type=int, default=256, help="sharegpt / single stream: prompt words (median)")
    load.add_argument("--output-len", type=int, default=128, help="sharegpt / single stream: output tokens (median)")
    load.add_argument("--len-sigma", type=float, default=1.0, help="sharegpt: the lognormal's sigma of prompt words")
    load.add_argument("--max-output", type=int, default=512, help="sharegpt: output tokens at most")
    load.add_argument("--conversations", type=int, default=16, help="multiturn: conversations")
    load.add_argument("--turns", type=int, default=5, help="multiturn: turns per conversation")
    load.add_argument("--user-len", type=int, default=64, help="multiturn: user message words (median)")
    load.add_argument("--answer-len", type=int, default=64, help="multiturn: answer tokens (median)")
    load.add_argument("--system-len", type=int, default=128, help="multiturn: system message words (ids: tokens)")
    load.add_argument("--max-token-id", type=int, default=30000,
                      help="multiturn-ids: message ids are drawn below it (and above a 30th of it)")
    load.add_argument("--tot-problems", type=int, default=4, help="tot: problems")
    load.add_argument("--tot-branches", type=int, default=16, help="tot: branches per problem, sent at once")
    load.add_argument("--tot-problem-len", type=int, default=1024, help="tot: the shared statement's words")
    load.add_argument("--tot-branch-len", type=int, default=16, help="tot: a branch's own words")
    load.add_argument("--tot-output-len", type=int, default=64, help="tot: output tokens per branch")
    single = p.add_argument_group("single stream")
    single.add_argument("--single-stream", action="store_true",
                        help="one streamed request alone, against LLM.generate in process (instead of the workloads)")
    single.add_argument("--rounds", type=int, default=3, help="single stream: timed rounds after one warm-up")
    single.add_argument("--no-llm", action="store_true", help="single stream: do not time LLM.generate")
    single.add_argument("--model-seed", type=int, default=0, help="--config's random weights (as the server's --seed)")
    p.add_argument("--offline", action="store_true",
                   help="after the server stopped, the sharegpt requests through LLM.generate in process: its step "
                   "beside the engine core's iteration (needs --model or --config)")
    p.add_argument("--smoke", action="store_true", help="a few small requests of each workload (a -smoke file)")
    add_run_arguments(p)
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        p.error(f"unknown workload {', '.join(unknown)}: choose from {', '.join(WORKLOADS)}")
    if args.compare_speculative and args.speculative:
        p.error("--compare-speculative SPEC runs without and with SPEC: give it instead of --speculative")
    if args.compare_speculative and args.url:
        p.error("--compare-speculative starts the server twice: give --model or --config, not --url")
    if args.url and (args.speculative or args.drafter):
        p.error("--speculative / --drafter configure a server started here; a running server (--url) has its own")
    if args.offline and (args.url or args.single_stream or "sharegpt" not in args.workloads):
        p.error("--offline runs the sharegpt workload's requests in process after the server it started: give "
                "--model or --config and the sharegpt workload, without --single-stream")
    if args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    return args


def settings(args: argparse.Namespace) -> dict:
    """The run's settings for the results file."""
    skip = {"out", "tag", "progress"}
    return {k: (v if v != float("inf") else "inf") for k, v in vars(args).items() if k not in skip}


def model_spec(args: argparse.Namespace) -> dict:
    return {"model": args.model, "config": args.config, "tokenizer": args.tokenizer, "device": args.device,
            "dtype": args.dtype, "seed": args.model_seed}


def server_args(args: argparse.Namespace, speculative: str | None) -> list[str]:
    """``treedec serve``'s arguments (without ``--host`` / ``--port``) for one mode."""
    out = ["--model", args.model] if args.model else ["--config", args.config, "--seed", str(args.model_seed)]
    for flag, value in (("--tokenizer", args.tokenizer), ("--device", args.device), ("--dtype", args.dtype)):
        if value:
            out += [flag, value]
    if speculative:
        out += ["--speculative", speculative] + (["--drafter", args.drafter] if args.drafter else [])
    return out + shlex.split(args.server_args)


def sessions_of(args: argparse.Namespace, name: str):
    if name == "sharegpt":
        return sharegpt(args.seed, args.num_prompts, args.input_len, args.output_len, args.len_sigma, args.context,
                        args.max_output)
    if name == "multiturn":
        return multiturn(args.seed, args.conversations, args.turns, args.user_len, args.answer_len,
                         system_words=args.system_len, context=args.context)
    if name == "multiturn-ids":
        return multiturn_ids(args.seed, args.conversations, args.turns, args.user_len, args.answer_len,
                             system_tokens=args.system_len, context=args.context, max_token_id=args.max_token_id)
    return tot(args.seed, args.tot_problems, args.tot_branches, args.tot_problem_len, args.tot_branch_len,
               args.tot_output_len, args.context)


def client_for(url: str):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="EMPTY", max_retries=0, timeout=3600.0)


def sampling(args: argparse.Namespace) -> dict:
    return {"temperature": args.temperature, **({"extra_body": {"ignore_eos": True}} if args.ignore_eos else {})}


def warm_up_sessions(args: argparse.Namespace) -> list:
    """Four small requests sent before a workload is measured (as ``time_offline_batches`` warms the offline LLM up):
    texts of their own, so that no workload prompt is in the prefix cache before it is sent."""
    return [dataclasses.replace(single_session(args.seed + 1 + i, args.input_len, 8), index=i) for i in range(4)]


async def run_workload(args: argparse.Namespace, url: str, name: str) -> tuple[dict, list[Record]]:
    """One workload against the server at ``url``: its entry of the results and its records."""
    sessions = sessions_of(args, name)
    expected = sum(len(s.turns) for s in sessions)
    client = client_for(url)
    try:
        model = await server_model(client)
        await replay(client, model, warm_up_sessions(args), float("inf"), args.max_concurrency, args.seed,
                     sampling(args))   # (graph captures, kernel compilation: out of the measured metrics)
        before = read_metrics(url)
        with tqdm(total=expected, desc=name, unit="request", disable=not args.progress, file=sys.stderr) as bar:
            records, seconds = await replay(client, model, sessions, args.rate, args.max_concurrency, args.seed,
                                            sampling(args), on_done=lambda r: bar.update(1))
        after = read_metrics(url)
    finally:
        await client.close()
    summary = summarize(records, seconds)
    summary["not_sent"] = expected - len(records)   # later turns of conversations whose turn failed
    metrics = None if before is None or after is None else metric_changes(parse_metrics(before), parse_metrics(after))
    print(f"{name}: {summary['succeeded']}/{expected} requests in {seconds:.1f} s, {summary['failed']} failed",
          file=sys.stderr)
    return {"workload": name, "model": model, "sessions": len(sessions), "summary": summary,
            "metrics": metrics if metrics is None else {**metrics, "headline": headline(metrics)},
            "requests": [r.to_json() for r in records]}, records


async def run_single(args: argparse.Namespace, url: str) -> dict:
    """One warm-up and ``--rounds`` single streamed requests, one at a time."""
    session = single_session(args.seed, args.input_len, args.output_len)
    client = client_for(url)
    try:
        model = await server_model(client)
        before = read_metrics(url)
        records = []
        for r in range(args.rounds + 1):
            [record], _ = await replay(client, model, [session], float("inf"), 1, args.seed, sampling(args))
            if r:
                records.append(record)
            print(f"single stream round {r}/{args.rounds}: {record.completion_tokens} tokens, "
                  f"{'error ' + record.error if record.error else f'{record.end:.2f} s'}", file=sys.stderr)
        after = read_metrics(url)
    finally:
        await client.close()
    metrics = None if before is None or after is None else metric_changes(parse_metrics(before), parse_metrics(after))
    return {"model": model, "prompt": session.turns[0].text, "max_tokens": args.output_len,
            **single_stream_summary(records), "requests": [r.to_json() for r in records],
            "metrics": metrics if metrics is None else {**metrics, "headline": headline(metrics)}}


#: The ``treedec serve`` metrics the table reads (``treedec/serve/metrics.py`` names them).
PROMPT_TOKENS, CACHED_TOKENS = "treedec_prompt_tokens_total", "treedec_cached_prompt_tokens_total"
HIT_RATE, STEP_SECONDS = "treedec_cache_hit_rate", "treedec_engine_step_seconds"
ACCEPTED, VERIFY_STEPS = "treedec_spec_accepted_tokens_total", "treedec_spec_verify_steps_total"


def headline(metrics: dict) -> dict:
    """The server metrics the table shows: ``cache_hit_rate``, cached over prompt tokens of the requests that
    finished during the run; ``engine_cache_hit_rate``, the engine's since it started; ``step_ms``, the mean
    engine step; ``accepted_per_step`` (draft tokens accepted per verification step) and ``acceptance_length``
    (tokens per verification step: those + 1). A metric the server does not export is left out."""
    after, delta, means = metrics["after"], metrics["delta"], metrics["means"]
    out = {}
    if delta.get(PROMPT_TOKENS):
        out["cache_hit_rate"] = delta.get(CACHED_TOKENS, 0.0) / delta[PROMPT_TOKENS]
    if HIT_RATE in after:
        out["engine_cache_hit_rate"] = after[HIT_RATE]
    if STEP_SECONDS in means:
        out["step_ms"] = means[STEP_SECONDS] * 1e3
    if delta.get(VERIFY_STEPS):
        out["accepted_per_step"] = delta.get(ACCEPTED, 0.0) / delta[VERIFY_STEPS]
        out["acceptance_length"] = out["accepted_per_step"] + 1
    return out


def offline_comparison(run: dict, offline: dict) -> dict:
    """The engine core's iterations beside the offline scheduler's steps over the same requests. The mean iteration
    alone is not a fair comparison: the server keeps ``--max-concurrency`` requests in flight, arrivals spread over
    its run, so its steps hold more tokens (decodes of a fuller batch, and prompt chunks mixed into them) than the
    offline batches, which admit all their requests at once and end with few decoding. Hence also the engine time
    per output token (the same prompts and outputs on both sides: the same work), the tokens per step, and the
    decode-only steps (no prompt chunk in them)."""
    metrics = run["metrics"] or {}
    delta, means = metrics.get("delta", {}), metrics.get("means", {})
    core = metrics.get("headline", {}).get("step_ms")
    tokens, steps = delta.get("treedec_generation_tokens_total"), delta.get("treedec_engine_steps_total")
    seconds = delta.get(f"{STEP_SECONDS}_sum")
    per_token = None if not tokens or seconds is None else seconds * 1e3 / tokens
    decode = means.get("treedec_engine_decode_step_seconds")
    decode = None if decode is None else decode * 1e3
    return {"workload": "sharegpt", "offline": offline, "core_iteration_ms": core,
            "core_over_offline_mean": ratio(core, offline["step_mean_ms"]),
            "core_over_offline_median": ratio(core, offline["step_ms"]),
            "core_ms_per_token": per_token, "core_over_offline_per_token": ratio(per_token, offline["ms_per_token"]),
            "core_tokens_per_step": ratio(tokens, steps),
            "core_decode_step_ms": decode,
            "core_decode_steps": delta.get("treedec_engine_decode_step_seconds_count"),
            "core_over_offline_decode_mean": ratio(decode, offline["decode_step_mean_ms"])}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def plot_cdfs(records: dict[str, list[Record]], path: Path) -> None:
    """TTFT, ITL and end-to-end latency CDFs of every run, one line per workload (and speculative mode)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("time to first token (ms)", lambda rs: [r.ttft for r in rs if r.ttft is not None]),
              ("inter-token latency (ms)", lambda rs: [x for r in rs for x in itls(r.arrivals)]),
              ("end-to-end latency (ms)", lambda rs: [r.end for r in rs]))
    for ax, (title, values) in zip(axes, panels):
        for label, rs in records.items():
            x = np.sort(np.asarray(values([r for r in rs if r.error is None]), dtype=float)) * 1e3
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=label)
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of gaps" if title.startswith("inter") else "fraction of requests")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(results: dict) -> None:
    """The short table, last: per run throughput, latency percentiles, errors and cache reuse."""
    if results["runs"]:
        print("\n| speculative | workload | ok / sent | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
              "TPOT p50 ms | E2E p50 / p99 ms | cache reuse | after turn 1 (of history) | "
              "server: hit rate / accept len / "
              "step ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for run in results["runs"]:
            s = run["summary"]
            pct = lambda key, q: None if s[key] is None else s[key][q]   # noqa: E731
            after = s.get("cache_after_first_turn", {}).get("reuse")
            history = s.get("cache_of_history", {}).get("reuse")
            h = (run["metrics"] or {}).get("headline", {})
            print(f"| {run['speculative'] or '-'} | {run['workload']} | {s['succeeded']} / {s['requests']} | "
                  f"{fmt(s['requests_per_s'], 2)} | {fmt(s['output_tokens_per_s'])} | "
                  f"{fmt(pct('ttft_ms', 'p50'))} / {fmt(pct('ttft_ms', 'p99'))} | "
                  f"{fmt(pct('itl_ms', 'p50'), 2)} / {fmt(pct('itl_ms', 'p99'), 2)} | {fmt(pct('tpot_ms', 'p50'), 2)} | "
                  f"{fmt(pct('e2e_ms', 'p50'))} / {fmt(pct('e2e_ms', 'p99'))} | {fmt(pct_of(s['cache']['reuse']))}% | "
                  f"{fmt(pct_of(after))}%{'' if history is None else f' ({fmt(pct_of(history))}%)'} | "
                  f"{fmt(pct_of(h.get('cache_hit_rate')))}% / "
                  f"{fmt(h.get('acceptance_length'), 2)} / {fmt(h.get('step_ms'), 2)} |")
    for entry in results["offline"]:
        off = entry["offline"]
        print(f"\n{entry['workload']}: engine-core iteration {fmt(entry['core_iteration_ms'], 2)} ms (mean, /metrics); "
              f"offline LLM.generate step {fmt(off['step_mean_ms'], 2)} ms mean / {fmt(off['step_ms'], 2)} ms median "
              f"({off['requests']} requests, {off['concurrency']} at a time); core / offline "
              f"{fmt(entry['core_over_offline_mean'], 3)}x mean, {fmt(entry['core_over_offline_median'], 3)}x median "
              f"(target <= 1.1); engine ms per output token {fmt(entry.get('core_ms_per_token'), 3)} core / "
              f"{fmt(off.get('ms_per_token'), 3)} offline = {fmt(entry.get('core_over_offline_per_token'), 3)}x "
              f"(tokens a step {fmt(entry.get('core_tokens_per_step'))} / {fmt(off.get('tokens_per_step'))}); "
              f"decode-only steps {fmt(entry.get('core_decode_step_ms'), 2)} / "
              f"{fmt(off.get('decode_step_mean_ms'), 2)} ms mean = "
              f"{fmt(entry.get('core_over_offline_decode_mean'), 3)}x")
    for entry in results["single_stream"]:
        served, llm = entry["server"], entry["llm_generate"]
        print(f"\nsingle stream ({entry['speculative'] or 'no speculation'}): server ITL p50 "
              f"{fmt(served['itl_p50_ms'], 2)} ms, TPOT {fmt(served['tpot_ms'], 2)} ms, TTFT {fmt(served['ttft_ms'])} ms"
              + ("" if llm is None else f"; LLM.generate step {fmt(llm['step_ms'], 2)} ms, "
                 f"{fmt(llm['ms_per_token'], 2)} ms/token; ITL / step {fmt(entry['itl_ratio'], 3)}x, "
                 f"TPOT / ms-per-token {fmt(entry['tpot_ratio'], 3)}x (target <= 1.1)"))


def pct_of(x: float | None) -> float | None:
    return None if x is None else 100.0 * x


if __name__ == "__main__":
    raise SystemExit(main())
