"""Lanes (treedec/runtime/lanes.py) through the programs that decode on them: a seeded request's tokens do not
depend on its batch, pipelined == unpipelined for every field, one processor's failure ends its request alone,
and host work per step does not grow in torch calls with the number of lanes."""
import pytest
import torch

from tests.engines import make_engine, tiny_model
from treedec.engine import Engine
from treedec.programs.generate import generate_batch
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def prompt(k, length=9):
    return tuple((37 * k + 11 * i + 5) % 512 for i in range(length))


SEEDED = RequestSpec("seeded", prompt_ids=prompt(0), params=SamplingParams(
    n=3, temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.3,
    frequency_penalty=0.2, seed=11, max_tokens=14, logprobs=2, stop_token_ids=(7, 100)))


def companions(k):
    """Other requests: greedy, unseeded sampled, penalized, of other lengths."""
    return [RequestSpec(f"c{k}-{i}", prompt_ids=prompt(10 * k + i, 5 + 3 * i), params=SamplingParams(
        n=1 + i % 2, temperature=0.0 if i % 3 == 0 else 1.1, presence_penalty=0.5 * (i % 2), max_tokens=6 + 2 * i))
        for i in range(k)]


def seeded_outputs(results):
    return [(r.index, r.output_ids, r.stop_reason, [sorted(d) for d in r.logprobs]) for r in results
            if r.id == "seeded"]


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_seeded_request_draws_the_same_whatever_its_batch(tiny, pipeline):
    alone, _ = generate_batch(make_engine(tiny), [SEEDED], pipeline=pipeline)
    want = seeded_outputs(alone)
    for k, first in ((3, True), (5, False), (8, True)):
        batch = [SEEDED] + companions(k) if first else companions(k) + [SEEDED]
        got, _ = generate_batch(make_engine(tiny), batch, pipeline=pipeline, generator=torch.Generator().manual_seed(k))
        assert seeded_outputs(got) == want, (k, first)
    # admitted while others run (a pool that admits a few at a time)
    small = Engine(tiny, kv_tokens=80, page_size=4, backend="torch")
    got, stats = generate_batch(small, companions(6) + [SEEDED], pipeline=pipeline)
    assert seeded_outputs(got) == want and stats.waits > 0


def test_pipelined_equals_unpipelined_for_every_field(tiny):
    """Read back one step late (as on a GPU) or at once: the same tokens, reasons, logprobs and texts."""
    from tests.programs.test_generate_batch import LetterTokenizer
    batch = [SEEDED] + companions(6) + [RequestSpec("text", prompt_ids=prompt(3), params=SamplingParams(
        n=2, temperature=1.0, seed=4, stop=("QQ", "XY"), max_tokens=30))]
    runs = []
    for pipeline in (False, True):
        engine = make_engine(tiny)
        results, _ = generate_batch(engine, batch, tokenizer=LetterTokenizer(), pipeline=pipeline,
                                    generator=torch.Generator().manual_seed(2))
        runs.append([(r.id, r.index, r.output_ids, r.stop_reason, r.text, r.logprobs) for r in results])
        assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0
    assert runs[0] == runs[1]


def test_a_raising_processor_fails_its_request_alone(tiny):
    from treedec.runtime.online import OnlineScheduler
    from treedec.programs.generate import GenerateProgram

    def bad(input_ids, scores):
        if input_ids.shape[1] > 12:
            raise RuntimeError("bad processor")
        return scores

    engine = make_engine(tiny)
    done, errors = {}, {}
    sched = OnlineScheduler(engine, on_done=done.__setitem__, on_error=errors.__setitem__, prefix_cache=False)
    specs = companions(4) + [RequestSpec("bad", prompt_ids=prompt(1), params=SamplingParams(
        temperature=0.5, seed=1, max_tokens=10, logits_processors=(bad,)))]
    handles = [sched.submit(GenerateProgram(s, list(s.prompt_ids))) for s in specs]
    while sched.iterate():
        pass
    assert set(errors) == {handles[-1]} and "bad processor" in str(errors[handles[-1]])
    assert set(done) == set(handles[:-1])
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0


def test_torch_calls_per_step_do_not_grow_with_the_lanes(tiny, monkeypatch):
    """The sampler, the stop match and the read-back are a fixed number of torch calls a step for the whole batch
    (Python per lane only on events): the lanes' and the sampler's own torch calls, counted over the decode steps of 4
    and of 32 sampled requests."""
    import cProfile
    import pstats

    def torch_calls_per_step(requests):
        engine = make_engine(tiny)
        specs = [RequestSpec(i, prompt_ids=prompt(i), params=SamplingParams(
            temperature=0.8, top_p=0.95, seed=i, max_tokens=20, ignore_eos=True)) for i in range(requests)]
        profiler, steps = cProfile.Profile(), []
        step = engine.step

        def timed(*a, **k):
            out = step(*a, **k)
            steps.append(1)
            if len(steps) == 4:
                profiler.enable()
            elif len(steps) == 12:
                profiler.disable()
            return out

        monkeypatch.setattr(engine, "step", timed)
        generate_batch(engine, specs, pipeline=True)
        # torch calls made by the lanes and the sampler (the torch backend's attention runs chunk by chunk here)
        calls = 0
        for (path, _, name), (_, _, _, _, callers) in pstats.Stats(profiler).stats.items():
            if "torch" in path or "torch" in name:
                calls += sum(n for (cpath, _, _), (n, *_) in callers.items()
                             if "treedec/runtime/" in cpath or "treedec/sampling/" in cpath)
        return calls / 8

    few, many = torch_calls_per_step(4), torch_calls_per_step(32)
    assert many <= few * 1.1 + 2, (few, many)


# ================================================================ the draw in the step's graph (lane_draw.py)


def _graphed_batch(k: int, sampled: bool):
    """``k`` requests, greedy or sampled with a seed each (every sampling field on the odd ones)."""
    def params(i):
        if not sampled:
            return SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
        extra = dict(top_k=40, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.1) \
            if i % 2 else {}
        return SamplingParams(temperature=0.9, top_p=0.95, seed=30 + i, max_tokens=7, ignore_eos=True, **extra)
    return [RequestSpec(f"r{i}", prompt_ids=prompt(i, 6 + i % 5), params=params(i)) for i in range(k)]


def _outputs(results):
    return [(r.id, r.index, r.output_ids) for r in results]


class _Recorded:
    """A CUDA graph's stand-in on the CPU: made by running the recorded work (the capture's run, which a GPU does
    not execute: its effects are undone as the warm-up's are), replayed by running the same closure again into the
    outputs it made: a replay reads what the recorded closure holds, as a graph reads the addresses it recorded."""

    def __init__(self, work):
        self.work, self.outputs = work, tuple(work())

    def replay(self):
        with torch.inference_mode():   # (the forward's outputs are inference tensors; a graph writes them in place)
            for out, value in zip(self.outputs, self.work()):
                out.copy_(value)


def _fake_capture(work):
    work()   # the warm-up run (GraphRunner.capture's, on a side stream)
    graph = _Recorded(work)
    return graph, graph.outputs


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.parametrize("sampled, replayed", [(False, False), (True, False), (True, True)])
def test_the_draw_in_the_step_s_graph_equals_the_eager_draw(tiny, triton_device, sampled, replayed):
    """Through a graphed engine's static buffers without capture (the arithmetic a replay does, on the CPU): the
    lanes' draw recorded with the forward (padded to its bucket) gives every request the tokens of the eager
    engine's draw after the step, pipelined; the steps say how they drew. ``replayed``: capture and replay stood in
    for (a warm-up run, a recorded closure run again): the warm-up's draw is undone, a key's recorded buffers are
    the ones every later step of that key uses."""
    import dataclasses
    from treedec.engine import CudaGraphConfig
    if triton_device.type == "cuda":
        pytest.skip("covered by the GPU test with real capture")
    batch = _graphed_batch(3, sampled)
    eager, _ = generate_batch(Engine(tiny, kv_tokens=1024, page_size=4, backend="triton"), batch, pipeline=True)
    engine = Engine(tiny, kv_tokens=1024, page_size=4, backend="triton", cuda_graphs=CudaGraphConfig(capture=False))
    if replayed:
        runner = engine.graph_runner
        runner.config = dataclasses.replace(runner.config, capture=True)
        runner.capture = _fake_capture
    graphed, stats = generate_batch(engine, batch, pipeline=True)
    assert _outputs(graphed) == _outputs(eager)
    assert stats.lane_draws["in the step's graph"] >= 5
    assert engine.graph_stats["tail_replays" if replayed else "static_eager_tail"] >= 5
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
    if sampled:   # a request with a logits processor: its steps draw after the forward, and say why
        processed = [RequestSpec("p", prompt_ids=prompt(9), params=SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, logits_processors=[lambda ids, scores: scores]))]
        _, stats = generate_batch(engine, batch[:1] + processed, pipeline=True)
        assert any(k.startswith("eager: logits processors") for k in stats.lane_draws), stats.lane_draws


def test_a_step_says_why_its_lanes_draw_eagerly(tiny):
    """An engine without CUDA graphs: the lanes draw after the step, and the stats say why."""
    _, stats = generate_batch(make_engine(tiny), _graphed_batch(2, sampled=True))
    assert set(stats.lane_draws) == {"eager: the engine has no CUDA graphs"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("k", [1, 8, 64])
def test_graphed_lanes_steps_draw_the_eager_steps_tokens_on_a_gpu(k, sampled):
    """On a GPU, graphed (each decode step ONE replay: the placeholders' ids, the forward, the lanes' batched draw,
    stop flags and counts) and pipelined: every request's tokens equal the eager engine's (its draw after each
    step), greedy and seeded sampled (fp32 logits, the same Triton kernels); the draws were in the graphs."""
    from treedec.models import from_config

    model = from_config("tiny", seed=0, dtype=torch.float32, device="cuda")
    batch = _graphed_batch(k, sampled)
    eager, _ = generate_batch(Engine(model, kv_tokens=65536, page_size=16, backend="triton"), batch, pipeline=True)
    engine = Engine(model, kv_tokens=65536, page_size=16, backend="triton", cuda_graphs=True)
    for _ in range(2):   # (the second run's lanes are new buffers: its own graphs, the first run's evicted in turn)
        graphed, stats = generate_batch(engine, batch, pipeline=True)
        assert _outputs(graphed) == _outputs(eager)
        assert stats.lane_draws["in the step's graph"] >= 5, stats.lane_draws
    assert engine.graph_stats["tail_replays"] >= 10, engine.graph_stats
    assert not [key for key in engine.graph_stats if key.startswith("eager") and "max_queries" not in key], \
        engine.graph_stats
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
