"""Pipelined speculative decoding, batched: step n+1 is planned and launched before step n's tokens reach the host,
for every request of a batch in one table.

For a draft whose tree is the same every step and whose tokens are computed on the device from what the step
before left there, or are fixed (:attr:`~treedec.programs.speculative.drafts.DraftSource.fixed_tree`: Medusa heads
run inside the step, EAGLE's chains drafted from the target's states, a ``TreeDraft`` of fixed tokens), under greedy
acceptance or rejection sampling, nothing the next step needs is a host value:

- step n's acceptance runs on the device (:mod:`~treedec.programs.speculative.device_acceptance`): the accepted
  length, the path and the bonus token (the next root) stay there;
- step n+1's tree hangs under ``1 + depth`` slots reserved at the end of the sequence, into which step n's root
  and accepted path K/V are copied on the device (a request's tree keeps its nodes and slots from step to step:
  :meth:`~treedec.tree.SequenceTree.advance_token_trees` reserves the slots and makes the tree pending again behind
  them); the slots past the accepted length are masked and the tree's positions moved back by their number, on the
  device (:class:`~treedec.attention.dynamic_span.DynamicSpans`: the group's spans as arrays);
- its draft tokens come from the device: gathered from step n's row-head output at the last accepted token
  (:meth:`~treedec.programs.speculative.drafts.DraftSource.row_head_drafts`), fixed, or drafted from the target's
  states at step n's root and path, of which only the accepted are real (EAGLE's chains, ``submit_step``).

The host reads step n's outcome while step n+1 runs: it records the tokens, checks the stop rules, and drops
the unused reserved slots before planning step n+2. A stop found there (EOS, a stop string, ``max_new_tokens``)
rolls step n+1 back: its tree is pruned and the sequence cut to the tokens kept, every page freed. Tokens, the tree
left behind and the stats equal the unpipelined loop's (``pipeline=False``).

A program (:class:`~treedec.programs.speculative.program.SpeculativeProgram`) computes its prompt and first token,
then yields :class:`Verify` once and is resumed when its output ends. :class:`VerifyTable` (the scheduler keeps one,
:mod:`treedec.runtime.bulk`) groups its requests by (tree shape, drafting kind and row head, acceptance rule and
its parameters, target states) and steps each group as ONE batched operation per concept
(:class:`~treedec.programs.speculative.verify_group.VerifyGroup`): the tree edits, one K/V move, the next trees'
tokens, one outcome over the group's ``[R, m]`` logits (rejection sampling: counter-based numbers of each
request's seed and step, so a seeded request's tokens do not depend on the batch), the outcomes read back in the
step's one copy. So a step's host work for a group is a fixed number of array operations whatever its size;
Python runs per request on events (a start, an end), for the requests whose text is checked every step (stop
strings, streaming, ``on_step``) and for EAGLE's drafter syncs (each request's drafter sequence is its own: one host
call a request, one sync and one chain run on the device for all); the group's spans are one
:class:`~treedec.attention.dynamic_span.DynamicSpans` (arrays, located and patched as arrays).

A draft budget (:mod:`~treedec.programs.speculative.draft_budget`) gives a group ONE share per step (the mean of
its requests' shares, :meth:`~treedec.programs.speculative.draft_budget.DraftBudget.group_tokens`): the group's
trees are cut alike, and the reservation is always for the full tree's depth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from treedec.attention import SpanMasking
from treedec.engine import Engine
from treedec.programs.speculative.acceptance import GreedyAcceptance, RejectionSampling
from treedec.programs.speculative.drafts import DraftSource
from treedec.programs.speculative.tree_drafting import EngineTreeDraft
from treedec.programs.speculative.verify_group import VerifyGroup, draft_kind
from treedec.runtime.bulk import Bulk, BulkTable
from treedec.runtime.program import StepRequest, StepRows
from treedec.sampling.stops import StopChecker

__all__ = ["Verify", "VerifyTable", "pipeline_refusal"]


def pipeline_refusal(engine: Engine, draft: DraftSource, acceptance) -> str | None:
    """Why the speculative loop of ``draft`` under ``acceptance`` cannot run pipelined on ``engine``; None when
    it can."""
    if draft.fixed_tree is None:
        return f"{type(draft).__name__} has no fixed tree drafted on the device (fixed_tree is None)"
    if type(acceptance) not in (GreedyAcceptance, RejectionSampling):
        return (f"pipelined steps accept on the device (GreedyAcceptance, RejectionSampling); "
                f"{type(acceptance).__name__} decides on the host")
    if engine.attention.windowed:
        return ("the model has sliding-window layers: a span's accepted length would move their windows' first keys, "
                "which only the device knows")
    if engine.attn.backend_impl.span_masking is SpanMasking.UNSUPPORTED:
        return (f"the {engine.attn.backend} attention backend plans from the layout (it cannot mask a span on the "
                f"device)")
    if isinstance(draft, EngineTreeDraft) and draft.engine.attn.backend_impl.span_masking is SpanMasking.UNSUPPORTED:
        return (f"the drafter engine's {draft.engine.attn.backend} attention backend plans from the layout (it cannot "
                f"mask the drafter's unaccepted rows on the device)")
    return None


class VerifyTable(BulkTable):
    """The scheduler loop's pipelined speculative requests, in groups (see the module docstring)."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.groups: dict[tuple, VerifyGroup] = {}
        self._of: dict[Any, VerifyGroup] = {}     # owner -> its group
        self._placed: list[VerifyGroup] = []      # the groups of the last place(), in order
        self._blocked: dict = {}                  # the groups' blocked owners (place() makes a new dict)

    @property
    def size(self) -> int:
        return len(self._of)

    def add(self, owner, request: Verify) -> None:
        program = request.program
        draft = program.draft
        kind = draft_kind(draft)
        drafting = (draft.batch_key or id(draft)) if kind == "heads" else None
        key = (draft.fixed_tree.parents, kind, drafting, program.acceptance.batch_key, program.target_states,
               request.head_name, id(program.budget), program.penalized)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = VerifyGroup(self.engine, request)
        group.add(owner, request)
        self._of[owner] = group

    def place(self, free_pages: int) -> list[StepRequest]:
        self._placed, requests, blocked = [], [], {}
        for group in self.groups.values():
            if group.size:
                request = group.place(self.engine.pool.num_free_pages)
                if request is not None:
                    self._placed.append(group)
                    requests.append(request)
                if group.blocked():
                    blocked.update(group.blocked())
        self._blocked = blocked
        return requests

    def after_step(self, rows: list[StepRows]) -> list[tuple[Any, Any]]:
        finished = []
        for group, out in zip(self._placed, rows):
            for owner, request in group.after_step(out):
                del self._of[owner]
                finished.append((owner, request.stats))
        self._placed = []
        return finished

    def blocked(self) -> dict:
        """The last place()'s blocked owners (a dict of its own: the next place() makes another)."""
        return self._blocked

    def drop(self, owner) -> None:
        group = self._of.pop(owner, None)
        if group is not None:
            group.drop(owner)
            self._blocked.pop(owner, None)

    def reset(self) -> None:
        self.groups.clear()
        self._of.clear()
        self._placed = []
        self._blocked = {}


@dataclass(eq=False)
class Verify(Bulk):
    """Yielded by a :class:`~treedec.programs.speculative.program.SpeculativeProgram` whose steps run pipelined: its
    request's verification steps, with every other request of its :class:`VerifyTable` group, until its stop rule
    ends it; the program is resumed with its ``stats`` filled (steps, accepted, draft sizes, seconds) and its
    ``checker`` holding the output.

    Attributes
    ----------
    program : the request's program (its draft, acceptance rule, budget, callbacks).
    node : its sequence node, a leaf, every token computed (the prompt's).
    first : [1] int64 device tensor: the first new token (drawn from the prompt's last logits): the first tree's root.
    checker : the :class:`~treedec.sampling.stops.StopChecker` of its output, nothing accepted yet.
    stats : its :class:`~treedec.programs.speculative.program.SpeculativeStats`.
    head_name : the engine's row head of its draft, or None.
    head : the row head's output at the prompt's last token (the first draft's input), or None.
    states : [n, ...] the target states its drafter reads at the prompt's tokens, or None.
    state_tokens : [n] int64 device tensor: the token after each of them (the prompt's next, then ``first``).
    """

    table = VerifyTable

    program: Any
    node: int
    first: torch.Tensor
    checker: StopChecker
    stats: Any
    head_name: str | None = None
    head: torch.Tensor | None = None
    states: torch.Tensor | None = None
    state_tokens: torch.Tensor | None = None
