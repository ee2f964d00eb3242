"""The prefix cache across requests: what it stores and shares, what it matches, eviction, and outputs equal with
the cache on and off (online, multi-turn, under pool pressure, across runs)."""
import numpy as np
import pytest
import torch

from treedec.engine import Engine
from treedec.programs.generate import GenerateProgram
from treedec.runtime.online import OnlineScheduler
from treedec.runtime.prefix_cache import PrefixCache
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.runtime.scheduler import run_programs
from treedec.tree import PagedKVPool, SequenceTree
from treedec.errors import TreeError
from treedec.models import from_hf_model
from tests.engines import make_engine, tiny_hf_llama, tiny_model
from tests.programs.test_generate_batch import outputs


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def tokens(seed, n, vocab=200):
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def computed_root(tree, ids):
    """A root of computed tokens (as a prefilled prompt is, without running the model)."""
    node = tree.add_prompt(ids)
    tree.commit_step()
    return node


def bare_tree(pages=64, page_size=4):
    return SequenceTree(PagedKVPool(num_pages=pages, page_size=page_size, num_layers=1, num_kv_heads=1, head_dim=2,
                                    device="cpu", dtype=torch.float32))


# ---------------------------------------------------------------- the cache on its own


def test_offer_shares_whole_pages_and_match_stops_short_of_the_last_token():
    tree = bare_tree()
    cache = PrefixCache(tree)
    ids = tokens(0, 22)
    node = computed_root(tree, ids)
    assert cache.offer(node) == 20   # whole pages of 4: 5 of them, shared (no copy)
    assert cache.stats.copied_tokens == 0 and cache.num_pages == 5
    tree.check_invariants(held=cache.held())
    tree.prune(node)                 # the request ends: the cache keeps its pages
    assert tree.pool.num_pages - tree.pool.num_free_pages == 5
    hit = cache.match(ids[:20] + [7])
    assert hit.tokens == ids[:20]
    assert len(cache.match(ids[:20]).tokens) == 16          # short of the last token: one page less
    part = cache.match(ids[:9] + [1, 2, 3])                # inside the cached sequence: its own prefix, shared pages
    assert part.tokens == ids[:8] and np.array_equal(part.slots, hit.slots[:8])
    assert cache.match(tokens(1, 30)) is None
    assert cache.match(ids[:4]) is None                    # one page, but the prompt's last token is in it
    tree.check_invariants(held=cache.held())
    assert cache.clear() == 5 and tree.pool.num_free_pages == tree.pool.num_pages


def test_a_cached_prefix_becomes_a_shared_root_read_by_every_program_on_it():
    tree = bare_tree()
    cache = PrefixCache(tree)
    ids = tokens(2, 17)
    cache.offer(computed_root(tree, ids))
    tree.prune(tree.roots[0])
    entry = cache.match(ids)
    engine = type("E", (), {"tree": tree})()
    entry.acquire(engine)
    entry.acquire(engine)
    assert tree.roots == [entry.node] and tree.sequence(entry.node) == ids[:16]
    child = tree.branch(entry.node, [ids[16:] + [3]])[0]
    tree.commit_step()
    tree.check_invariants(held=cache.held())
    with pytest.raises(TreeError, match="whole pages"):
        tree.add_shared_root(ids[:6], entry.slots[:6])
    tree.prune(child)
    entry.leave(tree, retired=True)
    assert entry.node in tree
    entry.leave(tree, retired=True)
    assert entry.node is None and tree.num_nodes == 0 and cache.num_pages == 4


def test_eviction_is_least_recently_used_and_counts_only_pages_it_frees():
    tree = bare_tree()
    cache = PrefixCache(tree)
    a, b = tokens(3, 13), tokens(4, 9)
    for ids in (a, b):
        cache.offer(computed_root(tree, ids))
    live = computed_root(tree, tokens(5, 5))   # not cached
    for root in list(tree.roots):
        if root != live:
            tree.prune(root)
    assert cache.evictable_pages() == 5
    cache.match(a)                             # a is used again: b is the least recently used
    assert cache.evict(1) == 2 and cache.num_pages == 3
    assert cache.match(b) is None and len(cache.match(a).tokens) == 12
    entry = cache.match(a)
    entry.acquire(type("E", (), {"tree": tree})())
    assert cache.evictable_pages() == 0 and cache.evict(10) == 0   # read by a program: kept
    tree.check_invariants(held=cache.held())


def test_an_output_after_a_partial_prompt_page_is_copied_and_reads_back_equal(tiny):
    engine = make_engine(tiny)
    cache = PrefixCache(engine.tree, copy_reserve=0)
    ids = tokens(6, 10)
    prompt = engine.prefill(ids).node
    out = engine.tree.branch(prompt, [tokens(7, 9)])[0]
    engine.step()
    assert cache.offer(out) == 16   # 19 tokens: 2 whole prompt pages shared, the 3rd and 4th pages copied
    assert cache.stats.copied_tokens == 8
    entry = cache.match(ids + tokens(7, 9) + [1])
    src = np.concatenate([engine.tree.slots(prompt), engine.tree.slots(out)])[:16]
    for a, b in zip(engine.pool.gather(entry.slots), engine.pool.gather(src)):
        assert torch.equal(a, b)
    engine.tree.check_invariants(held=cache.held())


# ---------------------------------------------------------------- through the scheduler


def spec(i, ids, n=1, temperature=0.0, max_tokens=6, seed=None):
    return RequestSpec(i, prompt_ids=ids, params=SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens,
                                                                seed=seed))


def drive(engine, programs, prefix_cache=True, between=None):
    """Run ``programs`` online, one submitted per iteration; ``between(sched)`` after each iteration."""
    done = {}
    sched = OnlineScheduler(engine, on_done=done.__setitem__, on_error=lambda h, e: done.__setitem__(h, e),
                            prefix_cache=prefix_cache)
    handles, waiting = [], list(programs)
    while waiting or not sched.idle:
        if waiting:
            handles.append(sched.submit(waiting.pop(0)))
        sched.iterate()
        if between is not None:
            between(sched)
    return [done[h] for h in handles], sched


def conversation(model, turns, prefix_cache, ps=4, user=7, answer=9, engine=None, pipeline=False):
    """A chat whose every turn re-sends the whole conversation plus a new user message; returns each turn's
    results and cached prompt tokens."""
    engine = make_engine(model, page_size=ps) if engine is None else engine
    sched = OnlineScheduler(engine, on_done=lambda h, r: done.append(r), on_error=lambda h, e: done.append(e),
                            prefix_cache=prefix_cache, pipeline=pipeline)
    history, done, cached = tokens(8, 13), [], []
    for t in range(turns):
        history = history + tokens(100 + t, user)
        sched.submit(GenerateProgram(spec(t, history, max_tokens=answer), list(history)))
        while not sched.idle:
            sched.iterate()
        result = done[-1][0]
        cached.append(result.stats["cached_tokens"])
        history = history + result.output_ids
    return done, cached, sched


def test_a_multi_turn_conversation_reads_its_history_from_the_cache_with_equal_outputs(tiny):
    on, cached, sched = conversation(tiny, 5, True)
    off, none, _ = conversation(tiny, 5, False)
    assert [outputs(r) for r in on] == [outputs(r) for r in off] and none == [0] * 5
    assert cached[0] == 0
    for t in range(1, 5):   # all of the last turn's prompt and answer but its last token, in whole pages
        last = on[t - 1][0]
        offered = len(last.prompt_ids) + len(last.output_ids) - 1
        assert cached[t] == min(offered // 4, (len(on[t][0].prompt_ids) - 1) // 4) * 4
    stats = sched.stats
    assert stats.cached_tokens == sum(cached) and stats.prompt_tokens == sum(len(r[0].prompt_ids) for r in on)
    later = sum(cached[1:]) / sum(len(r[0].prompt_ids) for r in on[1:])
    assert later > 0.7, later
    sched.engine.tree.check_invariants(held=sched.cache.held())


def test_requests_with_a_common_prompt_share_it_while_running_and_after(tiny):
    system = tokens(9, 24)
    specs = [spec(i, system + tokens(20 + i, 3 + i), n=1 + i % 2, temperature=0.7 * (i % 2), seed=i)
             for i in range(6)]
    programs = lambda: [GenerateProgram(s, list(s.prompt_ids)) for s in specs]   # noqa: E731
    roots = []
    on, sched = drive(make_engine(tiny), programs(), between=lambda s: roots.append(s.engine.tree.num_nodes))
    off, _ = drive(make_engine(tiny), programs(), prefix_cache=False)
    assert [outputs(r) for r in on] == [outputs(r) for r in off]
    # (the first's prompt is offered once the step computing it is launched: the second, admitted next, reads it)
    assert [r[0].stats["cached_tokens"] for r in on] == [0] + [24] * 5
    assert sched.stats.cache_hit_rate == pytest.approx(120 / sum(len(s.prompt_ids) for s in specs))


def test_under_pool_pressure_the_cache_gives_its_pages_back_and_outputs_stay_equal(tiny):
    specs = [spec(i, tokens(30 + i // 3, 30) + tokens(40 + i, 5), max_tokens=8) for i in range(15)]
    small = lambda: Engine(tiny, kv_tokens=160, page_size=4, backend="torch")   # noqa: E731  (40 pages)
    checks = []

    def check(sched):
        sched.engine.tree.check_invariants(held=sched.cache.held())
        checks.append(sched.cache.num_pages)

    on, sched = drive(small(), [GenerateProgram(s, list(s.prompt_ids)) for s in specs], between=check)
    off, _ = drive(small(), [GenerateProgram(s, list(s.prompt_ids)) for s in specs], prefix_cache=False)
    assert not any(isinstance(r, Exception) for r in on)
    assert [outputs(r) for r in on] == [outputs(r) for r in off]
    assert sched.cache.stats.evicted_pages > 0 and sched.stats.cached_tokens > 0
    assert sched.engine.tree.num_nodes == 0
    sched.cache.clear()
    assert sched.engine.pool.num_free_pages == sched.engine.pool.num_pages


def test_run_programs_reads_a_cache_kept_across_runs(tiny):
    engine = make_engine(tiny)
    cache = PrefixCache(engine.tree)
    first = [spec(0, tokens(50, 21))]
    results, stats = run_programs(engine, [GenerateProgram(s, list(s.prompt_ids)) for s in first], prefix_cache=cache)
    follow = spec(1, list(first[0].prompt_ids) + results[0][0].output_ids + tokens(51, 4))
    again, stats = run_programs(engine, [GenerateProgram(follow, list(follow.prompt_ids))], prefix_cache=cache)
    alone, _ = run_programs(make_engine(tiny), [GenerateProgram(follow, list(follow.prompt_ids))])
    assert outputs(again[0]) == outputs(alone[0])
    assert stats.cached_tokens == again[0][0].stats["cached_tokens"] == (21 + 6 - 1) // 4 * 4
    with pytest.raises(ValueError, match="this engine's tree"):
        run_programs(make_engine(tiny), [GenerateProgram(follow, list(follow.prompt_ids))], prefix_cache=cache)


def test_a_batch_sharing_a_prefix_the_cache_holds_reads_it_from_the_cache(tiny):
    """run_programs' within-run sharing (one prefill of a prefix its programs share) gives way to the cache: a
    batch whose prompts share a prefix the cache holds reads it from there (#51: the same batch twice read nothing
    from the cache, cached tokens [0, 0, 0] both times, the in-run group computing the prefix again); outputs equal
    a run without the cache."""
    engine = make_engine(tiny)
    cache = PrefixCache(engine.tree)
    system = tokens(60, 24)
    batch = [spec(i, system + tokens(61 + i, 5)) for i in range(3)]

    def run(cache):
        return run_programs(engine if cache is not None else make_engine(tiny),
                            [GenerateProgram(s, list(s.prompt_ids)) for s in batch], prefix_cache=cache)
    first, _ = run(cache)
    again, stats = run(cache)
    plain, _ = run(None)
    assert [outputs(r) for r in again] == [outputs(r) for r in first] == [outputs(r) for r in plain]
    whole = (len(batch[0].prompt_ids) - 1) // 4 * 4   # (each prompt's own pages too, offered by the first run)
    assert [r[0].stats["cached_tokens"] for r in again] == [whole] * 3
    assert stats.cached_tokens == 3 * whole and stats.shared_prefix_tokens == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_graphed_gpu_engine_pipelined_a_conversation_equals_the_cache_off():
    """On a GPU (CUDA graphs, pipelined steps: the cache's copies are queued behind the step that computed the K/V):
    the conversation's outputs with the cache on equal those with it off, and the cache is read."""
    gpu = from_hf_model(tiny_hf_llama().cuda())   # fp32: equal tokens whatever the chunking
    runs = []
    for cache in (True, False):
        engine = Engine(gpu, kv_tokens=4096, page_size=16, cuda_graphs=True, backend="triton")   # (fp32: triton)
        runs.append(conversation(None, 5, cache, ps=16, user=7, answer=24, engine=engine, pipeline=True))
    (on, cached, sched), (off, _, _) = runs
    assert [outputs(r) for r in on] == [outputs(r) for r in off]
    assert sum(cached[1:]) > 0 and sched.cache.stats.copied_tokens > 0
    sched.engine.tree.check_invariants(held=sched.cache.held())


def test_a_burst_with_one_long_prompt_computes_it_once_and_outputs_stay_equal(tiny):
    """Requests queued together (a ToT problem's branches) whose prompts share a prefix the cache does not hold read
    one copy of it, prefilled once; an aborted member leaves the group; nothing lingers."""
    problem = tokens(60, 29)
    specs = [spec(i, problem + tokens(70 + i, 2 + i), n=1 + i % 2, temperature=0.6 * (i % 2), seed=i)
             for i in range(6)]
    engine = make_engine(tiny)
    done = {}
    sched = OnlineScheduler(engine, on_done=done.__setitem__, on_error=done.__setitem__)
    handles = [sched.submit(GenerateProgram(s, list(s.prompt_ids))) for s in specs]
    sched.iterate()
    sched.abort(handles[3])   # running on the group's prefix: it leaves the group
    while not sched.idle:
        sched.iterate()
    off, _ = drive(make_engine(tiny), [GenerateProgram(s, list(s.prompt_ids)) for s in specs], prefix_cache=False)
    kept = [i for i in range(6) if i != 3]
    assert [outputs(done[handles[i]]) for i in kept] == [outputs(off[i]) for i in kept]
    assert type(done[handles[3]]).__name__ == "ProgramAborted"
    assert sched.stats.shared_prefix_tokens == 28 * 5   # whole pages of the common 29 tokens, once for six
    assert sched.stats.prompt_steps == 1 and engine.tree.num_nodes == 0
    again = spec(9, problem + [5, 6, 7])   # later: the burst's prompts are cached
    handle = sched.submit(GenerateProgram(again, list(again.prompt_ids)))
    while not sched.idle:
        sched.iterate()
    assert done[handle][0].stats["cached_tokens"] == 28



def test_a_speculative_conversation_reads_the_cache_with_equal_tokens(tiny):
    """Speculative requests (n-gram drafts) read and fill the cache too: each turn's tokens equal the cache off, and
    every turn after the first reads all of the last one but its last token, in whole pages."""
    from treedec.programs.speculative.drafts import PromptLookupDraft
    from treedec.programs.speculative.program import SpeculativeProgram
    from treedec.sampling.stops import StopRule
    runs = []
    for cache in (True, False):
        done = []
        sched = OnlineScheduler(make_engine(tiny), on_done=lambda h, r: done.append(r),
                                on_error=lambda h, e: done.append(e), prefix_cache=cache)
        history, turns = tokens(80, 21), []
        for t in range(4):
            sched.submit(SpeculativeProgram(history, PromptLookupDraft(max_ngram=2, num_draft_tokens=3),
                                            StopRule(max_new_tokens=7)))
            while not sched.idle:
                sched.iterate()
            checker, stats = done[-1]
            turns.append((list(checker.token_ids), stats.cached_tokens, len(history)))
            history = history + checker.token_ids + tokens(90 + t, 5)
        runs.append(turns)
    on, off = runs
    assert [t[0] for t in on] == [t[0] for t in off] and all(t[1] == 0 for t in off)
    for (out, _, prompt), (_, cached, next_prompt) in zip(on, on[1:]):
        assert cached == min((prompt + len(out) - 1) // 4, (next_prompt - 1) // 4) * 4


def test_the_online_scheduler_takes_a_given_cache_of_its_engine(tiny):
    engine = make_engine(tiny)
    cache = PrefixCache(engine.tree)
    sched = OnlineScheduler(engine, on_error=lambda h, e: None, prefix_cache=cache)
    assert sched.cache is cache
    with pytest.raises(ValueError, match="this engine's tree"):
        OnlineScheduler(make_engine(tiny), on_error=lambda h, e: None, prefix_cache=cache)


def test_llm_with_the_cache_runs_every_round_that_fits_the_pool_with_its_pages_back(tiny):
    """#48 item 8: ``generate_batch``'s up-front check counts the pages the cache can evict as the pool's: a round
    whose worst case fits the pool runs (it was refused while cached pages held it: "the pool has 4 free"), with
    the outputs of the cache off; one larger than the whole pool is still refused before anything runs."""
    from treedec import LLM
    from treedec.errors import PoolExhaustedError

    def make(cache):
        return LLM(tiny, kv_tokens=256, page_size=4, backend="torch", enable_prefix_caching=cache)   # 64 pages

    on, off = make(True), make(False)
    rng, short = np.random.default_rng(0), 0
    for round in range(6):
        length = int(rng.integers(60, 150))
        prompts = [{"prompt_token_ids": tokens(100 * round + k, length)} for k in range(2 if length < 90 else 1)]
        params = SamplingParams(max_tokens=int(rng.integers(8, 40)), temperature=0.0)
        free = on.engine.pool.num_free_pages
        got = on.generate(prompts, params, use_tqdm=False)
        want = off.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], round
        short += on.engine.pool.pages_for(length) + on.engine.pool.pages_for(params.max_tokens) > free
    assert short >= 2 and on.prefix_cache.num_pages > 0 and on.prefix_cache.stats.evicted_pages > 0
    with pytest.raises(PoolExhaustedError, match="nothing was run"):
        on.generate({"prompt_token_ids": tokens(7, 200)}, SamplingParams(max_tokens=60), use_tqdm=False)
