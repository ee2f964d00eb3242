"""Draft-model drafts (tiny models, CPU): EAGLE-2-style trees from the draft's own steps (greedy drafts in
chains drafted with the other requests', sampled drafts keeping their K/V of the accepted path), and greedy
speculative decoding equal to plain greedy, alone and batched."""
import pytest
import torch

from treedec.sampling.params import SamplingParams
from treedec.engine import Engine
from treedec.models import ModelConfig, from_config
from treedec.programs.speculative.draft_model import DraftModelDraft
from treedec.programs.speculative.program import speculative_generate
from tests.engines import assert_kv_equals_fresh_prefill, make_engine, plain_greedy, tiny_model
from tests.programs.speculative.test_speculative_program import prompt_with_repeats

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def other_tiny():
    """A draft model with other random weights (rarely right)."""
    return from_config("tiny", seed=1, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def reference(tiny):
    prompt = prompt_with_repeats()
    return prompt, plain_greedy(tiny, prompt, NEW_TOKENS + 8)


def draft_engine(model, page_size=4):
    return Engine(model, kv_tokens=1024, page_size=page_size, backend="torch")


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("which", ["self", "other"])
def test_draft_model_speculative_equals_plain_greedy(tiny, other_tiny, reference, which, page_size):
    prompt, ref = reference
    engine = make_engine(tiny, page_size=page_size)
    d_engine = draft_engine(tiny if which == "self" else other_tiny, page_size)
    draft = DraftModelDraft(d_engine, depth=3, top_k=2, total_tokens=10)   # 2 + 4 + 4: every node made is kept
    tokens, stats = speculative_generate(engine, prompt, draft, NEW_TOKENS)
    assert tokens == ref[:NEW_TOKENS]
    if which == "self":   # the draft is the target: its greedy path is always in the tree
        assert stats.accepted[:-1] == [3] * (stats.steps - 1)
    # the draft's sequence: the target's, up to the last root (its K/V computed, nothing pending)
    seq = d_engine.tree.sequence(draft.node)
    assert seq == (prompt + tokens)[:len(seq)] and len(seq) >= len(prompt) + NEW_TOKENS - 3
    assert d_engine.tree.layout().num_queries == 0
    draft.reset()   # (its chains' scratch pages are held outside the tree until then)
    d_engine.tree.check_invariants()
    assert d_engine.pool.num_free_pages == d_engine.pool.num_pages


def test_draft_kv_equals_a_fresh_prefill(tiny, other_tiny, reference):
    """The draft's K/V after accepted paths were moved equal those of a prefill of its sequence."""
    prompt, ref = reference
    d_engine = draft_engine(other_tiny)
    draft = DraftModelDraft(d_engine, depth=3, top_k=2, total_tokens=10)
    # drafts from the other model, verified by the same model: a path is accepted every step
    speculative_generate(draft_engine(other_tiny), prompt, draft, 20)
    assert_kv_equals_fresh_prefill(d_engine, draft.node, draft_engine(other_tiny))


def test_greedy_drafts_one_step_per_layer(tiny):
    """A greedy proposal is one sync step (the tokens the draft has not computed, the root included) and one
    chain step per deeper layer (top_k chain queries); the accepted tokens are computed again in the next sync."""
    d_engine = draft_engine(tiny)
    draft = DraftModelDraft(d_engine, depth=3, top_k=2, total_tokens=10)
    prompt = [3, 1, 4, 1, 5]
    tree, tokens = draft.propose(prompt)
    assert tokens[0] == 5 and tree.size == 11 and max(tree.depth) == 3
    assert d_engine.stats["steps"] == 3 and d_engine.stats["queries"] == 5 + 2 + 2
    computed = tree.depth.index(2)
    path = [tokens[tree.parents[computed]], tokens[computed]]
    draft.propose(prompt + path + [7])
    assert d_engine.stats["steps"] == 6 and d_engine.stats["queries"] == 9 + 3 + 2 + 2
    assert d_engine.tree.sequence(draft.node) == prompt + path + [7]
    # a sequence it holds already (nothing new to compute), or another request's: prefilled afresh
    draft.propose(prompt + path + [7])
    assert d_engine.stats["queries"] == 16 + 8 + 2 + 2
    draft.propose([9, 9, 2])
    assert d_engine.stats["queries"] == 28 + 3 + 2 + 2 and d_engine.tree.sequence(draft.node) == [9, 9, 2]
    draft.reset()
    d_engine.tree.check_invariants()
    assert d_engine.pool.num_free_pages == d_engine.pool.num_pages


def test_sampled_drafts_keep_the_accepted_paths_kv(tiny):
    """A sampled draft's frontier nodes live in its tree: an accepted path of them is moved onto its sequence
    (no recompute, its K/V those of a fresh prefill); only the new root is computed, then the layers."""
    from treedec.sampling.params import SamplingParams

    d_engine = draft_engine(tiny)
    draft = DraftModelDraft(d_engine, depth=3, top_k=2, total_tokens=10, sample=SamplingParams(temperature=1.0), seed=3)
    prompt = [3, 1, 4, 1, 5]
    draft.propose(prompt)
    assert d_engine.stats["steps"] == 3 and d_engine.stats["queries"] == 5 + 2 + 2
    path = next(p for p in draft._computed if len(p) == 2)   # two frontier nodes, computed by the draft
    draft.propose(prompt + list(path) + [7])
    assert d_engine.stats["steps"] == 6 and d_engine.stats["queries"] == 9 + 1 + 2 + 2
    assert d_engine.tree.sequence(draft.node) == prompt + list(path) + [7]
    assert_kv_equals_fresh_prefill(d_engine, draft.node, draft_engine(tiny))


def test_errors(tiny):
    d_engine = draft_engine(tiny)
    for kwargs, match in [({"depth": 0}, "depth must be an int >= 1, got 0"),
                          ({"top_k": 0}, "top_k must be an int >= 1, got 0"),
                          ({"total_tokens": 1.5}, "total_tokens must be an int >= 1, got 1.5"),
                          ({"top_k": 600}, r"top_k \(600\) must be <= the draft vocabulary \(512\)")]:
        with pytest.raises(ValueError, match=match):
            DraftModelDraft(d_engine, **kwargs)
    with pytest.raises(TypeError, match="engine must be the draft model's Engine"):
        DraftModelDraft(tiny)
    small_vocab = from_config(ModelConfig.from_name("tiny", vocab_size=256), dtype=torch.float32, device="cpu")
    target = make_engine(tiny)
    with pytest.raises(ValueError, match=r"vocabulary \(256 tokens\) must be the target's \(512 tokens\)"):
        speculative_generate(target, [1, 2, 3], DraftModelDraft(draft_engine(small_vocab)), 4)
    with pytest.raises(ValueError, match="needs its own Engine"):
        speculative_generate(target, [1, 2, 3], DraftModelDraft(target), 4)
    assert target.tree.num_nodes == 0
    with pytest.raises(ValueError, match="at least the root token"):
        DraftModelDraft(d_engine).propose([])


def test_sampled_trees_keep_children_in_draw_order_and_report_their_distributions(tiny):
    """sample=SamplingParams: each expanded node's children are distinct draws from its processed
    distribution (their row of draft_probs), the tree cut to total_tokens; the same seed, the same tree."""
    from treedec.sampling.params import SamplingParams, sampling_probs

    params = SamplingParams(temperature=0.9, top_k=5)
    trees = []
    for _ in range(2):
        engine = Engine(tiny, kv_tokens=1024, page_size=4, backend="torch")
        draft = DraftModelDraft(engine, depth=3, top_k=2, total_tokens=5, sample=params, seed=7)
        tree, tokens = draft.propose([5, 9, 2, 7])
        trees.append((tree.parents, tokens))
    parents, tokens = trees[0]
    assert trees[0] == trees[1] and len(tokens) == 6 and tokens[0] == 7
    probs = draft.draft_probs
    root_logits = Engine(tiny, kv_tokens=64, page_size=4, backend="torch").prefill([5, 9, 2, 7]).logits
    assert torch.allclose(probs[0], sampling_probs(root_logits, params), atol=1e-5)
    for node in range(len(tokens)):
        kids = [i for i, p in enumerate(parents) if p == node]
        assert len({tokens[i] for i in kids}) == len(kids)                   # without replacement
        assert all(probs[node][tokens[i]] > 0 for i in kids)                # inside the top-5 support
    with pytest.raises(ValueError, match="sample must be SamplingParams with a temperature > 0"):
        DraftModelDraft(engine, sample=SamplingParams(temperature=0.0))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["self", "other"])
def test_batched_draft_model_requests_draft_together_and_equal_each_alone(tiny, other_tiny, which):
    """Five requests (two share a system prompt) over ONE draft engine: each emits its plain greedy tokens and
    accepts what it accepts alone; a scheduler pass drafts for all its requests at once (one sync step and
    ``depth - 1`` chain steps, not per request), and every draft page is freed at the end."""
    from treedec.programs.speculative.drafter_batch import DrafterGroup
    from treedec.runtime.requests import RequestSpec
    from treedec.programs.speculative.batch import speculative_batch

    model = tiny if which == "self" else other_tiny
    system = list(range(100, 140))
    prompts = [system + [1, 2, 3], system + [4, 5], [7, 8, 9, 10], prompt_with_repeats(), [3, 3, 3]]
    specs = [RequestSpec(id=str(i), prompt_ids=tuple(p), params=SamplingParams(max_tokens=10 + 2 * i, temperature=0.0))
             for i, p in enumerate(prompts)]
    d_engine = draft_engine(model)
    results, stats = speculative_batch(make_engine(tiny), specs,
                                       lambda spec: DraftModelDraft(d_engine, depth=3, top_k=2, total_tokens=8))
    alone_steps = 0
    for spec, result in zip(specs, results):
        assert result.output_ids == plain_greedy(tiny, list(spec.prompt_ids), spec.params.max_tokens)
        d_alone = draft_engine(model)
        tokens, alone = speculative_generate(make_engine(tiny), list(spec.prompt_ids),
                                             DraftModelDraft(d_alone, depth=3, top_k=2, total_tokens=8),
                                             spec.params.max_tokens)
        assert tokens == result.output_ids and result.stats["accepted"] == alone.accepted
        alone_steps += d_alone.stats["steps"]
    assert max(stats.programs_per_step) == 5
    group = DrafterGroup.of(d_engine)
    assert group.stats["requests"] > group.stats["flushes"] > 0, group.stats
    assert d_engine.stats["steps"] <= 3 * group.stats["flushes"] + 8 < alone_steps   # (+ prompt chunks)
    assert d_engine.tree.num_nodes == 0 and d_engine.pool.num_free_pages == d_engine.pool.num_pages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batched_draft_model_in_captured_graphs():
    """Four requests on graphed engines, drafting together on one graphed draft engine (a bigram model
    drafting for itself): each emits plain greedy decoding's tokens, accepts most of the depth (a path is
    cut where a layer's frontier missed the greedy node), and every pass's drafting chain is one graph replay."""
    import numpy as np

    from treedec.programs.speculative.drafter_batch import DrafterGroup
    from treedec.programs.greedy import greedy_generate
    from treedec.runtime.requests import RequestSpec
    from treedec.programs.speculative.batch import speculative_batch
    from tests.programs.speculative.test_eagle import SIX_LAYERS

    model = from_config(SIX_LAYERS, seed=4, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():   # the next token depends on the current token only (see tests/programs/speculative/test_eagle.py)
        for layer in model.layers:
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, n).tolist() for n in (600, 130, 40, 300)]
    specs = [RequestSpec(id=str(i), prompt_ids=tuple(p), params=SamplingParams(max_tokens=30, temperature=0.0))
             for i, p in enumerate(prompts)]
    kw = {"kv_tokens": 8192, "page_size": 16, "cuda_graphs": True}
    d_engine = Engine(model, **kw)
    results, _ = speculative_batch(Engine(model, **kw), specs,
                                   lambda spec: DraftModelDraft(d_engine, depth=4, top_k=2, total_tokens=14))
    for prompt, result in zip(prompts, results):
        want = greedy_generate(Engine(model, kv_tokens=4096, page_size=16), prompt, 30, eos_token_id=None)
        assert result.output_ids == want
        accepted = result.stats["accepted"][:-1]
        assert min(accepted) >= 1 and sum(accepted) >= 2.5 * len(accepted), accepted
    group = DrafterGroup.of(d_engine)
    assert group.stats["requests"] > group.stats["flushes"] > 0
    assert d_engine.graph_stats["chain_replays"] == group.stats["flushes"]
    assert not [k for k in d_engine.graph_stats if k.startswith("eager") and "max_queries" not in k], \
        d_engine.graph_stats
    assert d_engine.tree.num_nodes == 0 and d_engine.pool.num_free_pages == d_engine.pool.num_pages


def test_a_failed_drafter_sync_leaves_nothing_pending(tiny):
    """A drafter step that fails inside a group's sync (its tokens added, never computed) raises as it came and
    leaves no pending token: the draft's reset then frees every page."""
    d_engine = draft_engine(tiny)
    draft = DraftModelDraft(d_engine, depth=3, top_k=2, total_tokens=8)
    draft.propose([3, 1, 4, 1, 5])

    def failing_step(*args, **kwargs):
        raise RuntimeError("device lost")
    d_engine.step = failing_step
    with pytest.raises(RuntimeError, match="device lost"):
        draft.propose([3, 1, 4, 1, 5, 9, 2])
    assert d_engine.tree.num_pending == 0
    draft.reset()
    d_engine.tree.check_invariants()
    assert d_engine.pool.num_free_pages == d_engine.pool.num_pages
