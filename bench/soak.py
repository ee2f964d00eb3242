#!/usr/bin/env python3
"""The soak (issue #51's target): ``treedec serve`` of the tiny model on the CPU over loopback, driven for
``--minutes`` by mixed requests with random client disconnects and aborts, its engine core killed once, then checked.

It starts ``python -m treedec serve --config tiny --max-core-restarts 1`` (a free port, its log beside the results;
the tokenizer: ``--tokenizer``, default the repository's offline test tokenizer, whose ids fit the tiny model's 512)
and runs ``--concurrency`` clients (:mod:`bench.soak_load`: completions and chat, streamed or not, ``n`` 1-3, stop
strings, varied ``max_tokens``, greedy or seeded sampling; 15% disconnect mid-stream, 15% are dropped after a random
delay). At ``--crash-at`` of the run it kills the engine core's process (SIGKILL; its pid from the server's startup
line) and times the server's restart (``/health`` 200 again); the load goes on for a quarter of the run after that
at least. Then (:mod:`bench.soak_checks`):

- nothing lost or duplicated: every request sent has an outcome; every completed one is well-formed (each choice
  once, one finish reason, no text after it), its response id unique, its texts those of the same request sent alone
  to the same server afterwards (greedy and seeded requests alike);
- the only errors are the crash's: ``engine_failed`` for requests in flight when the core was killed,
  ``engine_restarting`` for those sent while the new core was built;
- every page freed: once idle, the pool's pages are free or the prefix cache's (``/metrics``:
  ``treedec_kv_cache_free_pages + treedec_kv_cache_prefix_pages == treedec_kv_cache_pages``);
- the server answering after: requests completed after the restart, ``/health`` ``{"engine_restarts": 1}``;
- memory bounded: the resident memory of the server and its processes (``/proc``, every few seconds) in the run's
  second half at most 1.25x its first half's peak (+64 MiB).

    OMP_NUM_THREADS=1 python bench/soak.py                  # 20 minutes
    OMP_NUM_THREADS=1 python bench/soak.py --minutes 1 --smoke

Writes ``<out>/<date>-cpu-soak[-smoke][-tag].json`` (settings, the crash, every check, the RSS samples, the server's
log file) and prints a table; exit code 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.results_file import add_run_arguments, device_name, results_path, versions  # noqa: E402
from bench.serve_client import ServerProcess  # noqa: E402
from bench.soak_checks import check_outcomes, pages_after, tree_rss  # noqa: E402
from bench.soak_load import drive, reference  # noqa: E402

MODEL = "tiny"

#: Seconds between two samples of the server's resident memory.
RSS_SECONDS = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="how long the load runs (default 20)")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending at once (default 8)")
    p.add_argument("--crash-at", type=float, default=0.4,
                   help="when the engine core is killed, as a share of --minutes (default 0.4); < 0: never")
    p.add_argument("--tokenizer", help="a tokenizer folder (default: the repository's offline test tokenizer)")
    p.add_argument("--kv-tokens", type=int, default=8192, help="the server's KV pool in tokens (default 8192)")
    p.add_argument("--smoke", action="store_true", help="name the results file ...-smoke (a short run)")
    add_run_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="treedec-soak-") as scratch:
        tokenizer = args.tokenizer
        if tokenizer is None:
            from tests.tokenizers_local import build_tokenizer   # (offline: no download)
            tokenizer = str(build_tokenizer(Path(scratch) / "tokenizer"))
        path = results_path(Path(args.out), "cpu", "soak", args.smoke, args.tag or None)
        log = path.with_suffix(".log")
        server_args = ["--config", MODEL, "--tokenizer", tokenizer, "--device", "cpu", "--kv-tokens",
                       str(args.kv_tokens), "--page-size", "4", "--max-core-restarts", "1", "--seed", str(args.seed)]
        with ServerProcess(server_args, log, startup_timeout=300) as server:
            results = asyncio.run(soak(args, server, log))
            results["server"] = {"command": server.command, "log": str(log), "startup_seconds": server.startup_seconds}
            results["server"]["exit_code"] = server.stop()
    results["ok"] = all(results["checks"][name]["ok"] for name in results["checks"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"wrote {path}")
    return 0 if results["ok"] else 1


async def soak(args: argparse.Namespace, server: ServerProcess, log: Path) -> dict:
    url, seconds = server.url, args.minutes * 60.0
    started = time.monotonic()
    deadline = started + seconds
    found = re.search(r"engine core: process (\d+)", log.read_text())
    if found is None:
        raise RuntimeError(f"the server's log names no engine core process:\n{server.log_tail()}")
    crash = {"pid": int(found.group(1))} if args.crash_at >= 0 else None
    samples: list[tuple[float, int]] = []
    progress = tqdm(desc="soak", unit="req", file=sys.stderr, mininterval=5.0)
    counts: dict[str, int] = {}

    def done(outcome) -> None:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
        progress.update(1)
        progress.set_postfix(counts, refresh=False)

    async def sample_rss() -> None:
        while time.monotonic() < load_deadline():
            samples.append((time.monotonic() - started, tree_rss(server.process.pid)))
            await asyncio.sleep(RSS_SECONDS)

    async def kill_core() -> None:
        await asyncio.sleep(max(0.0, args.crash_at * seconds))
        crash["at"] = time.monotonic()
        crash["at_seconds"] = crash["at"] - started
        os.kill(crash["pid"], signal.SIGKILL)
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                await asyncio.sleep(0.05)
                try:
                    reply = await client.get(f"{url}/health")
                except httpx.HTTPError:
                    continue
                if reply.status_code == 200:
                    break
                crash.setdefault("health_while_restarting", reply.json()["error"]["code"])
        crash["healthy_at"] = time.monotonic()
        crash["restart_seconds"] = crash["healthy_at"] - crash["at"]

    helpers = [asyncio.ensure_future(sample_rss())]
    if crash is not None:
        helpers.append(asyncio.ensure_future(kill_core()))
    def load_deadline() -> float:   # (a crash's recovery is followed by a quarter of the run's load at least)
        if crash is None:
            return deadline
        return max(deadline, crash.get("healthy_at", float("inf")) + 0.25 * seconds)

    outcomes = await drive(url, MODEL, seed=args.seed, concurrency=args.concurrency, deadline=load_deadline,
                           on_done=done)
    progress.close()
    load_seconds = time.monotonic() - started
    for task in helpers:
        await task
    samples.append((time.monotonic() - started, tree_rss(server.process.pid)))
    pages_load = pages_after(url)
    keys = {}
    for o in outcomes:
        if o.status == "completed":
            keys.setdefault(o.spec.key, o.spec)
    references = await reference(url, MODEL, list(keys.values()))
    pages_end = pages_after(url)
    health = httpx.get(f"{url}/health", timeout=10.0)
    verdict = check_outcomes(outcomes, references, crash)
    after = [o for o in outcomes if crash is not None and o.status == "completed" and o.started > crash["healthy_at"]]
    answering = {"health": health.json(), "completed_after_restart": len(after),   # (and the references, all after)
                 "references_after_restart": len(references),
                 "ok": health.status_code == 200 and (crash is None or (
                     health.json().get("engine_restarts") == 1 and len(after) + len(references) > 0))}
    half = load_seconds / 2
    first = max((r for t, r in samples if t <= half), default=0)
    second = max((r for t, r in samples if t > half), default=0)
    rss = {"samples": [(round(t, 1), r) for t, r in samples], "first_half_peak": first, "second_half_peak": second,
           "end": samples[-1][1], "ok": second <= 1.25 * first + 64 * 2**20}
    if crash is not None:
        crash = {k: round(v - started, 3) if k in ("at", "healthy_at") else v for k, v in crash.items()}
    return {"settings": vars(args), "device": device_name(__import__("torch").device("cpu")),
            "versions": versions("fastapi", "uvicorn", "httpx"), "load_seconds": load_seconds,
            "requests_per_second": len(outcomes) / load_seconds, "crash": crash,
            "checks": {"requests": verdict, "pages_after_load": pages_load, "pages_at_end": pages_end,
                       "answering_after_crash": answering, "rss": rss}}


def print_table(results: dict) -> None:
    checks = results["checks"]
    v, crash = checks["requests"], results["crash"] or {}
    lat = v["latency_ms"] or {}
    rows = [
        ("requests", f"{v['requests']} in {results['load_seconds']:.0f} s ({results['requests_per_second']:.1f}/s): "
                     f"{v['completed']} completed, {v['disconnected']} disconnected, {v['aborted']} aborted, "
                     f"{v['status'].get('error', 0)} errors {v['error_codes']}"),
        ("mix", f"{v['streamed']} streamed, {v['chat']} chat, {v['n_gt_1']} n>1, {v['with_stop']} stop, "
                f"{v['seeded']} seeded"),
        ("latency", f"p50 {lat.get('p50', 0):.0f} ms, p90 {lat.get('p90', 0):.0f}, p99 {lat.get('p99', 0):.0f}, "
                    f"max {lat.get('max', 0):.0f}"),
        ("crash", "none" if not crash else f"core pid {crash['pid']} killed at {crash['at']:.0f} s, healthy again "
                  f"after {crash['restart_seconds']:.1f} s ({crash.get('health_while_restarting')} meanwhile)"),
        ("well-formed, unique", f"{v['malformed_count']} malformed, {len(v['duplicated_ids'])} duplicated ids, "
                                f"{len(v['over_budget'])} over budget: {'ok' if v['ok'] else 'FAILED'}"),
        ("same as alone", f"{v['compared_with_reference']} compared over {v['reference_keys']} keys, "
                          f"{v['differ_count']} differ; {v['unexpected_count']} unexpected errors "
                          f"{v['unexpected_errors'][:3] or ''}"),
    ]
    for name in ("pages_after_load", "pages_at_end"):
        p = checks[name]
        rows.append((name.replace("_", " "), f"pool {p['pool']}: {p['free']} free + {p['prefix_cache']} prefix cache, "
                                             f"{p['held']} held: {'ok' if p['ok'] else 'FAILED'}"))
    a, r = checks["answering_after_crash"], checks["rss"]
    rows.append(("answering after", f"{a['completed_after_restart']} completed after the restart (+"
                                    f"{a['references_after_restart']} references), /health "
                                    f"{a['health']}: {'ok' if a['ok'] else 'FAILED'}"))
    mib = {k: f"{r[k] / 2**20:.0f} MiB" for k in ("first_half_peak", "second_half_peak", "end")}
    rows.append(("rss", f"first half peak {mib['first_half_peak']}, second {mib['second_half_peak']}, end "
                        f"{mib['end']}: {'ok' if r['ok'] else 'FAILED'}"))
    width = max(len(k) for k, _ in rows)
    for k, text in rows:
        print(f"{k:<{width}}  {text}")
    print(f"{'soak':<{width}}  {'PASSED' if results['ok'] else 'FAILED'}")


if __name__ == "__main__":
    sys.exit(main())
