"""The soak's checks (``bench/soak.py``): what its requests got (:func:`check_outcomes`), the server's pages once
it is idle (:func:`pages_after`, from ``/metrics``) and the resident memory of the server's processes
(:func:`tree_rss`, from ``/proc``)."""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from bench.serve_stats import parse_metrics
from bench.soak_load import Outcome

__all__ = ["check_outcomes", "pages_after", "tree_rss"]


def check_outcomes(outcomes: list[Outcome], references: dict[tuple, list[str]], crash: dict | None) -> dict:
    """Every outcome's verdict, counted: each completed request well-formed (:attr:`Outcome.problems` empty), its
    response id unique, its completion tokens within ``n x max_tokens``, its texts those of its key's request sent
    alone (``references``); a failed one failed only because of the crash (``crash``: its ``"at"`` and
    ``"healthy_at"`` times, ``time.monotonic()``): ``engine_failed`` for a request in flight when the core was
    killed or sent before the server saw it gone (the reader thread's next poll: at the latest before ``/health``
    answers again), ``engine_restarting`` for one that reached the core while the new one was built; an unexpected
    error is listed as (k, code, HTTP status, its start in seconds after the kill). ``"ok"`` when all hold."""
    status = Counter(o.status for o in outcomes)
    codes = Counter(o.code for o in outcomes if o.status == "error")
    completed = [o for o in outcomes if o.status == "completed"]
    malformed = [(o.spec.k, o.problems) for o in completed if o.problems]
    ids = Counter(o.id for o in completed)
    duplicated = sorted(i for i, c in ids.items() if c > 1 or i is None)
    over_budget = [o.spec.k for o in completed if o.completion_tokens is not None and
                   o.completion_tokens > o.spec.n * o.spec.max_tokens]
    compared = [o for o in completed if o.spec.key in references]
    differ = [(o.spec.k, o.texts, references[o.spec.key]) for o in compared if o.texts != references[o.spec.key]]
    unexpected = []
    for o in outcomes:
        if o.status != "error":
            continue
        if crash is not None and o.code == "engine_failed" and o.ended >= crash["at"] and \
                o.started <= crash["healthy_at"]:
            continue   # (in flight when the core was killed, or sent to it before the server saw it gone)
        if crash is not None and o.code == "engine_restarting" and o.ended >= crash["at"] and \
                o.started <= crash["healthy_at"]:
            continue   # (submitted to the core while the new one was built: sent then, or being tokenized)
        unexpected.append((o.spec.k, o.code, o.http, round(o.started - crash["at"], 3) if crash else None))
    latency = [o.seconds for o in completed]
    verdict = {
        "requests": len(outcomes), "status": dict(status), "error_codes": {str(k): v for k, v in codes.items()},
        "completed": len(completed), "disconnected": status["disconnected"], "aborted": status["aborted"],
        "streamed": sum(o.spec.stream for o in outcomes), "chat": sum(o.spec.chat for o in outcomes),
        "n_gt_1": sum(o.spec.n > 1 for o in outcomes), "with_stop": sum(o.spec.stop is not None for o in outcomes),
        "seeded": sum(o.spec.seed is not None for o in outcomes),
        "choices_completed": sum(o.spec.n for o in completed),
        "compared_with_reference": len(compared), "reference_keys": len(references),
        "malformed": malformed[:20], "malformed_count": len(malformed),
        "duplicated_ids": duplicated[:20], "over_budget": over_budget[:20],
        "differ_from_reference": differ[:20], "differ_count": len(differ),
        "unexpected_errors": unexpected[:20], "unexpected_count": len(unexpected),
        "latency_ms": None if not latency else {
            "p50": float(np.percentile(latency, 50) * 1e3), "p90": float(np.percentile(latency, 90) * 1e3),
            "p99": float(np.percentile(latency, 99) * 1e3), "max": float(max(latency) * 1e3)},
    }
    verdict["ok"] = not (malformed or duplicated or over_budget or differ or unexpected) and bool(completed)
    return verdict


def pages_after(url: str, timeout: float = 60.0) -> dict:
    """Once the server runs no request and queues none (``/metrics``), its pool's pages: free, held by the
    prefix cache, and the rest (``held``: pages some request still holds; 0 when every page was freed)."""
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10.0).text)
        idle = m.get("treedec_requests_running") == 0 and m.get("treedec_requests_waiting") == 0
        pages = {"pool": int(m["treedec_kv_cache_pages"]), "free": int(m["treedec_kv_cache_free_pages"]),
                 "prefix_cache": int(m["treedec_kv_cache_prefix_pages"])}
        pages["held"] = pages["pool"] - pages["free"] - pages["prefix_cache"]
        if idle and pages["held"] == 0 or time.monotonic() > deadline:
            pages["idle"] = idle
            pages["ok"] = idle and pages["held"] == 0
            return pages
        time.sleep(0.2)


def tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and its descendants (the engine core, the chat-template worker), from
    ``/proc``; 0 when it is gone."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    total, todo, page = 0, [pid], os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except OSError:
            continue
        todo.extend(children.get(p, ()))
    return total
