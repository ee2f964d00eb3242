"""The online engine's speculative requests, pipelined in the scheduler's verify table as offline: their tokens equal
the offline batch's and plain greedy decoding's (Medusa heads and fixed trees pipelined, n-gram drafts not), their
streamed deltas join to their texts, stop strings cut them, and submits and aborts under load, preemption and the
prefix cache leave no page behind."""
import asyncio

import numpy as np
import pytest
import torch

from treedec.engine import Engine
from treedec.programs.generate import generate_batch
from treedec.programs.speculative.batch import speculative_batch
from treedec.programs.speculative.drafts import PromptLookupDraft, TreeDraft
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.programs.speculative.verify_table import VerifyTable
from treedec.runtime.online import ProgramAborted
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.core.online_engine import OnlineEngine
from treedec.tree.token_tree import TokenTree
from tests.programs.speculative.test_pipeline import permutation_target
from tests.programs.test_generate_batch import LetterTokenizer
from tests.runtime.test_online import all_free, collect

CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


@pytest.fixture(scope="module")
def permutation():
    return permutation_target("cpu", torch.float32)


def drafts_of(kind, heads):
    """Each request's draft source of ``kind``, and whether it runs pipelined."""
    if kind == "medusa":
        return (lambda spec: MedusaDraft(heads, CHOICES)), True
    if kind == "tree":
        tree = TokenTree.from_medusa_choices(CHOICES)
        return (lambda spec: TreeDraft(tree, [(7 * i) % 500 for i in range(1, tree.size)])), True
    return (lambda spec: PromptLookupDraft(max_ngram=2, num_draft_tokens=3)), False


def requests(count, seed=0, **params):
    rng = np.random.default_rng(seed)
    return [RequestSpec(k, prompt_ids=tuple(rng.integers(0, 512, 4 + 3 * (k % 5)).tolist()),
                        params=SamplingParams(**{"max_tokens": 5 + (3 * k) % 11, "temperature": 0.0, **params}))
            for k in range(count)]


def engine_of(model, kv_tokens=16384):
    return Engine(model, kv_tokens=kv_tokens, page_size=4, backend="torch")


def serve(engine, specs, drafts, pipeline, abort=(), **kw):
    """Submit ``specs`` at once to an OnlineEngine over ``engine``; abort the ids in ``abort`` after their first text;
    ``{id: (deltas, results) or the error}`` and the engine."""
    async def main():
        with OnlineEngine(engine, LetterTokenizer(), drafts=drafts, pipeline=pipeline, max_draft_tokens=16,
                          **kw) as server:
            servers.append(server)

            async def one(spec):
                stream = server.submit(spec)
                if spec.id not in abort:
                    return await collect(stream)
                try:
                    async for out in stream:
                        if out.text:
                            server.abort(spec.id)
                except ProgramAborted as error:
                    return error
                return "not aborted"
            return dict(zip([s.id for s in specs], await asyncio.gather(*map(one, specs))))

    servers = []
    return asyncio.run(main()), servers[0]


@pytest.mark.parametrize("kind", ["medusa", "tree", "ngram"])
def test_online_speculative_requests_equal_the_offline_batch_and_plain_greedy(permutation, kind):
    model, heads, _ = permutation
    drafts, pipelined = drafts_of(kind, heads)
    specs = requests(10)
    plain, _ = generate_batch(engine_of(model), specs)
    offline, _ = speculative_batch(engine_of(model), specs, drafts, tokenizer=LetterTokenizer(), pipeline=pipelined,
                                   max_draft_tokens=16)
    engine = engine_of(model)
    got, server = serve(engine, specs, drafts, pipelined or None)
    for p, o in zip(plain, offline):
        deltas, [r] = got[p.id]
        assert r.output_ids == o.output_ids == p.output_ids and r.stop_reason == o.stop_reason == p.stop_reason
        assert deltas.get(0, "") == r.text == o.text
        assert r.stats["pipelined"] == pipelined and r.stats["accepted"] == o.stats["accepted"]
    assert all_free(engine, server.scheduler.cache)


def test_online_sampled_speculative_requests_are_seeded_and_batch_independent(permutation):
    """Rejection sampling online (pipelined) draws a seeded request's tokens as offline, alone or with others."""
    model, heads, _ = permutation
    drafts, _ = drafts_of("medusa", heads)
    specs = requests(6, temperature=0.8, top_p=0.9, seed=11)
    specs = [RequestSpec(s.id, prompt_ids=s.prompt_ids, params=s.params.replace(seed=100 + s.id)) for s in specs]
    together, _ = serve(engine_of(model), specs, drafts, True)
    alone, _ = serve(engine_of(model), specs[2:3], drafts, True)
    assert together[2][1][0].output_ids == alone[2][1][0].output_ids
    from treedec.programs.speculative.batch import sampled_acceptance
    offline, _ = speculative_batch(engine_of(model), specs, drafts, tokenizer=LetterTokenizer(), pipeline=True,
                                   max_draft_tokens=16, acceptance=lambda spec: sampled_acceptance(
                                       spec, lambda s: s.params.seed))
    assert [together[o.id][1][0].output_ids for o in offline] == [o.output_ids for o in offline]


def test_stop_strings_and_stop_ids_cut_online_pipelined_requests_as_plain_decoding(permutation):
    model, heads, perm = permutation
    drafts, _ = drafts_of("medusa", heads)
    base = requests(6, max_tokens=14)
    plain, _ = generate_batch(engine_of(model), base, tokenizer=LetterTokenizer())
    tok = LetterTokenizer()
    specs = []
    for spec, p in zip(base, plain):
        cut = p.output_ids[5:7]
        extra = {"stop": (tok.decode(cut),)} if spec.id % 2 else {"stop_token_ids": (p.output_ids[4],)}
        specs.append(RequestSpec(spec.id, prompt_ids=spec.prompt_ids, params=spec.params.replace(**extra)))
    want, _ = generate_batch(engine_of(model), specs, tokenizer=tok)
    engine = engine_of(model)
    got, server = serve(engine, specs, drafts, True)
    for w in want:
        deltas, [r] = got[w.id]
        assert (r.output_ids, r.text, r.stop_reason) == (w.output_ids, w.text, w.stop_reason)
        assert deltas.get(0, "") == r.text   # (streamed, then its end: one text)
    assert all_free(engine, server.scheduler.cache)


def test_aborts_under_load_mid_verify_free_every_page_and_the_others_go_on(permutation):
    model, heads, _ = permutation
    drafts, _ = drafts_of("medusa", heads)
    specs = requests(16, max_tokens=30)
    plain, _ = generate_batch(engine_of(model), specs)
    engine = engine_of(model)
    aborted = {1, 4, 5, 9, 14}
    got, server = serve(engine, specs, drafts, True, abort=aborted)
    for p in plain:
        if p.id in aborted:
            assert isinstance(got[p.id], ProgramAborted)
        else:
            assert got[p.id][1][0].output_ids == p.output_ids
    assert VerifyTable in server.scheduler._core.tables and server.scheduler._core.tables[VerifyTable].size == 0
    assert all_free(engine, server.scheduler.cache)


def test_preempted_pipelined_requests_run_again_and_stream_each_character_once(permutation):
    """A pool too small for every request's trees at once: requests wait and the newest are preempted (run again from
    their start); their streams still join to their texts, their tokens are plain greedy's, every page is freed."""
    model, heads, _ = permutation
    drafts, _ = drafts_of("medusa", heads)
    specs = requests(8, max_tokens=24)
    plain, _ = generate_batch(engine_of(model), specs, tokenizer=LetterTokenizer())
    engine = engine_of(model, kv_tokens=96)
    got, server = serve(engine, specs, drafts, True, prefix_cache=False)
    for p in plain:
        deltas, [r] = got[p.id]
        assert r.output_ids == p.output_ids and deltas[0] == r.text == p.text
    assert server.scheduler.stats.preemptions > 0
    assert all_free(engine, None)


def test_the_prefix_cache_serves_online_pipelined_requests(permutation):
    """A request again after the same prompt reads it from the prefix cache (and a conversation's continuation, its
    output too); the tokens are the same."""
    model, heads, _ = permutation
    drafts, _ = drafts_of("medusa", heads)
    engine = engine_of(model)
    prompt = tuple(range(40, 72))
    first = [RequestSpec("a", prompt_ids=prompt, params=SamplingParams(max_tokens=8, temperature=0.0))]
    again = [RequestSpec("b", prompt_ids=prompt, params=SamplingParams(max_tokens=8, temperature=0.0))]

    async def main():
        with OnlineEngine(engine, LetterTokenizer(), drafts=drafts, pipeline=True, max_draft_tokens=16) as server:
            servers.append(server)
            one = await collect(server.submit(first[0]))
            two = await collect(server.submit(again[0]))
            return one, two

    servers = []
    (_, [one]), (_, [two]) = asyncio.run(main())
    assert one.output_ids == two.output_ids and two.stats["cached_tokens"] >= 28 and two.stats["pipelined"]
    assert all_free(engine, servers[0].scheduler.cache)


def test_pipeline_true_refuses_a_draft_that_cannot_run_pipelined_at_submit(permutation):
    model, _, _ = permutation
    engine = engine_of(model)

    async def main():
        with OnlineEngine(engine, LetterTokenizer(), drafts=lambda spec: PromptLookupDraft(), pipeline=True) as server:
            with pytest.raises(ValueError, match="cannot run pipelined.*no fixed tree"):
                server.submit(requests(1)[0])
    asyncio.run(main())
    with pytest.raises(ValueError, match="pipeline must be None, True or False"):
        OnlineEngine(engine, pipeline="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_online_speculative_requests_pipeline_by_default_on_a_gpu(cuda_graphs):
    """On a GPU the online engine pipelines Medusa requests by default (pipeline=None), 32 at once, with aborts mid-run:
    the others' tokens are plain greedy's, every page is freed."""
    model, heads, _ = permutation_target("cuda", torch.float32)
    drafts, _ = drafts_of("medusa", heads)
    specs = requests(32, max_tokens=40)
    plain, _ = generate_batch(Engine(model, kv_tokens=16384, page_size=16, backend="triton"), specs)   # (fp32)
    engine = Engine(model, kv_tokens=16384, page_size=16, cuda_graphs=cuda_graphs, backend="triton")
    aborted = {3, 17, 30}
    got, server = serve(engine, specs, drafts, None, abort=aborted)
    for p in plain:
        if p.id in aborted:
            assert isinstance(got[p.id], ProgramAborted)
        else:
            assert got[p.id][1][0].output_ids == p.output_ids and got[p.id][1][0].stats["pipelined"]
    assert all_free(engine, server.scheduler.cache)


@pytest.mark.parametrize("kind", ["medusa", "ngram"])
def test_speculative_token_streams_carry_each_steps_accepted_run_and_make_no_text(permutation, kind):
    """``stream_tokens=True`` (a server's engine core): each verification step's accepted tokens go on at once (several
    a step), joining to plain greedy's ids, with the output's end once, its steps' draft accounting (the offline
    batch's) and its logprobs (unpipelined: the target's, as offline); no text is made and no stop string checked
    (the frontend's), so a request with one runs to its length in the core; a preempted run passes each token once."""
    from tests.runtime.test_online_tokens import Collected
    model, heads, _ = permutation
    drafts, pipelined = drafts_of(kind, heads)
    extra = {} if pipelined else {"logprobs": 2}
    specs = [RequestSpec(s.id, prompt_ids=s.prompt_ids, params=s.params.replace(stop=("zz",), **extra))
             for s in requests(8, max_tokens=24, ignore_eos=True)]
    unstopped = [RequestSpec(s.id, prompt_ids=s.prompt_ids, params=s.params.replace(stop=())) for s in specs]
    plain, _ = generate_batch(engine_of(model), unstopped)
    offline, _ = speculative_batch(engine_of(model), unstopped, drafts, pipeline=pipelined, max_draft_tokens=16)
    for kv_tokens in (16384, 96):   # (96: requests wait and are preempted, run again from their start)
        engine = engine_of(model, kv_tokens)
        with OnlineEngine(engine, LetterTokenizer(), drafts=drafts, pipeline=pipelined or None, max_draft_tokens=16,
                          prefix_cache=False) as server:
            got = []
            for spec in specs:
                c = Collected(spec.id)
                server.submit(spec, stream=c.stream, stream_tokens=True)
                got.append(c)
            assert all(c.done.wait(120) for c in got)
            for c, p, o in zip(got, plain, offline):
                ids, logprobs, ends = c.tokens()
                items = [i for i in c.items if type(i).__name__ == "StreamTokens"]
                assert ids[0] == p.output_ids == o.output_ids and ends == {0: "length"}
                assert c.results[0].text is None
                if kv_tokens > 96:
                    assert [a for i in items for a in i.accepted] == o.stats["accepted"]
                    assert [a for i in items for a in i.draft_sizes] == o.stats["draft_sizes"]
                if extra:
                    assert [list(e) for e in logprobs[0]] == [list(e) for e in o.logprobs]
            assert any(len(i.token_ids) > 1 for c in got for i in c.items if type(i).__name__ == "StreamTokens")
            if kv_tokens == 96:
                assert server.scheduler.stats.preemptions > 0
        assert all_free(engine, None)


@pytest.mark.parametrize("kind", ["medusa", "ngram"])
def test_an_abort_keeping_a_speculative_output_offers_its_conversation_to_there(permutation, kind):
    """``abort(request_id, kept={0: tokens})`` (a frontend's stop string ended it there), pipelined or not: the
    conversation to the kept tokens is in the prefix cache after (whole pages), every page accounted for."""
    from tests.runtime.test_online_tokens import Collected
    from treedec.runtime.streams import StreamFailure, StreamTokens
    model, heads, _ = permutation
    drafts, pipelined = drafts_of(kind, heads)
    prompt = list(range(40, 56))
    engine = engine_of(model)
    with OnlineEngine(engine, drafts=drafts, pipeline=pipelined or None, max_draft_tokens=16) as server:
        seen, c = [], Collected("k")
        put = c.put

        def deliver(item):   # (on the engine's thread: the abort is drained at the next iteration)
            put(item)
            if isinstance(item, StreamTokens):
                seen.extend(item.token_ids)
                if len(seen) >= 12 and len(seen) - len(item.token_ids) < 12:
                    server.abort("k", {0: 10})
        c.stream._deliver = deliver
        server.submit(RequestSpec("k", prompt_ids=prompt, params=SamplingParams(max_tokens=60, temperature=0.0,
                                                                                ignore_eos=True)),
                      stream=c.stream, stream_tokens=True)
        assert c.done.wait(60) and isinstance(c.items[-1], StreamFailure)
        cache = server.scheduler.cache
        hit = cache.match(prompt + seen[:10] + [1, 2, 3])
        assert hit is not None and len(hit.tokens) == 4 * ((len(prompt) + 9) // 4)
    assert all_free(engine, cache)
