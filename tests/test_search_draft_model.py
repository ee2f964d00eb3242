"""Draft-model drafts (tiny models, CPU): EAGLE-2-style trees from the draft's own tree steps,
its K/V of the accepted path kept, and greedy speculative decoding equal to plain greedy."""
import pytest
import torch

from treedec.engine import Engine, ModelConfig, from_config
from treedec.search.draft_model import DraftModelDraft
from treedec.search.speculative import speculative_generate
from tests.engines import assert_kv_equals_fresh_prefill, make_engine, plain_greedy, tiny_model
from tests.test_search_speculative import prompt_with_repeats

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
    d_engine.tree.check_invariants()
    draft.reset()
    assert d_engine.pool.num_free_pages == d_engine.pool.num_pages


def test_draft_kv_equals_a_fresh_prefill(tiny, other_tiny, reference):
    """The draft's K/V after accepted paths were moved equal those of a prefill of its sequence."""
    prompt, ref = reference
    d_engine = draft_engine(other_tiny)
    draft = DraftModelDraft(d_engine, depth=3, top_k=2, total_tokens=10)
    # drafts from the other model, verified by the same model: a path is accepted every step
    speculative_generate(draft_engine(other_tiny), prompt, draft, 20)
    assert_kv_equals_fresh_prefill(d_engine, draft.node, draft_engine(other_tiny))


def test_one_draft_step_per_layer_and_no_recompute(tiny):
    d_engine = draft_engine(tiny)
    draft = DraftModelDraft(d_engine, depth=3, top_k=2, total_tokens=10)
    prompt = [3, 1, 4, 1, 5]
    tree, tokens = draft.propose(prompt)
    assert tokens[0] == 5 and tree.size == 11 and max(tree.depth) == 3
    # the prefill, then one step per frontier layer (layers 1 and 2: top_k nodes each)
    assert d_engine.stats["steps"] == 3 and d_engine.stats["queries"] == 5 + 2 + 2
    # tree order within a layer is by score, so the first top_k nodes of a layer are its frontier
    depth = tree.depth
    computed = depth.index(2)
    path = [tokens[tree.parents[computed]], tokens[computed]]
    # accepted: a path of frontier nodes (computed by the draft) + a bonus: one query for the bonus
    draft.propose(prompt + path + [7])
    assert d_engine.stats["steps"] == 6 and d_engine.stats["queries"] == 9 + 1 + 2 + 2
    assert d_engine.tree.sequence(draft.node) == prompt + path + [7]
    # a sequence it holds already (nothing new to compute): prefilled afresh
    tree, tokens = draft.propose(prompt + path + [7])
    assert d_engine.stats["queries"] == 14 + 8 + 2 + 2
    # accepted down to a last-layer leaf, which the draft never computed: two queries
    leaf = tree.depth.index(3)
    mid = tree.parents[leaf]
    chain = [tokens[tree.parents[mid]], tokens[mid], tokens[leaf]]
    before = d_engine.stats["queries"]
    draft.propose(prompt + path + [7] + chain + [9])
    assert d_engine.stats["queries"] - before == 2 + 2 + 2


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
    from treedec.search.sampling import SamplingParams, sampling_probs

    params = SamplingParams(0.9, 5)
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
        DraftModelDraft(engine, sample=SamplingParams(0.0))
