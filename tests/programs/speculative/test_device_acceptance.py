"""Rejection sampling decided on the device (treedec.programs.speculative.device_acceptance): the same distribution as the
host walk (chi-square on fixed tables, and host against device on one tree), the greedy limit equal to
greedy_path on hypothesis trees, batched outcomes equal to each tree's alone (rejection sampling: the same draws
whatever else is in the batch), bad input, and (GPU) no wait for the device while it is launched."""
import collections

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from treedec.programs.speculative.acceptance import RejectionSampling, greedy_path
from treedec.programs.speculative.device_acceptance import (DeviceTree, decode_outcome, greedy_outcomes,
                                                             rejection_outcomes)
from treedec.sampling.params import SamplingParams, sampling_probs
from treedec.tree.token_tree import TokenTree
from tests.programs.speculative.test_acceptance import (CHI2_CRITICAL_1E3, P_TABLE, Q_TABLE, chi_square, logits_of,
                                          passes_chi_square)


def emitted(rule_or_none, tree, tokens, logits, q=None, params=None):
    """(path, bonus) from the device rule (``rule_or_none`` None: rejection_outcomes of one tree with ``params``)."""
    if rule_or_none is None:
        one = torch.zeros(1, dtype=torch.int64)
        return decode_outcome(rejection_outcomes(tree, torch.tensor([tokens]), logits[None], params, one, one,
                                                 None if q is None else q[None])[0].tolist())
    return decode_outcome(rule_or_none.outcome(tree, tokens, logits, q).tolist())


def greedy_outcome(tree, tokens, argmax):
    """greedy_outcomes of one tree."""
    return greedy_outcomes(tree, torch.as_tensor(tokens)[None], torch.as_tensor(argmax)[None])[0]


@pytest.mark.slow
def test_first_token_follows_p_for_point_mass_drafts_with_a_repeated_token():
    # root -> three children 1, 3, 1: a rejected token is never accepted again
    tree, tokens = TokenTree((-1, 0, 0, 0)), [5, 1, 3, 1]
    logits = logits_of([list(P_TABLE)] * 4)
    rule = RejectionSampling(temperature=1.0, seed=0)
    counts = np.zeros(6)
    for _ in range(6000):
        path, bonus = emitted(rule, tree, tokens, logits)
        counts[([tokens[i] for i in path] + [bonus])[0]] += 1
        assert path in ([], [1], [2])   # the second 1 (index 3) is never the accepted child
    assert chi_square(counts, P_TABLE) < CHI2_CRITICAL_1E3[5]


@pytest.mark.slow
def test_first_token_follows_p_for_drafts_sampled_without_replacement():
    tree = TokenTree((-1, 0, 0, 0))
    q = torch.tensor(np.tile(Q_TABLE, (4, 1)), dtype=torch.float32)
    logits = logits_of([list(P_TABLE)] * 4)
    rule = RejectionSampling(temperature=1.0, seed=1)
    rng = np.random.default_rng(0)
    counts = np.zeros(6)
    for _ in range(6000):
        tokens = [5] + rng.choice(6, size=3, replace=False, p=Q_TABLE).tolist()
        path, bonus = emitted(rule, tree, tokens, logits, q)
        counts[([tokens[i] for i in path] + [bonus])[0]] += 1
    assert chi_square(counts, P_TABLE) < CHI2_CRITICAL_1E3[5]


@pytest.mark.slow
@pytest.mark.parametrize("top_k, top_p", [(None, 1.0), (5, 0.8)])
def test_every_conditional_of_a_tree_with_sampled_drafts(top_k, top_p):
    """As the host rule's test: the first emitted token ~ the target's processed p at the root, the second
    (after an accepted first child) ~ p there."""
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    target = logits_of([[0.3, 0.2, 0.15, 0.15, 0.1, 0.05, 0.05]] + [[0.1, 0.4, 0.1, 0.1, 0.1, 0.1, 0.1]] * 3)
    q = sampling_probs(logits_of([[0.1, 0.15, 0.3, 0.2, 0.1, 0.1, 0.05], [0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1],
                                  [1 / 7] * 7, [1 / 7] * 7]), params)
    tree = TokenTree((-1, 0, 0, 1))
    rule = RejectionSampling(temperature=0.8, top_k=top_k, top_p=top_p, seed=1)
    rng = torch.Generator().manual_seed(2)
    first, second = np.zeros(7), np.zeros(7)
    for _ in range(6000):
        a, b = torch.multinomial(q[0], 2, replacement=False, generator=rng).tolist()
        tokens = [6, a, b, int(torch.multinomial(q[1], 1, generator=rng))]
        path, bonus = emitted(rule, tree, tokens, target, q)
        out = [tokens[i] for i in path] + [bonus]
        first[out[0]] += 1
        if path[:1] == [1]:
            second[out[1]] += 1
    assert passes_chi_square(first, sampling_probs(target[0], params).double().numpy())
    assert second.sum() > 400 and passes_chi_square(second, sampling_probs(target[1], params).double().numpy())


@pytest.mark.slow
def test_device_outcomes_match_the_host_walk_in_distribution():
    """Two-sample chi-square over whole outcomes (accepted path and bonus) of one depth-3 tree: the host
    walk's against the device's, 5000 draws each."""
    tree = TokenTree((-1, 0, 0, 1, 1, 3))
    tokens = [0, 1, 2, 0, 3, 2]
    logits = logits_of([[0.3, 0.35, 0.2, 0.15], [0.4, 0.1, 0.2, 0.3], [0.25] * 4, [0.1, 0.2, 0.6, 0.1],
                        [0.25] * 4, [0.7, 0.1, 0.1, 0.1]])
    host, device = RejectionSampling(seed=0), RejectionSampling(seed=1)
    a = collections.Counter(repr(host.accept(tree, tokens, logits)) for _ in range(5000))
    b = collections.Counter(repr(emitted(device, tree, tokens, logits)) for _ in range(5000))
    keys = sorted(set(a) | set(b))
    common = [k for k in keys if a[k] + b[k] >= 20]               # rare outcomes pooled
    rows = np.array([[a[k] for k in common] + [sum(a[k] for k in keys if k not in common)],
                     [b[k] for k in common] + [sum(b[k] for k in keys if k not in common)]], dtype=float)
    rows = rows[:, rows.sum(axis=0) > 0]
    expected = rows.sum(axis=1, keepdims=True) * rows.sum(axis=0, keepdims=True) / rows.sum()
    statistic = ((rows - expected) ** 2 / expected).sum()
    df = rows.shape[1] - 1
    assert df >= 8
    critical = df + 3.09 * np.sqrt(2 * df) + 3.09 ** 2 * 2 / 3   # ~ the 0.001 quantile (Wilson-Hilferty bound)
    assert statistic < critical, (statistic, critical, a, b)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_greedy_limit_is_greedy_path(data):
    """At a tiny temperature p is one-hot at the argmax: the device's path and bonus are greedy_path's, on
    random trees with repeated sibling tokens."""
    size = data.draw(st.integers(1, 12))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, size)]
    vocab = 5
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=size, max_size=size))
    choice = data.draw(st.lists(st.integers(0, vocab - 1), min_size=size, max_size=size))
    tree = TokenTree(parents)
    logits = torch.nn.functional.one_hot(torch.tensor(choice), vocab).float() * 50
    out = emitted(None, tree, tokens, logits,
                  params=SamplingParams(temperature=0.01, top_k=None, top_p=1.0))
    assert out == greedy_path(tree, tokens, choice)


def test_device_tree_shapes_are_cached_per_device():
    tree = TokenTree((-1, 0, 0, 1))
    a = DeviceTree.of(tree, "cpu")
    assert DeviceTree.of(TokenTree((-1, 0, 0, 1)), torch.device("cpu")) is a
    assert a.children.tolist() == [[1, 2], [3, -1], [-1, -1], [-1, -1]]
    assert a.ancestors[3].tolist() == [False, True, False, True] and a.depth == 2


def test_bad_input_is_refused():
    rule = RejectionSampling()
    tree = TokenTree((-1, 0))
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[tree.size, vocab\] = \[2, 4\], got \[1, 4\]"):
        rule.outcome(tree, [0, 1], torch.zeros(2, 4), torch.ones(1, 4) / 4)
    with pytest.raises(ValueError, match=r"one row per tree token \(2\), got 3 and 2"):
        rule.outcome(tree, [0, 1, 2], torch.zeros(2, 4))


@pytest.mark.gpu
def test_the_outcome_is_launched_without_waiting_for_the_device():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tree = TokenTree.from_medusa_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    logits = torch.randn(tree.size, 32000, device="cuda")
    tokens = torch.randint(0, 32000, (tree.size,), device="cuda")
    q = torch.softmax(torch.randn(tree.size, 32000, device="cuda"), dim=-1)
    rule = RejectionSampling(temperature=0.7, top_k=50, seed=0)
    rule.outcome(tree, tokens, logits, q)   # first call: the tree's device tensors are made (copies)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    cut = TokenTree(tree.parents[:4])   # a shape never seen: its device tensors are made without a wait too
    try:
        one = rule.outcome(tree, tokens, logits)
        two = rule.outcome(tree, tokens, logits, q)
        three = greedy_outcome(cut, tokens[:4], logits[:4].argmax(dim=-1))
        again = [greedy_outcome(cut, tokens[:4], logits[:4].argmax(dim=-1)) for _ in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    path, bonus = decode_outcome(three.tolist())
    assert bonus == int(logits[path[-1] if path else 0].argmax())
    assert all(a.tolist() == three.tolist() for a in again)
    for out in (one, two):
        path, bonus = decode_outcome(out.tolist())
        assert 0 <= bonus < 32000 and all(tree.parents[c] == p for p, c in zip([0] + path, path))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_greedy_outcome_is_greedy_path(data):
    size = data.draw(st.integers(1, 14))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, size)]
    tokens = data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    choice = data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    tree = TokenTree(parents)
    out = decode_outcome(greedy_outcome(tree, torch.tensor(tokens), torch.tensor(choice)).tolist())
    assert out == greedy_path(tree, tokens, choice)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_batched_outcomes_equal_each_tree_alone(data):
    """R trees of one shape decided at once == each decided alone: greedy, and rejection sampling with each tree's
    own seed and step (its numbers do not depend on the others: seeded tokens independent of the batch)."""
    size = data.draw(st.integers(1, 8))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, size)]
    tree, r, vocab = TokenTree(parents), data.draw(st.integers(1, 5)), 6
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    tokens = torch.randint(0, vocab, (r, size), generator=gen)
    logits = torch.randn(r, size, vocab, generator=gen) * 2
    argmax = logits.argmax(dim=-1)
    batched = greedy_outcomes(tree, tokens, argmax)
    assert all(batched[i].tolist() == greedy_outcome(tree, tokens[i], argmax[i]).tolist() for i in range(r))
    params = SamplingParams(temperature=0.8)
    seeds, steps = torch.randint(0, 2 ** 40, (r,), generator=gen), torch.randint(0, 50, (r,), generator=gen)
    batched = rejection_outcomes(tree, tokens, logits, params, seeds, steps)
    for i in range(r):
        alone = rejection_outcomes(tree, tokens[i:i + 1], logits[i:i + 1], params, seeds[i:i + 1], steps[i:i + 1])
        assert batched[i].tolist() == alone[0].tolist()
        rule = RejectionSampling(temperature=0.8, seed=int(seeds[i]))
        assert rule.outcome(tree, tokens[i], logits[i], step=int(steps[i])).tolist() == alone[0].tolist()
