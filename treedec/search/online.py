"""Online decoding: programs submitted and aborted while the scheduler runs (the engine under a server).

:class:`OnlineScheduler` drives the scheduler's loop (:mod:`treedec.search.scheduler`: admission, resume,
one engine step for every live program, pool relief and preemption) one iteration at a time over one
:class:`~treedec.engine.Engine`, while programs come and go:

- :meth:`OnlineScheduler.submit` queues a program (from any thread); it is admitted at an iteration by the
  same rules as :func:`~treedec.search.scheduler.run_programs`', on the longest prefix of its prompt in the
  prefix cache across requests (:mod:`treedec.search.prefix_cache`: the prompts and conversations of
  earlier requests, and of running ones once computed), unless the cache is off;
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
:class:`~treedec.search.requests_file.RequestSpec` (a :class:`~treedec.search.batch.GenerateProgram`) and
returns an asyncio async iterator of :class:`StreamOutput`: text deltas as they are accepted, then the
request's final :class:`~treedec.search.requests_file.RequestResult` list; handed to the caller's event loop
with ``loop.call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.search.batch import GenerateProgram, prepare_requests
from treedec.search.prefix_cache import PrefixCache
from treedec.search.program import Program
from treedec.search.request import check_positions
from treedec.search.requests_file import RequestResult, RequestSpec
from treedec.search.scheduler_loop import SchedulerLoop, SchedulerStats

__all__ = ["OnlineEngine", "OnlineScheduler", "ProgramAborted", "StreamOutput"]


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
        conversations across requests (default True).

    The callbacks run on the driving thread, between or inside iterations: they must not call
    :meth:`iterate`, and should return quickly (an error escaping one ends every live program, as a failed
    step does).

    Attributes
    ----------
    stats : the :class:`~treedec.search.scheduler.SchedulerStats` since it was made (``seconds`` stays 0;
        the per-step lists grow by one entry a step).
    """

    def __init__(self, engine: Engine, *, max_step_tokens: int | None = None,
                 on_done: Callable[[int, Any], None] | None = None,
                 on_error: Callable[[int, BaseException], None],
                 on_step: Callable[[SchedulerStats], None] | None = None, prefix_cache: bool = True):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
        budget = engine.prefill_chunk if max_step_tokens is None else max_step_tokens
        positive_int("max_step_tokens", budget)
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
        self.cache = PrefixCache(engine.tree) if prefix_cache else None
        self._core = SchedulerLoop(engine, [], budget, 0, True, on_done, on_step, on_error, cache=self.cache)
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, int, Program | None]] = []
        self._handles = itertools.count()

    @property
    def stats(self) -> SchedulerStats:
        return self._core.stats

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

    def _drain(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, handle, program in inbox:
            if kind == "submit":
                self._core.add(handle, program)
            elif self._core.drop(handle):
                self._on_error(handle, ProgramAborted(f"program {handle} was aborted"))


@dataclass(frozen=True)
class StreamOutput:
    """One item of an :class:`OnlineEngine` stream.

    Attributes
    ----------
    request_id : the request's id.
    index : the output's index (of the request's ``n``) for a text delta; None for the final item.
    text : the output's new text (a delta; the deltas of an output join to its final ``text``), or "".
    results : the request's final results (one per output, as :func:`~treedec.search.batch.generate_batch`
        gives them), on the last item only; else None.
    """

    request_id: int | str
    index: int | None = None
    text: str = ""
    results: list[RequestResult] | None = None

    @property
    def finished(self) -> bool:
        return self.results is not None


class OnlineEngine:
    """A background thread driving an :class:`OnlineScheduler` over ``engine``, for a server.

    The thread loops :meth:`OnlineScheduler.iterate` while there is work and sleeps when idle. Nothing
    else may step ``engine`` while it runs. :meth:`submit` (in a coroutine of an asyncio loop) returns an
    async iterator of :class:`StreamOutput`; :meth:`abort` ends a request (its stream raises
    :class:`ProgramAborted`); :meth:`shutdown` aborts every request and joins the thread. Use it as a
    context manager to shut it down on exit.

    Parameters
    ----------
    engine : the engine (the thread's alone from now on).
    tokenizer : the default tokenizer of requests (text prompts, stop strings, streamed text).
    chat_template : encode ``prompt`` / ``messages`` through the tokenizer's chat template by default.
    max_step_tokens : as :class:`OnlineScheduler`'s.
    """

    def __init__(self, engine: Engine, tokenizer=None, *, chat_template: bool = False,
                 max_step_tokens: int | None = None):
        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self.scheduler = OnlineScheduler(engine, max_step_tokens=max_step_tokens, on_done=self._done,
                                         on_error=self._failed)
        self._streams: dict[int, _Stream] = {}       # handle -> stream (the driving thread pops it)
        self._requests: dict[int | str, int] = {}    # request id -> handle, while it runs
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None      # what stopped the thread, if something did
        self._thread = threading.Thread(target=self._loop, name="treedec-online", daemon=True)
        self._thread.start()

    def submit(self, spec: RequestSpec, tokenizer=None, chat_template: bool | None = None
               ) -> AsyncIterator[StreamOutput]:
        """Start request ``spec`` (its prompt encoded and checked here: a bad request raises here); returns an
        async iterator of its :class:`StreamOutput`, the last one ``finished``. Call it in a coroutine (the
        running loop gets the outputs). A request id must be unique among the running requests."""
        loop = asyncio.get_running_loop()
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        chat_template = self.chat_template if chat_template is None else chat_template
        [(spec, prompt_ids)] = prepare_requests(self.engine, [spec], tokenizer, chat_template)
        stream = _Stream(loop, spec.id)
        on_text = None if tokenizer is None else (lambda s, index, delta: stream.put(StreamOutput(s.id, index, delta)))
        program = GenerateProgram(spec, prompt_ids, tokenizer, pipeline=self.engine.device.type == "cuda",
                                  on_text=on_text)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the online engine is shut down")
            if spec.id in self._requests:
                raise ValueError(f"request id {spec.id!r} is already running")
            handle = self.scheduler.submit(program)
            self._streams[handle] = stream
            self._requests[spec.id] = handle
        self._wake.set()
        return stream

    def abort(self, request_id: int | str) -> bool:
        """Abort a running request (its stream raises :class:`ProgramAborted`); returns whether it was running."""
        with self._lock:
            handle = self._requests.get(request_id)
        if handle is None:
            return False
        self.scheduler.abort(handle)
        self._wake.set()
        return True

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort every running request, let the thread close them (their pages freed) and join it."""
        with self._lock:
            self._stopping = True
            handles = list(self._requests.values())
        for handle in handles:
            self.scheduler.abort(handle)
        self._wake.set()
        self._thread.join(timeout)

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
                    scheduler.iterate()
                    continue
                if self._stopping:
                    return
                self._wake.wait()
        except BaseException as error:   # (a callback's bug): end every stream with it
            self.error = error
            with self._lock:
                self._stopping = True
                streams, self._streams = self._streams, {}
                self._requests.clear()
            for stream in streams.values():
                stream.fail(error)

    def _finish(self, handle: int) -> _Stream | None:
        with self._lock:
            stream = self._streams.pop(handle, None)
            if stream is not None:
                self._requests.pop(stream.request_id, None)
        return stream

    def _done(self, handle: int, results: list[RequestResult]) -> None:
        stream = self._finish(handle)
        if stream is not None:
            stream.put(StreamOutput(stream.request_id, results=results))
            stream.close()

    def _failed(self, handle: int, error: BaseException) -> None:
        stream = self._finish(handle)
        if stream is not None:
            stream.fail(error)


_END = object()


class _Stream:
    """An async iterator fed from the driving thread through ``loop.call_soon_threadsafe``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id):
        self.loop, self.request_id = loop, request_id
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # the caller's loop is closed: nobody reads the stream any more
            pass

    def close(self) -> None:
        self.put(_END)

    def fail(self, error: BaseException) -> None:
        self.put(_Failure(error))

    def __aiter__(self) -> "_Stream":
        return self

    async def __anext__(self) -> StreamOutput:
        item = await self.queue.get()
        if item is _END:
            self.queue.put_nowait(_END)   # (iterating again ends again)
            raise StopAsyncIteration
        if isinstance(item, _Failure):
            raise item.error
        return item


@dataclass(frozen=True)
class _Failure:
    error: BaseException
