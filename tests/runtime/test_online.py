"""The online scheduler and its driver: programs submitted and aborted while others run."""
import asyncio

import pytest

from treedec.programs.generate import GenerateProgram
from treedec.runtime.online import OnlineScheduler, ProgramAborted
from treedec.core.online_engine import OnlineEngine
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.runtime.scheduler import run_program, run_programs
from treedec.programs.speculative.drafts import PromptLookupDraft
from treedec.programs.speculative.program import SpeculativeProgram
from treedec.sampling.stops import StopRule
from tests.engines import make_engine, tiny_model
from treedec.engine import Engine
from tests.programs.test_generate_batch import LetterTokenizer, outputs, prompt


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def specs():
    return [RequestSpec(0, prompt_ids=prompt(0), params=SamplingParams(max_tokens=7, temperature=0.0)),
            RequestSpec(1, prompt_ids=prompt(1, 30), params=SamplingParams(max_tokens=9, temperature=1.0, seed=3, n=3)),
            RequestSpec(2, prompt_ids=prompt(2, 5), params=SamplingParams(max_tokens=6, temperature=0.8, top_k=40,
                                                                          seed=9, n=2)),
            RequestSpec(3, prompt_ids=prompt(3, 17), params=SamplingParams(max_tokens=8, temperature=0.0, n=2))]


def generate(spec):
    return GenerateProgram(spec, list(spec.prompt_ids))


def speculative():
    ids = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    return SpeculativeProgram(ids, PromptLookupDraft(max_ngram=2, num_draft_tokens=3), StopRule(max_new_tokens=10))


def same(result):
    """What must not depend on the other programs: the outputs (timings and step counts may)."""
    if isinstance(result, tuple):   # a SpeculativeProgram's (checker, stats)
        return result[0].token_ids, result[0].stop_reason
    return outputs(result)


class Recorder:
    def __init__(self):
        self.done, self.errors = {}, {}

    def on_done(self, handle, result):
        self.done[handle] = result

    def on_error(self, handle, error):
        self.errors[handle] = error


def all_free(engine, cache):
    """No node is left, only the prefix cache holds pages (the invariants hold with its holds), and clearing it
    frees every page."""
    if engine.tree.num_nodes:
        return False
    engine.tree.check_invariants(held=None if cache is None else cache.held())
    if cache is not None:
        cache.clear()
        assert cache.num_prefixes == 0 and not cache.held().any()
    return engine.pool.num_free_pages == engine.pool.num_pages


def online(engine, **kw):
    rec = Recorder()
    return OnlineScheduler(engine, on_done=rec.on_done, on_error=rec.on_error, **kw), rec


def test_programs_submitted_while_others_run_give_their_outputs_alone(tiny):
    alone = [same(run_program(make_engine(tiny), generate(s))) for s in specs()]
    alone.append(same(run_program(make_engine(tiny), speculative())))
    engine = make_engine(tiny)
    sched, rec = online(engine)
    handles = [sched.submit(generate(specs()[0])), sched.submit(speculative())]
    later = iter([generate(s) for s in specs()[1:]])
    iterations = 0
    while not sched.idle:
        sched.iterate()
        iterations += 1
        if iterations % 2 == 0:   # one more every other iteration, while the others run
            program = next(later, None)
            if program is not None:
                handles.append(sched.submit(program))
    assert not rec.errors and all_free(engine, sched.cache)
    got = [same(rec.done[h]) for h in handles]
    assert got[0] == alone[0] and got[1] == alone[-1] and got[2:] == alone[1:-1]
    assert sched.stats.steps > 0 and max(sched.stats.programs_per_step) > 1


def test_abort_of_a_queued_and_of_a_live_program_frees_their_pages(tiny):
    alone = [same(run_program(make_engine(tiny), generate(s))) for s in specs()]
    engine = make_engine(tiny)
    sched, rec = online(engine)
    handles = [sched.submit(generate(s)) for s in specs()]
    sched.iterate()
    sched.iterate()
    live = {lv.index for lv in sched._core.live}
    assert handles[1] in live
    sched.abort(handles[1])   # live: closed between iterations
    queued = sched.submit(generate(specs()[0]))
    sched.abort(queued)       # dropped before it is admitted
    while sched.iterate():
        pass
    assert isinstance(rec.errors[handles[1]], ProgramAborted) and isinstance(rec.errors[queued], ProgramAborted)
    assert set(rec.errors) == {handles[1], queued}
    assert [same(rec.done[h]) for h in (handles[0], handles[2], handles[3])] == [alone[0], alone[2], alone[3]]
    assert all_free(engine, sched.cache) and sched.idle
    sched.abort(handles[0])   # ended already: left as it ended
    sched.iterate()
    assert handles[0] not in rec.errors


def test_a_program_that_raises_fails_only_itself(tiny):
    def raising(ids, scores):
        raise RuntimeError("bad processor")

    alone = [same(run_program(make_engine(tiny), generate(s))) for s in specs()]
    bad = RequestSpec("bad", prompt_ids=prompt(5, 6),
                      params=SamplingParams(max_tokens=5, temperature=1.0, seed=1, logits_processors=[raising]))
    engine = make_engine(tiny)
    sched, rec = online(engine)
    handles = [sched.submit(generate(s)) for s in specs()[:2]] + [sched.submit(generate(bad))]
    handles += [sched.submit(generate(s)) for s in specs()[2:]]
    while sched.iterate():
        pass
    assert set(rec.errors) == {handles[2]} and "bad processor" in str(rec.errors[handles[2]])
    assert [same(rec.done[h]) for h in handles[:2] + handles[3:]] == alone
    assert all_free(engine, sched.cache)


def test_an_engine_step_failure_fails_every_live_program_and_frees_all(tiny, monkeypatch):
    engine = make_engine(tiny)
    sched, rec = online(engine)
    handles = [sched.submit(generate(s)) for s in specs()]
    sched.iterate()
    step, calls = engine.step, []

    def failing(*args, **kw):
        if not calls:
            calls.append(1)
            raise RuntimeError("device lost")
        return step(*args, **kw)

    monkeypatch.setattr(engine, "step", failing)
    live = [lv.index for lv in sched._core.live]
    assert sched.iterate() == bool(sched._core.queue)
    assert set(rec.errors) == set(live) and all("device lost" in str(e) for e in rec.errors.values())
    assert not sched._core.live
    while sched.iterate():   # the queued ones (if any) run afterwards
        pass
    assert set(rec.done) | set(rec.errors) == set(handles) and all_free(engine, sched.cache)
    late = sched.submit(generate(specs()[0]))   # the engine goes on
    while sched.iterate():
        pass
    assert same(rec.done[late]) == same(run_program(make_engine(tiny), generate(specs()[0])))


def test_on_error_is_required(tiny):
    with pytest.raises(TypeError, match="on_error"):
        OnlineScheduler(make_engine(tiny), on_error=None)


def test_submit_refuses_a_program_past_the_model_positions(tiny):
    sched, _ = online(make_engine(tiny))
    spec = RequestSpec("long", prompt_ids=prompt(0), params=SamplingParams(max_tokens=10 ** 6))
    with pytest.raises(ValueError, match="long"):
        sched.submit(generate(spec))
    assert sched.idle


def letter_spec(k, text="HELLO", max_tokens=10, **kw):
    return RequestSpec(k, prompt=text, params=SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **kw}))


async def collect(stream):
    """A stream's text deltas joined per output, and its results; each output's end comes once, before the results,
    with its stop reason and token ids."""
    deltas, final, ends = {}, None, {}
    async for out in stream:
        if out.finished:
            final = out.results
            assert ends == {r.index: (r.stop_reason, r.output_ids) for r in final}, (ends, final)
        else:
            assert out.index not in ends, f"output {out.index} streamed after its end"
            if out.text:
                deltas[out.index] = deltas.get(out.index, "") + out.text
            if out.ended:
                ends[out.index] = (out.stop_reason, out.token_ids)
    return deltas, final


def test_the_asyncio_driver_streams_deltas_that_join_to_the_final_text(tiny):
    tokenizer = LetterTokenizer()
    engine = make_engine(tiny)

    async def main():
        with OnlineEngine(engine, tokenizer) as server:
            servers.append(server)
            return await asyncio.gather(collect(server.submit(letter_spec("a"))),
                                        collect(server.submit(letter_spec("b", "WORLD", n=2, seed=4,
                                                                          temperature=1.0))))

    servers = []
    (deltas_a, final_a), (deltas_b, final_b) = asyncio.run(main())
    sched = servers[0].scheduler
    assert [r.text for r in final_a] == [deltas_a[0]] and [r.text for r in final_b] == [deltas_b[0], deltas_b[1]]
    reference = RequestSpec("a", prompt_ids=tokenizer.encode("HELLO"), params=SamplingParams(max_tokens=10,
                                                                                          temperature=0.0))
    assert final_a[0].output_ids == run_program(make_engine(tiny), generate(reference))[0].output_ids
    assert all_free(engine, sched.cache)


def test_fifty_concurrent_submissions_all_complete(tiny):
    engine = make_engine(tiny)

    async def main():
        with OnlineEngine(engine, LetterTokenizer()) as server:
            servers.append(server)
            streams = [server.submit(letter_spec(k, "ABCDEFG"[k % 7:] + "HI", max_tokens=3)) for k in range(50)]
            return await asyncio.gather(*map(collect, streams))

    servers = []
    results = asyncio.run(main())
    sched = servers[0].scheduler
    assert len(results) == 50 and all(final is not None and len(final) == 1 for _, final in results)
    assert [final[0].id for _, final in results] == list(range(50)) and all_free(engine, sched.cache)


def test_abort_and_shutdown_with_live_requests_free_everything(tiny):
    engine = make_engine(tiny)

    async def main():
        server = OnlineEngine(engine, LetterTokenizer())
        servers.append(server)
        aborted = server.submit(letter_spec("x", max_tokens=200))
        live = [server.submit(letter_spec(k, max_tokens=200)) for k in range(3)]
        first = await aborted.__anext__()   # it runs
        assert server.abort("x") and not server.abort("unknown")
        with pytest.raises(ProgramAborted):
            async for _ in aborted:
                pass
        await live[0].__anext__()
        server.shutdown(timeout=30)
        assert not server._thread.is_alive()
        for stream in live:
            with pytest.raises(ProgramAborted):
                async for _ in stream:
                    pass
        with pytest.raises(RuntimeError, match="shut down"):
            server.submit(letter_spec("late"))
        return first

    servers = []
    assert asyncio.run(main()).request_id == "x"
    sched = servers[0].scheduler
    assert all_free(engine, sched.cache)


def test_a_bad_request_raises_at_submit(tiny):
    engine = make_engine(tiny)

    async def main():
        with OnlineEngine(engine) as server:
            servers.append(server)
            with pytest.raises(ValueError, match="tokenizer"):
                server.submit(letter_spec("needs-a-tokenizer"))
            first = server.submit(RequestSpec(7, prompt_ids=prompt(0), params=SamplingParams(max_tokens=3)))
            with pytest.raises(ValueError, match="already running"):
                server.submit(RequestSpec(7, prompt_ids=prompt(1), params=SamplingParams(max_tokens=3)))
            return await collect(first)

    servers = []
    deltas, final = asyncio.run(main())
    sched = servers[0].scheduler
    assert deltas == {} and len(final[0].output_ids) == 3 and all_free(engine, sched.cache)


def test_a_speculative_online_engine_equals_plain_decoding_and_refuses_what_it_cannot_do(tiny):
    """With a draft source every request is decoded speculatively: greedy == plain greedy, the streamed deltas join
    to the final text, a seeded sampled request is the same twice; n > 1 and min_tokens are refused at submit."""
    engine = make_engine(tiny)
    drafts = lambda spec: PromptLookupDraft(max_ngram=2, num_draft_tokens=3)   # noqa: E731

    async def main():
        with OnlineEngine(engine, LetterTokenizer(), drafts=drafts) as server:
            servers.append(server)
            with pytest.raises(ValueError, match="n=1"):
                server.submit(letter_spec("n2", n=2))
            with pytest.raises(ValueError, match="speculative decoding does not implement"):
                server.submit(letter_spec("min-tokens", min_tokens=2))
            greedy = server.submit(letter_spec("g", "ABABABABAB", max_tokens=12))
            sampled = [server.submit(letter_spec(f"s{k}", "ABCABCABC", max_tokens=8, temperature=0.9, seed=3))
                       for k in range(2)]
            return await asyncio.gather(collect(greedy), *map(collect, sampled))

    servers = []
    (deltas, final), (_, one), (_, two) = asyncio.run(main())
    reference = RequestSpec("g", prompt_ids=LetterTokenizer().encode("ABABABABAB"),
                            params=SamplingParams(max_tokens=12, temperature=0.0))
    assert final[0].output_ids == run_program(make_engine(tiny), generate(reference))[0].output_ids
    assert deltas[0] == final[0].text and len(final[0].stats["accepted"]) == final[0].stats["steps"]
    assert one[0].output_ids == two[0].output_ids
    assert all_free(engine, servers[0].scheduler.cache)


def test_a_preempted_request_streams_each_character_once(tiny):
    """A pool too small for every request at once preempts some (run again from the start); their streams still
    join to their final texts (unseeded sampled requests get seeds, so a run again draws the same)."""
    engine = Engine(tiny, kv_tokens=96, page_size=4, backend="torch")

    async def main():
        with OnlineEngine(engine, LetterTokenizer()) as server:
            streams = [server.submit(letter_spec(k, "ABCDEFGHIJ", max_tokens=30, temperature=1.0, ignore_eos=True))
                       for k in range(4)]
            got = await asyncio.gather(*map(collect, streams))
            return got, server.scheduler

    got, scheduler = asyncio.run(main())
    preemptions = scheduler.stats.preemptions
    assert preemptions > 0
    for deltas, final in got:
        assert deltas[0] == final[0].text and len(final[0].output_ids) == 30
    assert all_free(engine, scheduler.cache)


def test_the_scheduler_keeps_only_the_last_history_steps(tiny):
    engine = make_engine(tiny)
    recorder = Recorder()
    scheduler = OnlineScheduler(engine, on_done=recorder.on_done, on_error=recorder.on_error, history=4)
    scheduler.submit(generate(RequestSpec(0, prompt_ids=prompt(0), params=SamplingParams(max_tokens=20,
                                                                                          temperature=0.0))))
    while scheduler.iterate():
        assert len(scheduler.stats.queries_per_step) < 8 and len(scheduler.stats.programs_per_step) < 8
    assert scheduler.stats.steps >= 20 and len(recorder.done) == 1 and all_free(engine, scheduler.cache)


def test_submit_refuses_at_once_a_request_larger_than_the_pool_can_give_it(tiny):
    """#48 item 1: a request whose worst case (prompt + n x max_tokens pages) exceeds what the pool can give one
    request is refused at submit (it was admitted and built its n outputs' state on the engine's thread, n=2**31
    wedging it), counting the pages a lent prefix cache holds as the pool's; one that fits only later waits."""
    import time
    from treedec.errors import PoolExhaustedError
    from treedec.runtime.prefix_cache import PrefixCache

    engine = make_engine(tiny)   # 1024 tokens: 256 pages of 4
    cache = PrefixCache(engine.tree)
    run_programs(engine, [generate(RequestSpec("c", prompt_ids=prompt(5, 40), params=SamplingParams(max_tokens=4)))],
                 prefix_cache=cache)
    assert cache.num_pages > 0

    async def main():
        with OnlineEngine(engine, prefix_cache=cache) as server:
            servers.append(server)
            assert server.scheduler.capacity == 256   # the cache's pages are the pool's: it evicts them
            started = time.perf_counter()
            for n, max_tokens in ((2 ** 31, 16), (70, 16), (1, 1100)):
                with pytest.raises(PoolExhaustedError, match="KV pages"):
                    server.submit(RequestSpec(f"big-{n}", prompt_ids=prompt(0, 8),
                                              params=SamplingParams(n=n, max_tokens=max_tokens)))
            assert time.perf_counter() - started < 1 and server.scheduler.idle and server.waiting_outputs == 0
            hold = server.submit(RequestSpec("hold", prompt_ids=prompt(1, 20), params=SamplingParams(
                n=4, max_tokens=200, ignore_eos=True)))   # 6 + 4 x 50 pages: most of the pool
            while server.scheduler.num_running == 0:
                await asyncio.sleep(0.01)
            fits = server.submit(RequestSpec("fits", prompt_ids=prompt(2, 20), params=SamplingParams(
                n=2, max_tokens=200, ignore_eos=True)))   # 106 pages: it waits for the first one's
            assert server.waiting_outputs == 2
            return await collect(hold), await collect(fits)

    servers = []
    (_, held), (_, fitted) = asyncio.run(main())
    assert [len(r.output_ids) for r in held] == [200] * 4 and [len(r.output_ids) for r in fitted] == [200] * 2
    assert servers[0].waiting_outputs == 0 and all_free(engine, cache)


def test_the_heartbeat_shows_an_iteration_running_long(tiny):
    """#48 item 1: ``iteration_seconds`` is how long the iteration running now has run (a server's /health reports
    an engine stuck in one as stalled), 0 between iterations."""
    import threading
    import time

    release = threading.Event()

    def stuck(input_ids, scores):   # a step that hangs until released
        release.wait(30)
        return scores

    engine = make_engine(tiny)
    seen, servers = [], []

    async def main():
        with OnlineEngine(engine) as server:
            servers.append(server)
            seen.append(server.iteration_seconds)
            stream = server.submit(RequestSpec("stuck", prompt_ids=prompt(0, 8), params=SamplingParams(
                max_tokens=2, temperature=0.0, logits_processors=(stuck,))))
            deadline = time.monotonic() + 10
            while server.iteration_seconds < 0.3 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            seen.append(server.iteration_seconds)
            release.set()
            _, final = await collect(stream)
            seen.append(server.iteration_seconds)
            return final

    final = asyncio.run(main())
    assert len(final[0].output_ids) == 2
    assert seen[0] == 0.0 and seen[1] >= 0.3 and seen[2] < 0.3
    assert all_free(engine, servers[0].scheduler.cache)


def test_between_iterations_waits_for_the_running_iteration_and_holds_the_next(tiny):
    """A reader on another thread (a pages report's invariant check) gets the tree between two iterations: it waits
    for the one running now to end, and no iteration starts while it holds (an idle scheduler's last iteration may
    still be freeing the tree: reading it then saw a half-freed preorder)."""
    import threading
    import time

    release = threading.Event()

    def stuck(input_ids, scores):   # the first step hangs until released
        release.wait(30)
        return scores

    engine = make_engine(tiny)
    seen, servers = {}, []

    def reader(server):
        with server.between_iterations():
            seen["running"] = server.iteration_seconds
            steps = server.scheduler.stats.steps
            time.sleep(0.3)   # held: the program's next steps wait
            seen["steps"] = (steps, server.scheduler.stats.steps)

    async def main():
        with OnlineEngine(engine) as server:
            servers.append(server)
            stream = server.submit(RequestSpec("stuck", prompt_ids=prompt(0, 8), params=SamplingParams(
                max_tokens=3, temperature=0.0, logits_processors=(stuck,))))
            deadline = time.monotonic() + 10
            while server.iteration_seconds == 0.0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            thread = threading.Thread(target=reader, args=(server,))
            thread.start()
            await asyncio.sleep(0.2)
            assert "running" not in seen   # (still waiting for the stuck iteration)
            release.set()
            _, final = await collect(stream)
            thread.join(10)
            return final

    final = asyncio.run(main())
    assert len(final[0].output_ids) == 3
    assert seen["running"] == 0.0 and seen["steps"][0] == seen["steps"][1]
    assert all_free(engine, servers[0].scheduler.cache)
