"""Online decoding: programs submitted and aborted while the scheduler runs (the engine under a server).

:class:`OnlineScheduler` drives the scheduler's loop (:mod:`treedec.search.scheduler`: admission, resume,
one engine step for every live program, pool relief and preemption) one iteration at a time over one
:class:`~treedec.engine.Engine`, while programs come and go:

- :meth:`OnlineScheduler.submit` queues a program (from any thread); it is admitted at an iteration by the
  same rules as :func:`~treedec.search.scheduler.run_programs`', on the longest prefix of its prompt in the
  prefix cache across requests (:mod:`treedec.search.prefix_cache`: the prompts and conversations of
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

:class:`OnlineEngine` is that driving thread, for a server: a background thread loops ``iterate()`` while
there is work and sleeps on an event when idle; :meth:`OnlineEngine.submit` takes a
:class:`~treedec.search.requests_file.RequestSpec` and returns an asyncio async iterator of
:class:`~treedec.search.streams.StreamOutput` (:mod:`treedec.search.streams`): text deltas as they are accepted,
then the request's final :class:`~treedec.search.requests_file.RequestResult` list; handed to the caller's event
loop with ``loop.call_soon_threadsafe``. A request is a :class:`~treedec.search.batch.GenerateProgram`, or with a
draft source (``drafts``, e.g. :class:`~treedec.LLM`'s) a speculative program as :class:`~treedec.LLM` decodes it
(greedy acceptance at temperature 0, lossless rejection sampling above).

Memory stays bounded in a long-running server: :attr:`OnlineScheduler.stats` keeps its counters for the engine's
life but only the last ``history`` entries of its per-step lists.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from typing import Any, AsyncIterator, Callable

import numpy as np

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.search.batch import GenerateProgram, prepare_requests, worst_case_pages
from treedec.search.prefix_cache import PrefixCache
from treedec.search.program import Program, ProgramContext
from treedec.search.request import check_positions, pages_in_use
from treedec.search.requests_file import RequestSpec
from treedec.search.sampling import SEED_MAX
from treedec.search.scheduler_loop import SchedulerLoop
from treedec.search.scheduler_stats import SchedulerStats
from treedec.search.speculative.batch import sampled_acceptance, speculative_program, speculative_results
from treedec.search.speculative.draft_budget import DraftBudget
from treedec.search.speculative.drafts import DraftSource
from treedec.search.streams import OutputStream, StreamOutput

__all__ = ["OnlineEngine", "OnlineScheduler", "ProgramAborted"]


class ProgramAborted(Exception):
    """How an aborted program ends: given to ``on_error`` (raised by an :class:`OnlineEngine` stream)."""


class OnlineScheduler:
    """The scheduler's loop over ``engine``, with programs submitted and aborted while it runs (see the module
    docstring).

    Parameters
    ----------
    engine : the engine; its tree must have no pending tokens. Its other trees are left alone.
    max_step_tokens : as :func:`~treedec.search.scheduler.run_programs`' (default ``engine.prefill_chunk``).
    on_done : called as ``on_done(handle, result)`` when a program returns.
    on_error : called as ``on_error(handle, error)`` when a program fails or is aborted
        (:class:`ProgramAborted`); required (an error of one program is never raised to the driver).
    on_step : called as ``on_step(stats)`` after each engine step is launched.
    prefix_cache : keep a :class:`~treedec.search.prefix_cache.PrefixCache` (:attr:`cache`) of prompts and
        conversations across requests (default True), or this one (of ``engine``'s tree: e.g. an
        :class:`~treedec.LLM`'s, so that one cache holds the engine's cached pages).
    history : the per-step entries :attr:`stats` keeps (the newest).
    pipeline, seed : as :func:`~treedec.search.scheduler.run_programs`' (decoding outputs read back while the next
        step runs, default on a CUDA engine; the seed of the draws of requests without one).

    The callbacks run on the driving thread, between or inside iterations: they must not call
    :meth:`iterate`, and should return quickly (an error escaping one ends every live program, as a failed
    step does).

    Attributes
    ----------
    stats : the :class:`~treedec.search.scheduler.SchedulerStats` since it was made: its counters (``steps``,
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

    def abort(self, handle: int) -> None:
        """Abort program ``handle`` (any thread): at the next iteration it is dropped from the queue or closed,
        and ends with :class:`ProgramAborted`. A program that ended before then is left as it ended."""
        with self._lock:
            self._inbox.append(("abort", handle, None))

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
        for kind, handle, program in inbox:
            if kind == "submit":
                self._core.add(handle, program)
            elif self._core.drop(handle):
                self._on_error(handle, ProgramAborted(f"program {handle} was aborted"))




class OnlineEngine:
    """A background thread driving an :class:`OnlineScheduler` over ``engine``, for a server.

    The thread loops :meth:`OnlineScheduler.iterate` while there is work and sleeps when idle. Nothing
    else may step ``engine`` while it runs. :meth:`submit` (in a coroutine of an asyncio loop) returns an
    async iterator of :class:`~treedec.search.streams.StreamOutput`; :meth:`abort` ends a request (its stream raises
    :class:`ProgramAborted`); :meth:`shutdown` aborts every request and joins the thread. Use it as a
    context manager to shut it down on exit.

    Parameters
    ----------
    engine : the engine (the thread's alone from now on).
    tokenizer : the default tokenizer of requests (text prompts, stop strings, streamed text).
    chat_template : encode ``prompt`` / ``messages`` through the tokenizer's chat template by default.
    max_step_tokens : as :class:`OnlineScheduler`'s.
    drafts : every request decoded speculatively with ``drafts(spec)`` as its draft source (e.g. an
        :class:`~treedec.LLM`'s ``llm.drafts.source``), as :class:`~treedec.LLM` decodes: greedy acceptance at
        temperature 0, lossless rejection sampling above. A request speculative decoding cannot take
        (``n > 1``, penalties, ``min_p``, logprobs, ...) is refused at :meth:`submit` (ValueError). Its steps are
        not pipelined (the number of live requests varies; pipelining pays for small batches only).
    max_draft_tokens : the largest draft tree (root included) a speculative request verifies a step.
    seed : the seeds given to sampled requests without one (so that a preempted request, run again from its
        start, draws the same tokens and its streamed text stays right).
    on_iteration : called on the driving thread as ``on_iteration(stats, seconds)`` after each iteration (an
        engine step for every live program): the scheduler's stats and the iteration's wall time (metrics).
    history, prefix_cache : as :class:`OnlineScheduler`'s.

    Attributes
    ----------
    error : what stopped the thread (a callback's bug), else None; then :meth:`submit` raises RuntimeError.

    Every request's size is bounded before it is queued: :meth:`submit` refuses one whose worst case
    (:func:`~treedec.search.batch.worst_case_pages`: its prompt and ``n`` outputs of ``max_tokens``) exceeds the pages
    the pool can give one request (:attr:`OnlineScheduler.capacity`), so no request is admitted that could only
    fail later, after its ``n`` outputs' state was built. :attr:`waiting_outputs` counts the outputs waiting for
    admission (a server's queue bound) and :attr:`iteration_seconds` is a heartbeat (how long the iteration running
    now has run).
    """

    def __init__(self, engine: Engine, tokenizer=None, *, chat_template: bool = False,
                 max_step_tokens: int | None = None, drafts: Callable[[RequestSpec], DraftSource] | None = None,
                 max_draft_tokens: int = 64, seed: int = 0,
                 on_iteration: Callable[[SchedulerStats, float], None] | None = None, history: int = 1024,
                 prefix_cache: bool | PrefixCache = True):
        for name, f in (("drafts", drafts), ("on_iteration", on_iteration)):
            if f is not None and not callable(f):
                raise TypeError(f"{name} must be callable or None, got {type(f).__name__}")
        positive_int("max_draft_tokens", max_draft_tokens)
        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self.scheduler = OnlineScheduler(engine, max_step_tokens=max_step_tokens, on_done=self._done,
                                         on_error=self._failed, history=history, prefix_cache=prefix_cache)
        self.drafts, self.max_draft_tokens, self.on_iteration = drafts, max_draft_tokens, on_iteration
        self._budget = DraftBudget() if drafts is not None else None   # shared by the speculative requests
        self._seeds = np.random.default_rng(seed)
        self._requests: dict[int, _Request] = {}    # handle -> request (the driving thread pops it)
        self._handles: dict[int | str, int] = {}    # request id -> handle, while it runs
        self._waiting: dict[int | str, int] = {}    # request id -> its outputs, until its program first starts
        self._num_waiting = 0                       # their sum
        self._iteration_start: float | None = None  # (perf_counter) the iteration running now began
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="treedec-online", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the driving thread runs (not shut down, not failed)."""
        return self._thread.is_alive() and not self._stopping

    @property
    def waiting_outputs(self) -> int:
        """The outputs (``n`` a request) of the requests submitted whose program has not started yet (any thread)."""
        return self._num_waiting

    @property
    def iteration_seconds(self) -> float:
        """How long the iteration running now has run, in seconds; 0.0 between iterations (any thread)."""
        start = self._iteration_start
        return 0.0 if start is None else max(0.0, time.perf_counter() - start)

    def submit(self, spec: RequestSpec, tokenizer=None, chat_template: bool | None = None
               ) -> AsyncIterator[StreamOutput]:
        """Start request ``spec`` (its prompt encoded and checked here: a bad request raises here, ValueError or
        TypeError, or :class:`~treedec.errors.PoolExhaustedError` for one whose worst case exceeds what the pool can
        give a request, :attr:`OnlineScheduler.capacity`, or for a speculative request larger than the free pool);
        returns an async iterator of its :class:`~treedec.search.streams.StreamOutput`, the last one ``finished``.
        Call it in a coroutine (the running loop gets the outputs). A request id must be unique among the running
        requests. A sampled request without a seed gets one (see ``seed``)."""
        loop = asyncio.get_running_loop()
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        chat_template = self.chat_template if chat_template is None else chat_template
        [(spec, prompt_ids)] = prepare_requests(self.engine, [spec], tokenizer, chat_template)
        worst, capacity = worst_case_pages(self.engine.pool, spec.params, len(prompt_ids)), self.scheduler.capacity
        if self.drafts is None and worst > capacity:
            raise PoolExhaustedError(
                f"request {spec.id!r} may need {worst} KV pages (prompt {len(prompt_ids)} tokens + {spec.params.n} x "
                f"{spec.params.max_tokens} new tokens), more than the {capacity} the pool can give one request; lower "
                f"max_tokens or n, or give the engine more kv_tokens; nothing was run")
        if spec.params.temperature > 0 and spec.params.seed is None:
            with self._lock:
                seed = int(self._seeds.integers(0, SEED_MAX))
            spec = dataclasses.replace(spec, params=spec.params.replace(seed=seed))
        stream = OutputStream(loop, spec.id)
        if self.drafts is None:
            on_text = None if tokenizer is None else (lambda s, index, delta: stream.text(index, delta))
            program = GenerateProgram(spec, prompt_ids, tokenizer, on_text=on_text)
        else:
            program = speculative_program(
                self.engine, spec, prompt_ids, self.drafts(spec), tokenizer,
                sampled_acceptance(spec, lambda s: s.params.seed), self.max_draft_tokens, self._budget,
                pipeline=False, pipeline_note="online: the number of live requests varies",
                greedy_only=False, on_text=None if tokenizer is None else (lambda delta: stream.text(0, delta)))
        with self._lock:
            if self._stopping:
                raise RuntimeError("the online engine is shut down" if self.error is None else
                                   f"the online engine failed: {type(self.error).__name__}: {self.error}")
            if spec.id in self._handles:
                raise ValueError(f"request id {spec.id!r} is already running")
            handle = self.scheduler.submit(_Restarts(program, lambda: self._started(spec.id, stream)))
            self._requests[handle] = _Request(spec, prompt_ids, stream, self.drafts is not None)
            self._handles[spec.id] = handle
            self._waiting[spec.id] = spec.params.n
            self._num_waiting += spec.params.n
        self._wake.set()
        return stream

    def abort(self, request_id: int | str) -> bool:
        """Abort a running request (its stream raises :class:`ProgramAborted`; its pages are freed at the next
        iteration); returns whether it was running."""
        with self._lock:
            handle = self._handles.get(request_id)
        if handle is None:
            return False
        self.scheduler.abort(handle)
        self._wake.set()
        return True

    def shutdown(self, timeout: float | None = None) -> bool:
        """Abort every running request, let the thread close them (their pages freed) and join it (for at most
        ``timeout`` seconds); returns whether the thread has ended."""
        with self._lock:
            self._stopping = True
            handles = list(self._handles.values())
        for handle in handles:
            self.scheduler.abort(handle)
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> "OnlineEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _loop(self) -> None:
        scheduler = self.scheduler
        try:
            while True:
                self._wake.clear()
                if not scheduler.idle:
                    start = self._iteration_start = time.perf_counter()
                    try:
                        scheduler.iterate()
                    finally:
                        self._iteration_start = None
                    if self.on_iteration is not None:
                        self.on_iteration(scheduler.stats, time.perf_counter() - start)
                    continue
                if self._stopping:
                    return
                self._wake.wait()
        except BaseException as error:   # (a callback's bug): end every stream with it
            self.error = error
            with self._lock:
                self._stopping = True
                requests, self._requests = self._requests, {}
                self._handles.clear()
                self._waiting.clear()
                self._num_waiting = 0
            for request in requests.values():
                request.stream.fail(error)

    def _started(self, request_id: int | str, stream: OutputStream) -> None:
        """A run of the request's program starts (the driving thread): it no longer waits; its text starts again."""
        with self._lock:
            self._num_waiting -= self._waiting.pop(request_id, 0)
        stream.restart()

    def _finish(self, handle: int) -> _Request | None:
        with self._lock:
            request = self._requests.pop(handle, None)
            if request is not None:
                self._handles.pop(request.spec.id, None)
                self._num_waiting -= self._waiting.pop(request.spec.id, 0)
        return request

    def _done(self, handle: int, result) -> None:
        request = self._finish(handle)
        if request is not None:
            results = speculative_results(request.spec, request.prompt_ids, result) if request.speculative \
                else result
            request.stream.finish(results)

    def _failed(self, handle: int, error: BaseException) -> None:
        request = self._finish(handle)
        if request is not None:
            request.stream.fail(error)


@dataclasses.dataclass(frozen=True)
class _Request:
    spec: RequestSpec
    prompt_ids: list[int]
    stream: OutputStream
    speculative: bool


class _Restarts(Program):
    """``program`` as the scheduler runs it, calling ``on_start()`` whenever a run of it starts (a preempted
    program runs again from its start: its stream's text starts again)."""

    def __init__(self, program: Program, on_start: Callable[[], None]):
        self.program, self.on_start = program, on_start
        self.prompt_ids, self.shares_prompt, self.name = program.prompt_ids, program.shares_prompt, program.name

    def run(self, ctx: ProgramContext):
        self.on_start()
        return (yield from self.program.run(ctx))

    def positions(self):
        return self.program.positions()

    def start_pages(self, pool, shared: int = 0) -> int:
        return self.program.start_pages(pool, shared)

    def step_pages(self, pool) -> int:
        return self.program.step_pages(pool)
