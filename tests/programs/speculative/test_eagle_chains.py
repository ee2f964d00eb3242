"""EAGLE's fixed chains (EagleDraft(tree="chains"), treedec.programs.speculative.eagle_chains): the tree, the chains
drafted on the device, and the pipelined loop over them == the unpipelined loop == greedy decoding, with every page
of the target and of the drafter freed."""
import numpy as np
import pytest
import torch

from treedec.sampling.params import SamplingParams
from treedec.engine import Engine
from treedec.models import from_config
from treedec.models.eagle_drafter import EagleDrafter
from treedec.programs.speculative.acceptance import GreedyAcceptance
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.eagle_chains import chains_tree
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.program import speculative_generate
from tests.programs.speculative import test_eagle
from tests.programs.speculative.test_eagle import PROMPT, SIX_LAYERS, bigram_eagle, bigram_eagle3, engine

target, bigram = test_eagle.target, test_eagle.bigram   # (the fixtures)

DRAFTERS = {
    "eagle-random": lambda t: EagleDrafter.random(t, "eagle", seed=1),
    "eagle3-random": lambda t: EagleDrafter.random(t, "eagle3", seed=1, draft_vocab_size=300),
    "eagle-bigram": bigram_eagle,
    "eagle3-bigram": bigram_eagle3,
}


def test_chains_tree_is_chain_major():
    tree = chains_tree(2, 3)
    assert tree.parents == (-1, 0, 1, 2, 0, 4, 5) and max(tree.depth) == 3
    assert chains_tree(1, 1).parents == (-1, 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("page_size, chunk", [(1, 2048), (4, 5)])
def test_pipelined_chains_equal_unpipelined_and_greedy(target, bigram, name, page_size, chunk):
    """(chunk 5: the prompt's sync runs in chunks, the last with the root)"""
    model = bigram if "bigram" in name else target
    n = 30
    want = greedy_generate(engine(model, page_size), PROMPT, n, eos_token_id=None)
    runs = []
    for pipeline in (False, True):
        drafter = engine(DRAFTERS[name](model), page_size, prefill_chunk=chunk)
        draft = EagleDraft(drafter, depth=4, top_k=2, tree="chains")
        assert draft.fixed_tree.size == 9 and draft.total_tokens == 8 and draft.drafts_together
        t = engine(model, page_size)
        tokens, stats = speculative_generate(t, PROMPT, draft, n, eos_token_id=None, pipeline=pipeline)
        assert stats.pipelined == pipeline and tokens == want
        assert t.tree.sequence(stats.node)[:len(PROMPT) + n - 1] == PROMPT + tokens[:-1]
        t.tree.prune(stats.node)
        assert t.pool.num_free_pages == t.pool.num_pages
        draft.reset()
        assert drafter.tree.num_nodes == 0 and drafter.pool.num_free_pages == drafter.pool.num_pages
        runs.append(stats)
    assert runs[0].accepted == runs[1].accepted and runs[0].draft_sizes == runs[1].draft_sizes
    if name == "eagle-bigram":   # every chain token right: the best chain is accepted whole
        assert max(runs[1].accepted) == 4 and runs[1].tokens_per_step >= 4.0


def test_pipelined_chains_drafter_kv_equals_one_pass(bigram):
    """The drafter's sequence after a pipelined run with varied accepted lengths: its K/V at the real tokens
    equal one drafter pass over the target's states (the unaccepted sync rows dropped, none left between)."""
    d = bigram_eagle3(bigram)
    draft = EagleDraft(engine(d), depth=4, top_k=2, tree="chains")
    t = engine(bigram)
    tokens, stats = speculative_generate(t, PROMPT, draft, 25, eos_token_id=None, pipeline=True)
    assert len(set(stats.accepted)) > 1
    de = draft.engine
    have = de.tree.sequence_length(draft.node)
    real = have - (1 + 4)   # the newest sync's rows: their count was never read back
    seq = PROMPT + tokens
    fresh_t = engine(bigram)
    fresh_t.capture_hidden_layers(d.aux_layers)
    fresh_t.tree.add_prompt(seq[:real])
    aux = fresh_t.step(logits_rows=[0], hidden_rows=list(range(real)), return_aux=True).aux
    fresh = engine(d)
    node = fresh.tree.add_prompt(seq[1:real + 1])
    fresh.step(logits_rows=[0], features=d.fuse(aux))
    mine = np.concatenate([de.tree.slots(n) for n in de.tree.path(draft.node)])[:real]
    for a, b in ((de.pool.k, fresh.pool.k), (de.pool.v, fresh.pool.v)):
        a = a.reshape(1, -1, *a.shape[3:])[:, torch.as_tensor(mine)]
        b = b.reshape(1, -1, *b.shape[3:])[:, torch.as_tensor(fresh.tree.slots(node))]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("pipeline", [False, True])
def test_batched_chain_requests_equal_greedy_and_draft_together(bigram, pipeline):
    """Five requests with EAGLE-1 and EAGLE-3 chains in one scheduler run, the drafts of each kind sharing one
    drafter engine: each equals its greedy decoding, the requests of a pass drafted together (one sync and one
    chain run for all), every drafter page freed at the end."""
    from treedec.programs.speculative.eagle_chains import EagleChains
    from treedec.runtime.requests import RequestSpec
    from treedec.programs.speculative.batch import speculative_batch

    prompts = [list(range(100, 140)) + [1, 2, 3], [4, 5], [7, 8, 9, 10], PROMPT, [3, 3, 3]]
    specs = [RequestSpec(id=str(i), prompt_ids=tuple(p), params=SamplingParams(max_tokens=12 + i, temperature=0.0))
             for i, p in enumerate(prompts)]
    e1, e3 = engine(bigram_eagle(bigram)), engine(bigram_eagle3(bigram))

    def draft(spec):
        return EagleDraft(e1 if int(spec.id) % 2 else e3, depth=3, top_k=2, tree="chains")
    results, stats = speculative_batch(engine(bigram), specs, draft, pipeline=pipeline)
    for spec, result in zip(specs, results):
        assert result.stats["pipelined"] == pipeline
        assert result.output_ids == greedy_generate(engine(bigram), spec.prompt_ids, spec.params.max_tokens,
                                                    eos_token_id=None)
    for e in (e1, e3):
        group = EagleChains.of(e)
        assert group.stats["requests"] > group.stats["flushes"] > 0, group.stats
        assert e.tree.num_nodes == 0 and e.pool.num_free_pages == e.pool.num_pages


def test_chains_errors(target):
    d = engine(EagleDrafter.random(target, "eagle"))
    with pytest.raises(ValueError, match="tree must be"):
        EagleDraft(d, tree="beam")
    with pytest.raises(ValueError, match="top_k \\* depth = 6"):
        EagleDraft(d, depth=3, top_k=2, total_tokens=5, tree="chains")
    from treedec.sampling.params import SamplingParams
    with pytest.raises(ValueError, match="sample must be None"):
        EagleDraft(d, tree="chains", sample=SamplingParams(temperature=1.0))
    assert EagleDraft(d, depth=3, top_k=2, total_tokens=6, tree="chains").total_tokens == 6
    assert EagleDraft(d).fixed_tree is None and EagleDraft(d).total_tokens == 63
    from treedec.programs.speculative.eagle_chains import EagleChains
    chains, draft = EagleChains.of(d), EagleDraft(d, tree="chains")
    with pytest.raises(ValueError, match="3 states, 2 tokens"):
        chains.submit(draft, torch.zeros(2, dtype=torch.int64), torch.zeros(3, 128), None)
    with pytest.raises(ValueError, match="collect\\(\\) before submit"):
        chains.collect(draft)
    # a drafter on the reference backend cannot mask its unaccepted rows on the device: refused, nothing run
    from treedec.programs.speculative.verify_table import pipeline_refusal
    on_reference = EagleDraft(Engine(d.model, kv_tokens=256, page_size=4, backend="reference"), depth=2, top_k=2,
                              tree="chains")
    t = engine(target)
    assert "drafter engine's reference attention backend" in pipeline_refusal(t, on_reference, GreedyAcceptance())
    with pytest.raises(ValueError, match="drafter engine's reference attention backend"):
        speculative_generate(t, PROMPT, on_reference, 4, pipeline=True)
    assert t.tree.num_nodes == 0 and on_reference.engine.tree.num_nodes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("compile_model", [False, True])
def test_pipelined_chains_in_captured_graphs_equal_eager(kind, compile_model):
    """Pipelined EAGLE chains with target and drafter in CUDA graphs (the chains one graph whose plans mask the
    sync's unaccepted rows on the device): the tokens of greedy decoding and of the eager unpipelined loop, most
    drafts accepted, every drafter step a replay, and every page of both engines freed."""
    model = from_config(SIX_LAYERS, seed=4, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():   # a bigram target (tests/programs/speculative/test_eagle.py's fixture) so that drafts are accepted
        for layer in model.layers:
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
    drafter = (bigram_eagle if kind == "eagle" else bigram_eagle3)(model)
    prompt = np.random.default_rng(3).integers(0, 512, 600).tolist()
    want = greedy_generate(Engine(model, kv_tokens=4096, page_size=16), prompt, 40, eos_token_id=None)
    runs = []
    for graphs, pipeline in ((False, False), (True, True)):
        kw = {"kv_tokens": 4096, "page_size": 16, "cuda_graphs": graphs, "compile_model": compile_model and graphs}
        verifier, draft_engine = Engine(model, **kw), Engine(drafter, **kw)
        draft = EagleDraft(draft_engine, depth=4, top_k=2, tree="chains")
        tokens, stats = speculative_generate(verifier, prompt, draft, 40, eos_token_id=None, pipeline=pipeline)
        assert stats.pipelined == pipeline
        if graphs:
            for e in (verifier, draft_engine):
                assert not [k for k in e.graph_stats if k.startswith("eager") and "max_queries" not in k], \
                    e.graph_stats
            # per step: the sync (a replay; the first, the prompt's, eager) and the chain (one graph), the
            # step launched past the stop included
            assert draft_engine.graph_stats["chain_replays"] == stats.steps + 1
        verifier.tree.prune(stats.node)
        draft.reset()
        for e in (verifier, draft_engine):
            assert e.tree.num_nodes == 0 and e.pool.num_free_pages == e.pool.num_pages
        runs.append((tokens, stats.accepted))
    assert runs[0][0] == runs[1][0] == want
    assert sum(runs[0][1]) > 20 and sum(runs[1][1]) > 20
