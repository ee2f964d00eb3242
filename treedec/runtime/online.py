"""Online decoding: programs submitted and aborted while the scheduler runs (the engine under a server).

:class:`OnlineScheduler` drives the scheduler's loop (:mod:`treedec.runtime.scheduler`: admission, resume,
one engine step for every live program, pool relief and preemption) one iteration at a time over one
:class:`~treedec.engine.Engine`, while programs come and go:

- :meth:`OnlineScheduler.submit` queues a program (from any thread); it is admitted at an iteration by the
  same rules as :func:`~treedec.runtime.scheduler.run_programs`', on the longest prefix of its prompt in the
  prefix cache across requests (:mod:`treedec.runtime.prefix_cache`: the prompts and conversations of
  earlier requests, and of running ones once computed), unless the cache is off; programs queued together
  whose prompts share a prefix the cache lacks read one copy of it (a burst of branches of one problem);
- :meth:`OnlineScheduler.abort` drops a queued program, or closes a live one between iterations (its
  ``finally`` frees its nodes and pages); it ends with :class:`ProgramAborted`;
- each program ends through ``on_done(handle, result)`` or ``on_error(handle, error)``: an error of ONE
  program (a bad request found while it runs, a logits processor that raises, a pool too small for it
  alone) ends that program only, the others go on; an error of the engine step itself (a device failure)
  ends every live program (each gets it) and leaves their pages free.

One thread drives an engine: :meth:`OnlineScheduler.iterate` must only ever be called from one thread at a
time (never two threads in one engine, nor an engine that something else steps meanwhile). ``submit`` and
``abort`` from other threads go through an inbox (a lock and a list) that the driving thread drains at the
start of each iteration; the callbacks run on the driving thread.

:class:`~treedec.core.online_engine.OnlineEngine` is that driving thread, for the engine core (it turns requests into
programs).

Memory stays bounded in a long-running server: :attr:`OnlineScheduler.stats` keeps its counters for the engine's
life but only the last ``history`` entries of its per-step lists.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Mapping


from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.runtime.prefix_cache import PrefixCache
from treedec.runtime.program import Program
from treedec.runtime.request import check_positions, pages_in_use
from treedec.runtime.scheduler_loop import SchedulerLoop
from treedec.runtime.scheduler_stats import SchedulerStats

__all__ = ["OnlineScheduler", "ProgramAborted"]


class ProgramAborted(Exception):
    """How an aborted program ends: given to ``on_error`` (raised by an :class:`OnlineEngine` stream)."""


class OnlineScheduler:
    """The scheduler's loop over ``engine``, with programs submitted and aborted while it runs (see the module
    docstring).

    Parameters
    ----------
    engine : the engine; its tree must have no pending tokens. Its other trees are left alone.
    max_step_tokens : as :func:`~treedec.runtime.scheduler.run_programs`' (default ``engine.prefill_chunk``).
    on_done : called as ``on_done(handle, result)`` when a program returns.
    on_error : called as ``on_error(handle, error)`` when a program fails or is aborted
        (:class:`ProgramAborted`); required (an error of one program is never raised to the driver).
    on_step : called as ``on_step(stats)`` after each engine step is launched.
    prefix_cache : keep a :class:`~treedec.runtime.prefix_cache.PrefixCache` (:attr:`cache`) of prompts and
        conversations across requests (default True), or this one (of ``engine``'s tree: e.g. an
        :class:`~treedec.LLM`'s, so that one cache holds the engine's cached pages).
    history : the per-step entries :attr:`stats` keeps (the newest).
    pipeline, seed : as :func:`~treedec.runtime.scheduler.run_programs`' (decoding outputs read back while the next
        step runs, default on a CUDA engine; the seed of the draws of requests without one).

    The callbacks run on the driving thread, between or inside iterations: they must not call
    :meth:`iterate`, and should return quickly (an error escaping one ends every live program, as a failed
    step does).

    Attributes
    ----------
    stats : the :class:`~treedec.runtime.scheduler.SchedulerStats` since it was made: its counters (``steps``,
        ``prompt_tokens``, ``cached_tokens``, ...) count every step; its per-step lists (``queries_per_step``,
        ``programs_per_step``) hold the last ``history`` steps' (``seconds`` stays 0).
    capacity : the most KV pages the scheduler can ever give one program: the pool's pages but those held, when it
        was made, by anything but its prefix cache (the engine's other trees). A program needing more can never
        run to its end, however long it waits (the others' pages are freed as they end, the cache's evicted).
    """

    def __init__(self, engine: Engine, *, max_step_tokens: int | None = None,
                 on_done: Callable[[int, Any], None] | None = None,
                 on_error: Callable[[int, BaseException], None],
                 on_step: Callable[[SchedulerStats], None] | None = None, history: int = 1024,
                 prefix_cache: bool | PrefixCache = True, pipeline: bool | None = None, seed: int = 0):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
        budget = engine.prefill_chunk if max_step_tokens is None else max_step_tokens
        positive_int("max_step_tokens", budget)
        positive_int("history", history)
        pending = engine.tree.num_pending
        if pending:
            raise ValueError(f"the engine's tree has {pending} pending token(s): run engine.step() first")
        if not callable(on_error):
            raise TypeError(f"on_error must be callable, got {type(on_error).__name__}")
        for name, f in (("on_done", on_done), ("on_step", on_step)):
            if f is not None and not callable(f):
                raise TypeError(f"{name} must be callable, got {type(f).__name__}")
        self.engine = engine
        self._on_error = on_error
        if isinstance(prefix_cache, PrefixCache):
            if prefix_cache.tree is not engine.tree:
                raise ValueError("prefix_cache must be a PrefixCache of this engine's tree")
            self.cache = prefix_cache
        else:
            self.cache = PrefixCache(engine.tree) if prefix_cache else None
        self._core = SchedulerLoop(engine, [], budget, 0, True, on_done, on_step, on_error, cache=self.cache,
                                   share_queued=True, pipeline=pipeline, seed=seed)
        held = pages_in_use(engine.pool) - (0 if self.cache is None else self.cache.num_pages)
        self.capacity = engine.pool.num_pages - held
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, int, Program | None]] = []
        self._handles = itertools.count()
        self.history = history

    @property
    def stats(self) -> SchedulerStats:
        return self._core.stats

    @property
    def num_running(self) -> int:
        """Programs admitted and not yet ended (a snapshot; any thread)."""
        return len(self._core.live)

    @property
    def num_waiting(self) -> int:
        """Programs submitted and not yet admitted (a snapshot; any thread)."""
        with self._lock:
            inbox = sum(1 for kind, _, _ in self._inbox if kind == "submit")
        return len(self._core.queue) + inbox

    @property
    def idle(self) -> bool:
        """Nothing queued, live or in the inbox."""
        return not (self._inbox or self._core.queue or self._core.live)

    def submit(self, program: Program) -> int:
        """Queue ``program`` (any thread); returns its handle. A program whose length is known up front
        (:meth:`Program.positions`) and may run past the model's positions raises ``ValueError`` here."""
        if not isinstance(program, Program):
            raise TypeError(f"program must be a Program instance, got {type(program).__name__}")
        with self._lock:
            handle = next(self._handles)
        need = program.positions()
        if need is not None:
            name = program.name if program.name is not None else f"program {handle} ({type(program).__name__})"
            check_positions(self.engine.model, need, name, before_run=True)
        with self._lock:
            self._inbox.append(("submit", handle, program))
        return handle

    def abort(self, handle: int, kept: Mapping[int, int] | None = None) -> None:
        """Abort program ``handle`` (any thread): at the next iteration it is dropped from the queue or closed,
        and ends with :class:`ProgramAborted`. A program that ended before then is left as it ended. ``kept``:
        output index -> its tokens the caller kept (its stop string ended it there): the output's conversation to
        there is offered to the prefix cache before its pages are freed (a multi-turn chat's next turn reads it:
        :attr:`ProgramContext.kept <treedec.runtime.program.ProgramContext>`, read by the lanes and by a speculative
        program)."""
        with self._lock:
            self._inbox.append(("abort", handle, kept))

    def iterate(self) -> bool:
        """Drain the inbox, then one iteration (admit, resume, one engine step for every live program).
        Returns whether programs are left (queued or live). The driving thread only.

        A failed iteration (the engine step raised) ends every live program with its error (``on_error``);
        their pages are free, the queued programs stay queued. A ``BaseException``
        (``KeyboardInterrupt``) closes them and propagates."""
        core = self._core
        if self._inbox:
            self._drain()
        try:
            return core.iterate()
        except Exception as error:
            for handle in core.abandon():
                self._on_error(handle, error)
            return bool(core.queue)
        except BaseException:
            core.abandon()
            raise
        finally:
            stats = core.stats
            for steps in (stats.queries_per_step, stats.programs_per_step):
                if len(steps) >= 2 * self.history:   # (trimmed now and then: amortized O(1) a step)
                    del steps[:-self.history]

    def _drain(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, handle, payload in inbox:   # (a submit's program, an abort's kept outputs)
            if kind == "submit":
                self._core.add(handle, payload)
            elif self._core.drop(handle, payload):
                self._on_error(handle, ProgramAborted(f"program {handle} was aborted"))
