"""The draft-token budget of speculative batches (treedec.programs.speculative.draft_budget; tiny random Llama, CPU)."""
import logging

import numpy as np
import pytest
import torch

from treedec.engine import Engine
from treedec.programs.speculative.acceptance import RejectionSampling
from treedec.programs.speculative.draft_budget import DraftBudget, cut_tree
from treedec.programs.speculative.draft_model import DraftModelDraft
from treedec.programs.speculative.drafts import TreeDraft
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.programs.speculative.batch import speculative_batch
from treedec.tree.token_tree import TokenTree
from tests.engines import plain_greedy, tiny_model
from tests.programs.speculative.test_speculative_batch import medusa_token_tree, specs

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.mark.parametrize("kwargs,match", [({"step_tokens": 0},
                                           "step_tokens must be an int >= 1, 'auto' or None, got 0"),
                                          ({"step_tokens": "many"}, "step_tokens must be an int >= 1, 'auto' or None"),
                                          ({"step_tokens": True}, "step_tokens must be"),
                                          ({"min_tokens": -1}, "min_tokens must be an int >= 0, got -1"),
                                          ({"smoothing": 0}, r"smoothing must be a number in \(0, 1\], got 0"),
                                          ({"smoothing": 1.5}, "smoothing must be")])
def test_bad_budgets_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DraftBudget(**kwargs)


def test_shares_follow_measured_acceptance():
    """Three requests share a budget of 33 verify tokens, their 3 roots and 30 draft tokens: equally before any
    step, then by 1 + their running acceptance; never past the draft's tree, never under min_tokens; every decision
    recorded."""
    budget = DraftBudget(step_tokens=33, min_tokens=2, smoothing=1.0)
    a, b, c = object(), object(), object()
    for p in (a, b, c):
        budget.join(p)
    assert [budget.tokens(p, CPU, 63) for p in (a, b, c)] == [10, 10, 10]
    budget.observe(a, 4)      # weights 5, 1, 1
    assert [budget.tokens(p, CPU, 63) for p in (a, b, c)] == [21, 4, 4]
    assert budget.tokens(a, CPU, 7) == 7                              # the tree is smaller than the share
    budget.leave(b)
    budget.observe(c, 0)
    assert budget.tokens(c, CPU, 63) == 5                              # (33 - 2) * 1 / 6
    budget = DraftBudget(step_tokens=4, min_tokens=3)
    ps = [object() for _ in range(8)]
    for p in ps:
        budget.join(p)
    assert budget.tokens(ps[0], CPU, 63) == 3                          # 8 roots use all 4: min_tokens
    assert budget.history[-1] == {"requests": 8, "step_tokens": 4, "tokens": 3}
    assert DraftBudget(step_tokens=5).tokens(object(), CPU, 9) == 9    # a program not joined: its tree
    unlimited = DraftBudget(step_tokens=None)
    unlimited.join(a)
    assert unlimited.tokens(a, CPU, 63) == 63 and unlimited.resolve(torch.device("cuda")) is None


def test_auto_budget_is_reported(caplog):
    budget = DraftBudget()
    with caplog.at_level(logging.INFO, logger="treedec"):
        assert budget.resolve(CPU) is None and budget.resolve(torch.device("cuda")) is None   # chosen once
    assert "draft budget: no limit (auto, cpu)" in caplog.text
    assert DraftBudget().resolve(torch.device("cuda")) == 256


def test_cut_tree_keeps_a_tree():
    tree = medusa_token_tree()
    tokens = list(range(tree.size))
    probs = torch.rand(tree.size, 11)
    cut, kept, cut_probs = cut_tree(tree, tokens, 5, probs)
    assert cut.parents == tree.parents[:6] and kept == tokens[:6] and torch.equal(cut_probs, probs[:6])
    assert cut_tree(tree, tokens, tree.size, None) == (tree, tokens, None)
    assert cut_tree(TokenTree.chain(3), [1, 2, 3, 4], 0)[0].parents == (-1,)


def test_budgeted_batch_is_plain_greedy_with_cut_trees(tiny):
    """Five requests with 31-token Medusa trees under a budget of 12 draft tokens a step: every output is
    plain greedy decoding's, no step verifies more than the budget allows, every page is freed."""
    engine = Engine(tiny, kv_tokens=8192, page_size=4, backend="torch")
    budget = DraftBudget(step_tokens=12)
    results, _ = speculative_batch(engine, specs(), lambda spec: TreeDraft(
        medusa_token_tree(), [(spec.id * 7 + i) % 512 for i in range(31)]), max_draft_tokens=32, draft_budget=budget)
    for r, spec in zip(results, specs()):
        assert r.output_ids == plain_greedy(tiny, list(spec.prompt_ids), spec.params.max_tokens)
        assert r.stats["draft_sizes"] and max(r.stats["draft_sizes"]) <= 12
    assert {h["requests"] for h in budget.history} >= {5, 1} and max(h["tokens"] for h in budget.history) <= 12
    assert engine.pool.num_free_pages == engine.pool.num_pages and engine.tree.num_nodes == 0


def test_budgeted_sampled_drafts_run_with_cut_distributions(tiny):
    """Sampled draft-model trees cut by the budget hand the acceptance rule their cut distributions."""
    engine = Engine(tiny, kv_tokens=8192, page_size=4, backend="torch")
    requests = [RequestSpec(k, prompt_ids=(1 + k, 2, 3, 4),
                            params=SamplingParams(max_tokens=6, temperature=0.8, seed=k))
                for k in range(3)]
    draft_engine = Engine(tiny, kv_tokens=4096, page_size=4, backend="torch")
    results, _ = speculative_batch(
        engine, requests, lambda spec: DraftModelDraft(draft_engine, depth=3, top_k=3, total_tokens=12,
                                                       sample=SamplingParams(temperature=0.8), seed=spec.id),
        acceptance=lambda spec: RejectionSampling(0.8, seed=spec.params.seed), draft_budget=DraftBudget(step_tokens=6))
    assert [len(r.output_ids) for r in results] == [6, 6, 6]
    assert all(max(r.stats["draft_sizes"]) <= 6 for r in results)
    assert engine.pool.num_free_pages == engine.pool.num_pages and draft_engine.tree.num_nodes == 0


class DictBudget:
    """The budget's arithmetic as it was written before its slot array: a dict of running acceptances in join
    order, summed as Python floats (the reference its shares must equal bit for bit)."""

    def __init__(self, total, min_tokens, smoothing):
        self.total, self.min_tokens, self.smoothing, self.live = total, min_tokens, smoothing, {}

    def observe(self, p, accepted):
        if p in self.live:
            self.live[p] = (1 - self.smoothing) * self.live[p] + self.smoothing * accepted

    def group_tokens(self, programs, proposed):
        live = [p for p in programs if p in self.live]
        if not live:
            return proposed
        weights = len(self.live) + sum(self.live.values())
        drafts = max(self.total - len(self.live), 0)   # the roots' tokens first
        share = int(drafts * sum(1.0 + self.live[p] for p in live) / (weights * len(live)))
        return min(proposed, max(self.min_tokens, share))

    def tokens(self, p, proposed):
        if p not in self.live:
            return proposed
        drafts = max(self.total - len(self.live), 0)
        share = int(drafts * (1.0 + self.live[p]) / (len(self.live) + sum(self.live.values())))
        return min(proposed, max(self.min_tokens, share))


@pytest.mark.parametrize("seed", range(4))
def test_slot_shares_equal_the_dict_reference(seed):
    """Random joins, leaves (slots reused), batched and single observations: every share and acceptance equals the
    dict reference's exactly (sums in join order, whatever the slots)."""
    rng = np.random.default_rng(seed)
    budget = DraftBudget(step_tokens=int(rng.integers(8, 300)), min_tokens=1, smoothing=float(rng.uniform(0.05, 1)))
    ref = DictBudget(budget.step_tokens, 1, budget.smoothing)
    programs = [object() for _ in range(40)]
    for _ in range(300):
        p = programs[int(rng.integers(len(programs)))]
        event = rng.integers(4)
        if event == 0:
            budget.join(p)
            ref.live[p] = 0.0
        elif event == 1:
            budget.leave(p)
            ref.live.pop(p, None)
        elif event == 2:
            group = [programs[i] for i in rng.choice(len(programs), int(rng.integers(1, 12)), replace=False)]
            accepted = rng.integers(0, 9, len(group))
            budget.observe_many(np.array([budget.slot(q) for q in group], dtype=np.int64), accepted)
            for q, a in zip(group, accepted.tolist()):
                ref.observe(q, a)
        else:
            accepted = int(rng.integers(0, 9))
            budget.observe(p, accepted)
            ref.observe(p, accepted)
        group = [programs[i] for i in rng.choice(len(programs), int(rng.integers(1, 12)), replace=False)]
        slots = np.array([budget.slot(q) for q in group], dtype=np.int64)
        assert budget.group_tokens(slots, CPU, 63) == ref.group_tokens(group, 63)
        assert budget.tokens(p, CPU, 63) == ref.tokens(p, 63)
        assert [float(budget._acceptance[budget.slot(q)]) for q in ref.live] == list(ref.live.values())
