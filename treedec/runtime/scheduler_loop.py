"""The scheduler's loop (:mod:`treedec.runtime.scheduler`): its state and one iteration at a time.

:class:`SchedulerLoop` admits, resumes and steps programs (see :mod:`treedec.runtime.scheduler` for the
rules); :func:`~treedec.runtime.scheduler.run_programs` runs it over a fixed list,
:class:`~treedec.runtime.online.OnlineScheduler` while programs come and go; its counters are
:class:`~treedec.runtime.scheduler_stats.SchedulerStats`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Generator, Mapping

import torch

from treedec.runtime.bulk import Bulk, BulkTable
from treedec.runtime.decode import Decode, DecodeResult, PlacedLanes
from treedec.runtime.lanes import Lanes
from treedec.runtime.prefix_cache import CachedPrefix, PrefixCache
from treedec.runtime.prefixes import SharedPrefix, share_prefixes
from treedec.runtime.program import Program, ProgramContext, Read, StepRequest, Wait, program_name
from treedec.runtime.request import pages_in_use
from treedec.runtime.scheduler_relief import PoolRelief
from treedec.runtime.scheduler_stats import SchedulerStats
from treedec.runtime.scheduler_step import StepRun
from treedec.transfer import HostCopy

__all__ = ["SchedulerLoop"]


@dataclass(eq=False)
class _Live:
    index: int
    gen: Generator
    ctx: ProgramContext
    order: int                          # admission order (newest preempted first)
    send: Any = None                    # what it is resumed with next
    request: StepRequest | None = None  # its request in the step being gathered
    waiting: Wait | None = None
    started: bool = False               # resumed at least once (its prompt is placed)
    added: int = 0                      # tokens it added this iteration
    read: torch.Tensor | None = None    # what its Read asks for
    decoding: bool = False              # parked in a Decode: its lanes run, it is resumed when they end
    bulk: BulkTable | None = None       # parked in that table (a Bulk request): resumed when the request ends
    reserve: int = 0                    # the pages kept for it (its share of the admission headroom)


class SchedulerLoop(StepRun, PoolRelief):
    """The loop's state (the search layer's own: not exported). :meth:`iterate` is one iteration; :meth:`run`
    (:func:`run_programs`) loops it over a fixed list, :class:`~treedec.runtime.online.OnlineScheduler` while
    programs come and go (:meth:`add`, :meth:`drop`). ``on_error`` None: a program's error propagates (the
    run ends, :meth:`abandon`); else ``on_error(index, error)`` and the others go on. One thread drives it."""

    def __init__(self, engine, programs, budget, min_shared, preempt, on_done, on_step, on_error=None,
                 cache: PrefixCache | None = None, share_queued: bool = False, pipeline: bool | None = None,
                 seed: int = 0):
        self.engine, self.budget, self.cache = engine, budget, cache
        self.lanes = Lanes(engine, pipeline, seed)
        self.tables: dict[type, BulkTable] = {}   # one per Bulk kind, made on first use
        # (online) programs added since the last admission, grouped by shared prompt prefixes when admitted
        self.share_queued, self.ungrouped = share_queued, set()
        self.preempt, self.on_done, self.on_step, self.on_error = preempt, on_done, on_step, on_error
        shared = [None] * len(programs)
        if min_shared:   # (a prefix the cache holds is read from it: no group)
            shared = self._uncached(share_prefixes([p.prompt_ids if p.shares_prompt else None for p in programs],
                                                   min_shared, engine.pool.page_size))
        self.programs = dict(enumerate(programs))   # index -> program, until it retires or fails
        self.prefixes = dict(enumerate(shared))     # index -> its shared prefix or None
        self.groups = list({id(p): p for p in shared if p is not None}.values())   # each prefix once
        self.stats = SchedulerStats()
        self.stats.lane_draws = self.lanes.draws   # (the lanes count them)
        self.stats.shared_prefix_tokens = sum(len(p.tokens) * (p.members - 1) for p in self.groups)
        self.queue = deque(range(len(programs)))
        self.live: list[_Live] = []     # admitted, in admission order (events only change it)
        self.active: list[_Live] = []   # the live programs not parked in a Decode, in resume order
        self.waiters: set[_Live] = set()   # live programs waiting for pages
        self.headroom = 0               # the pages kept for the live programs' next steps and prompts
        self.admitted = 0
        self.held_before = pages_in_use(engine.pool)

    def run(self) -> tuple[list[Any], SchedulerStats]:
        results: dict[int, Any] = {}
        given = self.on_done

        def done(index: int, result: Any) -> None:
            results[index] = result
            if given is not None:
                given(index, result)

        self.on_done = done
        count = len(self.programs)
        start = time.perf_counter()
        try:
            while self.queue or self.live:
                self.iterate()
        except BaseException:
            self.abandon()
            raise
        self.stats.seconds = time.perf_counter() - start
        return [results[i] for i in range(count)], self.stats

    def iterate(self) -> bool:
        """One iteration: admit, resume, then one engine step (or, when every live program waits for pages,
        relieve the pool). Returns whether programs are left (queued or live)."""
        self._admit()
        gathered = self._resume()
        woken = self._wake(self.lanes.draw_fresh())   # (new lanes' first tokens: computed by this step)
        placed = self._place_lanes()
        bulk = self._place_bulk()
        self.stats.peak_pages = max(self.stats.peak_pages, pages_in_use(self.engine.pool) - self.held_before)
        if gathered or len(placed.nodes) or bulk:
            self._step(gathered, placed, bulk)
        elif self.lanes.unread:   # draws that no step computes (outputs they end): read back now
            self._wake(self.lanes.read_back())
        elif not woken and self.live and len(self.waiters) == len(self.live):
            self._relieve()
        return bool(self.queue or self.live)

    def abandon(self) -> list[int]:
        """After an error that ends every live program (a failed step): mark the tokens left pending computed
        (nothing reads them), close the live programs (their pages freed) and prune the shared prefixes.
        Returns the indices of the programs closed; the queued ones stay queued."""
        tree = self.engine.tree
        if tree.num_pending:   # a failed step: its tokens were never computed, nothing reads them
            tree.commit_step()
        closed, self.live, self.active, self.headroom = self.live, [], [], 0
        self.waiters.clear()
        self.lanes.reset()
        for table in self.tables.values():
            table.reset()
        for lv in closed:
            lv.gen.close()
            self.programs.pop(lv.index, None)
            prefix = self.prefixes.pop(lv.index, None)
            if isinstance(prefix, CachedPrefix):
                prefix.leave(tree, retired=False)
            elif isinstance(prefix, SharedPrefix):   # (it ends: one running member and one member fewer)
                prefix.live -= 1
                prefix.members -= 1
        for prefix in self.groups:
            prefix.evict(tree)
        self.groups = [g for g in self.groups if g.members > 0]
        return [lv.index for lv in closed]

    def add(self, index: int, program: Program) -> None:
        """Queue ``program`` as ``index``. With ``share_queued``, programs queued together (added between two
        admissions) whose prompts share a prefix the cache does not hold read one copy of it (as
        :func:`~treedec.runtime.scheduler.run_programs`' do): a burst of requests with one long prompt (a ToT
        problem's branches) computes it once."""
        self.programs[index], self.prefixes[index] = program, None
        self.queue.append(index)
        if self.share_queued:
            self.ungrouped.add(index)

    def drop(self, index: int, kept: Mapping[int, int] | None = None) -> bool:
        """Between iterations: take program ``index`` out, queued or live (closed: its ``finally`` frees its
        pages; ``kept``: as :meth:`Lanes.drop <treedec.runtime.lanes.Lanes.drop>`'s). Returns whether it was
        there."""
        if index not in self.programs:
            return False
        live = next((lv for lv in self.live if lv.index == index), None)
        if live is None:
            self.queue.remove(index)
        else:
            self._close(live, kept)
        self.programs.pop(index)
        self.ungrouped.discard(index)
        prefix = self.prefixes.pop(index)
        if isinstance(prefix, SharedPrefix):   # one member fewer, for good
            prefix.members -= 1
            self._forget_if_done(prefix)
        return True

    def _group_queued(self) -> None:
        """Group the programs queued since the last admission by shared prompt prefixes (not held by the cache)."""
        fresh = [i for i in self.queue if i in self.ungrouped and self.prefixes[i] is None]
        self.ungrouped.clear()
        if len(fresh) < 2:
            return
        ps = self.engine.pool.page_size
        shared = self._uncached(share_prefixes([self.programs[i].prompt_ids if self.programs[i].shares_prompt
                                                else None for i in fresh], ps, ps))
        for group in {id(p): p for p in shared if p is not None}.values():
            self.groups.append(group)
            self.stats.shared_prefix_tokens += len(group.tokens) * (group.members - 1)
            for i, prefix in zip(fresh, shared):
                if prefix is group:
                    self.prefixes[i] = group

    def _uncached(self, shared: list[SharedPrefix | None]) -> list[SharedPrefix | None]:
        """``shared`` (each program's group, :func:`share_prefixes`) without the groups whose whole prefix the cache
        holds: each of their members reads it from the cache at admission instead of a prefill of its own."""
        if self.cache is None:
            return shared
        covered = {id(g) for g in {id(p): p for p in shared if p is not None}.values() if self.cache.covers(g.tokens)}
        return [None if p is not None and id(p) in covered else p for p in shared]

    def _forget_if_done(self, prefix: SharedPrefix) -> None:
        """A shared prefix without members left is pruned and no longer tracked."""
        if prefix.members == 0:
            prefix.evict(self.engine.tree)
            self.groups = [g for g in self.groups if g is not prefix]

    def _admit(self) -> None:
        pool = self.engine.pool
        if not self.queue or self.waiters:
            return   # (the pages freed go to the programs that wait first)
        if self.ungrouped:
            self._group_queued()
        headroom = self.headroom   # the next step of every live program, and the prompts of those not resumed yet
        while self.queue:
            index = self.queue[0]
            program, prefix, cached = self.programs[index], self.prefixes[index], None
            if prefix is None and self.cache is not None and program.shares_prompt and program.prompt_ids:
                # (matched at each try: what is cached changes while it waits)
                cached = self.prefixes[index] = prefix = self.cache.match(program.prompt_ids)
            need = self._pages(index) + (0 if prefix is None else prefix.admission_pages(pool))
            short = need - (pool.num_free_pages - headroom)
            if short > 0:
                # Idle prefixes (no member running) and cached ones nothing reads give their pages back if that
                # admits it; with nothing live it is admitted anyway (and raises if it cannot run alone in the pool).
                if self.live and short > self._evictable(keep=prefix):
                    if cached is not None:   # (matched again at the next try)
                        self.prefixes[index] = None
                    self.stats.waits += 1
                    return
                self._evict_idle(short, keep=prefix)
            self.queue.popleft()
            self.stats.prompt_tokens += len(program.prompt_ids) if program.prompt_ids else 0
            if prefix is not None:
                prefix.acquire(self.engine)
            ctx = ProgramContext(self.engine, prefix, program_name(program, index), cache=self.cache)
            if cached is not None:
                ctx.cached_tokens = len(cached.tokens)
                self.stats.cached_tokens += ctx.cached_tokens
            lv = _Live(index, program.run(ctx), ctx, self.admitted, reserve=self._pages(index))
            self.live.append(lv)
            self.active.append(lv)
            self.admitted += 1
            headroom += lv.reserve
            self.headroom += lv.reserve

    def _pages(self, index: int, started: bool = False) -> int:
        """The pages kept for a live program: its next step's, and its prompt's (past its shared prefix)
        until it is resumed."""
        program, prefix, pool = self.programs[index], self.prefixes[index], self.engine.pool
        start = 0 if started else program.start_pages(pool, 0 if prefix is None else len(prefix.tokens))
        return program.step_pages(pool) + start

    def _resume(self) -> list[_Live]:
        """Resume the live programs (those not stepped last time first) until the budget is pending;
        the :class:`Read` requests of a pass are read back in one copy and their programs resumed."""
        tree, gathered, reading = self.engine.tree, [], []
        # Running programs first (their decode steps are small), then the new ones' prompts; the programs parked in
        # a Decode or a Bulk table are not resumed (their lanes or rows run). (self.live keeps every program until it
        # returns, so a failure closes them all.)
        for lv in sorted(self.active, key=lambda lv: not lv.started):
            if gathered and tree.num_pending >= self.budget:
                break
            if not lv.started:   # its prompt is placed now: its headroom is its steps' alone
                lv.started, reserve = True, self._pages(lv.index, started=True)
                self.headroom += reserve - lv.reserve
                lv.reserve = reserve
            lv.added = 0
            self._advance(lv, gathered, reading)
        while reading:
            batch, reading = reading, []
            values = torch.cat([lv.read.reshape(-1).to(torch.int64) for lv in batch])
            # (nothing to read, e.g. only ProgramContext.together: no copy, which would wait for the device)
            flat, at = (HostCopy(values).result() if values.numel() else []), 0
            for lv in batch:
                size = lv.read.numel()
                lv.send = flat[at:at + size] if lv.read.dim() <= 1 else \
                    torch.tensor(flat[at:at + size]).reshape(lv.read.shape).tolist()
                lv.read = None
                at += size
            for lv in batch:
                self._advance(lv, gathered, reading)
        # Stepped programs go last, so the ones held back by the budget are resumed first next time.
        stepped = set(map(id, gathered))
        self.active = [lv for lv in self.active if id(lv) not in stepped] + gathered
        return gathered

    def _advance(self, lv: _Live, gathered: list[_Live], reading: list[_Live]) -> None:
        """Resume one program until it yields; file it by what it yielded."""
        tree = self.engine.tree
        before = tree.num_pending
        if isinstance(lv.send, DecodeResult) and lv.send.pending:   # its last tokens, for its next step (its own)
            need = self.lanes.pending_pages(lv.send)
            if need > self.engine.pool.num_free_pages:
                if lv.waiting is None:
                    self.stats.waits += 1
                self._wait(lv, Wait(need, "a decoded output's last token needs a KV page"))
                return
            self.lanes.place_pending(lv.send)
            self._wait(lv, None)
        try:
            out = lv.gen.send(lv.send)
        except StopIteration as done:
            self._retire(lv, done.value)
            return
        except Exception as error:
            # Given to it alone, unless it had tokens pending or its ``finally`` marked the step's computed:
            # then the step is no longer the one the others asked for (all fail).
            if self.on_error is None or lv.added or tree.num_pending != before:
                raise
            self._fail(lv, error)
            return
        lv.send, lv.added = None, lv.added + tree.num_pending - before
        if isinstance(out, Read):
            lv.read = out.tensor
            reading.append(lv)
        elif isinstance(out, Wait):
            if lv.waiting is None:
                self.stats.waits += 1
            self._wait(lv, out)
        elif isinstance(out, StepRequest):
            self._wait(lv, None)
            lv.request = out
            lv.ctx.step_queries = lv.added
            gathered.append(lv)
        elif isinstance(out, Decode):
            if lv.added:   # (its pending tokens would be computed with no one reading their rows)
                error = TypeError(f"{type(self.programs[lv.index]).__name__}.run yielded a Decode with tokens "
                                  f"pending: a Decode starts after computed tokens")
                if self.on_error is None:
                    raise error
                self._fail(lv, error)
                return
            self._wait(lv, None)
            lv.decoding = True
            self.active.remove(lv)
            self.lanes.add(lv, out)
        elif isinstance(out, Bulk) and not lv.added:   # (its pending tokens would be computed unread)
            self._wait(lv, None)
            table = self.tables.get(out.table)
            if table is None:
                table = self.tables[out.table] = out.table(self.engine)
            lv.bulk = table
            self.active.remove(lv)
            table.add(lv, out)
        else:
            error = TypeError(f"{type(self.programs[lv.index]).__name__}.run yielded {type(out).__name__}, "
                              f"not a StepRequest, Decode, Bulk, Read or Wait" if not isinstance(out, Bulk) else
                              f"{type(self.programs[lv.index]).__name__}.run yielded a {type(out).__name__} with "
                              f"tokens pending: a bulk request starts after computed tokens")
            if self.on_error is None or lv.added:   # (closing it would mark the step's tokens computed)
                raise error
            self._fail(lv, error)

    def _place_lanes(self) -> PlacedLanes:
        """Append every ready lane's next token (the pages they need permitting); a decoding program some of whose
        lanes cannot grow for want of pages waits (:meth:`_relieve` may preempt it)."""
        lanes = self.lanes
        if not lanes.num_lanes:
            return PlacedLanes.NONE
        was = lanes.blocked_owners()
        placed = lanes.place(self.engine.pool.num_free_pages)
        blocked = lanes.blocked_owners()
        for lv in was - blocked:   # (the owners whose lanes changed only)
            if lv.decoding:
                self._wait(lv, None)
        for lv in blocked - was:
            self._wait(lv, Wait(1, "a decoding output needs a KV page"))
        return placed

    def _place_bulk(self) -> list[tuple[BulkTable, list[StepRequest]]]:
        """Each bulk table's rows of the next step (the pages left permitting); a program whose request a table
        left out for want of pages waits (:meth:`_relieve` may preempt it)."""
        placed = []
        for table in self.tables.values():
            if not table.size:
                continue
            was = table.blocked()
            requests = table.place(self.engine.pool.num_free_pages)
            blocked = table.blocked()
            if was or blocked:   # (a table's place() makes a new dict: ``was`` is the last one's)
                for lv in was.keys() - blocked.keys():
                    if lv.bulk is table:
                        self._wait(lv, None)
                for lv, pages in blocked.items():
                    if lv.waiting is None or lv.waiting.pages != pages:
                        self._wait(lv, Wait(pages, "a speculative request's next step needs KV pages"))
            if requests:
                placed.append((table, requests))
        return placed

    def _wait(self, lv: _Live, wait: Wait | None) -> None:
        lv.waiting = wait
        if wait is None:
            self.waiters.discard(lv)
        else:
            self.waiters.add(lv)

    def _wake(self, finished) -> bool:
        """Resume the programs whose Decode ended (with its result) and fail those whose lanes failed."""
        for lv, result in finished:
            lv.decoding, lv.bulk, lv.send = False, None, result
            self._wait(lv, None)
            self.active.append(lv)
        for lv, error in self.lanes.take_failures():
            if self.on_error is None:
                raise error
            self._fail(lv, error)
        return bool(finished)

    def _retire(self, lv: _Live, result: Any) -> None:
        self._forget(lv)
        del self.programs[lv.index]
        prefix = self.prefixes.pop(lv.index)
        if prefix is not None:
            prefix.leave(self.engine.tree, retired=True)
        if isinstance(prefix, SharedPrefix):
            self._forget_if_done(prefix)
        if self.on_done is not None:
            self.on_done(lv.index, result)

    def _close(self, lv: _Live, kept: Mapping[int, int] | None = None) -> None:
        """Close a live program (its lanes dropped, ``kept`` outputs offered: :meth:`Lanes.drop
        <treedec.runtime.lanes.Lanes.drop>`; its ``finally`` frees its pages) and leave its shared prefix."""
        self._forget(lv)
        lv.ctx.kept = kept
        if lv.decoding:
            self.lanes.drop(lv, kept)
            lv.decoding = False
        if lv.bulk is not None:
            lv.bulk.drop(lv)
            lv.bulk = None
        lv.gen.close()
        prefix = self.prefixes[lv.index]
        if prefix is not None:
            prefix.leave(self.engine.tree, retired=False)
        if isinstance(prefix, CachedPrefix):   # matched again when it is admitted again (it may be evicted)
            self.prefixes[lv.index] = None

    def _forget(self, lv: _Live) -> None:
        """``lv`` is no longer live (it returned or is closed)."""
        self.live.remove(lv)
        if not lv.decoding and lv.bulk is None:
            self.active.remove(lv)
        self.waiters.discard(lv)
        self.headroom -= lv.reserve

    def _fail(self, lv: _Live, error: Exception) -> None:
        """Program ``lv`` raised ``error`` (``on_error`` is set): it alone ends."""
        self._close(lv)
        del self.programs[lv.index]
        prefix = self.prefixes.pop(lv.index)
        if isinstance(prefix, SharedPrefix):
            prefix.members -= 1
            self._forget_if_done(prefix)
        self.on_error(lv.index, error)

