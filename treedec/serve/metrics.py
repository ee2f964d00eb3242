"""The server's Prometheus metrics, in a registry of its own (``/metrics``).

Names (all prefixed ``treedec_``):

- ``requests_total{route, status}``: requests answered, by route and HTTP status;
- ``prompt_tokens_total``, ``generation_tokens_total``: tokens of finished requests;
- ``cached_prompt_tokens_total``: their prompt tokens read from the prefix cache;
- ``cache_hit_rate``: the engine's share of admitted prompt tokens read from the prefix cache since it started
  (:attr:`~treedec.runtime.scheduler.SchedulerStats.cache_hit_rate`), and ``scheduler_prompt_tokens`` /
  ``scheduler_cached_tokens``, the counts it is the ratio of;
- ``engine_steps_total`` and ``engine_step_seconds`` (histogram): each scheduler iteration (one engine step for
  every live request) and its wall time (the scheduler's iterate: the core's flush and send after it are not in it);
  ``engine_step_tokens_total``: the tokens those steps computed (per step: prompt chunks and decode tokens);
  ``engine_decode_step_seconds`` (histogram): the iterations that computed no prompt chunk (at most one token a
  running request), the span to set beside an offline decode step whatever the arrivals' mix;
- ``time_to_first_token_seconds`` (histogram): arrival to the first text of a request;
- ``inter_token_latency_seconds`` (histogram): per output, its mean time per token after the first;
- ``request_seconds`` (histogram): arrival to the end;
- ``requests_running``, ``requests_waiting`` (gauges): admitted requests and those waiting for admission;
- the engine core's state after its last iteration (sent in its per-iteration message): ``kv_cache_free_pages`` and
  ``kv_cache_pages`` (gauges), ``kv_cache_prefix_pages`` (gauge: the pages the prefix cache holds; once every request
  has ended the free pages and these are all the pool's, which a soak checks), ``engine_step_queries`` (gauge: the
  tokens its last step computed), ``scheduler_preemptions`` (gauge: requests preempted since it started);
- ``engine_core_restarts`` (gauge): the times a crashed engine core was started again (``--max-core-restarts``);
- ``batch_invariant`` (gauge): 1 where the engine runs the batch-invariant mode (``--batch-invariant``), else 0;
- speculative decoding: ``spec_verify_steps_total`` and ``spec_accepted_tokens_total`` (their ratio is the mean
  accepted length; +1 for the bonus token: tokens per step), ``spec_draft_tokens_total`` (draft tokens verified),
  ``spec_acceptance_length`` (histogram: each request's mean accepted tokens per step).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from treedec.runtime.requests import RequestResult
from treedec.core.messages import IterationStats

__all__ = ["CONTENT_TYPE_LATEST", "ServeMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    """The metrics of one server (see the module docstring); ``render()`` is the ``/metrics`` body."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("treedec_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("treedec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("treedec_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.cached_tokens = Counter("treedec_cached_prompt_tokens", "Prompt tokens of finished requests read from "
                                     "the prefix cache", registry=r)
        self.cache_hit_rate = Gauge("treedec_cache_hit_rate", "Share of admitted prompt tokens read from the prefix "
                                    "cache since the engine started", registry=r)
        self.scheduler_prompt = Gauge("treedec_scheduler_prompt_tokens", "Prompt tokens admitted by the scheduler "
                                      "since the engine started", registry=r)
        self.scheduler_cached = Gauge("treedec_scheduler_cached_tokens", "Of them, read from the prefix cache",
                                      registry=r)
        self.steps = Counter("treedec_engine_steps", "Scheduler iterations (one engine step each)", registry=r)
        self.step_seconds = Histogram("treedec_engine_step_seconds", "Wall time of a scheduler iteration",
                                      buckets=_LATENCY, registry=r)
        self.step_queries_total = Counter("treedec_engine_step_tokens", "Tokens computed by the engine's steps",
                                          registry=r)
        self.decode_step_seconds = Histogram("treedec_engine_decode_step_seconds", "Wall time of a scheduler "
                                             "iteration that computed no prompt chunk", buckets=_LATENCY, registry=r)
        self.ttft = Histogram("treedec_time_to_first_token_seconds", "Arrival to a request's first text",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("treedec_inter_token_latency_seconds", "Per output: mean time per token after the "
                             "first", buckets=_LATENCY, registry=r)
        self.latency = Histogram("treedec_request_seconds", "Arrival to the end of a request", buckets=_LATENCY,
                                 registry=r)
        self.running = Gauge("treedec_requests_running", "Requests admitted by the scheduler", registry=r)
        self.waiting = Gauge("treedec_requests_waiting", "Requests waiting for admission", registry=r)
        self.free_pages = Gauge("treedec_kv_cache_free_pages", "Free KV pages after the engine's last iteration",
                                registry=r)
        self.pages = Gauge("treedec_kv_cache_pages", "KV pages of the engine's pool", registry=r)
        self.prefix_pages = Gauge("treedec_kv_cache_prefix_pages", "KV pages the prefix cache holds after the "
                                  "engine's last iteration", registry=r)
        self.step_queries = Gauge("treedec_engine_step_queries", "Tokens computed by the engine's last step",
                                  registry=r)
        self.preemptions = Gauge("treedec_scheduler_preemptions", "Requests preempted (run again) since the engine "
                                 "started", registry=r)
        self.core_restarts = Gauge("treedec_engine_core_restarts", "Times a crashed engine core was started again",
                                   registry=r)
        self.batch_invariant = Gauge("treedec_batch_invariant", "1 where the engine runs the batch-invariant mode "
                                     "(a request's tokens do not depend on the batch), else 0", registry=r)
        self.spec_steps = Counter("treedec_spec_verify_steps", "Speculative verification steps", registry=r)
        self.spec_accepted = Counter("treedec_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_drafted = Counter("treedec_spec_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_length = Histogram("treedec_spec_acceptance_length", "Per request: mean draft tokens accepted a "
                                     "step", buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16), registry=r)

    def watch(self, client) -> None:
        """Read the running and waiting counts from ``client`` (a CoreClient: its core's last stats) when scraped."""
        self.running.set_function(lambda: 0 if client.stats is None else client.stats.num_running)
        self.waiting.set_function(lambda: 0 if client.stats is None else client.stats.num_waiting)
        self.core_restarts.set_function(lambda: client.restarts)

    def iteration(self, stats: IterationStats) -> None:
        """A message of the engine core (the event loop): after an iteration (``stats.seconds`` > 0) or an arrival."""
        if stats.seconds:
            self.steps.inc()
            self.step_seconds.observe(stats.seconds)
            self.step_queries.set(stats.queries)
            self.step_queries_total.inc(stats.queries)
            if stats.queries <= stats.num_running:   # (after the step: a request that ended in it is not counted)
                self.decode_step_seconds.observe(stats.seconds)
        self.cache_hit_rate.set(stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0)
        self.scheduler_prompt.set(stats.prompt_tokens)
        self.scheduler_cached.set(stats.cached_tokens)
        self.free_pages.set(stats.free_pages)
        self.pages.set(stats.num_pages)
        self.prefix_pages.set(stats.cache_pages)
        self.preemptions.set(stats.preemptions)

    def finished(self, results: list[RequestResult], arrival: float, first: float | None, end: float) -> None:
        """A request's results (``arrival``, ``first`` text and ``end`` times, ``time.perf_counter()``)."""
        first_result = results[0]
        self.prompt_tokens.inc(len(first_result.prompt_ids))
        self.cached_tokens.inc(first_result.stats["cached_tokens"])
        self.generation_tokens.inc(sum(len(r.output_ids) for r in results))
        self.latency.observe(end - arrival)
        if first is not None:
            self.ttft.observe(first - arrival)
            for r in results:
                if len(r.output_ids) > 1:
                    self.itl.observe((end - first) / (len(r.output_ids) - 1))
        accepted = first_result.stats.get("accepted")
        if accepted:
            self.spec_steps.inc(len(accepted))
            self.spec_accepted.inc(sum(accepted))
            self.spec_drafted.inc(sum(first_result.stats.get("draft_sizes", ())))
            self.spec_length.observe(sum(accepted) / len(accepted))

    def render(self) -> bytes:
        return generate_latest(self.registry)
