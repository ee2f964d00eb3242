"""What ``bench/serve.py`` measures of each request, and the statistics it reports over a workload.

A :class:`Record` is one streamed request as the client saw it: when it was sent, when each piece of text
arrived, the usage the server reported in its last chunk (``stream_options={"include_usage": True}``), or the
error that ended it. From those:

- time to first token (TTFT): the first text's arrival less the send time;
- inter-token latency (ITL): the gaps between consecutive text arrivals of a request (one streamed chunk per
  engine step; a speculative step may carry several tokens in one chunk);
- time per output token (TPOT): (end-to-end - TTFT) / (output tokens - 1), per request;
- prompt-cache reuse: the sum of ``usage.prompt_tokens_details.cached_tokens`` over the sum of
  ``usage.prompt_tokens`` (for the multi-turn mix also over the turns after the first).

The server's Prometheus ``/metrics`` are read before and after a workload (:func:`parse_metrics`,
:func:`metric_changes`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["Record", "cache_reuse", "itls", "metric_changes", "parse_metrics", "percentiles", "summarize"]


@dataclass
class Record:
    """One request. Times are seconds: ``sent`` from the workload's start, ``arrivals`` from ``sent``.

    Attributes
    ----------
    workload, session, turn : which request of which workload.
    sent : when it was sent.
    arrivals : when each non-empty piece of text arrived.
    end : when the stream ended (or failed), from ``sent``.
    prompt_tokens, completion_tokens : the server's usage (None when it sent none).
    cached_tokens : ``usage.prompt_tokens_details.cached_tokens`` (None when not reported).
    finish_reason : the last choice's finish reason.
    text : the generated text (the next turn of a conversation re-sends it).
    error : ``"<ExceptionType>: message"`` of a failed request; None when it succeeded.
    token_ids : the generated token ids, when the server returned them (``return_token_ids``).
    new_tokens : of a token-id conversation's turn, the new message's tokens (the rest re-sends the history).
    """

    workload: str
    session: int
    turn: int
    sent: float
    arrivals: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    token_ids: list[int] | None = None
    new_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] if self.arrivals else None

    @property
    def tpot(self) -> float | None:
        if not self.arrivals or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.end - self.arrivals[0]) / (self.completion_tokens - 1)

    def to_json(self) -> dict:
        """The record without its text, times in milliseconds."""
        out = asdict(self)
        del out["text"], out["arrivals"]
        out["chunks"] = len(self.arrivals)
        out["ttft_ms"] = None if self.ttft is None else round(self.ttft * 1e3, 3)
        out["itl_ms"] = [round(x * 1e3, 3) for x in itls(self.arrivals)]
        out["sent"], out["end_ms"] = round(self.sent, 6), round(self.end * 1e3, 3)
        del out["end"]
        return out


def itls(arrivals: list[float]) -> list[float]:
    """The gaps between consecutive arrivals (none for fewer than two)."""
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def percentiles(values, scale: float = 1.0) -> dict | None:
    """``n``, ``mean``, ``p50``, ``p90``, ``p99`` and ``max`` of ``values`` times ``scale`` (linear interpolation
    between order statistics, numpy's default); None for no values."""
    x = np.asarray(list(values), dtype=float) * scale
    if x.size == 0:
        return None
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"n": int(x.size), "mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(x.max())}


def cache_reuse(records: list[Record]) -> dict:
    """Prompt tokens, cached tokens and their ratio over the successful ``records`` that reported cached tokens;
    ``unreported``: successful requests whose usage said nothing of cached tokens (``reuse`` None if all)."""
    ok = [r for r in records if r.error is None and r.prompt_tokens is not None]
    reported = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reported)
    cached = sum(r.cached_tokens for r in reported)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "reuse": cached / prompt if prompt else None,
            "unreported": len(ok) - len(reported)}


def summarize(records: list[Record], seconds: float) -> dict:
    """A workload's numbers: counts, throughput over ``seconds`` (its wall time), TTFT / ITL / TPOT / end-to-end
    percentiles in ms over the successful requests, prompt-cache reuse (and after the first turn where sessions
    have several), and every error (counted by message, none dropped)."""
    ok = [r for r in records if r.error is None]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    output = sum(r.completion_tokens or 0 for r in ok)
    out = {"requests": len(records), "succeeded": len(ok), "failed": len(records) - len(ok), "seconds": seconds,
           "requests_per_s": len(ok) / seconds if seconds > 0 else None,
           "output_tokens": output, "output_tokens_per_s": output / seconds if seconds > 0 else None,
           "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
           "no_usage": sum(r.completion_tokens is None for r in ok),
           "ttft_ms": percentiles((r.ttft for r in ok if r.ttft is not None), 1e3),
           "itl_ms": percentiles((x for r in ok for x in itls(r.arrivals)), 1e3),
           "tpot_ms": percentiles((r.tpot for r in ok if r.tpot is not None), 1e3),
           "e2e_ms": percentiles((r.end for r in ok), 1e3),
           "cache": cache_reuse(records), "errors": errors}
    if any(r.turn > 0 for r in records):
        out["cache_after_first_turn"] = cache_reuse([r for r in records if r.turn > 0])
    later = [r for r in records if r.turn > 0 and r.new_tokens is not None and r.error is None
             and r.prompt_tokens is not None and r.cached_tokens is not None]
    if later:   # of the re-sent history only: what a cache can hold (the new message is new)
        history = sum(r.prompt_tokens - r.new_tokens for r in later)
        out["cache_of_history"] = {"history_tokens": history, "cached_tokens": sum(r.cached_tokens for r in later),
                                   "reuse": sum(r.cached_tokens for r in later) / history if history else None}
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition as ``{"name{label=value,...}": value}`` (labels sorted);
    the interpreter's and process's own collectors (``python_*``, ``process_*``) and the counters' creation
    times (``*_created``) left out."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(("python_", "process_")) or s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return samples


def metric_changes(before: dict[str, float], after: dict[str, float]) -> dict:
    """What a workload moved in the server's metrics: ``delta`` of every sample present both times that changed,
    ``after`` of every sample, and ``means``: for each histogram or summary ``X`` (``X_sum`` / ``X_count``
    samples), its mean over the workload, delta(sum) / delta(count)."""
    delta = {k: after[k] - before[k] for k in after if k in before and after[k] != before[k]}
    delta.update({k: v for k, v in after.items() if k not in before and v})
    means = {}
    for key, count in delta.items():
        name, _, labels = key.partition("{")
        if name.endswith("_count") and count > 0:
            base = name[:-len("_count")]
            sum_key = f"{base}_sum" + (f"{{{labels}" if labels else "")
            if sum_key in after:
                total = after[sum_key] - before.get(sum_key, 0.0)
                if math.isfinite(total):
                    means[base + (f"{{{labels}" if labels else "")] = total / count
    return {"delta": delta, "means": means, "after": after}
