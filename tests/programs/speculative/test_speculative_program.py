"""Speculative decoding (tiny model, CPU): every draft source emits exactly the plain greedy
tokens, and stops on an EOS id exactly where plain greedy decoding does."""
import numpy as np
import pytest

from treedec.engine import Engine
from treedec.errors import TreeError
from treedec.programs.speculative.draft_model import DraftModelDraft
from treedec.models.medusa import MedusaHeads
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.programs.speculative.drafts import DraftSource, PromptLookupDraft, TreeDraft
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.drafts import check_draft_tree
from treedec.programs.speculative.program import speculative_generate
from treedec.tree.token_tree import TokenTree
from tests.engines import assert_kv_equals_fresh_prefill, make_engine, plain_greedy, tiny_model

NEW_TOKENS = 40
MEDUSA_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def prompt_with_repeats(seed=0):
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, 512, 6).tolist()
    return rng.integers(0, 512, 5).tolist() + phrase + rng.integers(0, 512, 4).tolist() + phrase


@pytest.fixture(scope="module")
def reference(tiny):
    prompt = prompt_with_repeats()
    return prompt, plain_greedy(tiny, prompt, NEW_TOKENS + 8)


def oracle_draft(prompt, continuation, seed=0):
    """Medusa tree whose all-zeros path is the model's own greedy continuation, the rest random."""
    tree = TokenTree.from_medusa_choices(MEDUSA_CHOICES)
    full = prompt + continuation
    rng = np.random.default_rng(seed)

    def tokens(seq):
        ahead = full[len(seq):]
        return [ahead[len(p) - 1] if not any(p) and len(p) <= len(ahead) else int(rng.integers(0, 512))
                for p in tree.paths[1:]]
    return TreeDraft(tree, tokens)


def random_tree_draft(seed=0):
    rng = np.random.default_rng(seed)
    tree = TokenTree.from_medusa_choices(MEDUSA_CHOICES)
    return TreeDraft(tree, rng.integers(0, 512, tree.size - 1).tolist())


DRAFTS = {
    "ngram": lambda prompt, ref: PromptLookupDraft(max_ngram=3, num_draft_tokens=5),
    "ngram-branches": lambda prompt, ref: PromptLookupDraft(max_ngram=2, min_ngram=1, num_draft_tokens=4,
                                                            max_matches=3),
    "random-tree": lambda prompt, ref: random_tree_draft(),
    "oracle": lambda prompt, ref: oracle_draft(prompt, ref),
}


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("name", list(DRAFTS))
def test_speculative_equals_plain_greedy(tiny, reference, name, page_size):
    prompt, ref = reference
    engine = make_engine(tiny, page_size=page_size)
    tokens, stats = speculative_generate(engine, prompt, DRAFTS[name](prompt, ref), NEW_TOKENS)
    assert tokens == ref[:NEW_TOKENS]
    assert stats.steps == len(stats.accepted) == len(stats.draft_sizes)
    assert 1 + sum(a + 1 for a in stats.accepted) >= NEW_TOKENS   # the prefill's token + accepted+1 per step
    assert engine.stats["steps"] == 1 + stats.steps
    seq = engine.tree.sequence(stats.node)
    assert seq[:len(prompt) + NEW_TOKENS - 1] == prompt + ref[:NEW_TOKENS - 1]
    assert engine.tree.children(stats.node) == [] and engine.tree.layout().num_queries == 0
    engine.tree.check_invariants()
    engine.tree.prune(stats.node)
    assert engine.pool.num_free_pages == engine.pool.num_pages
    if name == "oracle":
        assert min(stats.accepted) > 0 and stats.tokens_per_step > 4
    if name == "random-tree":
        assert stats.tokens_per_step < 2


def test_accepted_kv_equals_a_fresh_prefill(tiny, reference):
    """After accepted paths were moved, the sequence's K/V equal those of a prefill of it."""
    prompt, ref = reference
    engine = make_engine(tiny)
    speculative_generate(engine, prompt, oracle_draft(prompt, ref), 20)
    assert_kv_equals_fresh_prefill(engine, engine.tree.roots[0], make_engine(tiny))


def test_prompt_lookup_draft():
    draft = PromptLookupDraft(max_ngram=2, num_draft_tokens=3, max_matches=2)
    tree, tokens = draft.propose([1, 2, 3, 4, 9, 1, 2, 5, 6, 7, 1, 2])
    # bigram [1, 2] occurs at 5 (continues 5 6 7) and 0 (continues 3 4 9): most recent first
    assert tokens == [2, 5, 6, 7, 3, 4, 9] and tree.parents == (-1, 0, 1, 2, 0, 4, 5)
    tree, tokens = PromptLookupDraft(max_matches=3, num_draft_tokens=2).propose([4, 1, 5, 1, 6, 1, 5, 1])
    # the trigram [1, 5, 1] occurs once before, at index 1
    assert tokens == [1, 6, 1]
    tree, tokens = PromptLookupDraft().propose([1, 2, 3])
    assert tree.size == 1 and tokens == [3]
    branches = PromptLookupDraft(max_ngram=1, num_draft_tokens=2, max_matches=3).propose([7, 1, 7, 1, 7, 2, 7])
    # [7] at 4, 2, 0 continues [2, 7], [1, 7], [1, 7]: two distinct branches
    assert branches[1] == [7, 2, 7, 1, 7] and branches[0].parents == (-1, 0, 1, 0, 3)
    shared = PromptLookupDraft(max_ngram=1, num_draft_tokens=2, max_matches=2).propose([7, 1, 2, 7, 1, 3, 7])
    assert shared[1] == [7, 1, 3, 2] and shared[0].parents == (-1, 0, 1, 1)   # [1, 3], [1, 2]: prefix [1] once
    with pytest.raises(ValueError, match="min_ngram .3. must be <= max_ngram .2."):
        PromptLookupDraft(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="num_draft_tokens must be an int >= 1, got 0"):
        PromptLookupDraft(num_draft_tokens=0)


class _FixedDraft(DraftSource):
    """Proposes ``tokens(sequence)`` over ``tree`` every step."""

    def __init__(self, tree, tokens):
        self.tree, self.tokens = tree, tokens

    def propose(self, sequence_tokens):
        return self.tree, self.tokens(sequence_tokens)


def test_verify_errors_change_nothing(tiny):
    """A bad draft raises in the verification step before it changes anything: the request's node is
    freed with every page; a step's checks name an unknown node or one with children."""
    tree = TokenTree.chain(2)
    for tokens, error, match in [
            (lambda seq: [seq[-1], 5], ValueError, "one token per tree token .3., got 2"),
            (lambda seq: [seq[-1], 5, 600], ValueError, r"token ids in \[0, 512\), got \[600\]"),
            (lambda seq: [seq[-1], 5, 5.7], TypeError, r"tokens\[2\] must be an integer, got float"),  # was 5
            (lambda seq: "456", TypeError, "tokens must be a sequence of integers, got str")]:   # was [4, 5, 6]
        engine = make_engine(tiny)
        with pytest.raises(error, match=match):
            speculative_generate(engine, [1, 2, 3], _FixedDraft(tree, tokens), 5)
        assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
    engine = make_engine(tiny)
    node = engine.prefill([1, 2, 3]).node
    before = (engine.tree.num_tokens, engine.pool.num_free_pages)
    with pytest.raises(ValueError, match="one token per tree token .3., got 2"):
        check_draft_tree(engine, node, tree, [4, 5])
    with pytest.raises(ValueError, match=r"token ids in \[0, 512\), got \[600\]"):
        check_draft_tree(engine, node, tree, [4, 5, 600])
    with pytest.raises(TypeError, match=r"tokens\[2\] must be an integer, got float"):   # was truncated to 5
        check_draft_tree(engine, node, tree, [4, 5, 5.7])
    with pytest.raises(TypeError, match="tokens must be a sequence of integers, got str"):   # was [4, 5, 6]
        check_draft_tree(engine, node, tree, "456")
    assert (engine.tree.num_tokens, engine.pool.num_free_pages) == before
    with pytest.raises(TreeError, match="unknown node"):
        check_draft_tree(engine, 99, tree, [4, 5, 6])
    engine.tree.branch(node, [[9]])
    engine.step()
    with pytest.raises(ValueError, match="must be a leaf"):
        check_draft_tree(engine, node, tree, [4, 5, 6])
    assert (engine.tree.num_tokens, engine.pool.num_free_pages) == (before[0] + 1, before[1] - 1)
    with pytest.raises(ValueError, match="tokens\\[0\\] == the last sequence token"):
        speculative_generate(make_engine(tiny), [1, 2, 3], _BadRoot(), 5)
    with pytest.raises(ValueError, match="needs 2 draft tokens"):
        TreeDraft(tree, [1, 2, 3])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        speculative_generate(make_engine(tiny), [1, 2], PromptLookupDraft(), 0)


class _BadRoot(DraftSource):
    def propose(self, sequence_tokens):
        return TokenTree.chain(1), [0 if sequence_tokens[-1] else 1, 5]


def test_greedy_generate_is_plain_greedy(tiny, reference):
    prompt, ref = reference
    engine = make_engine(tiny)
    assert greedy_generate(engine, prompt, 12) == ref[:12]
    assert engine.stats["steps"] == 12 and engine.tree.sequence(engine.tree.roots[0]) == prompt + ref[:11]
    eos = first_occurrence(ref, 8)    # stops on it: returned, not computed
    engine = make_engine(tiny)
    assert greedy_generate(engine, prompt, 12, eos_token_id=[eos, 511]) == ref[:9]
    assert engine.stats["steps"] == 9 and engine.tree.sequence(engine.tree.roots[0]) == prompt + ref[:8]
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        greedy_generate(make_engine(tiny), prompt, 0)


# ================================================================ EOS


EOS_DRAFTS = {
    **DRAFTS,
    "medusa-untrained": lambda prompt, ref: MedusaDraft(MedusaHeads.untrained(tiny_model(), num_heads=4)),
    "draft-model-self": lambda prompt, ref: DraftModelDraft(Engine(tiny_model(), kv_tokens=1024, page_size=4,
                                                                   backend="torch"), depth=3, top_k=2, total_tokens=10),
}
# Positions of the reference continuation whose token first occurs there (asserted below):
# 0 is the prefill's token, 2 lies inside the oracle's and the self draft model's first
# accepted path, 38 is the n-gram draft's bonus after 3 accepted tokens; 40 is past
# NEW_TOKENS (the run ends on the length).
EOS_POSITIONS = [0, 2, 20, 38, 40]


def first_occurrence(tokens, p):
    assert tokens[p] not in tokens[:p], f"token {tokens[p]} at {p} occurs before, at {tokens.index(tokens[p])}"
    return tokens[p]


def assert_stopped_like_greedy(engine, prompt, tokens, stats, eos, page_size=4):
    """The tokens, the stop reason, the request's node and the pages held are those plain greedy decoding
    with the same EOS ids leaves behind; pruning the node frees every page."""
    plain = make_engine(tiny_model(), page_size=page_size)
    expected = greedy_generate(plain, prompt, NEW_TOKENS, eos_token_id=eos)
    assert tokens == expected
    ended = tokens[-1] in (eos if isinstance(eos, list) else [eos])
    assert stats.stop_reason == ("eos" if ended else "length")
    seq = engine.tree.sequence(stats.node)
    if ended:   # the EOS is returned, not computed; nothing after it is kept
        assert seq == plain.tree.sequence(plain.tree.roots[0]) == prompt + tokens[:-1]
        assert engine.pool.num_free_pages == plain.pool.num_free_pages
    else:
        assert seq[:len(prompt) + NEW_TOKENS - 1] == prompt + tokens[:-1]
    assert engine.tree.children(stats.node) == [] and engine.tree.layout().num_queries == 0
    engine.tree.check_invariants()
    engine.tree.prune(stats.node)
    assert engine.pool.num_free_pages == engine.pool.num_pages


@pytest.mark.slow
@pytest.mark.parametrize("position", EOS_POSITIONS)
@pytest.mark.parametrize("name", list(EOS_DRAFTS))
def test_speculative_stops_at_eos_like_greedy(tiny, reference, name, position):
    prompt, ref = reference
    eos = first_occurrence(ref, position)
    engine = make_engine(tiny)
    tokens, stats = speculative_generate(engine, prompt, EOS_DRAFTS[name](prompt, ref), NEW_TOKENS,
                                         eos_token_id=eos)
    assert tokens == ref[:min(position + 1, NEW_TOKENS)]
    assert stats.steps == len(stats.accepted) and (stats.steps == 0) == (position == 0)
    assert_stopped_like_greedy(engine, prompt, tokens, stats, eos)


def test_eos_inside_the_accepted_path_ends_it(tiny, reference):
    """The oracle accepts 5 draft tokens a step; an EOS as the 2nd of them is the step's last token:
    the node keeps the one accepted token before it, K/V equal to a fresh prefill's."""
    prompt, ref = reference
    _, free = speculative_generate(make_engine(tiny), prompt, oracle_draft(prompt, ref), NEW_TOKENS, eos_token_id=None)
    assert free.accepted[0] == 5 and free.stop_reason == "length"   # positions 1-5 accepted, 6 the bonus
    eos = first_occurrence(ref, 2)
    engine = make_engine(tiny)
    tokens, stats = speculative_generate(engine, prompt, oracle_draft(prompt, ref), NEW_TOKENS, eos_token_id=eos)
    assert tokens == ref[:3] and stats.accepted == [1] and stats.draft_sizes == free.draft_sizes[:1]
    assert_kv_equals_fresh_prefill(engine, stats.node, make_engine(tiny))
    assert_stopped_like_greedy(engine, prompt, tokens, stats, eos)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_eos_inside_an_accepted_prompt_lookup_path(tiny, page_size):
    """A prompt P + C + P, C greedy's own continuation of P: after the second P the n-gram draft
    proposes C again and greedy accepts two of its tokens; an EOS on the first of them ends the
    path before the second and the bonus."""
    P = np.random.default_rng(0).integers(0, 512, 8).tolist()
    prompt = P + plain_greedy(tiny, P, 8) + P
    draft = PromptLookupDraft(max_ngram=3, num_draft_tokens=5)
    free_engine = make_engine(tiny, page_size)
    free, free_stats = speculative_generate(free_engine, prompt, draft, NEW_TOKENS, eos_token_id=None)
    assert free_stats.accepted[0] == 2           # new tokens 1 and 2 accepted, 3 the bonus
    eos = first_occurrence(free, 1)
    engine = make_engine(tiny, page_size)
    tokens, stats = speculative_generate(engine, prompt, draft, NEW_TOKENS, eos_token_id=[511, eos])
    assert tokens == free[:2] and stats.accepted == [0] and stats.stop_reason == "eos"
    assert_kv_equals_fresh_prefill(engine, stats.node, make_engine(tiny))
    assert_stopped_like_greedy(engine, prompt, tokens, stats, [511, eos], page_size)


def test_default_eos_is_the_model_s(tiny, reference, monkeypatch):
    prompt, ref = reference
    eos = first_occurrence(ref, 8)
    assert tiny.eos_token_ids == ()   # random weights: no EOS
    monkeypatch.setattr(tiny, "eos_token_ids", (eos,))
    tokens, stats = speculative_generate(make_engine(tiny), prompt, PromptLookupDraft(), NEW_TOKENS)
    assert tokens == ref[:9] == greedy_generate(make_engine(tiny), prompt, NEW_TOKENS) and stats.stop_reason == "eos"
    tokens, stats = speculative_generate(make_engine(tiny), prompt, PromptLookupDraft(), NEW_TOKENS, eos_token_id=None)
    assert tokens == ref[:NEW_TOKENS] == greedy_generate(make_engine(tiny), prompt, NEW_TOKENS, eos_token_id=None)
    assert stats.stop_reason == "length"


@pytest.mark.parametrize("eos, match", [
    ("eos", "eos_token_id must be 'model'"),
    (512, r"eos_token_id must be token ids in \[0, 512\), got 512"),
    ([3, -1], r"eos_token_id must be token ids in \[0, 512\), got \[3, -1\]"),
    ([], "eos_token_id must be token ids"),
])
def test_bad_eos_raises_before_the_prefill(tiny, eos, match):
    for run in (lambda e: speculative_generate(e, [1, 2, 3], PromptLookupDraft(), 4, eos_token_id=eos),
                lambda e: greedy_generate(e, [1, 2, 3], 4, eos_token_id=eos)):
        engine = make_engine(tiny)
        with pytest.raises(ValueError, match=match):
            run(engine)
        assert engine.tree.num_nodes == 0


def test_pipelined_greedy_equals_plain_greedy(tiny, reference):
    """Each step planned and launched before the previous token is read back (the engine reads it on
    the device): the same tokens and tree; after an EOS one more step ran and its token was dropped."""
    prompt, ref = reference
    engine = make_engine(tiny)
    assert greedy_generate(engine, prompt, 12, pipeline=True) == ref[:12]
    assert engine.stats["steps"] == 12 and engine.tree.sequence(engine.tree.roots[0]) == prompt + ref[:11]
    eos = first_occurrence(ref, 8)
    engine = make_engine(tiny)
    assert greedy_generate(engine, prompt, 12, eos_token_id=[eos, 511], pipeline=True) == ref[:9]
    assert engine.stats["steps"] == 10 and engine.tree.sequence(engine.tree.roots[0]) == prompt + ref[:8]
    engine.tree.check_invariants()
    assert greedy_generate(make_engine(tiny), prompt, 1, pipeline=True) == ref[:1]
