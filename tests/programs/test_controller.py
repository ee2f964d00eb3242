"""Branch controller (tiny model, CPU): DeFT's branch-every policy, no recompute, op validation."""
import pytest
import torch

from treedec.sampling.params import SamplingParams
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.programs.controller import (Branch, BranchEvery, ControllerError, ControllerProgram, Extend, Prune, Stop,
                                       TreeView, run_controller)
from treedec.runtime.scheduler import run_program, run_programs
from tests.engines import make_engine, plain_greedy, tiny_model

PROMPT = [5, 17, 300, 42, 9, 111, 7]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


class Scripted:
    """Returns the scripted op lists in turn, then []; records every view."""

    def __init__(self, *scripts):
        self.scripts, self.views = list(scripts), []

    def decide(self, view: TreeView):
        self.views.append(view)
        return self.scripts.pop(0)(view) if self.scripts else []


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_branch_every_follows_the_policy(tiny, page_size):
    engine = make_engine(tiny, page_size)
    run = run_controller(engine, PROMPT, BranchEvery(every=3, k=2, max_leaves=8), max_steps=10)
    tree = engine.tree
    # iterations 0, 3, 6 branch (1 -> 2 -> 4 -> 8 leaves), iteration 9 would make 16 > 8
    assert run.steps == 10 and run.queries_per_step == [2, 2, 2, 4, 4, 4, 8, 8, 8, 8]
    leaves = tree.live_leaves()
    assert len(leaves) == 8
    for leaf in leaves:
        path = tree.path(leaf)
        assert len(path) == 4 and [len(tree.tokens(n)) for n in path] == [len(PROMPT), 3, 3, 4]
        assert all(len(tree.children(n)) == 2 for n in path[:-1])
    # Shared prefixes computed once: every tree token was a query exactly once.
    assert engine.stats["queries"] == tree.num_tokens == len(PROMPT) + sum(run.queries_per_step)
    # Always taking the first (top-1) child is plain greedy decoding.
    node, first_path = run.root, []
    while tree.children(node):
        node = tree.children(node)[0]
        first_path += tree.tokens(node)
    assert first_path == plain_greedy(tiny, PROMPT, 10)
    tree.check_invariants()
    tree.prune(run.root)
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_other_requests_in_the_forest_are_left_alone(tiny):
    """A controller run sees and grows only its own request's leaves, whatever else the forest holds."""
    engine = make_engine(tiny)
    other = engine.prefill([3, 1, 4, 1, 5]).node
    engine.tree.branch(other, [[9], [2]])
    engine.step()
    before = {n: engine.tree.tokens(n) for n in engine.tree.children(other)}
    run = run_controller(engine, PROMPT, BranchEvery(every=3, k=2, max_leaves=8), max_steps=4)
    assert run.queries_per_step == [2, 2, 2, 4]
    assert {n: engine.tree.tokens(n) for n in engine.tree.children(other)} == before
    engine.tree.check_invariants()


def test_view_extend_prune_stop(tiny):
    engine = make_engine(tiny)
    controller = Scripted(
        lambda v: [Branch(v.root, 3)],
        lambda v: [Extend(v.leaves[0], (1, 2, 3)), Prune(v.leaves[1])],
        lambda v: [Prune(v.leaves[0]), Prune(v.leaves[1])],     # the root is a leaf again: backtrack
        lambda v: [Stop()],
    )
    run = run_controller(engine, PROMPT, controller, max_steps=10)
    views, tree = controller.views, engine.tree
    assert run.stopped and run.steps == 3 and run.queries_per_step == [3, 3 + 1, 1]
    assert views[0].leaves == [run.root] and views[0].logits[run.root].shape == (512,)
    assert len(views[1].leaves) == 3 and len(views[2].leaves) == 2
    assert views[3].leaves == [run.root] and tree.children(run.root) == []
    assert len(tree.tokens(run.root)) == len(PROMPT) + 1   # the backtracked root took one decoded token
    assert tree.tokens(run.root)[-1] == plain_greedy(tiny, PROMPT, 1)[0]
    tree.check_invariants()


@pytest.mark.parametrize("ops, match", [
    (lambda v: ["extend"], r"ops\[0\] = 'extend' is not an op"),
    (lambda v: [Branch(v.leaves[0], 0)], r"k must be an int in \[1, 512\], got 0"),
    (lambda v: [Branch(v.leaves[0], 2), Prune(999)], "node 999 is not in the tree"),
    (lambda v: [Prune(v.root)], "cannot prune the prompt node"),
    (lambda v: [Extend(v.leaves[0]), Branch(v.leaves[0], 2)], "named by an earlier op"),
    (lambda v: [Extend(v.leaves[0], (600,))], r"ids in \[0, 512\)"),
    (lambda v: [Branch(v.leaves[0], 2), Stop()], "Stop.. may come only with Prune"),
    (lambda v: "ops", "must return a list of ops"),
])
def test_bad_ops_change_nothing(tiny, ops, match):
    engine = make_engine(tiny)
    controller = Scripted(lambda v: [Branch(v.root, 2)], lambda v: [], ops)
    with pytest.raises(ControllerError, match=match):
        run_controller(engine, PROMPT, controller, max_steps=5)
    tree = engine.tree
    assert len(tree.live_leaves()) == 2 and tree.layout().num_queries == 0
    assert all(len(tree.tokens(n)) == 2 for n in tree.live_leaves())
    tree.check_invariants()


def test_non_live_leaf_and_pruned_node(tiny):
    engine = make_engine(tiny)
    state = {}

    def prune_first(v):
        state["gone"] = v.leaves[0]
        return [Prune(v.leaves[0])]
    controller = Scripted(lambda v: [Branch(v.root, 2)], prune_first, lambda v: [Prune(state["gone"])])
    with pytest.raises(ControllerError, match="is not in the tree .pruned or never made."):
        run_controller(engine, PROMPT, controller, max_steps=5)
    controller = Scripted(lambda v: [Branch(v.root, 2)], lambda v: [Extend(v.root)])
    with pytest.raises(ControllerError, match="is not a live leaf"):
        run_controller(make_engine(tiny), PROMPT, controller, max_steps=5)


def test_sampling_is_seeded(tiny):
    runs = []
    for _ in range(2):
        engine = make_engine(tiny)
        run_controller(engine, PROMPT, BranchEvery(every=2, k=2, max_leaves=4), max_steps=5,
                       sampling=SamplingParams(temperature=1.0),
                       generator=torch.Generator().manual_seed(3))
        runs.append([engine.tree.sequence(n) for n in engine.tree.live_leaves()])
    assert runs[0] == runs[1] and len(runs[0]) == 4
    with pytest.raises(ValueError, match="sampling must be a SamplingParams, got float"):
        run_controller(make_engine(tiny), PROMPT, BranchEvery(), max_steps=1, sampling=1.0)
    with pytest.raises(ValueError, match="the branch controller's token draws does not implement logprobs=1"):
        run_controller(make_engine(tiny), PROMPT, BranchEvery(), max_steps=1, sampling=SamplingParams(logprobs=1))


def test_exhausted_pool_raises_before_any_op_and_prunes_count():
    engine = Engine(tiny_model(), kv_tokens=4 * 12, page_size=4, backend="torch")   # 12 pages
    pool, tree = engine.pool, engine.tree
    state = {}

    def too_big(v):   # prompt 2 pages + 3 leaves: 7 free, 8 after the prune; 2 x 5 fresh children need 10
        state["before"] = ({n: tree.tokens(n) for n in v.leaves}, pool.num_free_pages, pool.refcount.tolist())
        return [Prune(v.leaves[0]), Branch(v.leaves[1], 5), Branch(v.leaves[2], 5)]
    controller = Scripted(lambda v: [Branch(v.root, 3)], too_big)
    with pytest.raises(PoolExhaustedError, match="need 10 page.s. of 4 tokens, 8 of 12 would be free"):
        run_controller(engine, PROMPT, controller, max_steps=5)
    leaves = tree.live_leaves()
    assert ({n: tree.tokens(n) for n in leaves}, pool.num_free_pages, pool.refcount.tolist()) == state["before"]
    assert tree.layout().num_queries == 0
    tree.check_invariants()

    # 8 children fit only when the page the prune frees is counted.
    engine = Engine(tiny_model(), kv_tokens=4 * 12, page_size=4, backend="torch")
    controller = Scripted(lambda v: [Branch(v.root, 3)],
                          lambda v: [Prune(v.leaves[0]), Branch(v.leaves[1], 5), Branch(v.leaves[2], 3)],
                          lambda v: [Stop()])
    run = run_controller(engine, PROMPT, controller, max_steps=5)
    assert run.stopped and run.queries_per_step == [3, 8] and engine.pool.num_free_pages == 0
    engine.tree.check_invariants()


def test_a_leaf_that_emits_eos_is_paused(tiny, monkeypatch):
    """Three branches decode greedily; each stops on its first EOS id (kept, computed), paused, while the
    others go on; the run ends when none is left. The default EOS ids are the model's."""
    free_engine = make_engine(tiny)
    free = run_controller(free_engine, PROMPT, Scripted(lambda v: [Branch(v.root, 3)]), max_steps=8,
                          eos_token_id=None)
    leaves = free_engine.tree.children(free.root)
    branches = [free_engine.tree.tokens(n) for n in leaves]
    assert free.finished == [] and all(len(b) == 8 for b in branches)
    eos = {branches[0][4], branches[1][5]}
    ends = [next((i + 1 for i, t in enumerate(b) if t in eos), None) for b in branches]   # tokens kept per branch
    assert ends == [5, 6, None], (branches, eos)

    monkeypatch.setattr(tiny, "eos_token_ids", tuple(eos))
    engine = make_engine(tiny)
    run = run_controller(engine, PROMPT, Scripted(lambda v: [Branch(v.root, 3)]), max_steps=8)
    tree = engine.tree
    assert [tree.tokens(n) for n in tree.children(run.root)] == [b[:e] for b, e in zip(branches, ends)]
    assert sorted(run.finished, key=leaves.index) == [n for n, e in zip(leaves, ends) if e is not None]
    assert all(tree.is_paused(n) for n in run.finished) and tree.live_leaves() == [n for n, e in zip(leaves, ends)
                                                                                   if e is None]
    assert run.queries_per_step == [sum(e is None or e > i for e in ends) for i in range(8)]
    assert engine.stats["queries"] == tree.num_tokens and tree.layout().num_queries == 0
    tree.check_invariants()

    # Every branch finished: the run ends there; a finished leaf cannot grow.
    engine = make_engine(tiny)
    run = run_controller(engine, PROMPT, Scripted(lambda v: [Branch(v.root, 3)]), max_steps=8,
                         eos_token_id=[b[1] for b in branches])
    assert run.steps == 2 and len(run.finished) == 3 and engine.tree.live_leaves() == []
    controller = Scripted(lambda v: [Branch(v.root, 3)], lambda v: [Extend(v.tree.children(v.root)[0])])
    with pytest.raises(ControllerError, match="is not a live leaf"):
        run_controller(make_engine(tiny), PROMPT, controller, max_steps=5, eos_token_id=branches[0][0])
    with pytest.raises(ValueError, match="eos_token_id must be token ids in"):
        run_controller(make_engine(tiny), PROMPT, BranchEvery(), max_steps=1, eos_token_id=512)


def test_requests_sharing_a_prompt_prefix_run_as_alone(tiny):
    """Batched, prompts with a common prefix continue under one shared prefix node: each controller still
    sees (and grows) the leaves under its own prompt (before, it found none and stopped at once)."""
    system = [(29 * i + 11) % 512 for i in range(16)]

    def programs():
        return [ControllerProgram(make_engine(tiny), system + [k + 1, 2 * k + 3],
                                  BranchEvery(every=2, k=2, max_leaves=4), max_steps=4) for k in range(2)]

    results, stats = run_programs(make_engine(tiny), programs())
    alone = [run_program(make_engine(tiny), p) for p in programs()]
    assert stats.shared_prefix_tokens == 16
    assert [(r.steps, r.queries_per_step) for r in results] == [(r.steps, r.queries_per_step) for r in alone] \
        == [(4, [2, 2, 4, 4])] * 2
