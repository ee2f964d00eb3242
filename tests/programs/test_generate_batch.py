"""Batched generation over the forest (tiny random Llama, CPU): batched == alone, continuous
admission under a small pool, stops, text, pages."""
import pytest
import torch

from treedec.sampling.params import SamplingParams
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.programs.generate import GenerateProgram, generate_batch
from treedec.runtime.requests import RequestSpec
from treedec.runtime.scheduler import run_program
from tests.engines import make_engine, plain_greedy, tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def prompt(k, length=9):
    return tuple((37 * k + 11 * i + 5) % 512 for i in range(length))


def requests():
    """Mixed requests: greedy and seeded sampling, several outputs, EOS ids that end outputs early."""
    return [
        RequestSpec(0, prompt_ids=prompt(0), params=SamplingParams(max_tokens=7, temperature=0.0)),
        RequestSpec("b", prompt_ids=prompt(1, 30), params=SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3)),
        RequestSpec(2, prompt_ids=prompt(2, 5),
                    params=SamplingParams(max_tokens=10, temperature=0.8, top_k=40, seed=9, n=2,
                                          stop_token_ids=tuple(range(0, 512, 7)))),
        RequestSpec(3, prompt_ids=prompt(3, 17),
                    params=SamplingParams(max_tokens=4, temperature=1.2, top_p=0.9, seed=1)),
        RequestSpec(4, prompt_ids=prompt(4, 3),
                    params=SamplingParams(max_tokens=9, temperature=0.0, n=2, stop_token_ids=tuple(range(1, 512, 5)))),
    ]


def outputs(results):
    return [(r.id, r.index, r.output_ids, r.stop_reason) for r in results]


@pytest.mark.parametrize("kv_tokens", [4096, 100, 72])
def test_batched_equals_each_request_alone(tiny, kv_tokens):
    """Every request's outputs are those of the request run alone on a fresh engine, with a pool
    large enough for all at once and with ones so small that requests wait for pages, or are
    preempted and run again."""
    engine = Engine(tiny, kv_tokens=kv_tokens, page_size=4, backend="torch")
    batched, stats = generate_batch(engine, requests())
    alone = []
    for spec in requests():
        alone += generate_batch(make_engine(tiny), [spec])[0]
    assert outputs(batched) == outputs(alone)
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0
    assert [r.id for r in batched] == [0, "b", "b", "b", 2, 2, 3, 4, 4]
    assert {r.stop_reason for r in batched} >= {"eos", "length"}
    if kv_tokens == 4096:
        assert stats.waits == 0 and max(stats.programs_per_step) == 5 and stats.preemptions == 0
        # The prompts, and every output token but the last (nothing reads it).
        assert sum(stats.queries_per_step) == sum(len(s.prompt_ids) for s in requests()) \
            + sum(len(r.output_ids) - 1 for r in batched)
    else:
        assert stats.waits > 0 and stats.peak_pages <= kv_tokens // 4


def test_greedy_outputs_are_plain_greedy_decoding(tiny):
    specs = [RequestSpec(k, prompt_ids=prompt(k, 6 + k),
                         params=SamplingParams(max_tokens=8, temperature=0.0, n=2)) for k in range(3)]
    results, _ = generate_batch(make_engine(tiny), specs)
    for r in results:
        assert r.output_ids == plain_greedy(tiny, list(prompt(r.id, 6 + r.id)), 8) and r.stop_reason == "length"


@pytest.mark.parametrize("pipeline", [False, True])
def test_an_output_on_the_prompt_s_node_stays_there(tiny, pipeline):
    """on_prompt (greedy_generate's program): the one output grows on the prompt's node, which holds every
    token but the last when the program returns (a pipelined token past the end truncated), all with keep."""
    spec = RequestSpec(0, prompt_ids=prompt(0), params=SamplingParams(max_tokens=6, temperature=0.0))
    want = plain_greedy(tiny, list(prompt(0)), 6)
    for keep, kept in ((False, want[:-1]), (True, want)):
        engine = make_engine(tiny)
        [result] = run_program(engine, GenerateProgram(spec, list(spec.prompt_ids), keep=keep, on_prompt=True),
                               pipeline=pipeline)
        root = result.stats["root"]
        assert result.output_ids == want and result.stats["nodes"] == [root] and engine.tree.roots == [root]
        assert engine.tree.sequence(root) == list(prompt(0)) + kept
        engine.tree.check_invariants()
    with pytest.raises(ValueError, match="the request must have n=1, got n=2"):
        GenerateProgram(RequestSpec(1, prompt_ids=prompt(1),
                                    params=SamplingParams(n=2)), list(prompt(1)), on_prompt=True)


class LetterTokenizer:
    """Token id i is the letter chr(65 + i % 26): every output has a text, one character a token."""

    def encode(self, text):
        return [ord(c) - 65 for c in text]

    def decode(self, ids):
        return "".join(chr(65 + int(i) % 26) for i in ids)


def test_text_prompts_stop_strings_and_the_model_eos(tiny, monkeypatch):
    tokenizer = LetterTokenizer()
    greedy = RequestSpec(0, prompt="HELLO", params=SamplingParams(max_tokens=12, temperature=0.0))
    [probe], _ = generate_batch(make_engine(tiny), [greedy], tokenizer=tokenizer)
    ids, text = probe.output_ids, probe.text
    assert probe.prompt_ids == [7, 4, 11, 11, 14] and probe.prompt == "HELLO" and text == tokenizer.decode(ids)
    stop = text[4:6]
    cut = text.index(stop)
    eos_at = next(i for i in range(6, 12) if ids[i] not in ids[:i])
    monkeypatch.setattr(tiny, "eos_token_ids", (ids[eos_at],))
    specs = [RequestSpec(0, prompt="HELLO", params=SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,))),
             RequestSpec(1, prompt="HELLO",
                         params=SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,),
                                               include_stop_str_in_output=True)),
             RequestSpec(2, prompt="HELLO", params=SamplingParams(max_tokens=12, temperature=0.0))]
    results, _ = generate_batch(make_engine(tiny), specs, tokenizer=tokenizer)
    assert results[0].stop_reason == "stop_string" and results[0].text == text[:cut]
    assert results[0].output_ids == ids[:cut + len(stop)]       # tokens up to the one completing the stop
    assert results[1].text == text[:cut + len(stop)]
    assert results[2].stop_reason == "eos" and results[2].output_ids == ids[:eos_at + 1]


def test_results_reach_the_callback_as_requests_retire(tiny):
    seen = []
    results, stats = generate_batch(make_engine(tiny), requests(), on_request_done=lambda done: seen.append(done))
    assert sorted(str(r.id) for done in seen for r in done if r.index == 0) == ["0", "2", "3", "4", "b"]
    assert all(len({r.id for r in done}) == 1 for done in seen)
    assert all(r.stats["steps"] >= 1 and r.stats["prompt_tokens"] > 0 for r in results)
    assert stats.steps == len(stats.queries_per_step) and stats.seconds > 0


@pytest.mark.parametrize("specs,kwargs,error,message", [
    ([RequestSpec(0, prompt="hi")], {}, ValueError, "needs the checkpoint's tokenizer"),
    ([RequestSpec(0, prompt_ids=(1,)), RequestSpec(0, prompt_ids=(2,))], {}, ValueError, "request id 0 is used twice"),
    ([RequestSpec(0, prompt_ids=(600,))], {}, ValueError, r"token id 600 is out of vocabulary \(the model's vocabulary has 512 tokens"),
    ([RequestSpec(0, prompt_ids=(1,), params=SamplingParams(stop=("x",)))], {}, ValueError,
     "stop strings .* need the checkpoint's tokenizer"),
    ([RequestSpec(0, prompt_ids=(1,), params=SamplingParams(max_tokens=100, n=8))], {}, PoolExhaustedError,
     "request 0 may need 201 KV pages .* the pool has 63 free"),
    (RequestSpec(0, prompt_ids=(1,)), {}, TypeError, "requests must be a sequence of RequestSpec"),
    ([{"prompt_ids": [1]}], {}, TypeError, r"requests\[0\] must be a RequestSpec, got dict"),
    ([RequestSpec(0, prompt_ids=(1,))], {"chat_template": "yes"}, TypeError, "chat_template must be a bool"),
    ([RequestSpec(0, prompt_ids=(1,))], {"pipeline": 1}, ValueError, r"pipeline must be a bool or None"),
])
def test_bad_requests_raise_before_anything_runs(tiny, specs, kwargs, error, message):
    engine = Engine(tiny, kv_tokens=256, page_size=4, backend="torch")
    other = engine.prefill([1, 2, 3]).node
    free = engine.pool.num_free_pages
    with pytest.raises(error, match=message):
        generate_batch(engine, specs, **kwargs)
    assert engine.tree.roots == [other] and engine.pool.num_free_pages == free and engine.stats["steps"] == 1


def test_a_failing_step_frees_the_live_requests(tiny, monkeypatch):
    engine = make_engine(tiny)
    step, calls = engine.step, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("device lost")
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        generate_batch(engine, requests())
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batched_generation_on_a_graphed_gpu_engine():
    """On a GPU (graphed steps): every step a graph replay, outputs stopped by their rules, pages all
    freed; a greedy request's first token (from its own prefill) is the one it gets alone."""
    from treedec.models import from_config

    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, kv_tokens=8192, page_size=16, cuda_graphs=True)
    results, stats = generate_batch(engine, requests())
    assert not [k for k in engine.graph_stats if k.startswith("eager") and "max_queries" not in k]
    # (a step whose lanes draw inside its graph replays a tail graph: the forward with the draw after it)
    assert engine.graph_stats["replays"] + engine.graph_stats["tail_replays"] >= stats.steps > 0
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0
    for r, spec in zip([r for r in results if r.index == 0], requests()):
        assert 1 <= len(r.output_ids) <= spec.params.max_tokens
        assert r.stop_reason == "length" or r.output_ids[-1] in spec.params.stop_token_ids
    alone, _ = generate_batch(Engine(model, kv_tokens=8192, page_size=16, cuda_graphs=True), [requests()[0]])
    assert alone[0].output_ids[0] == results[0].output_ids[0]


def shared_prompt_requests():
    """Two groups sharing a system prompt each (one member's prompt is its whole system prompt),
    and one request sharing nothing."""
    system_a, system_b = list(prompt(7, 40)), list(prompt(8, 23))
    specs = [RequestSpec(k, prompt_ids=tuple(system_a + list(prompt(20 + k, 5))),
                         params=SamplingParams(max_tokens=6, temperature=0.9, seed=k, n=1 + k % 2)) for k in range(4)]
    specs.append(RequestSpec(4, prompt_ids=tuple(system_a), params=SamplingParams(max_tokens=5, temperature=0.0)))
    specs += [RequestSpec(5 + k, prompt_ids=tuple(system_b + list(prompt(30 + k, 3 + k))),
                          params=SamplingParams(max_tokens=4, temperature=0.0)) for k in range(2)]
    specs.append(RequestSpec(7, prompt_ids=prompt(9, 12), params=SamplingParams(max_tokens=5, temperature=0.0)))
    return specs


@pytest.mark.parametrize("kv_tokens", [4096, 100])
def test_shared_prompt_prefixes_are_stored_once(tiny, kv_tokens):
    """Requests that start with the same system prompt read one copy of its K/V: fewer pages, the
    same outputs as each request alone (and as the batch without sharing)."""
    shared_engine = Engine(tiny, kv_tokens=kv_tokens, page_size=4, backend="torch")
    shared, stats = generate_batch(shared_engine, shared_prompt_requests())
    unshared, plain = generate_batch(Engine(tiny, kv_tokens=4096, page_size=4, backend="torch"),
                                     shared_prompt_requests(), min_shared_prefix=0)
    alone = []
    for spec in shared_prompt_requests():
        alone += generate_batch(make_engine(tiny), [spec])[0]
    assert outputs(shared) == outputs(alone) == outputs(unshared)
    # Group a's prefix stops one token short of request 4's prompt (all of system prompt a: every member
    # keeps a node of its own), rounded down to whole pages: 36 tokens; group b's 23 tokens round to 20.
    assert stats.shared_prefix_tokens == 36 * 4 + 20 * 1 and plain.shared_prefix_tokens == 0
    if kv_tokens == 4096:   # every request at once: the two prefixes' pages once, not 5 and 2 times (a member
        # with its prefix holds the pages it holds alone)
        assert plain.peak_pages - stats.peak_pages == 4 * 9 + 1 * 5
    else:
        assert stats.waits > 0
    assert shared_engine.pool.num_free_pages == shared_engine.pool.num_pages and shared_engine.tree.num_nodes == 0


def test_min_shared_prefix_is_checked(tiny):
    with pytest.raises(ValueError, match=r"min_shared_prefix must be an int >= 0 \(0: no sharing\) or None, got -1"):
        generate_batch(make_engine(tiny), requests(), min_shared_prefix=-1)


@pytest.mark.parametrize("make", [requests, shared_prompt_requests])
@pytest.mark.parametrize("kv_tokens", [4096, 100])
def test_pipelined_batches_give_the_same_outputs(tiny, make, kv_tokens):
    """Pipelined (each step launched before its tokens are read back, as on a GPU), the outputs,
    the pages freed and the requests' waits for pages are those of the unpipelined run."""
    runs = []
    for pipeline in (False, True):
        engine = Engine(tiny, kv_tokens=kv_tokens, page_size=4, backend="torch")
        results, stats = generate_batch(engine, make(), pipeline=pipeline)
        assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0
        runs.append((outputs(results), stats.waits > 0))
    assert runs[0] == runs[1]


def test_pipelined_text_and_stop_strings(tiny, monkeypatch):
    tokenizer = LetterTokenizer()
    [probe], _ = generate_batch(make_engine(tiny), [RequestSpec(0, prompt="HELLO",
                                                                params=SamplingParams(max_tokens=12, temperature=0.0))],
                                tokenizer=tokenizer)
    stop = probe.text[4:6]
    specs = [RequestSpec(k, prompt="HELLO" + "AB"[k % 2] * k,
                         params=SamplingParams(max_tokens=12, temperature=0.5 * (k % 3), seed=k, stop=(stop,),
                                               n=1 + k % 2)) for k in range(6)]
    runs = [generate_batch(make_engine(tiny), specs, tokenizer=tokenizer, pipeline=p)[0] for p in (False, True)]
    assert [(r.output_ids, r.text, r.stop_reason) for r in runs[0]] == [(r.output_ids, r.text, r.stop_reason)
                                                                        for r in runs[1]]
    assert any(r.stop_reason == "stop_string" for r in runs[0])


def test_requests_that_outgrow_the_pool_are_preempted_and_run_again(tiny):
    """Two long requests both admitted (their prompts fit) outgrow a 16-page pool together: when both
    wait for pages the newer one is preempted (its pages freed) and run again after the other; a
    seeded request's outputs are the same as alone."""
    specs = [RequestSpec(k, prompt_ids=prompt(k, 4),
                         params=SamplingParams(max_tokens=40, temperature=0.9, seed=k)) for k in range(2)]
    engine = Engine(tiny, kv_tokens=64, page_size=4, backend="torch")
    batched, stats = generate_batch(engine, specs)
    alone = [generate_batch(make_engine(tiny), [spec])[0][0] for spec in specs]
    assert outputs(batched) == outputs(alone)
    assert stats.preemptions >= 1 and stats.peak_pages <= 16
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_streamed_text_joins_to_each_output_s_text(tiny, pipeline):
    """on_text streams each output's text as tokens are accepted; a tail that may start a stop string is
    held back, so the deltas join to the final text (cut before the stop string) and never pass it."""
    tokenizer = LetterTokenizer()
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    [probe], _ = generate_batch(make_engine(tiny), [RequestSpec(0, prompt="HELLO", params=greedy)], tokenizer=tokenizer)
    stop = probe.text[5:8]   # three letters: the first one or two are held back while they may start it
    specs = [RequestSpec(0, prompt="HELLO", params=SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,))),
             RequestSpec(1, prompt="WORLD", params=SamplingParams(max_tokens=9, temperature=0.9, seed=2, n=2))]
    streamed: dict = {}
    results, _ = generate_batch(make_engine(tiny), specs, tokenizer=tokenizer, pipeline=pipeline,
                                on_text=lambda spec, i, delta: streamed.setdefault((spec.id, i), []).append(delta))
    for r in results:
        assert "".join(streamed.get((r.id, r.index), [])) == r.text
    assert results[0].stop_reason == "stop_string" and results[0].text == probe.text[:probe.text.index(stop)]
    assert all(delta for deltas in streamed.values() for delta in deltas)


def test_streaming_needs_a_tokenizer(tiny):
    with pytest.raises(ValueError, match="on_text streams detokenized text: it must be callable and needs"):
        generate_batch(make_engine(tiny), requests(), on_text=print)
