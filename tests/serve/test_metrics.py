"""The server's metrics of the engine core's iterations: every iteration's time, its tokens, and the decode-only
iterations' time apart (the span set beside an offline decode step)."""
from treedec.core.messages import IterationStats
from treedec.serve.metrics import ServeMetrics


def stats(seconds: float, queries: int, running: int) -> IterationStats:
    return IterationStats(seconds=seconds, steps=1, num_running=running, num_waiting=0, waiting_outputs=0,
                          prompt_tokens=0, cached_tokens=0, preemptions=0, free_pages=10, num_pages=10,
                          queries=queries)


def samples(metrics: ServeMetrics) -> dict[str, float]:
    out = {}
    for line in metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_decode_only_iterations_are_timed_apart_and_every_step_counts_its_tokens():
    metrics = ServeMetrics()
    metrics.iteration(stats(0.010, 3, 3))     # one token a running request: a decode step
    metrics.iteration(stats(0.050, 515, 4))   # a prompt chunk mixed in
    metrics.iteration(stats(0.0, 0, 4))       # an arrival's message: no iteration
    s = samples(metrics)
    assert s["treedec_engine_steps_total"] == 2
    assert s["treedec_engine_step_tokens_total"] == 518
    assert s["treedec_engine_step_seconds_count"] == 2 and abs(s["treedec_engine_step_seconds_sum"] - 0.06) < 1e-9
    assert s["treedec_engine_decode_step_seconds_count"] == 1
    assert abs(s["treedec_engine_decode_step_seconds_sum"] - 0.010) < 1e-9
