"""Acceptance rules: greedy, Medusa typical (hand-computed thresholds), lossless rejection sampling
(chi-square against fixed target/draft tables, no model), and seeded end-to-end runs on the tiny model."""
import collections
import math

import numpy as np
import pytest
import torch

from treedec.sampling.params import SamplingParams, sampling_probs
from treedec.programs.speculative.acceptance import (GreedyAcceptance, RejectionSampling, TypicalAcceptance,
                                                   recursive_rejection, without_replacement)
from treedec.programs.speculative.drafts import PromptLookupDraft
from treedec.programs.speculative.program import speculative_generate
from treedec.tree.token_tree import TokenTree
from tests.engines import make_engine, plain_greedy, tiny_model

# chi-square critical values at significance 1e-3, by degrees of freedom
CHI2_CRITICAL_1E3 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}   # p-value 0.001


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def logits_of(rows: list[list[float]]) -> torch.Tensor:
    """Logits whose softmax at temperature 1 is each row (rows of probabilities)."""
    return torch.log(torch.tensor(rows, dtype=torch.float64)).float()


# ================================================================ greedy


def test_greedy_accepts_the_longest_argmax_path():
    # root -> 1 (tok 5), 2 (tok 6); 1 -> 3 (tok 7); 2 -> 4 (tok 8); 3 -> 5 (tok 9)
    tree = TokenTree((-1, 0, 0, 1, 2, 3))
    tokens = [0, 5, 6, 7, 8, 9]
    argmax = [6, 7, 8, 3, 2, 1]     # the model's choice after each tree token
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).float()
    assert GreedyAcceptance().accept(tree, tokens, logits) == ([2, 4], 2)
    argmax[0] = 4                   # no root child matches
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).float()
    assert GreedyAcceptance().accept(tree, tokens, logits) == ([], 4)
    assert GreedyAcceptance().first_token(logits[1]) == 7


# ================================================================ typical acceptance

# vocab 4. Root row: p = [.7, .2, .05, .05]: H = 0.87, 0.3 * exp(-H) = 0.126, threshold 0.09.
TYPICAL_TREE = TokenTree((-1, 0, 0, 0, 1, 2))    # root -> a, b, c; a -> e; b -> d
TYPICAL_TOKENS = [0, 0, 1, 2, 2, 3]              # a=0 (.7), b=1 (.2), c=2 (.05); e=2, d=3
TYPICAL_ROWS = [
    [0.7, 0.2, 0.05, 0.05],     # root
    [0.97, 0.01, 0.01, 0.01],   # after a: e (token 2) has .01 < threshold
    [0.25, 0.25, 0.0, 0.5],     # after b: d (token 3) has .5
    [0.25, 0.25, 0.25, 0.25],   # after c
    [0.25, 0.25, 0.25, 0.25],   # after e
    [1e-9, 1e-9, 1.0, 1e-9],    # after d: the bonus is token 2 (the only one above the threshold)
]


def test_typical_acceptance_hand_computed():
    rule = TypicalAcceptance(temperature=1.0)
    # accepted: a (.7), b (.2), d (.5 after b); rejected: c (.05), e (.01). Deepest: b -> d.
    assert rule.accept(TYPICAL_TREE, TYPICAL_TOKENS, logits_of(TYPICAL_ROWS)) == ([2, 5], 2)


def test_typical_threshold_to_zero_accepts_the_deepest_likeliest_path():
    rule = TypicalAcceptance(temperature=1.0, posterior_threshold=1e-12)
    # every token is accepted: e and d are both at depth 2; log(.7 * .01) < log(.2 * .5): d wins
    assert rule.accept(TYPICAL_TREE, TYPICAL_TOKENS, logits_of(TYPICAL_ROWS))[0] == [2, 5]
    rows = [list(r) for r in TYPICAL_ROWS]
    rows[1] = [0.1, 0.1, 0.7, 0.1]                    # now e has .7: .7 * .7 > .2 * .5, e wins
    assert rule.accept(TYPICAL_TREE, TYPICAL_TOKENS, logits_of(rows))[0] == [1, 4]


def test_typical_strict_threshold_accepts_nothing():
    rule = TypicalAcceptance(temperature=1.0, posterior_threshold=1.0, posterior_alpha=1e9)
    # threshold 1: no token is accepted, and the bonus keeps the root's argmax only
    assert rule.accept(TYPICAL_TREE, TYPICAL_TOKENS, logits_of(TYPICAL_ROWS)) == ([], 0)


def test_typical_first_token_samples_above_the_threshold():
    rule = TypicalAcceptance(temperature=1.0, seed=0)
    root = logits_of(TYPICAL_ROWS)[0]
    draws = [rule.first_token(root) for _ in range(400)]
    assert set(draws) == {0, 1}                        # tokens 2 and 3 (.05 < .09) are never drawn
    assert 0.6 < draws.count(0) / len(draws) < 0.95    # p(0 | kept) = .7 / .9


def test_typical_acceptance_errors():
    with pytest.raises(ValueError, match=r"temperature must be a number in \[1e-05, 3.4028235e\+38\] "
                                         r"\(.*GreedyAcceptance\), got 0"):
        TypicalAcceptance(temperature=0)
    for temperature in (1e-45, 5e-324, 1e308):   # 0 or inf in float32: a NaN distribution
        with pytest.raises(ValueError, match="temperature must be a number in"):
            TypicalAcceptance(temperature=temperature)
        with pytest.raises(ValueError, match="temperature must be a number in"):
            RejectionSampling(temperature=temperature)
    with pytest.raises(ValueError, match=r"posterior_threshold must be a number in \[0, 3.4028235e\+38\] "
                                         r"\(finite in float32\), got -0.1"):
        TypicalAcceptance(posterior_threshold=-0.1)
    with pytest.raises(ValueError, match="posterior_alpha must be a number in .*got nan"):
        TypicalAcceptance(posterior_alpha=float("nan"))
    with pytest.raises(ValueError, match=r"seed must be in \[-9223372036854775808, 18446744073709551615\]"):
        RejectionSampling(seed=-2**63 - 1)   # (an int64 or its unsigned word: -1 is taken, as vLLM's seeds)
    with pytest.raises(ValueError, match="temperature must be a number in .*, got inf"):
        RejectionSampling(temperature=math.inf)


# ================================================================ rejection sampling: lossless

P_TABLE = np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
Q_TABLE = np.array([0.1, 0.4, 0.1, 0.3, 0.05, 0.05])
TRIALS = 12000


def sample_first_tokens(draft, trials=TRIALS, seed=0):
    """Emitted token per trial: k draft tokens from ``draft(rng)`` -> (tokens, q or None)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    p = torch.tensor(P_TABLE, dtype=torch.float32)
    counts = np.zeros(len(P_TABLE))
    for _ in range(trials):
        tokens, q = draft(rng)
        _, token = recursive_rejection(p, tokens, q, gen)
        counts[token] += 1
    return counts


@pytest.mark.slow
def test_rejection_sampling_is_lossless_for_sampled_drafts():
    q = torch.tensor(np.tile(Q_TABLE, (3, 1)), dtype=torch.float32)
    counts = sample_first_tokens(lambda rng: (rng.choice(6, size=3, p=Q_TABLE).tolist(), q))
    assert chi_square(counts, P_TABLE) < CHI2_CRITICAL_1E3[5]
    # the test has power: taking the first draft token as is gives q, far from p
    naive = np.bincount(np.random.default_rng(1).choice(6, size=TRIALS, p=Q_TABLE), minlength=6)
    assert chi_square(naive, P_TABLE) > 50 * CHI2_CRITICAL_1E3[5]


def test_rejection_sampling_is_lossless_for_deterministic_drafts():
    # one-hot q (q=None): a fixed draft [1, 3, 1] (a repeated token is never accepted twice)
    counts = sample_first_tokens(lambda rng: ([1, 3, 1], None))
    assert chi_square(counts, P_TABLE) < CHI2_CRITICAL_1E3[5]
    counts = sample_first_tokens(lambda rng: ([], None), trials=4000)
    assert chi_square(counts, P_TABLE) < CHI2_CRITICAL_1E3[5]


def test_rejection_sampling_over_a_tree_keeps_every_conditional():
    """First emitted token ~ p(root); given it is draft child a, the second ~ p(a)."""
    tree = TokenTree((-1, 0, 0, 1, 1))          # root -> a (tok 0), b (tok 2); a -> (tok 1), (tok 3)
    tokens = [3, 0, 2, 1, 3]
    rows = [[0.4, 0.1, 0.3, 0.2], [0.1, 0.5, 0.15, 0.25], [0.25] * 4, [0.25] * 4, [0.25] * 4]
    logits = logits_of(rows)
    rule = RejectionSampling(temperature=1.0, seed=0)
    first, second_after_a = np.zeros(4), np.zeros(4)
    for _ in range(8000):
        path, bonus = rule.accept(tree, tokens, logits)
        emitted = [tokens[i] for i in path] + [bonus]
        first[emitted[0]] += 1
        if path[:1] == [1]:
            second_after_a[emitted[1]] += 1
    assert chi_square(first, np.array(rows[0])) < CHI2_CRITICAL_1E3[3]
    assert second_after_a.sum() > 2500         # p(a) = .4
    assert chi_square(second_after_a, np.array(rows[1])) < CHI2_CRITICAL_1E3[3]


def passes_chi_square(counts: np.ndarray, probs: np.ndarray) -> bool:
    """chi-square over the tokens of nonzero probability below the 0.001 critical value; a token of
    zero probability must never appear."""
    assert counts[probs == 0].sum() == 0, f"tokens outside the support drawn: {counts[probs == 0]}"
    keep = probs > 0
    return chi_square(counts[keep], probs[keep] / probs[keep].sum()) < CHI2_CRITICAL_1E3[int(keep.sum()) - 1]


@pytest.mark.slow
def test_rejection_sampling_is_lossless_for_drafts_sampled_without_replacement():
    """Three distinct draft tokens drawn one after another from q without replacement, each tested
    against q without the ones before it: the emitted token is an exact sample of p."""
    q = torch.tensor(Q_TABLE, dtype=torch.float32)

    def draft(rng):
        tokens = rng.choice(6, size=3, replace=False, p=Q_TABLE).tolist()
        return tokens, without_replacement(q, tokens)

    counts = sample_first_tokens(draft)
    assert chi_square(counts, P_TABLE) < CHI2_CRITICAL_1E3[5]
    # the test has power: treating the draws as independent draws from q (the i.i.d. rule) is biased
    biased = sample_first_tokens(lambda rng: (rng.choice(6, size=3, replace=False, p=Q_TABLE).tolist(),
                                              q.repeat(3, 1)))
    assert chi_square(biased, P_TABLE) > 5 * CHI2_CRITICAL_1E3[5]


@pytest.mark.slow
@pytest.mark.parametrize("top_k, top_p", [(None, 1.0), (4, 1.0), (None, 0.7), (5, 0.8)])
def test_tree_rejection_sampling_with_sampled_drafts_emits_the_processed_target(top_k, top_p):
    """A tree whose children were sampled without replacement from the draft's processed q (same
    temperature, top-k, top-p as the rule): the first emitted token follows the target's processed p,
    and the second, after an accepted first child, the target's processed p there."""
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    target = logits_of([[0.3, 0.2, 0.15, 0.15, 0.1, 0.05, 0.05]] + [[0.1, 0.4, 0.1, 0.1, 0.1, 0.1, 0.1]] * 3)
    draft_logits = logits_of([[0.1, 0.15, 0.3, 0.2, 0.1, 0.1, 0.05], [0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1],
                              [1 / 7] * 7, [1 / 7] * 7])
    q = sampling_probs(draft_logits, params)                          # [4, vocab]: rows of root, a, b, c
    p_root = sampling_probs(target[0], params).double().numpy()
    p_after = sampling_probs(target[1], params).double().numpy()
    tree = TokenTree((-1, 0, 0, 1))                                   # root -> a, b; a -> c
    rule = RejectionSampling(temperature=0.8, top_k=top_k, top_p=top_p, seed=1)
    rng = torch.Generator().manual_seed(2)
    first, second = np.zeros(7), np.zeros(7)
    for _ in range(8000):
        a, b = torch.multinomial(q[0], 2, replacement=False, generator=rng).tolist()
        c = int(torch.multinomial(q[1], 1, generator=rng))
        tokens = [6, a, b, c]
        path, bonus = rule.accept(tree, tokens, target, q)
        emitted = [tokens[i] for i in path] + [bonus]
        first[emitted[0]] += 1
        if path[:1] == [1]:
            second[emitted[1]] += 1
    assert passes_chi_square(first, p_root)
    assert second.sum() > 500 and passes_chi_square(second, p_after)


def test_draft_probs_must_match_the_tree():
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[tree.size, vocab\] = \[2, 4\], got \[1, 4\]"):
        RejectionSampling().accept(TokenTree((-1, 0)), [0, 1], torch.zeros(2, 4), torch.ones(1, 4) / 4)


def test_recursive_rejection_checks_q():
    with pytest.raises(ValueError, match=r"q must have shape \[len\(draft_tokens\), vocab\] = \[2, 6\], got \[1, 6\]"):
        recursive_rejection(torch.tensor(P_TABLE), [0, 1], torch.ones(1, 6) / 6)


# ================================================================ end to end on the tiny model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


PROMPT = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2]


def run(tiny, rule, draft=None, n=24):
    engine = make_engine(tiny)
    tokens, stats = speculative_generate(engine, PROMPT, draft or PromptLookupDraft(num_draft_tokens=4), n, rule)
    engine.tree.check_invariants()
    engine.tree.prune(stats.node)
    assert engine.pool.num_free_pages == engine.pool.num_pages
    return tokens, stats


def test_sampled_runs_are_seeded(tiny):
    a, stats = run(tiny, RejectionSampling(temperature=1.0, seed=3))
    b, _ = run(tiny, RejectionSampling(temperature=1.0, seed=3))
    c, _ = run(tiny, RejectionSampling(temperature=1.0, seed=4))
    assert a == b and a != c and len(a) == 24 and all(0 <= t < 512 for t in a)
    assert stats.steps == len(stats.accepted) and sum(stats.accepted) + stats.steps + 1 >= 24
    t1, _ = run(tiny, TypicalAcceptance(seed=3))
    t2, _ = run(tiny, TypicalAcceptance(seed=3))
    assert t1 == t2


@pytest.mark.parametrize("rule", [RejectionSampling(temperature=1e-4), TypicalAcceptance(temperature=1e-4)],
                         ids=["sample", "typical"])
def test_near_zero_temperature_is_greedy(tiny, rule):
    # p is one-hot at the argmax: rejection sampling accepts exactly the argmax; the typical
    # threshold is min(.09, .3 * exp(-0)) = .09, so only the argmax passes it too
    tokens, stats = run(tiny, rule)
    assert tokens == plain_greedy(tiny, PROMPT, 24)
    assert sum(stats.accepted) > 0


@pytest.mark.slow
def test_sampled_draft_model_speculation_emits_the_target_distribution(tiny):
    """End to end on the tiny model: a draft model samples its trees (its distribution at temperature
    1.2, top-k 4: other than the target's), the program hands the draft's distributions to
    RejectionSampling (temperature 0.7, top-k 3); over many seeds, with hundreds of draft tokens
    accepted, the first emitted tokens and the second after the most frequent first one follow the
    target's own processed distributions. (The fixed tables above carry the power check: a flat
    random model's small top-k distributions barely separate a biased rule.)"""
    from tests.engines import make_engine as target_engine
    from treedec.engine import Engine
    from treedec.models import from_config
    from treedec.programs.speculative.draft_model import DraftModelDraft

    params = SamplingParams(temperature=0.7, top_k=3)
    draft_engine = Engine(from_config("tiny", seed=0), kv_tokens=1024, page_size=4, backend="torch")
    draft = DraftModelDraft(draft_engine, depth=2, top_k=2, total_tokens=4,
                            sample=SamplingParams(temperature=1.2, top_k=4))
    engine = target_engine(tiny)
    runs, accepted = [], 0
    for seed in range(600):
        rule = RejectionSampling(temperature=0.7, top_k=3, seed=seed)
        tokens, stats = speculative_generate(engine, PROMPT, draft, 3, rule, eos_token_id=None)
        engine.tree.prune(stats.node)
        runs.append(tokens)
        accepted += sum(stats.accepted)
    assert accepted > 300 and draft.draft_probs.shape == (5, 512)
    a, count = collections.Counter(t[0] for t in runs).most_common(1)[0]
    logits = engine.prefill(PROMPT + [a]).logits
    second = np.bincount([t[1] for t in runs if t[0] == a], minlength=512).astype(float)
    assert count > 150 and passes_chi_square(second, sampling_probs(logits, params).double().numpy())
    logits = engine.prefill(PROMPT).logits
    first = np.bincount([t[0] for t in runs], minlength=512).astype(float)
    assert passes_chi_square(first, sampling_probs(logits, params).double().numpy())


# ================================================================ float32 safety (issue #48)


def test_sampling_rules_stay_valid_at_degenerate_float32_values():
    """top_p=1e-300 (0 in float32) keeps the most likely token, a temperature near float32's largest over -inf
    padded logits gives a uniform distribution over the rest: no NaN, every id in the vocabulary."""
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0))
    logits[:, -6:] = float("-inf")                                    # a padded vocabulary
    tree = TokenTree([-1, 0, 0, 1])
    tokens = [3, int(logits[0].argmax()), 7, int(logits[1].argmax())]
    narrow = RejectionSampling(temperature=0.7, top_p=1e-300, seed=1)
    for _ in range(5):
        path, bonus = narrow.accept(tree, tokens, logits)
        assert path == [1, 3] and bonus == int(logits[3].argmax())      # only the argmax has mass
        length, bonus, *rest = narrow.outcome(tree, tokens, logits).tolist()
        assert length == 2 and bonus == int(logits[3].argmax())
    hot = TypicalAcceptance(temperature=3e38, seed=2)
    draws = {hot.first_token(logits[0]) for _ in range(50)}
    assert draws and max(draws) < 34
    hot_rejection = RejectionSampling(temperature=3e38, seed=3)
    assert all(hot_rejection.first_token(logits[0]) < 34 for _ in range(20))
