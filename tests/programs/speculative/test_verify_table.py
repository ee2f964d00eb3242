"""Batched pipelined verification (treedec.programs.speculative.verify_table): a batch's requests verified, accepted,
their K/V moved and their next trees drafted as one operation per group a step give each request the tokens,
stop reasons, texts and stats it gets alone and unpipelined, at 1, 4 and 32 requests ending at different steps
(max_tokens, EOS ids, stop strings), for Medusa heads, fixed-token trees and EAGLE chains; rejection sampling's
seeded tokens do not depend on the batch; pool pressure (waits, preemptions) and an abort mid-run free every page."""
import numpy as np
import pytest
import torch

from treedec.engine import Engine
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.acceptance import RejectionSampling
from treedec.programs.speculative.batch import speculative_batch
from treedec.programs.speculative.draft_budget import DraftBudget
from treedec.programs.speculative.drafts import TreeDraft
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.programs.speculative.program import SpeculativeProgram
from treedec.programs.speculative.verify_table import VerifyTable
from treedec.runtime.online import OnlineScheduler, ProgramAborted
from treedec.runtime.requests import RequestSpec
from treedec.runtime.scheduler import run_program
from treedec.sampling.params import SamplingParams
from treedec.sampling.stops import StopRule
from treedec.tree.token_tree import TokenTree
from tests.programs.speculative import test_eagle
from tests.programs.speculative.test_eagle import bigram_eagle, engine as eagle_engine
from tests.programs.speculative.test_pipeline import permutation_target
from tests.programs.test_generate_batch import LetterTokenizer

bigram = test_eagle.bigram   # (the fixture)
CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


@pytest.fixture(scope="module")
def permutation():
    return permutation_target("cpu", torch.float32)


def chain(perm, prompt, n):
    """The permutation target's greedy continuation of ``prompt``."""
    out = [int(perm[prompt[-1]])]
    while len(out) < n:
        out.append(int(perm[out[-1]]))
    return out


def mixed_requests(count, perm=None, vocab=512, seed=0):
    """``count`` requests of various prompts ending at different steps: max_tokens, and (with ``perm``, whose
    continuations are known) an EOS id or a stop string inside the continuation for some."""
    rng = np.random.default_rng(seed)
    tokenizer = LetterTokenizer()
    out = []
    for k in range(count):
        prompt = rng.integers(0, vocab, 5 + 3 * (k % 7)).tolist()
        params = dict(max_tokens=4 + (5 * k) % 17, temperature=0.0)
        if perm is not None:
            want = chain(perm, prompt, params["max_tokens"])
            if k % 3 == 1:
                params["stop_token_ids"] = (want[(k * 7) % len(want)],)
            elif k % 3 == 2 and len(want) > 3:
                params["stop"] = (tokenizer.decode(want[2:4]),)
        out.append(RequestSpec(k, prompt_ids=tuple(prompt), params=SamplingParams(**params)))
    return out


def outcome(result):
    return (result.output_ids, result.stop_reason, result.text, result.stats["accepted"],
            result.stats["draft_sizes"], result.stats["steps"])


def run(model, specs, draft, pipeline, acceptance=None, kv_tokens=16384, page_size=4, **kw):
    engine = Engine(model, kv_tokens=kv_tokens, page_size=page_size, backend="torch")
    results, stats = speculative_batch(engine, specs, draft, tokenizer=LetterTokenizer(), pipeline=pipeline,
                                       acceptance=acceptance, max_draft_tokens=16, **kw)
    assert all(r.stats["pipelined"] == pipeline for r in results)
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
    return results, stats


def batched_alone_unpipelined(model, specs, draft, acceptance=None):
    batched, stats = run(model, specs, draft, True, acceptance)
    alone = [run(model, [spec], draft, True, acceptance)[0][0] for spec in specs]
    eager, _ = run(model, specs, draft, False, acceptance)
    for b, a, e in zip(batched, alone, eager):
        assert outcome(b) == outcome(a) == outcome(e), b.id
    return batched, stats


SIZES = [1, 4, pytest.param(32, marks=pytest.mark.slow)]


@pytest.mark.parametrize("count", SIZES)
def test_medusa_batched_equals_alone_and_unpipelined(permutation, count):
    model, heads, perm = permutation
    specs = mixed_requests(count, perm)
    results, stats = batched_alone_unpipelined(model, specs, lambda spec: MedusaDraft(heads, CHOICES))
    for r, spec in zip(results, specs):
        assert r.output_ids == chain(perm, list(spec.prompt_ids), spec.params.max_tokens)[:len(r.output_ids)]
    reasons = {r.stop_reason for r in results}
    assert count < 4 or {"length", "eos", "stop_string"} <= reasons
    assert count < 32 or max(stats.programs_per_step) == 32 and len({len(r.stats["accepted"]) for r in results}) > 3
    assert count < 4 or len({a for r in results for a in r.stats["accepted"]}) > 1   # accepted lengths vary


@pytest.mark.parametrize("count", SIZES)
def test_fixed_token_trees_batched_equal_alone_and_unpipelined(permutation, count):
    """TreeDraft of fixed tokens, each request its own (some of its continuation's: some steps accept)."""
    model, _, perm = permutation
    specs = mixed_requests(count, perm, seed=1)
    tree = TokenTree.from_medusa_choices(CHOICES)

    def draft(spec):
        want = chain(perm, list(spec.prompt_ids), 12)
        return TreeDraft(tree, [want[(i * 5 + spec.id) % 12] for i in range(tree.size - 1)])
    results, _ = batched_alone_unpipelined(model, specs, draft)
    for r, spec in zip(results, specs):
        assert r.output_ids == chain(perm, list(spec.prompt_ids), spec.params.max_tokens)[:len(r.output_ids)]


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 4, 32])
def test_eagle_chains_batched_equal_alone_unpipelined_and_greedy(bigram, count):
    specs = mixed_requests(count, vocab=bigram.config.vocab_size, seed=2)
    drafter = eagle_engine(bigram_eagle(bigram))

    def draft(spec):
        return EagleDraft(drafter, depth=3, top_k=2, tree="chains")
    results, _ = batched_alone_unpipelined(bigram, specs, draft)
    for r, spec in zip(results, specs):
        want = greedy_generate(eagle_engine(bigram), spec.prompt_ids, spec.params.max_tokens, eos_token_id=None)
        assert r.output_ids == want[:len(r.output_ids)]
    assert drafter.tree.num_nodes == 0 and drafter.pool.num_free_pages == drafter.pool.num_pages


def test_seeded_rejection_sampling_does_not_depend_on_the_batch(permutation):
    """Each request's tokens alone == in a batch == in another batch (other requests, another order) ==
    unpipelined: its random numbers are its seed's and its steps'."""
    model, heads, _ = permutation
    specs = [RequestSpec(k, prompt_ids=tuple(range(3 + k, 12 + 2 * k)),
                         params=SamplingParams(max_tokens=6 + 3 * k, temperature=0.8, seed=100 + k)) for k in range(4)]

    def acceptance(spec):
        return RejectionSampling(temperature=spec.params.temperature, seed=spec.params.seed)

    def draft(spec):
        return MedusaDraft(heads, CHOICES)
    batched, _ = batched_alone_unpipelined(model, specs, draft, acceptance)
    others, _ = run(model, specs[::-2] + [RequestSpec(9, prompt_ids=(1, 2, 3), params=specs[0].params)], draft, True,
                    acceptance)
    mine = {r.id: outcome(r) for r in batched}
    assert all(outcome(r) == mine[r.id] for r in others if r.id != 9)
    assert len({tuple(r.output_ids) for r in batched}) == len(batched)


def test_a_negative_seed_draws_as_its_unsigned_word(permutation):
    """SamplingParams' seeds are int64 (vLLM's): a negative one runs batched, pipelined and not, and draws the numbers
    of its unsigned 64-bit word (it overflowed the rule's int64 seed column, crashing the request)."""
    model, heads, _ = permutation
    spec = RequestSpec(0, prompt_ids=tuple(range(3, 12)), params=SamplingParams(max_tokens=9, temperature=0.8,
                                                                               seed=-5))

    def draft(spec):
        return MedusaDraft(heads, CHOICES)
    results = {}
    for seed in (-5, 2**64 - 5):
        rule = lambda s, seed=seed: RejectionSampling(temperature=0.8, seed=seed)   # noqa: E731
        results[seed], _ = batched_alone_unpipelined(model, [spec], draft, rule)
    assert [outcome(r) for r in results[-5]] == [outcome(r) for r in results[2**64 - 5]]
    with pytest.raises(ValueError, match="seed"):
        RejectionSampling(seed=2**64)


def test_pool_pressure_waits_and_preempts_with_the_same_tokens(permutation):
    """Eight long outputs in a pool that holds a few: requests wait, one is preempted (its rows leave the table, its
    pages freed, it runs again from its start), and every request still gets its greedy tokens."""
    model, heads, perm = permutation
    specs = [RequestSpec(k, prompt_ids=tuple(range(k, k + 10)), params=SamplingParams(max_tokens=40 + 3 * k,
                                                                                       temperature=0.0))
             for k in range(8)]
    results, stats = run(model, specs, lambda spec: MedusaDraft(heads, CHOICES), True, kv_tokens=160)
    for r, spec in zip(results, specs):
        assert r.output_ids == chain(perm, list(spec.prompt_ids), spec.params.max_tokens)
    assert stats.waits > 0 and stats.preemptions > 0


def test_an_abort_mid_run_frees_every_page(permutation):
    """A pipelined request aborted while its rows are in the verify table leaves the table and frees every page;
    the others give their tokens alone."""
    model, heads, _ = permutation
    engine = Engine(model, kv_tokens=8192, page_size=4, backend="torch")
    done, errors = {}, {}
    sched = OnlineScheduler(engine, on_done=lambda h, r: done.__setitem__(h, r),
                            on_error=lambda h, e: errors.__setitem__(h, e))

    def program(k):
        return SpeculativeProgram(list(range(5 + k, 20 + k)), MedusaDraft(heads, CHOICES), StopRule(40 + k, ()),
                                  pipeline=True)
    handles = [sched.submit(program(k)) for k in range(4)]
    for _ in range(4):
        sched.iterate()
    table = sched._core.tables[VerifyTable]
    assert table.size == 4
    sched.abort(handles[2])
    sched.iterate()
    assert table.size == 3
    while sched.iterate():
        pass
    assert isinstance(errors[handles[2]], ProgramAborted) and set(done) == {handles[0], handles[1], handles[3]}
    for k in (0, 1, 3):
        checker, stats = run_program(Engine(model, kv_tokens=8192, page_size=4, backend="torch"), program(k))
        assert done[handles[k]][0].token_ids == checker.token_ids and done[handles[k]][1].accepted == stats.accepted
    assert engine.tree.num_nodes == 0
    engine.tree.check_invariants(held=sched.cache.held())
    sched.cache.clear()   # (the finished conversations it keeps)
    assert engine.pool.num_free_pages == engine.pool.num_pages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_32_requests_pipelined_on_a_gpu_equal_the_eager_unpipelined_batch(graphs):
    """32 requests over a 64-token Medusa tree on a GPU (captured steps with ``graphs``): the batched pipelined
    steps give every request the eager unpipelined batch's tokens and stats, every page freed, one verify group."""
    from treedec.workloads.deft import medusa_tree
    model, heads, perm = permutation_target("cuda", torch.bfloat16)
    choices = medusa_tree(64).paths
    rng = np.random.default_rng(4)
    specs = []
    for k in range(32):
        prompt = rng.integers(0, model.config.vocab_size, 100 + 37 * k).tolist()
        want = chain(perm, prompt, 24 + k)
        params = dict(max_tokens=24 + k, temperature=0.0)
        if k % 4 == 1:
            params["stop_token_ids"] = (want[10 + k % 7],)
        specs.append(RequestSpec(k, prompt_ids=tuple(prompt), params=SamplingParams(**params)))
    runs = []
    for pipeline, cuda_graphs in ((False, False), (True, graphs)):
        engine = Engine(model, kv_tokens=65536, page_size=16, cuda_graphs=cuda_graphs)
        results, _ = speculative_batch(engine, specs, lambda spec: MedusaDraft(heads, choices), pipeline=pipeline,
                                       draft_budget=DraftBudget(step_tokens=None))   # (whole trees: equal stats)
        assert all(r.stats["pipelined"] == pipeline for r in results)
        assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
        runs.append([(r.output_ids, r.stop_reason, r.stats["accepted"]) for r in results])
    assert runs[0] == runs[1]
    for (tokens, _, _), spec in zip(runs[1], specs):
        assert tokens == chain(perm, list(spec.prompt_ids), spec.params.max_tokens)[:len(tokens)]


def test_a_budget_cuts_a_groups_trees_alike_with_the_same_tokens(permutation):
    """A draft budget gives the group one share a step (its requests' mean): every request's trees are cut to it
    (at first 26 verify tokens for 6 requests: 6 roots and 3 draft tokens each; more as requests end), and the
    tokens stay the greedy ones."""
    model, heads, perm = permutation
    specs = mixed_requests(6, perm, seed=5)
    budget = DraftBudget(step_tokens=26)
    results, _ = run(model, specs, lambda spec: MedusaDraft(heads, CHOICES), True, draft_budget=budget)
    for r, spec in zip(results, specs):
        assert r.output_ids == chain(perm, list(spec.prompt_ids), spec.params.max_tokens)[:len(r.output_ids)]
        assert r.stats["draft_sizes"][:1] in ([], [3])   # (none: it ended at its first token)
    assert all(entry["tokens"] == 3 for entry in budget.history[:6])
    assert max(size for r in results for size in r.stats["draft_sizes"]) > 3


def test_streamed_text_of_pipelined_requests_joins_to_their_text(permutation):
    """on_text (a request checked token by token) streams deltas that join to its final text, batched."""
    model, heads, _ = permutation
    from treedec.runtime.scheduler import run_programs
    streams = {k: [] for k in range(3)}
    programs = [SpeculativeProgram(list(range(3 + k, 15 + k)), MedusaDraft(heads, CHOICES), StopRule(9 + 4 * k, ()),
                                   tokenizer=LetterTokenizer(), pipeline=True,
                                   on_text=lambda delta, checker, k=k: streams[k].append(delta))
                for k in range(3)]
    results, _ = run_programs(Engine(model, kv_tokens=8192, page_size=4, backend="torch"), programs)
    for k, (checker, stats) in enumerate(results):
        assert "".join(streams[k]) == checker.text and len(checker.token_ids) == 9 + 4 * k and stats.pipelined
