"""One group of the verify table (:mod:`~treedec.programs.speculative.verify_table`): the requests whose trees share
one fixed shape, one way of drafting it on the device and one acceptance rule, stepped as ONE batched operation
each per step: the tree edits (:mod:`treedec.tree.verify_edits`), the accepted K/V's move (one
:meth:`~treedec.tree.PagedKVPool.copy_slots`), the next trees' tokens, the outcomes over ``[R, m]`` logits and
the host record of the outcomes read back (:class:`~treedec.programs.speculative.verify_rows.VerifyRows`).

Device columns, one row per request (compacted on events): ``read`` [R, 2 + 2D] (the outcome to read next:
accepted length, bonus, path, path tokens; a new request's: length 0 and its first token as the bonus),
``outcome`` [R, 2 + D], ``slots`` / ``tokens`` [R, m] (its launched tree's, padded to the full tree),
``flight_heads`` [R, m, ...] and ``head`` [R, ...] (a row head's output at the tree's tokens, and at the last
accepted token: the next draft's input), ``states`` [R, m, ...] (the target states a drafter reads), ``fixed``
[R, m - 1] (fixed draft tokens), ``seeds`` / ``steps`` [R] (rejection sampling's streams).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from treedec.attention.dynamic_span import DynamicSpans
from treedec.programs.speculative.acceptance import seed_bits
from treedec.programs.speculative.drafts import DeviceStep, target_states_at
from treedec.programs.speculative.target_processing import path_pairs
from treedec.programs.speculative.verify_rows import VerifyRows
from treedec.runtime.program import StepRequest, StepRows
from treedec.sampling.logits import count_tokens_, token_mask
from treedec.sampling.sampler import penalize
from treedec.transfer import to_device
from treedec.tree.token_tree import TokenTree

__all__ = ["VerifyGroup"]

NO_ROWS = np.zeros(0, dtype=np.int64)   # (the new spans' shift rows: shared, read-only)
NO_ROWS.setflags(write=False)
NO_SLOTS = np.zeros((0, 0), dtype=np.int64)   # (the spans' slots of a step of new rows only)


class VerifyGroup:
    """The requests of one group key (see the module docstring). ``first``: the group's first
    :class:`~treedec.programs.speculative.verify_table.Verify` (its draft's fixed tree, drafting kind, acceptance
    rule and target states are every member's)."""

    def __init__(self, engine, first):
        program = first.program
        self.engine, self.tree, self.pool, self.device = engine, engine.tree, engine.pool, engine.device
        self.draft, self.rule, self.budget = program.draft, program.acceptance, program.budget
        self.full: TokenTree = self.draft.fixed_tree
        self.m, self.depth = self.full.size, max(self.full.depth)
        self.kind = draft_kind(self.draft)
        self.head_name, self.states_kind = first.head_name, program.target_states
        self.want = {"heads": self.head_name is not None, "hidden": self.states_kind == "hidden",
                     "aux": isinstance(self.states_kind, tuple)}
        self.rows = VerifyRows(self.depth, self.m)
        self.requests: list = []      # each row's Verify
        self.owners: list = []
        self.checkers: list = []      # each row's StopChecker when it is checked every step, else None
        self.prompt_states: list = []   # a chains row's prompt states until its first draft
        self.budget_slots = np.zeros(0, dtype=np.int64)   # each row's program's slot in the budget (-1: none)
        d, m, dev = self.depth, self.m, self.device
        self.read = torch.zeros((0, 2 + 2 * d), dtype=torch.int64, device=dev)
        self.outcome = torch.zeros((0, 2 + d), dtype=torch.int64, device=dev)
        self.slots = torch.zeros((0, m), dtype=torch.int64, device=dev)
        self.tokens = torch.zeros((0, m), dtype=torch.int64, device=dev)
        self.seeds = torch.zeros(0, dtype=torch.int64, device=dev)
        self.steps = torch.zeros(0, dtype=torch.int64, device=dev)
        self.head = self.flight_heads = self.states = self.fixed = None
        # penalties (a group's rows all have some, or none): each row's output counts, prompt mask and
        # (repetition, presence, frequency), on the device (target_processing's rules, per row)
        self.penalized = program.penalized
        self.counts = self.prompt_masks = self.penalties = None
        self._pairs: dict = {}
        self._cuts: dict[int, TokenTree] = {}      # the budget's cuts of the full tree, by draft tokens kept
        self._cut_depth: dict[int, int] = {}       # each cut's depth, by its size
        self._zero = torch.zeros(1, dtype=torch.int64, device=dev)
        self._placed = None
        self._blocked: dict = {}
        self._clock = time.perf_counter()

    @property
    def size(self) -> int:
        return self.rows.size

    # ------------------------------------------------------------ events

    def add(self, owner, request) -> None:
        """A new row (an event): its prompt computed, its first token drawn (``request.first``)."""
        program, dev, d = request.program, self.device, self.depth
        checker = request.checker
        rule = checker.rule
        text = bool(rule.stop_strings or rule.min_tokens or program.on_text is not None or program.on_step is not None
                    or program.on_tokens is not None)
        self.rows.add(request.node, self.tree.node_length(request.node), rule.max_new_tokens, rule.eos_token_ids, text)
        self.requests.append(request)
        self.owners.append(owner)
        self.checkers.append(checker if text else None)
        self.prompt_states.append((request.states, request.state_tokens) if self.kind == "chains" else None)
        self.budget_slots = np.append(self.budget_slots, -1 if self.budget is None else self.budget.slot(program))
        first = request.first.reshape(1).to(torch.int64)
        self.read = torch.cat([self.read, torch.cat([self._zero, first, self._zero.expand(2 * d) - 1])[None]])
        self.outcome = torch.cat([self.outcome, self.outcome.new_zeros(1, 2 + d)])
        self.slots = torch.cat([self.slots, self.slots.new_zeros(1, self.m)])
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(1, self.m)])
        self.seeds = torch.cat([self.seeds, self._zero + seed_bits(program.acceptance.seed)])
        self.steps = torch.cat([self.steps, self._zero])
        if self.want["heads"]:
            head = request.head[None]
            self.head = head if self.head is None else torch.cat([self.head, head])
            blank = head.new_zeros((1, self.m, *head.shape[1:]))
            self.flight_heads = blank if self.flight_heads is None else torch.cat([self.flight_heads, blank])
        if self.states_kind is not None:
            blank = request.states.new_zeros((1, self.m, *request.states.shape[1:]))
            self.states = blank if self.states is None else torch.cat([self.states, blank])
        if self.kind == "fixed":
            fixed = program.draft.device_drafts(DeviceStep(dev)).reshape(1, -1).to(torch.int64)
            self.fixed = fixed if self.fixed is None else torch.cat([self.fixed, fixed])
        if self.penalized:   # (its first token counted: the output so far)
            vocab, p = self.engine.model.config.vocab_size, program.params
            counts = count_tokens_(torch.zeros(1, vocab, dtype=torch.int32, device=dev), first.reshape(1, 1))
            mask = token_mask(program.prompt_ids, vocab, dev, "prompt_ids")
            values = to_device(np.array([[p.repetition_penalty, p.presence_penalty, p.frequency_penalty]],
                                        dtype=np.float32), dev)
            for name, row in (("counts", counts), ("prompt_masks", mask), ("penalties", values)):
                column = getattr(self, name)
                setattr(self, name, row if column is None else torch.cat([column, row]))

    def drop(self, owner) -> None:
        """Forget ``owner``'s row (its program is closed: it frees its node)."""
        i = next(i for i, o in enumerate(self.owners) if o is owner)
        keep = np.ones(self.size, dtype=bool)
        keep[i] = False
        self._blocked.pop(owner, None)
        self._keep(keep)

    def blocked(self) -> dict:
        return self._blocked

    # ------------------------------------------------------------ the step

    def place(self, free_pages: int) -> StepRequest | None:
        """The next step's trees of the rows whose pages fit in ``free_pages`` (in row order): each row's unused
        reserved slots dropped, ``1 + depth`` slots reserved and the accepted K/V moved there, and its tree pending
        again behind them (:meth:`~treedec.tree.SequenceTree.advance_token_trees`; a new row's first tree, or one
        of another size, hung: an event); what the step computes and reads for them (None: no row fits)."""
        rows, tree, d = self.rows, self.tree, self.depth
        shape = self._shape()
        m = shape.size
        flight = rows.flight_root >= 0
        ps = self.pool.page_size
        need = np.where(flight, self.pool.pages_for(1 + d) + 1, 0) + np.where(rows.tree_size == m, 0, -(-m // ps))
        fits = need.cumsum() <= free_pages
        self._blocked = {self.owners[i]: int(need[i]) for i in (~fits).nonzero()[0].tolist()} if not fits[-1] else {}
        at = fits.nonzero()[0]
        a = len(at)
        if not a:
            return None
        f = at[flight[at]]
        nf = len(f)
        unused = rows.garbage[f]
        keep = o = None
        dst = NO_SLOTS
        if nf:
            same = rows.tree_size[f] == m
            if np.logical_and.reduce(same):
                dst = tree.advance_token_trees(rows.trees[f, :m], unused, 1 + d, checked=False)
            else:
                dst = self._regrow(f, same, unused, m)
            rows.length[f] += 1 + d - unused
        on = to_device(np.concatenate([at, f, dst.reshape(-1)]), self.device)   # (one copy)
        at_d, f_d, dst_d = on[:a], on[a:a + nf], on[a + nf:]
        if nf:
            o = self.outcome.index_select(0, f_d)
            keep = o[:, 0]
            # the launched trees' root and path slots (a tree hung anew below sends its slots after this read)
            src = self.slots.index_select(0, f_d).gather(1, torch.cat([o.new_zeros(nf, 1), o[:, 2:].clamp(min=0)],
                                                                        dim=1)).reshape(-1)
            self.pool.copy_slots(src, dst_d, checked=False)
            if self.head is not None:
                last = torch.where(keep > 0, o[:, 2:].gather(1, (keep - 1).clamp(min=0)[:, None])[:, 0], 0)
                picked = self.flight_heads.index_select(0, f_d)[torch.arange(nf, device=self.device), last]
                self.head.index_copy_(0, f_d, picked)
        hang = at[rows.tree_size[at] != m]
        if len(hang):
            self._hang(hang, shape)
        rows.garbage[at] = 0
        rows.reserved[at] = flight[at]
        read = self.read.index_select(0, at_d)
        spans = self._spans(at, flight[at], dst, keep)
        drafted = self._drafts(at, at_d, f, f_d if nf else None, o, unused)[:, :m - 1]
        tokens = torch.cat([read[:, 1:2], drafted], dim=1).to(torch.int64)   # (the bonus read next: the new root)
        self._placed = (at, at_d, shape, tokens)
        return StepRequest(rows.trees[at, :m].reshape(-1), tokens=tokens.reshape(-1), read=read.reshape(-1),
                           dynamic=spans, **self.want)

    def after_step(self, out: StepRows) -> list[tuple]:
        """The placed rows' outcomes on the device (kept for the next step), then the outcomes read back with the
        step recorded; ``(owner, request)`` of the rows that ended (their launched step rolled back)."""
        at, at_d, shape, tokens = self._placed
        self._placed = None
        p, m, d = len(at), shape.size, self.depth
        logits = out.logits.reshape(p, m, -1)
        if self.penalized:
            logits = self._penalize(at_d, shape, tokens, logits)
        outcome = self.rule.outcomes(shape, tokens, logits, self.seeds.index_select(0, at_d),
                                     self.steps.index_select(0, at_d))
        pad = 0 if shape is self.full else d - self._cut_depth[m]   # (a cut tree may be shallower)
        if pad:
            outcome = torch.cat([outcome, outcome.new_full((p, pad), -1)], dim=1)
        self.steps.index_add_(0, at_d, torch.ones_like(at_d))
        path_tokens = tokens.gather(1, outcome[:, 2:].clamp(min=0))
        if self.penalized:   # the accepted path and the bonus join each row's output (a row that stops there ends)
            emitted = torch.cat([path_tokens, outcome[:, 1:2]], dim=1)
            real = torch.arange(d + 1, device=self.device)[None, :] < outcome[:, :1]
            real[:, d] = True
            self.counts.index_copy_(0, at_d, count_tokens_(self.counts.index_select(0, at_d), emitted, real))
        self.read.index_copy_(0, at_d, torch.cat([outcome, path_tokens], dim=1))
        self.outcome.index_copy_(0, at_d, outcome)
        full = self.m - m
        self.tokens.index_copy_(0, at_d, torch.cat([tokens, tokens.new_zeros(p, full)], dim=1) if full else tokens)
        if self.head is not None:
            heads = out.heads[self.head_name].reshape(p, m, *self.head.shape[1:])
            self.flight_heads.index_copy_(0, at_d, _padded(heads, full))
        if self.states is not None:
            states = target_states_at(self.engine, self.states_kind, out)
            self.states.index_copy_(0, at_d, _padded(states.reshape(p, m, *states.shape[1:]), full))
        return self._record(at, np.asarray(out.read, dtype=np.int64).reshape(p, 2 + 2 * d), m)

    # ------------------------------------------------------------ private

    def _penalize(self, at_d: torch.Tensor, shape: TokenTree, tokens: torch.Tensor, logits: torch.Tensor
                  ) -> torch.Tensor:
        """``logits [P, m, V]`` of the placed rows' trees penalized, each tree row by its request's output so far and
        the draft tokens on its path (:mod:`~treedec.programs.speculative.target_processing`): a fixed number of
        device operations for the group."""
        p, m, vocab = logits.shape
        pairs = self._pairs.get(shape.parents)
        if pairs is None:
            pairs = self._pairs[shape.parents] = path_pairs(shape, self.device)
        rows, along = pairs
        counts = self.counts.index_select(0, at_d)[:, None, :].expand(p, m, vocab).clone()
        if len(rows):
            n = len(rows)
            counts.index_put_((torch.arange(p, device=self.device).repeat_interleave(n), rows.repeat(p),
                               tokens[:, along].reshape(-1)), torch.ones(p * n, dtype=counts.dtype, device=self.device),
                              accumulate=True)
        values = self.penalties.index_select(0, at_d).repeat_interleave(m, dim=0)   # [P * m, 3]
        mask = self.prompt_masks.index_select(0, at_d).repeat_interleave(m, dim=0)
        return penalize(logits.reshape(p * m, vocab), mask, counts.reshape(p * m, vocab), values[:, 0], values[:, 1],
                        values[:, 2]).reshape(p, m, vocab)

    def _hang(self, at: np.ndarray, shape: TokenTree) -> None:
        """Trees of ``shape`` hung under the nodes of rows ``at`` (an event: a row's first step, or its tree's size
        changed), kept in the rows' columns from step to step: their ids, and their slots on the device (a cut
        tree's padded with its last one's, to the full tree's m)."""
        rows, m = self.rows, shape.size
        ids = self.tree.add_token_trees(rows.node[at], [-1] + list(shape.parents[1:]), checked=False)
        rows.trees[at, :m], rows.trees[at, m:] = ids, -1
        rows.tree_size[at], rows.flight_root[at] = m, ids[:, 0]
        slots = self.tree.first_slots(ids.reshape(-1)).reshape(len(at), m)[:, np.minimum(np.arange(self.m), m - 1)]
        self.slots.index_copy_(0, to_device(at, self.device), to_device(slots, self.device))

    def _regrow(self, f: np.ndarray, same: np.ndarray, unused: np.ndarray, m: int) -> np.ndarray:
        """:meth:`place`'s leaf edits of rows ``f`` (``[F, 1 + depth]``: their new slots) when the trees of some
        (``~same``) are of another size than this step's ``m`` (a budget's new share, an event): those trees are
        pruned and their leaves cut and grown alone (:meth:`_hang` hangs their new trees), the others advance. The
        prunes and cuts come first, the reservations last, right before the copy that fills them all (what a
        schedule recorder writes as accepts: :mod:`treedec.replay.pipelined_accepts`)."""
        rows, tree, d = self.rows, self.tree, self.depth
        dst = np.empty((len(f), 1 + d), dtype=np.int64)
        other, cut = f[~same], unused[~same]
        tree.prune_many(rows.flight_root[other], checked=False)
        rows.tree_size[other] = 0
        g = cut > 0
        if g.any():
            tree.truncate_many(rows.node[other[g]], rows.length[other[g]] - cut[g], checked=False)
        if same.any():
            s = f[same]
            dst[same] = tree.advance_token_trees(rows.trees[s, :m], unused[same], 1 + d, checked=False)
        dst[~same] = tree.extend_computed_many(rows.node[other], 1 + d, checked=False)
        return dst

    def _shape(self) -> TokenTree:
        """This step's tree: the full tree, or its first draft tokens when a budget gives the group fewer (one share
        for the group: its requests' mean share of the step's budget)."""
        if self.budget is None:
            return self.full
        share = self.budget.group_tokens(self.budget_slots, self.device, self.m - 1)
        if share >= self.m - 1:
            return self.full
        cut = self._cuts.get(share)
        if cut is None:   # (a share is the same step after step while the group's size stays: made once)
            cut = self._cuts[share] = TokenTree(self.full.parents[:share + 1])
            self._cut_depth[cut.size] = max(cut.depth)
        return cut

    def _spans(self, at, flight, dst, keep) -> DynamicSpans:
        """The placed rows' spans, as arrays, in row order: a row with a reservation, its ``depth`` path slots
        (``keep`` real, ``keep [F]`` on the device); a new one, an empty span."""
        lengths = np.where(flight, self.depth, 0)   # (int64: the depth is an int)
        slots = dst[:, 1:].reshape(-1)   # (the rows with a reservation, in order: theirs alone)
        if keep is None:   # (new rows only)
            every = self._zero.expand(len(at))
        elif np.logical_and.reduce(flight):
            every = keep
        else:
            every = torch.zeros(len(at), dtype=torch.int64, device=self.device).index_copy_(
                0, to_device(flight.nonzero()[0], self.device), keep)
        return DynamicSpans.unchecked(slots, lengths, every, NO_ROWS, NO_ROWS)   # (the scheduler gives the rows)

    def _drafts(self, at, at_d, f, f_d, o, unused) -> torch.Tensor:
        """``[P, m - 1]``: the next trees' draft tokens of the placed rows, on the device."""
        if self.kind == "heads":
            return self.draft.row_head_drafts(self.head.index_select(0, at_d))
        if self.kind == "fixed":
            return self.fixed.index_select(0, at_d)
        # EAGLE's chains: each request's drafter syncs its own sequence (a host call a request), the device work is
        # one sync and one chain run for all (EagleChains)
        steps = {}
        if f_d is not None:
            keep = o[:, 0]
            pick = torch.cat([o.new_zeros(len(f), 1), o[:, 2:].clamp(min=0)], dim=1)
            states = self.states.index_select(0, f_d)
            states = states[torch.arange(len(f), device=self.device)[:, None], pick]
            bonus = o[:, 1]
            after = torch.cat([self.tokens.index_select(0, f_d).gather(1, o[:, 2:].clamp(min=0)), bonus[:, None]],
                              dim=1)
            column = torch.arange(1 + self.depth, device=self.device)
            following = torch.where(column[None, :] == keep[:, None], bonus[:, None], after)
            count = (keep + 1).reshape(-1, 1)
            for j, i in enumerate(f.tolist()):
                steps[i] = DeviceStep(self.device, None, states[j], following[j], count[j], int(unused[j]))
        for i in at.tolist():
            if i not in steps:
                states, tokens = self.prompt_states[i]
                self.prompt_states[i] = None
                steps[i] = DeviceStep(self.device, None, states, tokens)
            self.requests[i].program.draft.submit_step(steps[i])
        return torch.stack([self.requests[i].program.draft.collect_step() for i in at.tolist()])

    def _record(self, at: np.ndarray, values: np.ndarray, m: int) -> list[tuple]:
        rows, tree, d = self.rows, self.tree, self.depth
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        res = rows.reserved[at]
        s = at[res]
        if len(s):   # the tokens of the reservation: the read tree's root and accepted path
            length = values[res, 0]
            both = np.concatenate([rows.root_token[s][:, None], values[res, 2 + d:2 + 2 * d]], axis=1)
            real = np.arange(1 + d)[None, :] < 1 + length[:, None]
            tree.set_tokens_many(rows.node[s], rows.length[s] - d - 1, both[real], 1 + length, checked=False)
        found = rows.record(at, values, self.checkers, seconds)
        if self.budget is not None:
            self.budget.observe_many(self.budget_slots[at[found.stepped]], found.kept[found.stepped])
        for j in (rows.text[at] & found.stepped).nonzero()[0].tolist():   # on_step, on_text: per step
            i = int(at[j])
            self._fill_stats(i)
            self.requests[i].program.stepped(self.requests[i].stats, self.checkers[i])
        ended = at[found.stop]
        finished = []
        if len(ended):
            tree.prune_many(rows.flight_root[ended])   # the step launched past the stop: rolled back
            cut = found.cut[found.stop]
            c = cut > 0
            if c.any():
                tree.truncate_many(rows.node[ended][c], rows.length[ended][c] - cut[c])
            for i in ended.tolist():   # (an event a request)
                request = self.requests[i]
                self._fill_stats(i)
                if self.checkers[i] is None:   # its stop rule applied to its tokens at once, as token by token
                    request.checker.accept(rows.tokens[i, :rows.emitted[i]].tolist())
                    assert request.checker.stopped, f"{request.checker.token_ids=} did not end"
                finished.append((self.owners[i], request))
            keep = np.ones(self.size, dtype=bool)
            keep[ended] = False
        going = at[~found.stop]
        rows.launched(going, m - 1)
        if len(ended):
            self._keep(keep)
        return finished

    def _fill_stats(self, i: int) -> None:
        """Row ``i``'s stats from its columns (at its end, and every step for the rows checked one by one)."""
        stats = self.requests[i].stats
        _, accepted, sizes, seconds = self.rows.result(i)
        stats.steps, stats.accepted, stats.draft_sizes = len(accepted), accepted, sizes
        stats.draft_seconds, stats.verify_seconds = [0.0] * len(accepted), seconds

    def _keep(self, keep: np.ndarray) -> None:
        """Keep the rows of ``keep`` ([R] bool) in every column (an event)."""
        self.rows.keep(keep)
        index = keep.nonzero()[0]
        self.requests = [self.requests[i] for i in index]
        self.owners = [self.owners[i] for i in index]
        self.checkers = [self.checkers[i] for i in index]
        self.prompt_states = [self.prompt_states[i] for i in index]
        self.budget_slots = self.budget_slots[index]
        on = to_device(index, self.device)
        for name in ("read", "outcome", "slots", "tokens", "seeds", "steps", "head", "flight_heads", "states",
                     "fixed", "counts", "prompt_masks", "penalties"):
            column = getattr(self, name)
            if column is not None:
                setattr(self, name, column.index_select(0, on))


def draft_kind(draft) -> str:
    """How a draft with a fixed tree makes its tokens on the device: ``"chains"`` (a drafter synced per request,
    drafting together: EAGLE), ``"heads"`` (from its row head's output: Medusa) or ``"fixed"`` (fixed tokens)."""
    return "chains" if draft.drafts_together else "heads" if draft.row_head is not None else "fixed"


def _padded(values: torch.Tensor, extra: int) -> torch.Tensor:
    """``values [P, m, ...]`` with ``extra`` zero rows after each one's ``m`` (to the full tree's)."""
    if not extra:
        return values
    return torch.cat([values, values.new_zeros((values.shape[0], extra, *values.shape[2:]))], dim=1)
