"""The scheduler's loop (:mod:`treedec.search.scheduler`): its state and one iteration at a time.

:class:`SchedulerLoop` admits, resumes and steps programs (see :mod:`treedec.search.scheduler` for the
rules); :func:`~treedec.search.scheduler.run_programs` runs it over a fixed list,
:class:`~treedec.search.online.OnlineScheduler` while programs come and go. :class:`SchedulerStats` are its
counters.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generator

import numpy as np
import torch

from treedec.errors import PoolExhaustedError
from treedec.search.prefix_cache import CachedPrefix, PrefixCache
from treedec.search.prefixes import SharedPrefix, share_prefixes
from treedec.search.program import Program, ProgramContext, Read, StepRequest, StepRows, Wait, set_aside_bad_tokens
from treedec.search.request import pages_in_use
from treedec.search.sampling import GREEDY, sample_tokens
from treedec.transfer import HostCopy, to_device

__all__ = ["SchedulerLoop", "SchedulerStats", "program_name"]


@dataclass
class SchedulerStats:
    """Counters of one :func:`run_programs` run.

    Attributes
    ----------
    steps : engine steps run by the scheduler (shared-prefix prefills not included).
    prompt_steps : those of them that computed a prompt chunk (the others only decode).
    queries_per_step : tokens computed by each step.
    programs_per_step : programs with rows in each step.
    waits : times a program waited for pages (a :class:`Wait`) or a queued program for admission.
    preemptions : programs closed to free pages and run again.
    shared_prefix_tokens : prompt tokens not stored again because another request shares them
        (a prefix of ``t`` tokens read by ``m`` requests counts ``t * (m - 1)``).
    prompt_tokens : prompt tokens of the programs admitted (each admission counted: a preempted program's
        prompt again).
    cached_tokens : those of them read from the prefix cache across requests
        (:mod:`treedec.search.prefix_cache`) instead of computed; :attr:`cache_hit_rate` is their share.
    peak_pages : the most KV pages the run held at once.
    seconds : wall time.
    """

    steps: int = 0
    prompt_steps: int = 0
    queries_per_step: list[int] = field(default_factory=list)
    programs_per_step: list[int] = field(default_factory=list)
    waits: int = 0
    preemptions: int = 0
    shared_prefix_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    peak_pages: int = 0
    seconds: float = 0.0

    @property
    def cache_hit_rate(self) -> float:
        """The share of admitted prompt tokens read from the prefix cache (0.0 before any prompt)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


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


class SchedulerLoop:
    """The loop's state (the search layer's own: not exported). :meth:`iterate` is one iteration; :meth:`run`
    (:func:`run_programs`) loops it over a fixed list, :class:`~treedec.search.online.OnlineScheduler` while
    programs come and go (:meth:`add`, :meth:`drop`). ``on_error`` None: a program's error propagates (the
    run ends, :meth:`abandon`); else ``on_error(index, error)`` and the others go on. One thread drives it."""

    def __init__(self, engine, programs, budget, min_shared, preempt, on_done, on_step, on_error=None,
                 cache: PrefixCache | None = None, share_queued: bool = False):
        self.engine, self.budget, self.cache = engine, budget, cache
        # (online) programs added since the last admission, grouped by shared prompt prefixes when admitted
        self.share_queued, self.ungrouped = share_queued, set()
        self.preempt, self.on_done, self.on_step, self.on_error = preempt, on_done, on_step, on_error
        shared = share_prefixes([p.prompt_ids if p.shares_prompt else None for p in programs], min_shared,
                                engine.pool.page_size) if min_shared else [None] * len(programs)
        self.programs = dict(enumerate(programs))   # index -> program, until it retires or fails
        self.prefixes = dict(enumerate(shared))     # index -> its shared prefix or None
        self.groups = list({id(p): p for p in shared if p is not None}.values())   # each prefix once
        self.stats = SchedulerStats()
        self.stats.shared_prefix_tokens = sum(len(p.tokens) * (p.members - 1) for p in self.groups)
        self.queue = deque(range(len(programs)))
        self.live: list[_Live] = []
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
        self.stats.peak_pages = max(self.stats.peak_pages, pages_in_use(self.engine.pool) - self.held_before)
        if gathered:
            self._step(gathered)
        elif self.live and all(lv.waiting is not None for lv in self.live):
            self._relieve()
        return bool(self.queue or self.live)

    def abandon(self) -> list[int]:
        """After an error that ends every live program (a failed step): mark the tokens left pending computed
        (nothing reads them), close the live programs (their pages freed) and prune the shared prefixes.
        Returns the indices of the programs closed; the queued ones stay queued."""
        tree = self.engine.tree
        if tree.num_pending:   # a failed step: its tokens were never computed, nothing reads them
            tree.commit_step()
        closed, self.live = self.live, []
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
        :func:`~treedec.search.scheduler.run_programs`' do): a burst of requests with one long prompt (a ToT
        problem's branches) computes it once."""
        self.programs[index], self.prefixes[index] = program, None
        self.queue.append(index)
        if self.share_queued:
            self.ungrouped.add(index)

    def drop(self, index: int) -> bool:
        """Between iterations: take program ``index`` out, queued or live (closed: its ``finally`` frees its
        pages). Returns whether it was there."""
        if index not in self.programs:
            return False
        live = next((lv for lv in self.live if lv.index == index), None)
        if live is None:
            self.queue.remove(index)
        else:
            self._close(live)
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
        shared = share_prefixes([self.programs[i].prompt_ids if self.programs[i].shares_prompt else None
                                 for i in fresh], ps, ps)
        for group in {id(p): p for p in shared if p is not None}.values():
            if self.cache is not None and self.cache.covers(group.tokens):
                continue   # (each member reads it from the cache)
            self.groups.append(group)
            self.stats.shared_prefix_tokens += len(group.tokens) * (group.members - 1)
            for i, prefix in zip(fresh, shared):
                if prefix is group:
                    self.prefixes[i] = group

    def _forget_if_done(self, prefix: SharedPrefix) -> None:
        """A shared prefix without members left is pruned and no longer tracked."""
        if prefix.members == 0:
            prefix.evict(self.engine.tree)
            self.groups = [g for g in self.groups if g is not prefix]

    def _admit(self) -> None:
        pool = self.engine.pool
        if any(lv.waiting is not None for lv in self.live):
            return   # the pages freed go to the programs that wait first
        if self.ungrouped:
            self._group_queued()
        # The next step of every live program, and the prompts of those not resumed yet.
        headroom = sum(self._pages(lv.index, started=lv.started) for lv in self.live)
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
            self.live.append(_Live(index, program.run(ctx), ctx, self.admitted))
            self.admitted += 1
            headroom += self._pages(index)

    def _pages(self, index: int, started: bool = False) -> int:
        """The pages kept for a live program: its next step's, and its prompt's (past its shared prefix)
        until it is resumed."""
        program, prefix, pool = self.programs[index], self.prefixes[index], self.engine.pool
        start = 0 if started else program.start_pages(pool, 0 if prefix is None else len(prefix.tokens))
        return program.step_pages(pool) + start

    def _evictable(self, keep=None) -> int:
        """Pages that evicting the idle shared prefixes and cached ones (but ``keep``) would give back."""
        pool = self.engine.pool
        shared = sum(p.pages(pool) for p in self.groups if p.idle and p is not keep)
        return shared + (0 if self.cache is None else self.cache.evictable_pages(keep))

    def _evict_idle(self, pages: int, keep=None) -> None:
        """Prune idle shared prefixes, then evict the cached ones nothing reads, least recently used first (but
        ``keep``), until ``pages`` more pages are free, or none is left."""
        pool = self.engine.pool
        free = pool.num_free_pages
        for prefix in self.groups:
            if pool.num_free_pages - free >= pages:
                return
            if prefix.idle and prefix is not keep:
                prefix.evict(self.engine.tree)
        if self.cache is not None and pool.num_free_pages - free < pages:
            self.cache.evict(pages - (pool.num_free_pages - free), keep=keep)

    def _resume(self) -> list[_Live]:
        """Resume the live programs (those not stepped last time first) until the budget is pending;
        the :class:`Read` requests of a pass are read back in one copy and their programs resumed."""
        tree, gathered, reading = self.engine.tree, [], []
        # Running programs first (their decode steps are small), then the new ones' prompts.
        # (self.live keeps every program until it returns, so a failure closes them all.)
        for lv in sorted(self.live, key=lambda lv: not lv.started):
            if gathered and tree.num_pending >= self.budget:
                break
            lv.started, lv.added = True, 0
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
        self.live = [lv for lv in self.live if id(lv) not in stepped] + gathered
        return gathered

    def _advance(self, lv: _Live, gathered: list[_Live], reading: list[_Live]) -> None:
        """Resume one program until it yields; file it by what it yielded."""
        tree = self.engine.tree
        before = tree.num_pending
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
            lv.waiting = out
        elif isinstance(out, StepRequest):
            lv.waiting, lv.request = None, out
            lv.ctx.step_queries = lv.added
            gathered.append(lv)
        else:
            error = TypeError(f"{type(self.programs[lv.index]).__name__}.run yielded {type(out).__name__}, "
                              f"not a StepRequest, Read or Wait")
            if self.on_error is None or lv.added:   # (closing it would mark the step's tokens computed)
                raise error
            self._fail(lv, error)

    def _step(self, gathered: list[_Live]) -> None:
        engine = self.engine
        requests = [lv.request for lv in gathered]
        reads = [r.read for r in requests if r.read is not None]
        copy = HostCopy(torch.cat([r.reshape(-1) for r in reads])) if reads else None
        nodes = [n for r in requests for n in r.nodes]
        out = None
        faulty: dict[_Live, Exception] = {}
        hidden_parts: list[slice] = []
        if engine.tree.num_pending:   # (tokens without output rows are computed too)
            rows = engine.pending_rows(nodes)
            hidden = any(r.hidden for r in requests)
            aux = any(r.aux for r in requests)
            heads = any(r.heads for r in requests)
            hidden_rows, at = None, 0
            if (hidden or aux) and any(r.all_rows for r in requests):
                hidden_rows = []   # each request's: its output rows, or every pending token of its nodes
                for r in requests:
                    part = (engine.pending_token_rows(r.nodes) if r.all_rows else engine.pending_rows(r.nodes)) \
                        if r.nodes else np.zeros(0, dtype=np.int64)
                    hidden_rows.append(part)
                    hidden_parts.append(slice(at, at + len(part)))
                    at += len(part)
                hidden_rows = np.concatenate(hidden_rows)
            else:
                for r in requests:
                    hidden_parts.append(slice(at, at + len(r.nodes)))
                    at += len(r.nodes)
            queries = engine.tree.num_pending
            # A pipelined program's span moves back the positions of its own queries (rows known only now).
            spans = [dataclasses.replace(r.dynamic, shift_rows=engine.pending_rows(r.nodes))
                     for r in requests if r.dynamic is not None]
            step = dict(logits_rows=rows, return_hidden=hidden, return_heads=heads, return_aux=aux,
                        hidden_rows=hidden_rows, tokens=self._device_tokens(requests), dynamic=spans or None)
            try:
                out = engine.step(**step)
            except ValueError:   # the engine refused the step before any work: a program's bad token ids?
                faulty = {} if self.on_error is None else \
                    set_aside_bad_tokens(engine, [(lv, lv.request, lv.ctx.name) for lv in gathered])
                if not faulty:
                    raise
                step["tokens"] = self._device_tokens(requests)
                out = engine.step(**step)   # without them (their programs fail below, their K/V never read)
            prompt_step = any(r.prompt for r in requests)
            for lv in gathered if prompt_step else ():   # prompts whose last chunk this step computes: cached for
                if lv.ctx.offer_after_step is not None:  # the next admissions (decode-only steps skip the loop)
                    lv.ctx.offer(lv.ctx.offer_after_step)
                    lv.ctx.offer_after_step = None
            argmax = sample_tokens(out.logits, GREEDY) if any(r.argmax for r in requests) else None
            self.stats.steps += 1
            self.stats.prompt_steps += prompt_step
            self.stats.queries_per_step.append(queries)
            self.stats.programs_per_step.append(sum(1 for r in requests if r.nodes))
            if self.on_step is not None:
                self.on_step(self.stats)
        flat = copy.result() if copy is not None else None
        offset, read_at = 0, 0
        for i, (lv, r) in enumerate(zip(gathered, requests)):
            k = len(r.nodes)
            part = slice(offset, offset + k)
            value = StepRows()
            if k:
                value.logits = out.logits[part]
                value.hidden = out.hidden[hidden_parts[i]] if r.hidden else None
                value.aux = out.aux[hidden_parts[i]] if r.aux else None
                value.heads = {name: t[part] for name, t in out.heads.items()} if r.heads else None
                value.argmax = argmax[part] if r.argmax else None
            if r.read is not None:
                size = r.read.numel()
                part_read = flat[read_at:read_at + size]
                value.read = part_read if r.read.dim() == 1 else torch.tensor(part_read).reshape(r.read.shape).tolist()
                read_at += size
            lv.send, lv.request = value, None
            offset += k
        for lv, error in faulty.items():   # (online) one program's bad token ids fail that program alone
            self._fail(lv, error)

    def _device_tokens(self, requests: list[StepRequest]) -> torch.Tensor | None:
        """All pending token ids on the device, placeholders replaced by the programs' device ids."""
        given = [r for r in requests if r.tokens is not None]
        if not given:
            return None
        engine = self.engine
        ids = to_device(engine.tree.pending_tokens(), engine.device)
        rows = to_device(engine.pending_rows([n for r in given for n in (r.nodes if r.placed is None else r.placed)]),
                         engine.device)
        ids[rows] = torch.cat([r.tokens.reshape(-1) for r in given]).to(torch.int64)
        return ids

    def _relieve(self) -> None:
        """Every live program waits for pages: take back idle prefixes' pages, else preempt the newest, or
        raise if that cannot help."""
        pool = self.engine.pool
        if any(lv.waiting.pages <= pool.num_free_pages for lv in self.live):
            return   # programs that retired after it asked freed enough: it goes on next iteration
        self._evict_idle(min(lv.waiting.pages for lv in self.live) - pool.num_free_pages)
        if any(lv.waiting.pages <= pool.num_free_pages for lv in self.live):
            return
        if not self.preempt or len(self.live) == 1:
            wait = max((lv.waiting for lv in self.live), key=lambda w: w.pages)
            need = wait.reason or (f"a program needs {wait.pages} free pages of {pool.page_size} tokens, "
                                   f"{pool.num_free_pages} of {pool.num_pages} are free")
            error = PoolExhaustedError(f"KV pool exhausted: {need}; nothing else can free pages: give the engine "
                                       f"more kv_tokens")
            if self.on_error is None or len(self.live) != 1:
                raise error
            self._fail(self.live[0], error)   # (online) it cannot run alone in the pool
            return
        victim = max(self.live, key=lambda lv: lv.order)
        self._close(victim)
        self.queue.appendleft(victim.index)
        self.stats.preemptions += 1

    def _retire(self, lv: _Live, result: Any) -> None:
        self.live.remove(lv)
        del self.programs[lv.index]
        prefix = self.prefixes.pop(lv.index)
        if prefix is not None:
            prefix.leave(self.engine.tree, retired=True)
        if isinstance(prefix, SharedPrefix):
            self._forget_if_done(prefix)
        if self.on_done is not None:
            self.on_done(lv.index, result)

    def _close(self, lv: _Live) -> None:
        """Close a live program (its ``finally`` frees its pages) and leave its shared prefix."""
        self.live.remove(lv)
        lv.gen.close()
        prefix = self.prefixes[lv.index]
        if prefix is not None:
            prefix.leave(self.engine.tree, retired=False)
        if isinstance(prefix, CachedPrefix):   # matched again when it is admitted again (it may be evicted)
            self.prefixes[lv.index] = None

    def _fail(self, lv: _Live, error: Exception) -> None:
        """Program ``lv`` raised ``error`` (``on_error`` is set): it alone ends."""
        self._close(lv)
        del self.programs[lv.index]
        prefix = self.prefixes.pop(lv.index)
        if isinstance(prefix, SharedPrefix):
            prefix.members -= 1
            self._forget_if_done(prefix)
        self.on_error(lv.index, error)


def program_name(program: Program, index: int) -> str:
    """How errors name a program of the run."""
    return program.name if program.name is not None else f"programs[{index}] ({type(program).__name__})"
