"""ScheduleRecorder on speculative decoding (tiny random model, CPU): every draft source, one request or a batch,
greedy or sampled, pipelined or not; each run recorded, saved, loaded and replayed (tests/replay/recording.py).

An unpipelined run replays to the same tree after every step. A pipelined step reserves slots for the previous
step's root and accepted path before that path is known (``tree.extend_computed``), copies their K/V on the
device and cuts the unused slots a step later; the recorder writes that as the accept it is, so the schedule's
tree is the one the unpipelined loop grows: its replay reads, after every step, the token sequences the
unpipelined run read (same accepted paths, same drafts), and ends on the pipelined run's tree.
"""
import collections

import numpy as np
import pytest

from treedec.sampling.params import SamplingParams
from treedec.engine import Engine
from treedec.models.medusa import MedusaHeads
from treedec.programs import greedy_generate
from treedec.runtime import RequestSpec
from treedec.programs.speculative import (DraftModelDraft, EagleDraft, MedusaDraft, PromptLookupDraft,
                                        RejectionSampling, TreeDraft, speculative_batch, speculative_generate)
from treedec.tree.token_tree import TokenTree
from treedec.workloads import Accept, Extend, TokenTree as TokenTreeOp
from tests.engines import tiny_model
from tests.replay.recording import (CHUNK, PAGE, continued, leaf_sequences, make_engine, ops_of, prompt, record,
                                    replay_steps, sequences_seen)
from tests.programs.speculative.test_eagle import bigram_eagle

TEXT = prompt(9, 5) + prompt(10, 3) + prompt(9, 5)   # repeats, for the n-gram draft
AHEAD = greedy_generate(make_engine(), TEXT, 30, eos_token_id=None)
HEADS = MedusaHeads.untrained(tiny_model(), num_heads=4)


def oracle_tree_draft():
    """A fixed token tree whose all-zeros path is the model's greedy continuation (accepted), the rest random."""
    tree = TokenTree.from_medusa_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    full, rng = list(TEXT) + AHEAD, np.random.default_rng(0)

    def tokens(seq):
        rest = full[len(seq):]
        return [rest[len(p) - 1] if not any(p) and len(p) <= len(rest) else int(rng.integers(0, 512))
                for p in tree.paths[1:]]
    return TreeDraft(tree, tokens)


def common_tokens_draft():
    """A fixed tree of fixed tokens (it pipelines): the greedy continuation's most frequent tokens, so that
    steps accept paths of different lengths."""
    common = [t for t, _ in collections.Counter(AHEAD).most_common(3)]
    tree = TokenTree.from_medusa_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
    return TreeDraft(tree, common + [common[1], common[2], common[0]])


def eagle_engine():
    return Engine(bigram_eagle(tiny_model()), kv_tokens=1024, page_size=PAGE, backend="torch")


DRAFTS = {
    "fixed-tree": oracle_tree_draft,
    "n-gram": lambda: PromptLookupDraft(max_ngram=2, min_ngram=1, num_draft_tokens=3, max_matches=2),
    "medusa": lambda: MedusaDraft(HEADS),
    "draft-model": lambda: DraftModelDraft(Engine(tiny_model(), kv_tokens=512, page_size=PAGE, backend="torch"),
                                           depth=2, top_k=2, total_tokens=4),
    "eagle": lambda: EagleDraft(eagle_engine(), depth=3, top_k=2),
}


@pytest.mark.parametrize("name", list(DRAFTS))
def test_speculative_generate(name):
    schedule, shots, final, (tokens, stats) = record(
        lambda e: speculative_generate(e, TEXT, DRAFTS[name](), 8, eos_token_id=None, pipeline=False), prompt_ids=True)
    assert tokens == AHEAD[:8] and not stats.pipelined
    if name in ("fixed-tree", "draft-model"):   # drafts of the model's own choices: some are accepted
        assert ops_of(schedule, Accept)
    assert ops_of(schedule, TokenTreeOp)
    replay_steps(schedule, shots, final)   # greedy: the replay's own choices are the recorded tokens
    node_tokens = next(toks for parent, toks in final[0].values() if parent is None)
    assert node_tokens[len(TEXT):] == tuple(tokens[:len(node_tokens) - len(TEXT)])


def test_sampled_speculative_generate():
    def run(engine):
        return speculative_generate(engine, TEXT, MedusaDraft(HEADS), 10, RejectionSampling(0.8, seed=3),
                                    eos_token_id=None, pipeline=False)

    schedule, shots, final, _ = record(run, token_ids=True)
    replay_steps(schedule, shots, final)


# ================================================================ pipelined


def pipelined_and_not(run, **flags):
    """Record ``run(engine, pipeline)`` both ways: (schedule, snapshots, final tree, result) of each."""
    return [record(lambda e: run(e, pipeline), **flags) for pipeline in (False, True)]


def check_pipelined(unpipelined, pipelined):
    """The pipelined run's schedule replays to the token sequences the unpipelined run read after each of its
    steps (the pipelined run launches one step more, past the stop, and rolls it back: one step more in its
    schedule) and to the pipelined run's final tree; returns the pipelined schedule."""
    reference, shots, _, _ = unpipelined
    schedule, _, final, _ = pipelined
    _, trees = sequences_seen(schedule)
    assert len(schedule) == len(reference) + 1
    for i, (replayed, real) in enumerate(zip(trees, shots)):
        assert leaf_sequences(replayed) == leaf_sequences(real), f"step {i}"
    assert trees[-1] == final
    return schedule


PIPELINED = {
    "fixed-tokens": (common_tokens_draft, None, None),
    "fixed-tokens-eos": (common_tokens_draft, None, AHEAD[5]),
    "medusa": (lambda: MedusaDraft(HEADS), None, None),
    "medusa-sampled": (lambda: MedusaDraft(HEADS), lambda: RejectionSampling(0.8, seed=3), None),
    "eagle-chains": (lambda: EagleDraft(eagle_engine(), depth=3, top_k=2, tree="chains"), None, None),
}


@pytest.mark.parametrize("name", list(PIPELINED))
def test_pipelined_speculative_generate(name):
    draft, rule, eos = PIPELINED[name]

    def run(engine, pipeline):
        return speculative_generate(engine, TEXT, draft(), 12, None if rule is None else rule(), eos_token_id=eos,
                                    pipeline=pipeline)

    runs = pipelined_and_not(run, **({"prompt_ids": True} if rule is None else {"token_ids": True}))
    (tokens, stats), (piped_tokens, piped_stats) = runs[0][3], runs[1][3]
    assert piped_stats.pipelined and piped_tokens == tokens and piped_stats.accepted == stats.accepted
    if rule is None:
        assert tokens == AHEAD[:len(tokens)]
    if name.startswith("fixed-tokens"):   # paths of several lengths: reserved slots were left unused
        assert len(set(stats.accepted)) > 1
    schedule = check_pipelined(*runs)
    assert len(ops_of(schedule, Accept)) == len(stats.accepted)   # each verified tree's path, kept in place
    assert [op.tokens for op in ops_of(schedule, Extend)] == [TEXT[CHUNK:]]   # (the prompt's second chunk)
    # The step launched past the stop is rolled back: its tree pruned (and the node cut if the stop was inside
    # the path).
    assert [op.op for op in schedule.steps[-1]] in (["prune"], ["prune", "truncate"])


@pytest.mark.parametrize("pipeline", [False, True])
def test_speculative_batch(pipeline):
    specs = [RequestSpec(i, prompt_ids=prompt(20 + i, 6 + 3 * i),
                         params=SamplingParams(max_tokens=5 + i, temperature=0.0))
             for i in range(3)]
    schedule, shots, final, (results, stats) = record(
        lambda e: speculative_batch(e, specs, lambda spec: common_tokens_draft(), pipeline=pipeline,
                                    max_step_tokens=64), prompt_ids=True)
    assert all(r.stats["pipelined"] == pipeline for r in results) and max(stats.programs_per_step) == 3
    for spec, result in zip(specs, results):
        assert result.output_ids == greedy_generate(make_engine(), spec.prompt_ids, spec.params.max_tokens,
                                                    eos_token_id=None)
    if not pipeline:
        replay_steps(schedule, shots, final)
        return
    # Pipelined, the run's trees hold reserved slots the schedule has not: the replay has the run's nodes under
    # the same parents after every step, a request's node as long as the run's but its reserved slots; every
    # request's output is read by the replay.
    seen, trees = sequences_seen(schedule)
    depth, reserved = max(common_tokens_draft().fixed_tree.depth), []
    for i, (replayed, real) in enumerate(zip(trees, shots)):
        assert {n: p for n, (p, _) in replayed[0].items()} == {n: p for n, (p, _) in real[0].items()}, f"step {i}"
        extra = [len(real[0][n][1]) - len(t) for n, (_, t) in replayed[0].items()]
        assert all(0 <= k <= depth for k in extra), f"step {i}: {extra}"
        reserved += extra
    assert max(reserved) > 0 and trees[-1] == final
    assert all(continued(seen, spec.prompt_ids, r.output_ids) for spec, r in zip(specs, results))
