"""Speculative requests with penalties, min-p and logprobs (treedec.programs.speculative.target_processing): greedy
acceptance with penalties gives plain greedy decoding's tokens with the same penalties, each tree row penalized by
its own path; rejection sampling's min-p is the target's warper (min_p=1 keeps only the argmax: plain greedy's
tokens again) and a seeded request's tokens do not depend on its batch; logprobs are the raw target's, as plain
decoding reports them; pipelined (the verify table's device counts) the penalties give the same tokens, logprobs
run unpipelined and say why."""
import numpy as np
import pytest
import torch

from treedec.engine import Engine
from treedec.programs.generate import generate_batch
from treedec.programs.speculative.acceptance import RejectionSampling
from treedec.programs.speculative.batch import sampled_acceptance, speculative_batch
from treedec.programs.speculative.drafts import PromptLookupDraft, TreeDraft
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.programs.speculative.target_processing import path_pairs
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.tree.token_tree import TokenTree
from tests.engines import tiny_model
from tests.programs.speculative.test_pipeline import permutation_target

CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]
PENALTIES = [dict(repetition_penalty=6.0), dict(presence_penalty=1.5), dict(frequency_penalty=0.3),
             dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.4)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def permutation():
    return permutation_target("cpu", torch.float32)


def engine_of(model):
    return Engine(model, kv_tokens=8192, page_size=4, backend="torch")


def specs(count, **params):
    rng = np.random.default_rng(0)
    out = []
    for k in range(count):
        motif = rng.integers(0, 512, 3).tolist()   # (repeated: the n-gram draft proposes repeats, which penalties hit)
        out.append(RequestSpec(k, prompt_ids=tuple(motif * (2 + k % 3) + rng.integers(0, 512, 2).tolist()),
                               params=SamplingParams(**{"max_tokens": 12 + k, "temperature": 0.0, "ignore_eos": True,
                                                        **params})))
    return out


def drafts(kind, heads=None):
    if kind == "ngram":
        return lambda spec: PromptLookupDraft(max_ngram=2, num_draft_tokens=4)
    if kind == "tree":
        tree = TokenTree.from_medusa_choices(CHOICES)
        return lambda spec: TreeDraft(tree, [(11 * i) % 512 for i in range(1, tree.size)])
    return lambda spec: MedusaDraft(heads, CHOICES)


def test_path_pairs_list_each_row_s_draft_tokens_from_the_root():
    tree = TokenTree.from_medusa_choices([(0,), (1,), (0, 0), (0, 0, 0)])   # 0 -> 1 -> 3 -> 4, 0 -> 2
    rows, along = path_pairs(tree, torch.device("cpu"))
    pairs = sorted(zip(rows.tolist(), along.tolist()))
    parents = tree.parents
    want = sorted((j, a) for j in range(1, tree.size) for a in _path(parents, j))
    assert pairs == want and (0, 0) not in pairs


def _path(parents, j):
    out = []
    while j:
        out.append(j)
        j = parents[j]
    return out


def cycle_target(length=3, logit=1.5, seed=0):
    """A tiny target whose greedy next token is ``perm[token]`` for a permutation of ``length``-cycles (its outputs
    repeat: penalties change them), its winning logit about ``logit``."""
    from treedec.models import from_config
    model = from_config("tiny", seed=seed, dtype=torch.float32, device="cpu")
    vocab = model.config.vocab_size
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    perm = torch.empty(vocab, dtype=torch.int64)
    cycles = order.reshape(-1, length) if vocab % length == 0 else order[:vocab - vocab % length].reshape(-1, length)
    perm[order] = order   # (the leftovers map to themselves)
    perm[cycles.reshape(-1)] = cycles.roll(-1, dims=1).reshape(-1)
    with torch.no_grad():
        for layer in model.layers:
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
        emb = model.embed_tokens.weight
        model.lm_head.weight.copy_(emb[torch.argsort(perm)])
        x = emb[:64]
        hidden = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.norm.eps) * model.norm.weight
        top = (hidden @ model.lm_head.weight.T).amax(dim=-1).mean()
        model.lm_head.weight.mul_(logit / float(top))
    return model


@pytest.fixture(scope="module")
def cycles():
    return cycle_target()


@pytest.mark.slow
@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(p))
def test_greedy_ngram_acceptance_with_penalties_equals_plain_greedy_with_them(cycles, penalty):
    """Outputs that repeat (the target's cycles, the n-gram draft proposing the repeats): penalties change them, and
    each tree row is penalized by its own path."""
    batch = specs(4, **penalty)
    plain, _ = generate_batch(engine_of(cycles), batch)
    spec, _ = speculative_batch(engine_of(cycles), batch, drafts("ngram"), max_draft_tokens=16)
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    assert all(not s.stats["pipelined"] for s in spec)
    unpenalized, _ = generate_batch(engine_of(cycles), specs(4))
    assert [u.output_ids for u in unpenalized] != [p.output_ids for p in plain]   # (the penalties mattered)
    if penalty == dict(frequency_penalty=0.3):   # (mild: the cycles repeat a while, their drafts accepted, then change)
        assert all(sum(s.stats["accepted"]) for s in spec)


@pytest.mark.parametrize("kind", ["tree", "medusa"])
def test_greedy_tree_acceptance_with_penalties_equals_plain_greedy_with_them(permutation, kind):
    model, heads, _ = permutation
    batch = specs(4, **PENALTIES[-1])
    plain, _ = generate_batch(engine_of(model), batch)
    spec, _ = speculative_batch(engine_of(model), batch, drafts(kind, heads), max_draft_tokens=16)
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]


def test_greedy_ngram_with_penalties_on_a_random_model_equals_plain_greedy(tiny):
    batch = specs(3, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3)
    plain, _ = generate_batch(engine_of(tiny), batch)
    spec, _ = speculative_batch(engine_of(tiny), batch, drafts("ngram"), max_draft_tokens=16)
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]


def test_rejection_sampling_with_min_p_one_and_penalties_is_plain_greedy_with_them(permutation):
    """min_p=1 keeps only the most likely token of the penalized distribution: rejection sampling at any temperature
    then emits plain greedy decoding's tokens under the same penalties."""
    model, heads, _ = permutation
    penalty = dict(repetition_penalty=1.2, frequency_penalty=0.6)
    plain, _ = generate_batch(engine_of(model), specs(4, **penalty))
    sampled = specs(4, **penalty, temperature=0.9, min_p=1.0, seed=5)
    got, _ = speculative_batch(engine_of(model), sampled, drafts("ngram"), max_draft_tokens=16,
                               acceptance=lambda spec: sampled_acceptance(spec, lambda s: s.params.seed))
    assert [g.output_ids for g in got] == [p.output_ids for p in plain]


def test_seeded_rejection_sampling_with_penalties_and_min_p_is_batch_independent(permutation):
    model, heads, _ = permutation
    batch = specs(6, presence_penalty=0.7, temperature=1.0, min_p=0.05, seed=0)
    batch = [RequestSpec(s.id, prompt_ids=s.prompt_ids, params=s.params.replace(seed=40 + s.id)) for s in batch]
    rule = lambda spec: sampled_acceptance(spec, lambda s: s.params.seed)   # noqa: E731
    together, _ = speculative_batch(engine_of(model), batch, drafts("ngram"), max_draft_tokens=16, acceptance=rule)
    alone, _ = speculative_batch(engine_of(model), batch[3:4], drafts("ngram"), max_draft_tokens=16, acceptance=rule)
    assert together[3].output_ids == alone[0].output_ids
    again, _ = speculative_batch(engine_of(model), batch, drafts("ngram"), max_draft_tokens=16, acceptance=rule)
    assert [a.output_ids for a in again] == [t.output_ids for t in together]
    assert RejectionSampling(0.5, min_p=0.1).batch_key != RejectionSampling(0.5, min_p=0.2).batch_key
    with pytest.raises(ValueError, match="min_p"):
        RejectionSampling(0.5, min_p=1.5)


@pytest.mark.parametrize("kind", ["ngram", "medusa"])
def test_logprobs_of_accepted_tokens_are_the_raw_target_s_as_plain_decoding_reports(permutation, kind):
    model, heads, _ = permutation
    batch = specs(4, logprobs=3, frequency_penalty=0.5)
    plain, _ = generate_batch(engine_of(model), batch)
    spec, _ = speculative_batch(engine_of(model), batch, drafts(kind, heads), max_draft_tokens=16)
    for s, p in zip(spec, plain):
        assert s.output_ids == p.output_ids and len(s.logprobs) == len(s.output_ids)
        for mine, theirs, token in zip(s.logprobs, p.logprobs, s.output_ids):
            assert mine.keys() == theirs.keys() and mine[token].rank == theirs[token].rank
            assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)
        assert s.cumulative_logprob == pytest.approx(p.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("kind", ["medusa", "tree"])
def test_pipelined_penalties_equal_the_unpipelined_loop_and_plain_greedy(permutation, kind):
    """The verify table keeps its rows' counts on the device: pipelined, greedy acceptance with penalties gives plain
    greedy decoding's tokens, in a batch mixing penalized and plain requests (two groups)."""
    model, heads, _ = permutation
    batch = specs(6, **PENALTIES[0])
    batch = [s if s.id % 3 else RequestSpec(s.id, prompt_ids=s.prompt_ids, params=SamplingParams(
        max_tokens=s.params.max_tokens, temperature=0.0, ignore_eos=True)) for s in batch]
    plain, _ = generate_batch(engine_of(model), batch)
    piped, _ = speculative_batch(engine_of(model), batch, drafts(kind, heads), pipeline=True, max_draft_tokens=16)
    assert [s.output_ids for s in piped] == [p.output_ids for p in plain] and all(s.stats["pipelined"] for s in piped)
    unpenalized, _ = generate_batch(engine_of(model), specs(6))
    assert [u.output_ids for u in unpenalized] != [p.output_ids for p in plain]   # (the penalties mattered)


def test_pipelined_seeded_rejection_sampling_with_penalties_equals_the_unpipelined_loop(permutation):
    """Seeded rejection sampling draws the same counter-based numbers pipelined or not: with penalties (counted on
    the device, pipelined) and min-p the tokens are the same."""
    model, heads, _ = permutation
    batch = specs(5, repetition_penalty=3.0, frequency_penalty=0.5, temperature=0.8, min_p=0.02, seed=0)
    batch = [RequestSpec(s.id, prompt_ids=s.prompt_ids, params=s.params.replace(seed=7 + s.id)) for s in batch]
    rule = lambda spec: sampled_acceptance(spec, lambda s: s.params.seed)   # noqa: E731
    runs = [speculative_batch(engine_of(model), batch, drafts("medusa", heads), pipeline=pipeline, acceptance=rule,
                              max_draft_tokens=16)[0] for pipeline in (False, True)]
    assert [r.output_ids for r in runs[0]] == [r.output_ids for r in runs[1]]
    assert [r.stats["pipelined"] for r in runs[1]] == [True] * 5


def test_the_pipelined_path_declines_logprobs_and_says_why(permutation):
    model, heads, _ = permutation
    with pytest.raises(ValueError, match="logprobs are recorded on the unpipelined path"):
        speculative_batch(engine_of(model), specs(1, logprobs=1), drafts("medusa", heads), pipeline=True)
    [auto], _ = speculative_batch(engine_of(model), specs(1, logprobs=0), drafts("medusa", heads))
    assert not auto.stats["pipelined"]
    [piped], _ = speculative_batch(engine_of(model), specs(1, min_p=0.2), drafts("medusa", heads), pipeline=True)
    assert piped.stats["pipelined"]   # (min-p is the rule's warper: pipelined too)
