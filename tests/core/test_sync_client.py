"""LLM(..., engine_process=True) through the engine core's process (treedec/core/sync_client.py, the server's process
client): its results equal the in-process LLM's (greedy and seeded, n > 1, stop strings, logprobs, chat, beams,
speculative decoding, cached tokens); a bad request raises the in-process error and the core serves the next call;
what the process cannot carry is refused by name; a killed core fails the waiting call with EngineDeadError; shutdown,
``with`` and the interpreter's exit end the process. The tiny random Llama (tests/engines.py) written as a
checkpoint, so that the core's process builds it by name."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from tests.engines import tiny_checkpoint, tiny_model  # noqa: E402
from treedec import LLM, BeamSearchParams, PoolExhaustedError, SamplingParams  # noqa: E402
from treedec.core.client import EngineDeadError  # noqa: E402
from treedec.programs import GenerateProgram  # noqa: E402
from treedec.sampling import StructuredOutputsParams  # noqa: E402

OPTIONS = dict(kv_tokens=2048, page_size=4, backend="torch")
PROMPTS = ["The quick brown fox", {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}, "hello world, hello",
           {"prompt": "abc def"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def reference(folder):
    """The in-process LLM of the same checkpoint."""
    return LLM(folder, **OPTIONS)


@pytest.fixture(scope="module")
def remote(folder):
    """The module's LLM whose engine runs in a core process of its own."""
    llm = LLM(folder, engine_process=True, **OPTIONS)
    yield llm
    llm.shutdown()


def same(got, want, stats=("prompt_tokens", "cached_tokens")):
    """Two generate results are the same: request ids, prompts, and every output's tokens, text, ends, logprobs."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.request_id, g.prompt, g.prompt_token_ids) == (w.request_id, w.prompt, w.prompt_token_ids)
        assert [g.stats[k] for k in stats] == [w.stats[k] for k in stats], (g.stats, w.stats)
        same_logprobs(_logprobs(g.prompt_logprobs), _logprobs(w.prompt_logprobs))
        assert len(g.outputs) == len(w.outputs)
        for a, b in zip(g.outputs, w.outputs):
            assert (a.index, a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
                (b.index, b.token_ids, b.text, b.finish_reason, b.stop_reason)
            same_logprobs(_logprobs(a.logprobs), _logprobs(b.logprobs))
            assert (a.cumulative_logprob is None) == (b.cumulative_logprob is None)
            if a.cumulative_logprob is not None:
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


def _logprobs(entries):
    """Logprob dicts as comparable values: (per position its token ids and ranks in order, every logprob)."""
    if entries is None:
        return None
    keys = [None if e is None else [(t, lp.rank) for t, lp in e.items()] for e in entries]
    return keys, [lp.logprob for e in entries if e is not None for lp in e.values()]


def same_logprobs(got, want):
    assert (got is None) == (want is None)
    if got is not None:
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-5)


def params_batch(reference):
    """Greedy and seeded sampled requests, n > 1, logprobs, prompt logprobs, stop ids and a stop string the greedy
    output meets."""
    [greedy] = reference.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = greedy.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop and stop in text
    return [SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
            SamplingParams(temperature=0.8, n=3, seed=4, max_tokens=8, logprobs=2, prompt_logprobs=1),
            SamplingParams(temperature=1.1, top_k=20, min_p=0.05, seed=9, max_tokens=7, stop_token_ids=[3],
                           repetition_penalty=1.2),
            SamplingParams(temperature=0.7, n=2, seed=11, max_tokens=10, stop=[stop], include_stop_str_in_output=True)]


def test_generate_equals_the_in_process_llm(reference, remote):
    assert remote.engine_process and remote.name == reference.name and remote.max_model_len == reference.max_model_len
    params = params_batch(reference)
    want = reference.generate(PROMPTS, params, use_tqdm=False)
    got = remote.generate(PROMPTS, params)   # (the progress bar too)
    same(got, want)
    assert want[0].outputs[0].finish_reason == "stop" and want[0].outputs[0].stop_reason == params[0].stop[0]
    assert len(got[1].outputs) == 3 and got[1].prompt_logprobs is not None
    again = remote.generate(PROMPTS, params, use_tqdm=False)   # (the same ids again: the core holds none of them)
    same(again, want)


class _Bar:
    """tqdm as LLM uses it, recorded (a bar on a terminal only: none under pytest)."""

    made: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.n, self.postfix = kwargs, 0, []
        _Bar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def update(self, k):
        self.n += k

    def set_postfix_str(self, text, refresh=True):
        self.postfix.append(text)


def test_the_progress_bar_counts_the_requests_and_the_core_s_steps(remote, monkeypatch):
    monkeypatch.setattr("treedec.llm.tqdm", _Bar)
    for _ in range(2):
        remote.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        bar = _Bar.made[-1]
        assert (bar.kwargs["total"], bar.kwargs["desc"], bar.kwargs["unit"], bar.n) == (4, "generate", "request", 4)
        steps = [int(text.split()[-1]) for text in bar.postfix]   # (this call's steps, not the core's since it began)
        assert steps and steps == sorted(steps) and 4 <= steps[-1] <= 8, bar.postfix


def test_chat_equals_the_in_process_llm(reference, remote):
    chats = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "name a colour"}]]
    for params in (SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.9, seed=2, n=2,
                                                                                max_tokens=8)):
        same(remote.chat(chats, params, use_tqdm=False), reference.chat(chats, params, use_tqdm=False))


def test_structured_outputs_equal_the_in_process_llm_and_a_bad_one_fails_alike(reference, remote):
    pytest.importorskip("xgrammar")
    from treedec.sampling.grammar import GrammarError
    params = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
                  choice=["yes", "no", "maybe not"])),
              SamplingParams(temperature=0.9, seed=3, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,4}-[a-z]{2}"))]
    got = remote.generate(PROMPTS[:2], params, use_tqdm=False)
    same(got, reference.generate(PROMPTS[:2], params, use_tqdm=False))
    assert got[0].outputs[0].text in ("yes", "no", "maybe not")
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(ab"))
    with pytest.raises(GrammarError) as want:
        reference.generate("hello", bad, use_tqdm=False)
    with pytest.raises(GrammarError) as got:
        remote.generate("hello", bad, use_tqdm=False)
    assert str(got.value) == str(want.value)


def test_beam_search_equals_the_in_process_llm(reference, remote):
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    prompts = ["The quick brown fox", [5, 6, 7, 8]]
    for got, want in zip(remote.beam_search(prompts, params), reference.beam_search(prompts, params)):
        assert len(got.sequences) == 3
        for a, b in zip(got.sequences, want.sequences):
            assert (a.tokens, a.text, a.finish_reason) == (b.tokens, b.text, b.finish_reason)
            assert (a.score, a.cum_logprob) == (pytest.approx(b.score, abs=1e-5), pytest.approx(b.cum_logprob,
                                                                                              abs=1e-4))


def test_no_prefix_cache_across_calls_unless_asked(reference, remote):
    prompt = {"prompt_token_ids": list(range(10, 40))}
    params = SamplingParams(temperature=0, max_tokens=4)
    for _ in range(2):
        got, want = remote.generate(prompt, params, use_tqdm=False), reference.generate(prompt, params,
                                                                                        use_tqdm=False)
        same(got, want)
        assert got[0].stats["cached_tokens"] == 0


def test_cached_tokens_equal_the_in_process_llm_with_prefix_caching(folder):
    reference = LLM(folder, enable_prefix_caching=True, **OPTIONS)
    with LLM(folder, engine_process=True, enable_prefix_caching=True, **OPTIONS) as remote:
        prefix = list(range(10, 42))
        params = SamplingParams(temperature=0, max_tokens=5)
        cached = []
        # (across calls: within one, the core admits a call's requests as they arrive, so which of two prompts
        # sharing a prefix reads it from the cache, and counts it, depends on their timing there)
        for prompts in ([{"prompt_token_ids": prefix}], [{"prompt_token_ids": prefix + [50, 51, 52]}, "hello"],
                        ["The quick brown fox jumps over the lazy dog"], ["The quick brown fox jumps over the fence"]):
            got, want = remote.generate(prompts, params, use_tqdm=False), reference.generate(prompts, params,
                                                                                             use_tqdm=False)
            same(got, want)
            cached.append([o.stats["cached_tokens"] for o in got])
        assert cached[0] == [0] and cached[1][0] >= 28 and cached[3][0] > 0, cached
        [got] = remote.generate({"prompt_token_ids": prefix + [60]}, params, use_tqdm=False)
        [want] = reference.generate({"prompt_token_ids": prefix + [60]}, params, use_tqdm=False)
        assert got.stats["cached_tokens"] == want.stats["cached_tokens"] >= 28
        same([got], [want])


def _bad_inputs():
    long = {"prompt_token_ids": [5] * 4000}
    return [
        ("out of vocabulary", [{"prompt_token_ids": [5, 6, 99999]}], SamplingParams(max_tokens=4), ValueError),
        ("past max_model_len", [long], SamplingParams(max_tokens=200), ValueError),
        ("logit_bias out of vocabulary", ["hello"], SamplingParams(max_tokens=4, logit_bias={70000: 1.0}),
         ValueError),
        ("a parameter count", ["a", "b"], [SamplingParams(max_tokens=4)] * 3, ValueError),
        ("not a SamplingParams", ["a"], [{"max_tokens": 4}], TypeError),
        ("not a prompt", [{"text": "a"}], SamplingParams(max_tokens=4), ValueError),
        ("no prompts", [], SamplingParams(max_tokens=4), ValueError),
    ]


@pytest.mark.parametrize("what, prompts, params, error", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_a_bad_request_raises_the_in_process_error_and_the_core_serves_the_next_call(reference, remote, what,
                                                                                     prompts, params, error):
    with pytest.raises(error) as want:
        reference.generate(prompts, params, use_tqdm=False)
    with pytest.raises(error) as got:
        remote.generate(prompts, params, use_tqdm=False)
    assert str(got.value) == str(want.value)
    good = SamplingParams(temperature=0, max_tokens=5)
    same(remote.generate(PROMPTS[:2], good, use_tqdm=False), reference.generate(PROMPTS[:2], good, use_tqdm=False))


def test_a_request_the_core_refuses_aborts_the_others_and_frees_their_pages(reference, remote):
    too_big = SamplingParams(temperature=0, n=64, max_tokens=1000, ignore_eos=True)   # (past the 2048-token pool)
    params = [SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True), too_big]
    with pytest.raises(PoolExhaustedError):
        reference.generate(PROMPTS[:2], params, use_tqdm=False)
    with pytest.raises(PoolExhaustedError, match="request '1'"):
        remote.generate(PROMPTS[:2], params, use_tqdm=False)
    report = remote._core.pages()
    assert report.idle and report.num_nodes == 0 and report.held_pages == 0 and report.invariants is None
    good = SamplingParams(temperature=0, max_tokens=5)
    same(remote.generate(PROMPTS[:2], good, use_tqdm=False), reference.generate(PROMPTS[:2], good, use_tqdm=False))


def test_ctrl_c_aborts_the_call_s_requests_and_the_core_serves_the_next_call(reference, remote):
    client = remote._core.client

    def interrupt_once_running():
        deadline = time.monotonic() + 60
        while (client.stats is None or client.stats.num_running == 0) and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)   # (the main thread waits in generate)

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        remote.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True), use_tqdm=False)
    report = remote._core.pages()
    assert report.idle and report.num_nodes == 0 and report.held_pages == 0
    good = SamplingParams(temperature=0, max_tokens=5)
    same(remote.generate(PROMPTS, good, use_tqdm=False), reference.generate(PROMPTS, good, use_tqdm=False))


def _double(token_ids, logits):   # (a logits processor a pickle carries: module-level)
    return logits


def test_what_the_core_process_cannot_carry_is_refused_by_name(folder, remote):
    with pytest.raises(ValueError, match="engine_process=True builds the model in the engine core's process"):
        LLM(tiny_model(), engine_process=True)
    with pytest.raises(TypeError, match="engine_process must be True or False"):
        LLM(folder, engine_process="yes")
    with pytest.raises(NotImplementedError, match=r"LLM.run\(programs\).*engine_process=False"):
        remote.run([GenerateProgram])
    for name in ("engine", "model", "prefix_cache", "drafts", "generator", "grammars"):
        with pytest.raises(AttributeError, match=f"has no {name} in this process.*engine_process=False"):
            getattr(remote, name)
    with pytest.raises(AttributeError, match="'LLM' object has no attribute 'nothing'"):
        remote.nothing
    constrained = BeamSearchParams(beam_width=2, max_tokens=4,
                                   structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="structured_outputs.*engine_process=False"):
        remote.beam_search(["hello"], constrained)
    with pytest.raises(ValueError, match="request '0': its logits_processors cannot be sent.*engine_process=False"):
        remote.generate("hello", SamplingParams(max_tokens=3, logits_processors=[lambda ids, logits: logits]),
                        use_tqdm=False)
    from treedec.serve import build_app
    with pytest.raises(ValueError, match="engine_process=False"):
        build_app(remote)
    [out] = remote.generate("hello", SamplingParams(temperature=0, max_tokens=3, logits_processors=[_double]),
                            use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_a_core_built_with_a_bad_argument_raises_the_in_process_error(folder):
    with pytest.raises(ValueError) as want:
        LLM(folder, **{**OPTIONS, "kv_tokens": 2048, "max_model_len": 10**6})
    with pytest.raises(ValueError) as got:   # (raised in the core's process, while it builds: its class and line)
        LLM(folder, engine_process=True, **{**OPTIONS, "kv_tokens": 2048, "max_model_len": 10**6})
    assert str(got.value) == str(want.value) and "max_model_len" in str(got.value)


def test_speculative_decoding_in_the_core_equals_the_in_process_llm(folder):
    config = {"method": "ngram", "num_speculative_tokens": 3}
    reference = LLM(folder, speculative_config=config, **OPTIONS)
    with LLM(folder, engine_process=True, speculative_config=config, **OPTIONS) as remote:
        params = [SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=0.8, seed=5, max_tokens=12)]
        prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}, "hello world, hello world"]
        same(remote.generate(prompts, params, use_tqdm=False), reference.generate(prompts, params, use_tqdm=False))
        with pytest.raises(ValueError, match="request '0': speculative decoding gives one output") as got:
            remote.generate("hi", SamplingParams(n=2, max_tokens=3), use_tqdm=False)
        with pytest.raises(ValueError) as want:
            reference.generate("hi", SamplingParams(n=2, max_tokens=3), use_tqdm=False)
        assert str(got.value) == str(want.value)
        with pytest.raises(ValueError, match="beam_search on a speculative LLM.*engine_process=False"):
            remote.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=3))


def test_a_killed_core_fails_the_waiting_generate_with_its_exit_code(folder):
    llm = LLM(folder, engine_process=True, **OPTIONS)
    pid, client = llm._core.pid, llm._core.client
    assert pid != os.getpid()

    def kill_once_running():
        deadline = time.monotonic() + 60
        while (client.stats is None or client.stats.num_running == 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_running, daemon=True)
    killer.start()
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=f"pid {pid}.*exit code -9"):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - started < 60
    killer.join(10)
    with pytest.raises(EngineDeadError, match="exit code -9"):   # (every later call)
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()   # (no hang)
    assert not client.process_handle.is_alive()


def test_shutdown_and_with_end_the_core_process(folder):
    with LLM(folder, engine_process=True, **OPTIONS) as llm:
        handle = llm._core.client.process_handle
        assert handle.is_alive()
        [out] = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3
    assert not handle.is_alive() and handle.exitcode == 0   # (ended by itself, told to)
    with pytest.raises(ProcessLookupError):
        os.kill(handle.pid, 0)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()   # (twice: nothing)


def test_the_interpreter_exit_ends_the_core_process(folder, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import weakref
        from treedec import LLM, SamplingParams

        class Marker:
            pass

        marker, handle = Marker(), []   # (an older finalizer than the LLM's: run after it at exit)
        weakref.finalize(marker, lambda: print("exit code", handle[0].exitcode, flush=True))
        if __name__ == "__main__":
            llm = LLM({folder!r}, engine_process=True, **{OPTIONS!r})
            handle.append(llm._core.client.process_handle)
            llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
            print(llm._core.pid, flush=True)   # (and exits without shutdown)
        """))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": root}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert time.monotonic() - started < 300
    pid, ended = result.stdout.split("\n")[-3:-1]
    assert ended == "exit code 0", result.stdout   # (told to end, not killed, before multiprocessing's own exit)
    pid = int(pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the engine core's process {pid} outlived its interpreter")
