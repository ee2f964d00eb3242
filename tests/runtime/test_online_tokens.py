"""Requests that stream token ids (``OnlineEngine.submit(stream_tokens=True)``, a server's engine core whose frontend
detokenizes): each step's new tokens reach the stream once per output, with their logprobs and each output's end, no
text is made, and a preempted request's tokens are not passed on twice."""
import threading

import pytest

from tests.engines import make_engine, tiny_model
from tests.programs.test_generate_batch import LetterTokenizer
from treedec.engine import Engine
from treedec.models.text import IncrementalDetokenizer
from treedec.programs.beam import BeamSearchParams
from treedec.programs.generate import GenerateProgram
from treedec.runtime.requests import RequestSpec
from treedec.runtime.scheduler import run_program
from treedec.runtime.streams import OutputStream, StreamFailure, StreamOutput, StreamTokens
from treedec.sampling.params import SamplingParams
from treedec.core.online_engine import OnlineEngine


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


class Collected:
    """A token stream's items, gathered on the engine's thread."""

    def __init__(self, rid):
        self.items, self.done = [], threading.Event()
        self.stream = OutputStream(None, rid, deliver=self.put)

    def put(self, item):
        self.items.append(item)
        if isinstance(item, StreamFailure) or isinstance(item, StreamOutput) and item.finished:
            self.done.set()

    def tokens(self):
        """Per output: its tokens joined, its logprobs joined, its end (once, on its last item)."""
        ids, logprobs, ends = {}, {}, {}
        for item in self.items:
            if isinstance(item, StreamTokens):
                assert item.index not in ends, f"output {item.index} streamed after its end"
                ids.setdefault(item.index, []).extend(item.token_ids)
                if item.logprobs is not None:
                    logprobs.setdefault(item.index, []).extend(item.logprobs)
                if item.end is not None:
                    ends[item.index] = item.end
        return ids, logprobs, ends

    @property
    def results(self):
        return next(item.results for item in self.items if isinstance(item, StreamOutput) and item.finished)


def run(engine, specs, tokenizer=None, **submit):
    with OnlineEngine(engine, tokenizer) as server:
        got = []
        for spec in specs:
            c = Collected(spec.id)
            server.submit(spec, stream=c.stream, stream_tokens=True, **submit)
            got.append(c)
        for c in got:
            assert c.done.wait(60)
        return got, server


def test_token_streams_join_to_the_outputs_with_their_logprobs_and_ends_and_make_no_text(tiny, monkeypatch):
    made = []
    init = IncrementalDetokenizer.__init__
    monkeypatch.setattr(IncrementalDetokenizer, "__init__", lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    tokenizer = LetterTokenizer()
    specs = [RequestSpec("g", prompt_ids=tokenizer.encode("HELLO"),
                         params=SamplingParams(max_tokens=9, temperature=0.0, logprobs=2, stop=("X",))),
             RequestSpec("s", prompt_ids=tokenizer.encode("WORLD"),
                         params=SamplingParams(max_tokens=7, temperature=1.0, seed=5, n=3, prompt_logprobs=1))]
    got, server = run(make_engine(tiny), specs, tokenizer)
    assert made == []   # (no detokenizer in the engine: its requests' stop strings are the caller's)
    for spec, c in zip(specs, got):
        ids, logprobs, ends = c.tokens()
        plain = spec.params.replace(stop=(), detokenize=False)
        want = run_program(make_engine(tiny), GenerateProgram(RequestSpec(spec.id, prompt_ids=spec.prompt_ids,
                                                                          params=plain), list(spec.prompt_ids)))
        assert [ids[r.index] for r in want] == [r.output_ids for r in want]
        assert [ends[r.index] for r in want] == [r.stop_reason for r in want]
        assert [r.text for r in c.results] == [None] * spec.params.n
        if spec.params.logprobs is not None:   # (the same run's: a batch's logits differ in their last bits)
            assert [logprobs[r.index] for r in c.results] == [r.logprobs for r in c.results]
            assert [list(map(list, e)) for e in logprobs.values()] == [list(map(list, r.logprobs)) for r in want]
        firsts = [item.prompt_logprobs for item in c.items if isinstance(item, StreamTokens)]
        if spec.params.prompt_logprobs is not None:   # (once, on the request's first item)
            assert firsts[0] == c.results[0].prompt_logprobs and all(p is None for p in firsts[1:])


def test_a_preempted_request_passes_each_token_on_once(tiny):
    engine = Engine(tiny, kv_tokens=96, page_size=4, backend="torch")
    specs = [RequestSpec(k, prompt_ids=list(range(k, k + 10)),
                         params=SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)) for k in range(4)]
    got, server = run(engine, specs)
    assert server.scheduler.stats.preemptions > 0
    for c in got:
        ids, _, ends = c.tokens()
        [result] = c.results
        assert ids[0] == result.output_ids and len(ids[0]) == 30 and ends == {0: "length"}


def test_a_beam_search_does_not_stream_token_ids(tiny):
    spec = RequestSpec("b", prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, temperature=0.0, n=2))
    with OnlineEngine(make_engine(tiny)) as server:
        with pytest.raises(ValueError, match="not a beam search"):
            server.submit(spec, beam=BeamSearchParams(beam_width=2, max_tokens=4), stream=Collected("b").stream,
                          stream_tokens=True)


@pytest.mark.parametrize("n", [1, 2])
def test_an_abort_keeping_outputs_offers_their_conversations_to_there(tiny, n):
    """``abort(request_id, kept={output: tokens})`` (a frontend's stop string ended them): each kept output's
    conversation to its kept tokens (the last one's K/V not kept) is in the prefix cache after, whole pages of
    it, and every page is accounted for."""
    from tests.runtime.test_online import all_free
    prompt = list(range(40, 56))
    spec = RequestSpec("k", prompt_ids=prompt, params=SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=n,
                                                                     ignore_eos=True))
    engine = make_engine(tiny)
    with OnlineEngine(engine) as server:
        seen, c = [], Collected("k")
        put = c.put

        def deliver(item):   # (on the engine's thread: the abort is drained at the next iteration)
            put(item)
            if isinstance(item, StreamTokens) and item.index == 0:
                seen.extend(item.token_ids)
                if len(seen) == 12:
                    server.abort("k", {0: 10})
        c.stream._deliver = deliver
        server.submit(spec, stream=c.stream, stream_tokens=True)
        assert c.done.wait(60) and isinstance(c.items[-1], StreamFailure)
        cache = server.scheduler.cache
        ids, _, _ = c.tokens()
        hit = cache.match(prompt + ids[0][:10] + [1, 2, 3])
        assert hit is not None and len(hit.tokens) == 4 * ((len(prompt) + 9) // 4)
        if n == 2:   # (an output not kept: its conversation not offered, only the prompt's pages shared)
            other = cache.match(prompt + ids[1][:10] + [1, 2, 3])
            assert other is None or len(other.tokens) <= len(prompt)
    assert all_free(engine, cache)


def test_many_token_streams_of_one_step_each_get_their_own_tokens(tiny):
    """A step's tokens go to each request's stream grouped by one sort over the whole step: with requests of mixed n
    and lengths submitted together (their lanes interleaved in the table), every output streams exactly its own
    tokens, in order, and its end once."""
    specs = [RequestSpec(f"m{k}", prompt_ids=list(range(3 + k, 9 + 2 * k)),
                         params=SamplingParams(max_tokens=4 + k % 5, temperature=1.0, seed=k, n=1 + k % 3,
                                               ignore_eos=True)) for k in range(12)]
    got, _ = run(make_engine(tiny), specs)
    for spec, c in zip(specs, got):
        ids, _, ends = c.tokens()
        assert sorted(ids) == list(range(spec.params.n)), spec.id
        assert [ids[r.index] for r in c.results] == [r.output_ids for r in c.results], spec.id
        assert all(len(ids[r.index]) == spec.params.max_tokens for r in c.results), spec.id
        assert ends == {i: "length" for i in range(spec.params.n)}, spec.id
