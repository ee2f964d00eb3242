"""Pipelined speculative decoding: step n+1 is planned and launched before step n's tokens reach the host.

For a draft whose tree is the same every step and whose tokens are computed on the device from what the step
before left there, or are fixed (:attr:`~treedec.programs.speculative.drafts.DraftSource.fixed_tree`: Medusa heads
run inside the step, EAGLE's chains drafted from the target's states, a ``TreeDraft`` of fixed tokens), under greedy
acceptance or rejection sampling, nothing the next step needs is a host value:

- step n's acceptance runs on the device (:mod:`~treedec.programs.speculative.device_acceptance`): the accepted
  length, the path and the bonus token (the next root) stay there;
- step n+1 hangs its tree under ``1 + depth`` slots reserved at the end of the sequence
  (:meth:`~treedec.tree.SequenceTree.extend_computed`), into which step n's root and accepted path K/V are
  copied on the device; the slots past the accepted length are masked and the new tree's positions moved
  back by their number, on the device (:class:`~treedec.attention.dynamic_span.DynamicSpan`);
- its draft tokens come from the device (:meth:`~treedec.programs.speculative.drafts.DraftSource.device_drafts` of a
  :class:`~treedec.programs.speculative.drafts.DeviceStep`): gathered from step n's row-head output at the last accepted
  token, or drafted from the target's states at step n's root and path, of which only the accepted are real
  (EAGLE's chains).

The host reads step n's outcome while step n+1 runs: it records the tokens, checks the stop rules, and drops
the unused reserved slots (:meth:`~treedec.tree.SequenceTree.truncate`) before planning step n+2. A stop found
there (EOS, a stop string, ``max_new_tokens``) rolls step n+1 back: its tree is pruned and the sequence cut to
the tokens kept, every page freed. Tokens, the tree left behind and the stats equal the unpipelined loop's
(``pipeline=False``). It is a scheduler program (:func:`pipelined_run`, run by
:class:`~treedec.programs.speculative.program.SpeculativeProgram`): in a batch every request has its span in the one
step and the previous step's outcomes come back in the batch's one copy; a draft budget cuts the fixed tree
to each request's share, decided from acceptances one step older than the unpipelined loop's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from treedec.attention import SpanMasking
from treedec.attention.dynamic_span import DynamicSpan
from treedec.engine import Engine
from treedec.programs.speculative.acceptance import GreedyAcceptance, RejectionSampling
from treedec.programs.speculative.device_acceptance import greedy_outcome
from treedec.programs.speculative.drafts import DeviceStep, DraftSource, target_states_at
from treedec.runtime.program import ProgramContext, StepRequest
from treedec.sampling.params import GREEDY, sample_tokens
from treedec.sampling.stops import StopChecker
from treedec.programs.speculative.tree_drafting import EngineTreeDraft
from treedec.transfer import to_device
from treedec.tree.token_tree import TokenTree

__all__ = ["pipelined_run", "pipeline_refusal"]


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


@dataclass
class _Flight:
    """A launched step: its tree's shape, node ids, slots and tokens, and its outcome on the device."""

    shape: TokenTree
    ids: list[int]
    slots: torch.Tensor          # [m] its tree tokens' pool slots, token order (device)
    tokens: torch.Tensor         # [m] their ids (device)
    heads: torch.Tensor | None   # [m, ...] the draft's row head at each (None: no row head)
    states: torch.Tensor | None  # [m, ...] the target's states the draft reads at each (None: none)
    outcome: torch.Tensor        # [2 + depth]: accepted length, bonus, path

    @property
    def depth(self) -> int:
        return max(self.shape.depth)


def pipelined_run(ctx: ProgramContext, program, checker: StopChecker, head_name: str | None, stats):
    """The pipelined loop of one request as a scheduler program (``yield from`` it in
    :meth:`~treedec.programs.speculative.program.SpeculativeProgram.run`): its prompt, then steps, each launched before
    the previous one's outcome is read (that read rides with the step, :attr:`StepRequest.read`, in the batch's
    one copy). Fills ``stats`` as the unpipelined loop does; returns the node."""
    engine, draft, acceptance, budget = ctx.engine, program.draft, program.acceptance, program.budget
    tree, full = engine.tree, draft.fixed_tree
    if full.size > program.max_draft_tokens:
        raise ValueError(f"the draft's fixed tree has {full.size} tokens; at most max_draft_tokens="
                         f"{program.max_draft_tokens}")
    greedy = isinstance(acceptance, GreedyAcceptance)
    stop_ids = checker.rule.eos_token_ids
    kind = program.target_states
    want = {"heads": head_name is not None, "hidden": kind == "hidden", "aux": isinstance(kind, tuple)}
    start = time.perf_counter()
    node, out = yield from ctx.prompt(program.prompt_ids, all_rows=kind is not None, **want)
    stats.node = node
    first = (sample_tokens(out.logits[0], GREEDY) if greedy else acceptance.first_sample(out.logits[0])).reshape(1)
    root, read = first, first
    step = DeviceStep(engine.device, None if head_name is None else out.heads[head_name][0],
                      target_states_at(engine, kind, out),
                      None if kind is None else torch.cat([to_device(np.asarray(program.prompt_ids[1:], dtype=np.int64),
                                                                     engine.device), first]))
    stats.prefill_seconds = time.perf_counter() - start
    span, flight, root_token, garbage = None, None, -1, 0   # garbage: unused reserved slots ending the node
    while True:
        started = time.perf_counter()
        share = full.size - 1 if budget is None else budget.tokens(program, engine.device, full.size - 1)
        shape = full if share >= full.size - 1 else TokenTree(full.parents[:share + 1])
        reserve = 0 if flight is None else engine.pool.pages_for(1 + flight.depth) + 1
        yield from ctx.reserve(reserve + 1 + engine.pool.pages_for(shape.size - 1))
        if flight is not None:
            # Step n is launched: free its tree (stream order keeps its K/V until the copy below has read them),
            # drop the slots step n-1 did not use, and reserve step n's root and path.
            tree.prune(flight.ids[0])
            if garbage:
                tree.truncate(node, tree.node_length(node) - garbage)
            dst = tree.extend_computed(node, [0] * (1 + flight.depth))
            length = flight.outcome[:1]
            pick = torch.cat([flight.outcome.new_zeros(1), flight.outcome[2:].clamp(min=0)])
            engine.pool.copy_slots(flight.slots[pick], dst)
            last = torch.where(length > 0, flight.outcome[2:].gather(0, (length - 1).clamp(min=0)), 0)
            root = flight.outcome[1:2]
            span = DynamicSpan(dst[1:], length, np.zeros(0, dtype=np.int64))   # (the scheduler gives the rows)
            step = DeviceStep(engine.device, None if flight.heads is None else flight.heads.index_select(0, last)[0],
                              None if flight.states is None else flight.states.index_select(0, pick),
                              None if flight.states is None else _next_tokens(flight, root), length + 1, garbage)
        if draft.drafts_together:   # (EAGLE's chains: one drafter sync and one chain run for the pass's requests)
            draft.submit_step(step)
            yield from ctx.together()
            drafted = draft.collect_step()
        else:
            drafted = draft.device_drafts(step)
        tokens = torch.cat([root, drafted[:shape.size - 1]]).to(torch.int64)
        ids = tree.add_token_tree(node, [0] * shape.size, [-1] + list(shape.parents[1:]))
        slots = tree.first_slots(ids)
        rows = yield StepRequest(ids, tokens=tokens, read=read, dynamic=span, **want)
        outcome = (greedy_outcome(shape, tokens, sample_tokens(rows.logits, GREEDY)) if greedy
                   else acceptance.outcome(shape, tokens, rows.logits))
        read = torch.cat([outcome, tokens[outcome[2:].clamp(min=0)]])
        launched = _Flight(shape, ids, to_device(slots, engine.device), tokens,
                           None if head_name is None else rows.heads[head_name], target_states_at(engine, kind, rows),
                           outcome)
        # The step before this one, read with the batch's reads after this one was launched.
        if flight is None:
            root_token = int(rows.read[0])
            checker.accept([root_token])
            stop = 0 if checker.stopped else None
        else:
            stop, garbage, root_token = _record(tree, node, checker, flight, rows.read, root_token, stop_ids, stats,
                                                started)
            if budget is not None:
                budget.observe(program, stats.accepted[-1])
            program.stepped(stats, checker)
        if stop is not None:
            tree.prune(launched.ids[0])   # the step launched past the stop: rolled back, its pages freed
            if flight is not None:
                tree.truncate(node, tree.node_length(node) - stop)
            return node
        flight = launched
        stats.draft_sizes.append(shape.size - 1)


def _next_tokens(flight: _Flight, bonus: torch.Tensor) -> torch.Tensor:
    """``[1 + depth]``: the token after each of step n's root and path slots (the accepted path's tokens, then
    the bonus at the accepted length; past it, anything), on the device."""
    path = flight.tokens[flight.outcome[2:].clamp(min=0)]
    after = torch.cat([path, bonus])
    at = torch.arange(len(after), device=after.device)
    return torch.where(at == flight.outcome[:1], bonus, after)


def _record(tree, node: int, checker: StopChecker, flight: _Flight, values: list[int], root_token: int, stop_ids,
            stats, started: float) -> tuple[int | None, int, int]:
    """Step n's outcome read back (``values``: outcome and accepted tokens) on the host: its root (``root_token``)
    and accepted tokens into the node's reserved slots, its emitted tokens through the stop checker. Returns (the
    node's tokens to drop when the output stops there, else None; the unused reserved slots; the next root, step
    n's bonus)."""
    depth = flight.depth
    length, bonus = values[0], values[1]
    path_tokens = values[2 + depth:2 + depth + length]
    end = tree.node_length(node)             # the reservation is the node's last 1 + depth tokens
    tree.set_tokens(node, end - depth - 1, [root_token] + path_tokens)
    cut = next((d for d, t in enumerate(path_tokens) if t in stop_ids), None)
    if cut is not None:
        path_tokens, bonus = path_tokens[:cut], path_tokens[cut]
    decision = checker.accept(list(path_tokens) + [int(bonus)])
    kept = min(decision.keep, len(path_tokens))
    stats.steps += 1
    stats.accepted.append(kept)
    stats.draft_seconds.append(0.0)
    stats.verify_seconds.append(time.perf_counter() - started)
    if checker.stopped:
        return depth - kept, depth - length, int(bonus)
    return None, depth - length, int(bonus)
