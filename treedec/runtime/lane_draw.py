"""The lanes' batched draw over a block of rows (:mod:`treedec.runtime.lanes`): one definition for the eager draw
of every lane and for the draw recorded in a step's CUDA graph (:class:`~treedec.engine.step_tail.StepTail`).

A graphed step's draw covers a fixed block: the first :func:`lane_bucket` rows of the lane table (the step graphs'
query bucket of the lanes, at most the table's capacity), its rows past the lanes padding. Every operation of the draw is row-wise (each row its own
logits, parameters, counters, EOS ids and token counts), so the padding rows, which read some real row's logits and
whatever the table holds past its lanes, cannot change a real row's token; what they write lands in rows past the
lanes, which :meth:`~treedec.runtime.lanes.Lanes.add` writes anew before a lane lives there.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.attention.static_plan import PlanBounds
from treedec.sampling.grammar import apply_bitmask
from treedec.sampling.logits import drawable_rows, token_logprobs
from treedec.sampling.sampler import SamplingRows, sample_rows
from treedec.transfer import to_device

__all__ = ["LaneDrawWork", "draw_block", "lane_bucket", "store_draws"]


def lane_bucket(lanes: int, capacity: int) -> int:
    """The rows a graphed draw of ``lanes`` lanes covers: the step graphs' query bucket of as many queries
    (:meth:`~treedec.attention.static_plan.PlanBounds.query_bucket`: the next power of two, past 256 also 5/8 and
    3/4 of it), at most the table's ``capacity`` (>= ``lanes``): a graph per bucket, not per batch size. Never more
    rows than the graph of the step they ride in has (its bucket is of at least as many queries as lanes)."""
    if not 0 < lanes <= capacity:
        raise ValueError(f"a draw covers 1 .. capacity ({capacity}) lanes, got {lanes}")
    return min(PlanBounds.query_bucket(lanes), capacity)


def draw_block(table, raw: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Draw the next token of the table's first ``n = raw.shape[0]`` rows from ``raw`` ([n, V] logits, row ``i``
    lane ``i``'s) under ``rows`` (their :class:`SamplingRows`, ``n`` rows): the tokens, their stop flags (EOS / stop
    ids on the device), draw counters, penalties' counts and (penalized rows) whether a row had anything to draw
    from, written into the table's device columns; returns the [n] int64 tokens. Device work only."""
    n = raw.shape[0]
    if rows.penalized:   # (read back with the tokens: a row with nothing to draw from fails alone)
        table.ok[:n] = drawable_rows(raw.float()).long()
    masks = counts = None
    if rows.penalized:
        masks, counts = table.prompt_mask[:n], table.counts[:n]
    tokens = sample_rows(raw, rows, table.drawn_count[:n], masks, counts)
    store_draws(table, slice(0, n), tokens)
    return tokens


def store_draws(table, at: slice | torch.Tensor, tokens: torch.Tensor) -> None:
    """Store drawn ``tokens`` ([m] int64 device) of the table's rows ``at`` (a slice, or [m] device indices): the
    tokens, their stop flags (EOS / stop ids), draw counters and penalties' counts."""
    table.drawn[at] = tokens
    table.stopped[at] = (tokens[:, None] == table.eos[at]).any(dim=1).long()
    table.drawn_count[at] += 1
    if table.counts is not None:   # (each row its own drawn token: a slice would pair every row with every token)
        ones = torch.ones_like(tokens, dtype=table.counts.dtype)
        if isinstance(at, slice):
            table.counts[at].scatter_add_(1, tokens[:, None], ones[:, None])
        else:
            table.counts.index_put_((at, tokens), ones, accumulate=True)


class LaneDrawWork:
    """The eager draw's per-group work (grammar masks, processors, logprobs): methods of
    :class:`~treedec.runtime.lanes.Lanes`."""

    def _grammar_rows(self, slots: np.ndarray) -> tuple[np.ndarray, list]:
        """The positions in ``slots`` of the lanes with a grammar, and their matchers."""
        groups = self.group[slots]
        mine = np.flatnonzero(np.isin(groups, np.fromiter(self._grammar, dtype=np.int64)))
        index = self.index[slots[mine]]
        return mine, [self.groups[g].matchers[i] for g, i in zip(groups[mine].tolist(), index.tolist())]

    def _masked(self, slots: np.ndarray, raw: torch.Tensor) -> torch.Tensor:
        """``raw`` with the rows of the lanes that have a grammar masked by their matchers' bitmasks (one batched
        fill, one copy to the device, one masking op); ``raw`` itself when none of ``slots`` has one."""
        mine, matchers = self._grammar_rows(slots)
        if len(mine) == 0:
            return raw
        masks = self._bitmasks.fill(matchers)
        if len(mine) == len(slots):
            return apply_bitmask(raw.float().clone(), masks)
        scores = raw.float().clone()
        at = to_device(mine, self.device)
        scores[at] = apply_bitmask(scores[at], masks)
        return scores

    def _process(self, slots: np.ndarray, raw: torch.Tensor) -> torch.Tensor:
        """The rows of the groups that need it processed before the batched draw (:meth:`LaneGroup.process`); a
        Python pass per such group a step, none for the others. A group whose user processor raises fails alone."""
        scores = raw.float().clone()
        groups = self.group[slots]
        for uid in self._special & set(np.unique(groups).tolist()):
            g = self.groups[uid]
            mine = np.flatnonzero(groups == uid)
            at = to_device(mine, self.device)
            try:
                scores[at] = g.process(scores[at], self.tokens[slots[mine]], self.length[slots[mine]])
            except Exception as error:   # (a user processor: its lanes go at the end of the step)
                self._fail(g, error)
        return scores

    def _record_logprobs(self, slots: np.ndarray, tokens: torch.Tensor, raw: torch.Tensor | None) -> None:
        """The log-probabilities of ``slots``' drawn ``tokens`` from ``raw``, for the groups that report them."""
        for uid in (self._logprobs & set(np.unique(self.group[slots]).tolist())) if raw is not None and \
                self._logprobs else ():
            g = self.groups[uid]
            mine = np.flatnonzero(self.group[slots] == uid)
            at = to_device(mine, raw.device)
            g.records.append((self.index[slots[mine]].copy(),
                              token_logprobs(raw[at], tokens[at], g.decode.params.logprobs)))
