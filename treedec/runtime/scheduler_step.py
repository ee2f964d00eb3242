"""One engine step of the scheduler's loop (:class:`StepRun`, a part of
:class:`~treedec.runtime.scheduler_loop.SchedulerLoop`): the gathered programs' requests, the bulk tables' and the
lanes' tokens computed in ONE step (one plan, one forward), the reads they asked for copied back in one copy, and
each one's rows handed back."""
from __future__ import annotations

import numpy as np
import torch

from treedec.attention.dynamic_span import DynamicSpans
from treedec.runtime.decode import PlacedLanes
from treedec.runtime.program import StepRequest, StepRows, set_aside_bad_tokens
from treedec.sampling.params import GREEDY, sample_tokens
from treedec.transfer import HostCopy

__all__ = ["StepRun"]


class StepRun:
    """:meth:`_step` and :meth:`_device_tokens` of the loop."""

    def _step(self, gathered: list, placed: PlacedLanes = PlacedLanes.NONE, bulk: list | None = None) -> None:
        """Step the ``gathered`` programs' requests, the ``bulk`` tables' (``(table, StepRequest)`` pairs) and the
        ``placed`` lanes; resume-values for the programs, :meth:`BulkTable.after_step` for the tables."""
        engine = self.engine
        requests = [lv.request for lv in gathered] + [r for _, rs in bulk for r in rs] if gathered or bulk else ()
        copy = None
        # What the step asks of its requests, in one pass over them (a few: the programs' and one a bulk group's)
        hidden = aux = heads = all_rows = argmax = prompt_step = False
        apart, programs, reads, parts, sizes, given, programs_of = False, placed.groups, [], [], [], 0, len(gathered)
        for i, r in enumerate(requests):
            hidden, aux, heads, all_rows = hidden or r.hidden, aux or r.aux, heads or r.heads, all_rows or r.all_rows
            argmax, prompt_step = argmax or r.argmax, prompt_step or r.prompt
            part = np.asarray(r.nodes, dtype=np.int64).reshape(-1)
            parts.append(part)
            sizes.append(len(part))
            if r.read is not None:
                reads.append(r.read.reshape(-1))
            if r.tokens is not None:
                given += 1
                apart = apart or r.placed is not None
            if i < programs_of:
                programs += sizes[i] > 0
            elif r.dynamic is not None:
                programs += len(r.dynamic.lengths)
        if requests:
            copy = HostCopy(torch.cat(reads)) if reads else None
            nodes = np.concatenate(parts + [placed.nodes])
        else:   # (the lanes alone: every decode step of generation)
            nodes = placed.nodes
        programs_rows = len(nodes) - len(placed.nodes)
        out = None
        faulty: dict = {}
        hidden_parts: list[slice] = []   # (each request's hidden rows, when not its logits rows)
        if engine.tree.num_pending:   # (tokens without output rows are computed too)
            rows = engine.pending_rows(nodes)
            hidden_rows, at = None, 0
            if (hidden or aux) and all_rows:
                hidden_rows = []   # each request's: its output rows, or every pending token of its nodes
                for r in requests:
                    part = (engine.pending_token_rows(r.nodes) if r.all_rows else engine.pending_rows(r.nodes)) \
                        if len(r.nodes) else np.zeros(0, dtype=np.int64)
                    hidden_rows.append(part)
                    hidden_parts.append(slice(at, at + len(part)))
                    at += len(part)
                hidden_rows = np.concatenate(hidden_rows)
            queries = engine.tree.num_pending
            spans = self._spans(requests, rows) if requests else None
            # (every request's tokens its own nodes' placeholders: their rows are the step's)
            own = rows[:programs_rows] if given == len(requests) and not apart else None
            tokens, token_rows = self._device_tokens(requests, placed, rows[programs_rows:], own)
            # (the lanes' draw recorded in the step's graph when the lanes are the step's only rows)
            tail = self.lanes.step_tail(placed, alone=not requests) if len(placed.nodes) else None
            step = dict(logits_rows=rows, return_hidden=hidden, return_heads=heads, return_aux=aux,
                        hidden_rows=hidden_rows, tokens=tokens, token_rows=token_rows, dynamic=spans, tail=tail)
            self.lanes.start_read()   # (the lanes' draws come back while the step runs)
            try:
                out = engine.step(**step)
            except ValueError:   # the engine refused the step before any work: a program's bad token ids?
                faulty = {} if self.on_error is None else \
                    set_aside_bad_tokens(engine, [(lv, lv.request, lv.ctx.name) for lv in gathered])
                if not faulty:
                    raise
                step["tokens"], step["token_rows"] = self._device_tokens(requests, placed, rows[programs_rows:], own)
                out = engine.step(**step)   # without them (their programs fail below, their K/V never read)
            for lv in gathered if prompt_step else ():   # prompts whose last chunk this step computes: cached for
                if lv.ctx.offer_after_step is not None:  # the next admissions (decode-only steps skip the loop)
                    lv.ctx.offer(lv.ctx.offer_after_step)
                    lv.ctx.offer_after_step = None
            argmax = sample_tokens(out.logits[:programs_rows], GREEDY) if argmax else None
            self.stats.steps += 1
            self.stats.prompt_steps += prompt_step
            self.stats.queries_per_step.append(queries)
            self.stats.programs_per_step.append(programs)
            if self.on_step is not None:
                self.on_step(self.stats)
        flat = copy.result() if copy is not None else None
        offset, read_at = 0, 0
        values = []
        for i, r in enumerate(requests):   # (none in a lanes-only step)
            k = sizes[i]
            part = slice(offset, offset + k)
            value = StepRows()
            if k:
                value.logits = out.logits[part]
                value.hidden = out.hidden[hidden_parts[i] if hidden_parts else part] if r.hidden else None
                value.aux = out.aux[hidden_parts[i] if hidden_parts else part] if r.aux else None
                value.heads = {name: t[part] for name, t in out.heads.items()} if r.heads else None
                value.argmax = argmax[part] if r.argmax else None
            if r.read is not None:
                size = r.read.numel()
                part_read = flat[read_at:read_at + size]
                value.read = part_read if r.read.dim() == 1 else torch.tensor(part_read).reshape(r.read.shape).tolist()
                read_at += size
            values.append(value)
            offset += k
        for lv, value in zip(gathered, values):
            lv.send, lv.request = value, None
        for lv, error in faulty.items():   # (online) one program's bad token ids fail that program alone
            self._fail(lv, error)
        at = programs_of
        for table, rs in bulk or ():
            self._wake(table.after_step(values[at:at + len(rs)]))
            at += len(rs)
        if self.lanes.num_lanes:
            self._wake(self.lanes.after_step(None if out is None else out.logits[programs_rows:], placed,
                                             drawn=out is not None and step["tail"] is not None))

    def _spans(self, requests: list[StepRequest], rows: np.ndarray) -> DynamicSpans | None:
        """The requests' dynamic spans as one :class:`DynamicSpans` (a request's spans given its nodes' rows as the
        queries after them, split evenly among them in order); None: none. Per request with spans (a verify
        group's: one a group), not per span."""
        spans, at = [], 0
        for r in requests:
            k = len(r.nodes)
            if r.dynamic is not None:
                spans.append(r.dynamic.with_rows(rows[at:at + k]))
            at += k
        return DynamicSpans.concat(spans) if spans else None   # (the parts' own: the engine drops empty spans)

    def _device_tokens(self, requests, placed: PlacedLanes, lane_rows: np.ndarray, own: np.ndarray | None = None
                       ) -> tuple[torch.Tensor | None, np.ndarray | None]:
        """The step's token ids read on the device, and their query rows (:meth:`Engine.step`'s ``tokens`` and
        ``token_rows``; (None, None): the tree holds every id): the programs' placeholders' and the lanes'
        (``lane_rows``: the placed lanes' rows; ``own``: the programs' rows when every request gives the tokens of
        its own nodes, found already)."""
        given = [r for r in requests if r.tokens is not None] if requests else ()
        if not given:
            return (None, None) if placed.tokens is None else (placed.tokens, lane_rows)
        if own is None:
            own = self.engine.pending_rows(np.concatenate([
                np.asarray(r.nodes if r.placed is None else r.placed, dtype=np.int64).reshape(-1) for r in given]))
        rows = [own]
        values = [r.tokens.reshape(-1).to(torch.int64) for r in given]
        if placed.tokens is not None:
            rows.append(lane_rows)
            values.append(placed.tokens)
        return torch.cat(values), np.concatenate(rows)
