"""The branch-controller protocol: a policy decides, each step, how the decoding tree grows.

Each iteration :func:`run_controller` shows the controller a :class:`TreeView` (the tree,
its live leaves and each leaf's next-token logits) and applies the operations it returns:

- :class:`Extend` ``(node, tokens=None)``: append one decoded token to a leaf (greedy,
  or sampled: ``sampling``), or the given tokens;
- :class:`Branch` ``(node, k)``: give a leaf k children, each starting with one of its
  k best (greedy) or k sampled next tokens;
- :class:`Prune` ``(node)``: remove a node's subtree (its pages are freed);
- :class:`Stop` ``()``: end the run (only Prune ops may come with it).

A live leaf that no op names is extended by one decoded token, so a controller returns
only what differs from plain decoding. Then one engine step computes every new token;
shared prefixes stay in place and are never recomputed or copied. A leaf whose newest
token is an EOS id is *finished*: after that step it is paused (its K/V stay, it is no
longer a live leaf, so it does not grow; the controller may still prune it). The ops of one
iteration are checked together before any is applied: a bad list (ControllerError) changes
nothing; one that needs more KV pages than the pool has free, counting those its prunes free,
waits for them (batched with other programs, :class:`ControllerProgram`), or raises
PoolExhaustedError having changed nothing (run alone).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from treedec.checks import int_in_range, nonnegative_int
from treedec.engine import Engine
from treedec.errors import ControllerError
from treedec.runtime.request import MODEL_EOS, Positions, eos_token_ids, position_limit
from treedec.sampling.params import GREEDY, SamplingParams, sample_tokens
from treedec.runtime.program import Program, ProgramContext, StepRequest
from treedec.runtime.scheduler import run_program
from treedec.tree import SequenceTree
from treedec.tree.validate import int_list

#: The :class:`~treedec.sampling.params.SamplingParams` fields the controller's draws implement (its lengths and
#: stops are the controller's ops and ``max_steps``); others are refused, not ignored.
CONTROLLER_SAMPLING_FIELDS = frozenset({"temperature", "top_k", "top_p", "min_p"})

__all__ = ["Branch", "BranchEvery", "Controller", "ControllerError", "ControllerProgram", "ControllerRun", "Extend", "Op",
           "Prune", "Stop", "TreeView", "run_controller"]

@dataclass(frozen=True)
class Extend:
    node: int
    tokens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Branch:
    node: int
    k: int


@dataclass(frozen=True)
class Prune:
    node: int


@dataclass(frozen=True)
class Stop:
    pass


Op = Extend | Branch | Prune | Stop


@dataclass
class TreeView:
    """What a controller sees at one iteration.

    Attributes
    ----------
    step : iterations run so far (0: right after the prefill).
    root : the prompt's node.
    tree : the engine's SequenceTree (read it; change it only through ops).
    leaves : live leaves, depth-first.
    logits : leaf -> [vocab] logits of its next token (model dtype, model device).
    """

    step: int
    root: int
    tree: SequenceTree
    leaves: list[int]
    logits: dict[int, torch.Tensor]


class Controller(Protocol):
    def decide(self, view: TreeView) -> list[Op]: ...


@dataclass
class ControllerRun:
    """The record of :func:`run_controller`.

    Attributes
    ----------
    root : the prompt's node (prune it to free the request).
    steps : engine steps run after the prefill.
    queries_per_step : tokens computed by each step.
    stopped : True if the controller returned Stop (else max_steps or no live leaf ended it).
    finished : the leaves paused because their newest token is an EOS id, in the order
        they finished (a pruned one stays listed).
    """

    root: int
    steps: int = 0
    queries_per_step: list[int] = field(default_factory=list)
    stopped: bool = False
    finished: list[int] = field(default_factory=list)


@dataclass
class BranchEvery:
    """DeFT's example policy: every ``every`` iterations, branch each leaf into ``k``, while
    that keeps the leaves at most ``max_leaves``; other iterations extend every leaf."""

    every: int = 3
    k: int = 2
    max_leaves: int = 8

    def decide(self, view: TreeView) -> list[Op]:
        if view.step % self.every == 0 and len(view.leaves) * self.k <= self.max_leaves:
            return [Branch(leaf, self.k) for leaf in view.leaves]
        return []


def _request_leaves(tree, root: int) -> list[int]:
    """The live leaves under ``root`` only: the forest may hold other requests (and ``root`` may be the child
    of a prompt prefix shared with them)."""
    return [n for n in tree.live_leaves() if root in tree.path(n)]


def run_controller(engine: Engine, prompt_ids: Sequence[int], controller: Controller, max_steps: int,
                   sampling: SamplingParams = GREEDY, generator: torch.Generator | None = None,
                   eos_token_id: int | Sequence[int] | str | None = MODEL_EOS) -> ControllerRun:
    """Prefill ``prompt_ids``, then up to ``max_steps`` iterations of decide / apply / step.

    ``sampling`` (:class:`~treedec.sampling.params.SamplingParams`: temperature, top_k, top_p, min_p; default
    greedy): at temperature 0 tokens are the argmax (Branch takes the top-k tokens); else they are drawn from the
    processed distribution (Branch: k without replacement) with ``generator``. A leaf whose newest token is an EOS
    id (``eos_token_id``: ``"model"``, the default, for ``engine.model.eos_token_ids``; an id, several ids, or None)
    is paused and listed in ``run.finished``. The run ends at ``max_steps``, on Stop, or when no live leaf is left.
    The request stays in ``engine.tree`` under ``run.root`` (also when the run raises). :class:`ControllerProgram`
    runs it batched with other programs.
    """
    program = ControllerProgram(engine, prompt_ids, controller, max_steps, sampling, generator, eos_token_id,
                                keep_tree=True)
    return run_program(engine, program)


class ControllerProgram(Program):
    """A controller's run (:func:`run_controller`) as a scheduler program; its result is the
    :class:`ControllerRun`. ``keep_tree``: the request stays in the tree (the caller prunes
    ``run.root``), else it is freed when the program ends. Checks its arguments on construction."""

    def __init__(self, engine: Engine, prompt_ids: Sequence[int], controller: Controller, max_steps: int,
                 sampling: SamplingParams = GREEDY, generator: torch.Generator | None = None,
                 eos_token_id: int | Sequence[int] | str | None = MODEL_EOS, keep_tree: bool = False):
        nonnegative_int("max_steps", max_steps)
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        sampling.check_supported(CONTROLLER_SAMPLING_FIELDS, "the branch controller's token draws", "sampling")
        self.eos = frozenset(eos_token_ids(eos_token_id, engine.model))
        self.prompt_ids = int_list(prompt_ids, "prompt_ids", low=0)
        self.controller, self.max_steps, self.generator = controller, max_steps, generator
        self.params = sampling
        self.keep_tree = keep_tree

    def positions(self) -> Positions:
        # One token a leaf per iteration (an Extend op's longer token list is checked when it comes).
        p = len(self.prompt_ids)
        return Positions(p + self.max_steps, f"a {p}-token prompt + max_steps {self.max_steps}")

    def run(self, ctx: ProgramContext):
        engine, root = ctx.engine, None
        try:
            root, out = yield from ctx.prompt(self.prompt_ids)
            run = ControllerRun(root=root)
            yield from self._iterate(engine, ctx, run, {root: out.logits[0]})
            return run
        finally:
            if not self.keep_tree:
                ctx.free(root)

    def _iterate(self, engine: Engine, ctx: ProgramContext, run: ControllerRun, logits: dict[int, torch.Tensor]):
        """``logits``: every node's next-token logits at its last token, while it lives."""
        tree, root, params, generator = engine.tree, run.root, self.params, self.generator
        while run.steps < self.max_steps:
            leaves = _request_leaves(tree, root)
            ops = self.controller.decide(TreeView(run.steps, root, tree, leaves, dict((n, logits[n]) for n in leaves)))
            plan = _check(ops, tree, root, leaves, engine.model.config.vocab_size, position_limit(engine.model))
            need, freed = _pool_need(tree, plan, leaves)
            if need:   # waits before any op is applied
                yield from ctx.reserve(need - freed, f"this iteration's ops need {need} page(s) of "
                                                     f"{tree.pool.page_size} tokens, {tree.pool.num_free_pages + freed}"
                                                     f" of {tree.pool.num_pages} would be free after its prunes")
            for node in plan.prune:
                for dead in tree.subtree(node):
                    logits.pop(dead, None)
                tree.prune(node)
            if plan.stop:
                run.stopped = True
                break
            leaves = _request_leaves(tree, root)   # a node whose children were all pruned is a leaf again
            grow = {n: plan.extend.get(n) or sample_tokens(logits[n], params, generator, k=1).tolist()
                    for n in leaves if n not in plan.branch}
            tree.extend_many(grow)
            last = {n: tokens[-1] for n, tokens in grow.items()}   # each new leaf's newest token
            for node, k in plan.branch.items():
                tokens = sample_tokens(logits[node], params, generator, k=k).tolist()
                last.update(zip(tree.branch(node, [[t] for t in tokens]), tokens))
            new_leaves = list(last)
            if not new_leaves:
                break
            out = yield StepRequest(new_leaves)
            logits.update(zip(new_leaves, out.logits))
            run.steps += 1
            run.queries_per_step.append(ctx.step_queries)
            for leaf, token in last.items():
                if token in self.eos:
                    tree.pause(leaf)
                    run.finished.append(leaf)


# ================================================================ private


@dataclass
class _Plan:
    prune: list[int] = field(default_factory=list)
    extend: dict[int, list[int]] = field(default_factory=dict)
    branch: dict[int, int] = field(default_factory=dict)
    stop: bool = False


def _check(ops, tree: SequenceTree, root: int, leaves: list[int], vocab: int, positions: int) -> _Plan:
    """Validate a whole op list against the tree and the model's ``positions``; returns it grouped, or raises
    ControllerError."""
    if not isinstance(ops, (list, tuple)):
        raise ControllerError(f"decide() must return a list of ops, got {type(ops).__name__}")
    plan, live, named = _Plan(), set(leaves), set()
    for i, op in enumerate(ops):
        if isinstance(op, Stop):
            plan.stop = True
            continue
        if not isinstance(op, (Extend, Branch, Prune)):
            raise ControllerError(f"ops[{i}] = {op!r:.80} is not an op (Extend, Branch, Prune or Stop)")
        if op.node in named:
            raise ControllerError(f"ops[{i}] = {op!r}: node {op.node} is named by an earlier op of this step")
        named.add(op.node)
        if isinstance(op, Prune):
            if op.node not in tree:
                raise ControllerError(f"ops[{i}] = {op!r}: node {op.node} is not in the tree (pruned or never made)")
            if op.node == root:
                raise ControllerError(f"ops[{i}] = {op!r}: cannot prune the prompt node {root}; return Stop()")
            plan.prune.append(op.node)
            continue
        if op.node not in live:
            raise ControllerError(f"ops[{i}] = {op!r}: node {op.node} is not a live leaf (live leaves: "
                                  f"{sorted(live)[:8]})")
        if isinstance(op, Branch):
            k = op.k
            if type(k) is not int or not 1 <= k <= vocab:   # every step: a plain int in range skips the call
                k = int_in_range(f"ops[{i}] = {op!r}: k", k, 1, vocab, error=ControllerError)
            plan.branch[op.node] = k
        elif op.tokens is not None:
            toks = list(op.tokens)
            if not toks or not all(isinstance(t, int) and 0 <= t < vocab for t in toks):
                raise ControllerError(f"ops[{i}] = {op!r}: tokens must be a non-empty list of ids in [0, {vocab})")
            length = len(tree.sequence(op.node))
            if length + len(toks) > positions:
                raise ControllerError(f"ops[{i}] = {op!r:.80}: {length} + {len(toks)} tokens would run past the "
                                      f"model's {positions} positions")
            plan.extend[op.node] = toks
    if plan.stop and (plan.extend or plan.branch):
        raise ControllerError("Stop() may come only with Prune ops, got Extend/Branch ops too")
    doomed = set()
    for node in plan.prune:
        sub = tree.subtree(node)
        if doomed & set(sub):
            raise ControllerError(f"Prune({node}) overlaps another Prune of this step")
        doomed.update(sub)
    clash = sorted(doomed & (set(plan.extend) | set(plan.branch)))
    if clash:
        raise ControllerError(f"node(s) {clash[:5]} are extended or branched and pruned in the same step")
    return plan


def _pool_need(tree: SequenceTree, plan: _Plan, leaves: list[int]) -> tuple[int, int]:
    """The pages the plan's growth needs and those its prunes free (0, 0 for a stop)."""
    if plan.stop:
        return 0, 0
    doomed = {n for node in plan.prune for n in tree.subtree(node)}
    grow = [n for n in leaves if n not in doomed and n not in plan.branch]
    for node in plan.prune:   # a parent whose children all go is a leaf again and takes a token
        parent = tree.parent(node)
        if parent is None or parent in grow or tree.is_paused(parent):
            continue
        if all(c in doomed for c in tree.children(parent)):
            grow.append(parent)
    need = sum(tree.pages_to_extend(n, len(plan.extend.get(n, (0,)))) for n in grow)
    need += sum(k * tree.pool.pages_for(1) for k in plan.branch.values())
    return need, tree.pages_freed_by_prune(plan.prune)
