"""The frontend's side of the engine core (:mod:`treedec.core.engine_core`): one client interface, two transports.

:class:`CoreClient` is what the server (:mod:`treedec.serve.app`) talks to: :meth:`~CoreClient.submit` sends a
request and returns its :class:`~treedec.core.output_processor.RequestStream` (an async iterator of
:class:`~treedec.runtime.streams.StreamOutput`, as :class:`~treedec.core.online_engine.OnlineEngine`'s streams) once
the core accepted it (a refusal raises its error); :meth:`~CoreClient.abort`; the core's last
:class:`~treedec.core.messages.IterationStats`; its health. Every output message the core sends is handled by one
method on the event loop (:meth:`CoreClient.process`): one wake-up per engine iteration, however many requests it
advanced. A generated request streams token ids from the core: its text, stop strings and results are made here
(:class:`~treedec.core.output_processor.RequestOutputs`), and a request whose outputs all ended here while the core
still runs it (a stop string) is aborted there; so does a speculative request. A beam search streams text made in the
core. Two transports under it:

- :class:`InProcessClient`: the core in this process (its engine's thread; the messages passed as objects), for an
  :class:`~treedec.LLM` built here (tests, ``--no-engine-process``);
- :class:`~treedec.core.process_client.ProcessClient`: the core in a process of its own, over ZMQ
  (:mod:`treedec.core.process_client`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import time
from typing import Callable

from treedec.runtime.online import ProgramAborted
from treedec.runtime.streams import STREAM_END, StreamFailure, StreamOutput
from treedec.core.engine_core import ERROR_KINDS, EngineCore
from treedec.core.messages import (AbortRequests, AddRequest, CoreInput, CoreOutput, CoreReady, IterationOutputs,
                                   IterationStats, OutputDelta, PagesQuery, PagesReport, Shutdown, dumps, loads)
from treedec.core.output_processor import RequestOutputs, RequestStream

__all__ = ["CoreClient", "EngineDeadError", "EngineError", "EngineRestartingError", "EngineStartupError",
           "InProcessClient", "WATCH_SECONDS"]

#: Seconds between two checks of the core's health (its process, or its engine's thread).
WATCH_SECONDS = 0.05


class EngineDeadError(RuntimeError):
    """The engine core is gone (its process ended, or its engine's thread failed): every request in flight fails
    with it."""


class EngineRestartingError(RuntimeError):
    """The engine core crashed and is being started again (``ProcessClient(max_restarts=...)``): a request sent
    meanwhile is refused with it (503 ``engine_restarting`` on a server; retry shortly)."""


class EngineError(RuntimeError):
    """A request failed in the engine core (its engine step failed: every live request gets it); the message starts
    with the core's error class."""


class EngineStartupError(RuntimeError):
    """The engine core could not start (its reason in the message; ``kind``: the class name of the core's error,
    e.g. ``"FileNotFoundError"``, or None when the process ended or did not answer)."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


class CoreClient:
    """The engine core seen from the frontend (see the module docstring); made and used on one event loop.

    Attributes
    ----------
    ready : what the core told of its model (:class:`~treedec.core.messages.CoreReady`), once started.
    tokenizer : the core's tokenizer (the frontend encodes and decodes with the same one), or None.
    stats : the core's last :class:`~treedec.core.messages.IterationStats` (None before its first message).
    dead : the :class:`EngineDeadError` once the core is gone (for good: no restart left), else None.
    restarting : whether a crashed core is being started again (a transport that restarts one; requests are refused
        meanwhile with :class:`EngineRestartingError`).
    restarts : the times the core was started again after a crash.
    on_iteration : called with each message's stats (the server's metrics).
    on_dead : called once, with the error, when the core is gone unasked.
    loop : the event loop it runs on, once started.
    """

    mode = "?"

    def __init__(self):
        self.ready: CoreReady | None = None
        self.tokenizer = None
        self.stats: IterationStats | None = None
        self.dead: EngineDeadError | None = None
        self.restarting = False
        self.restarts = 0
        self.on_iteration: Callable[[IterationStats], None] | None = None
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._streams: dict[str, RequestStream] = {}
        self._ending: set[str] = set()   # requests ended here whose end the core has not told yet
        self._settled: asyncio.Future | None = None
        self._unacknowledged = 0   # outputs of requests sent and not yet accepted or refused
        self._last_message = time.monotonic()
        self._closing = False
        self._pages: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._watch: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ the interface

    @property
    def alive(self) -> bool:
        """Whether the core runs and takes requests."""
        return self.dead is None and not self._closing and self.ready is not None and not self.restarting

    @property
    def waiting_outputs(self) -> int:
        """Outputs (``n`` a request) waiting for admission: the core's count, and the requests on their way to it."""
        return (0 if self.stats is None else self.stats.waiting_outputs) + self._unacknowledged

    @property
    def iteration_seconds(self) -> float:
        """A heartbeat: while requests are in flight, the seconds since the core's last message (an iteration that
        hangs grows it); 0.0 when none is."""
        return time.monotonic() - self._last_message if self._streams else 0.0

    async def submit(self, request_id: str, prompt_ids: list[int], params, beam=None) -> RequestStream:
        """Send a request (``params``: its SamplingParams, ``beam``: its BeamSearchParams or None) and wait for the
        core to accept it; raises the core's error for one it refused (ValueError, TypeError,
        PoolExhaustedError, as :meth:`OnlineEngine.submit`), or :class:`EngineDeadError`."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        tokens = beam is None   # (a beam search's text is made in the core)
        processor = RequestOutputs(request_id, prompt_ids, params, self.tokenizer, self.ready.eos_token_ids) \
            if tokens else None
        stream = self._streams[request_id] = RequestStream(request_id, params.n, processor)
        self._unacknowledged += params.n
        try:
            self._send(AddRequest(request_id, list(prompt_ids), dumps(params), None if beam is None else dumps(beam),
                                  stream_tokens=tokens))
            return await stream.accepted   # (its error: the stream was forgotten with it)
        finally:
            if not stream.accepted.done():   # (cancelled while waiting: the client went away)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (its pages are freed at the core's next iteration); nothing for one that has ended."""
        if request_id in self._streams and self.dead is None and not self._closing and not self.restarting:
            self._send(AbortRequests([request_id]))

    async def pages(self, timeout: float = 30.0) -> PagesReport:
        """The core's page accounting (:class:`~treedec.core.messages.PagesReport`), asked now."""
        self._check_alive()
        token = next(self._tokens)
        answer = self._pages[token] = asyncio.get_running_loop().create_future()
        self._send(PagesQuery(token))
        try:
            return await asyncio.wait_for(answer, timeout)
        finally:
            self._pages.pop(token, None)

    async def settled(self) -> None:
        """Wait until the core has ended every request whose outputs all ended here (its news of the end follows the
        last tokens; one a stop string ended here is aborted there), so that their pages and their ids are free there
        (an offline LLM's next call reuses its ids); at once when none is left, or when the core is gone."""
        if self._ending and self.dead is None and not self._closing:
            self._settled = asyncio.get_running_loop().create_future()
            await self._settled

    def shutdown(self) -> None:
        """Abort every request in flight now (each fails with ``server_shutdown``); :meth:`close` ends the core."""
        if self._closing:
            return
        self._closing = True
        self._fail_all(ProgramAborted("the server is shutting down"))
        if self.dead is None and self.ready is not None and not self.restarting:   # (a restarted core: told then)
            self._send(Shutdown())

    # ------------------------------------------------------------ the core's messages (on the loop)

    def process(self, message: CoreOutput) -> None:
        """Handle one output message of the core."""
        self._last_message = time.monotonic()
        if isinstance(message, PagesReport):
            future = self._pages.get(message.token)
            if future is not None and not future.done():
                future.set_result(message)
            return
        if not isinstance(message, IterationOutputs):
            raise TypeError(f"unexpected message from the engine core: {type(message).__name__}")
        streams = self._streams
        for rid in message.accepted:
            stream = streams.get(rid)
            if stream is not None:
                self._unacknowledged -= stream.outputs
                if not stream.accepted.done():
                    stream.accepted.set_result(stream)
        self.stats = message.stats
        for delta in message.tokens:
            stream = streams.get(delta.request_id)
            if stream is not None and stream.take(delta):   # (none: ended here, the core's tokens past it dropped)
                self._end_here(stream)
        for delta in message.outputs:
            stream = streams.get(delta.request_id)
            if stream is not None:
                stream.put(_stream_output(delta))
        for done in message.finished:
            stream = streams.pop(done.request_id, None)
            if stream is None:   # (ended here first: now in the core too)
                self._ended(done.request_id)
                continue
            if done.results is None:   # (a token stream's outputs all end in its deltas, before this)
                stream.put(StreamFailure(EngineError(f"the engine core finished request {done.request_id!r} before "
                                                     f"every output of it ended")))
                continue
            stream.put(StreamOutput(done.request_id, results=loads(done.results)))
            stream.put(STREAM_END)
        for failure in message.failed:
            stream = streams.pop(failure.request_id, None)
            if stream is None:   # (ended here first, then aborted there)
                self._ended(failure.request_id)
            else:
                error_type = ERROR_KINDS.get(failure.kind)
                error = error_type(failure.message) if error_type is not None else \
                    EngineError(f"{failure.kind.split(':', 1)[-1]}: {failure.message}")
                if not stream.accepted.done():   # (refused on arrival)
                    self._unacknowledged -= stream.outputs
                    stream.accepted.set_exception(error)
                    stream.accepted.exception()   # (retrieved: a cancelled submit leaves it unawaited)
                stream.put(StreamFailure(error))
        if self.on_iteration is not None:
            self.on_iteration(message.stats)

    def _end_here(self, stream: RequestStream) -> None:
        """A token stream ended in the frontend: forgotten (the core's later news of it dropped) and, when the core
        still runs it, aborted there (its pages freed at its next iteration)."""
        del self._streams[stream.request_id]
        self._ending.add(stream.request_id)   # (until the core's news of its end, which follows: settled())
        if stream.processor.needs_abort and self.dead is None and not self._closing:
            try:   # (the outputs its stop strings ended offered to the prefix cache there)
                self._send(AbortRequests([stream.request_id], [stream.processor.kept_tokens]))
            except EngineDeadError:   # (the core is gone: the reader reports it, failing what runs)
                pass

    def _ended(self, request_id: str) -> None:
        self._ending.discard(request_id)
        if not self._ending and self._settled is not None and not self._settled.done():
            self._settled.set_result(None)

    def _died(self, reason: str) -> None:
        if self.dead is not None or self._closing:
            return
        self.dead = EngineDeadError(reason)
        self._fail_all(self.dead)
        if self.on_dead is not None:
            self.on_dead(self.dead)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        self._unacknowledged = 0
        self._ending.clear()   # (nothing more comes from the core)
        if self._settled is not None and not self._settled.done():
            self._settled.set_result(None)
        for stream in streams.values():
            if not stream.accepted.done():
                stream.accepted.set_exception(error)
                stream.accepted.exception()
            stream.put(StreamFailure(error))
        for future in self._pages.values():
            if not future.done():
                future.set_exception(error)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self.restarting and not self._closing:
            raise EngineRestartingError(f"the engine core crashed and is being started again (restart {self.restarts}"
                                        f"); retry shortly")
        if self._closing or self.ready is None:
            raise ProgramAborted("the server is shutting down" if self._closing else "the engine core is not started")

    # ------------------------------------------------------------ the transport's

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def _send(self, message: CoreInput) -> None:
        raise NotImplementedError


def _stream_output(delta: OutputDelta) -> StreamOutput:
    return StreamOutput(delta.request_id, delta.index, delta.text, delta.tokens, delta.stop_reason, delta.token_ids)


class InProcessClient(CoreClient):
    """The core in this process over ``llm`` (built here): its engine's thread sends each message to the loop with
    ``call_soon_threadsafe``; inputs are handled in order by one input thread, as the core's own process does."""

    mode = "in-process"

    def __init__(self, llm, *, max_step_tokens: int | None = None, seed: int = 0):
        super().__init__()
        self.llm, self._options = llm, dict(max_step_tokens=max_step_tokens, seed=seed)
        self.core: EngineCore | None = None

    async def start(self) -> None:
        self.loop = loop = asyncio.get_running_loop()

        def sink(message) -> None:
            try:
                loop.call_soon_threadsafe(self.process, message)
            except RuntimeError:   # (the loop is closed: nobody reads it)
                pass

        self._sink = sink
        self._inputs = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="treedec-core-inputs")
        self.core = EngineCore(self.llm, sink, **self._options)
        self.ready = self.core.ready(os.getpid())
        self.tokenizer = self.llm.tokenizer
        self._watch = asyncio.ensure_future(self._watch_engine())

    async def _watch_engine(self) -> None:
        online = self.core.online
        while online.error is None and not self._closing:
            await asyncio.sleep(WATCH_SECONDS)
        if online.error is not None:
            self.core.flush(0.0)   # (its requests' failures)
            await asyncio.sleep(0)
            self._died(f"the engine failed: {type(online.error).__name__}: {online.error}")

    def _send(self, message: CoreInput) -> None:
        self._inputs.submit(self._handle, message)

    def _handle(self, message: CoreInput) -> None:
        """The core's input thread (as the core's own process has): a request's checks and its grammar's compile run
        off the event loop and off the engine's thread, the inputs in order."""
        answer = self.core.handle([message])
        if answer is not None:
            self._sink(answer)

    async def close(self, timeout: float = 10.0) -> bool:
        """Shut the core down (every request aborted) and join its engine's thread; returns whether it ended."""
        self.shutdown()
        if self._watch is not None:
            self._watch.cancel()
        if self.core is None:
            return True
        self._inputs.shutdown(wait=False)
        return await asyncio.get_running_loop().run_in_executor(None, self.core.shutdown, timeout)
