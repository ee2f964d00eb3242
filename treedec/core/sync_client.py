"""A :class:`~treedec.core.process_client.ProcessClient` driven from blocking code: the offline
:class:`~treedec.LLM`'s client with ``engine_process=True``, as vLLM's ``SyncMPClient``.

The process client is the server's own (the same messages, the same frontend processing of a generated request's
token ids: text, stop strings, results; the same watch of the core's process); its event loop runs on a thread of its
own here, so a blocking caller on any thread (one under a running event loop, a notebook's, included) submits a batch
of requests and waits for their results (:meth:`SyncClient.run`). A call leaves the core idle: every request that
ended in the frontend first (a stop string) has ended in the core too, so the next call may use the same request ids.

What a call can end with: its results; the core's refusal of a request (its own class and message: ValueError,
TypeError, :class:`~treedec.errors.PoolExhaustedError`, a grammar's error), the call's other requests aborted first; a
request's failure in the core (:class:`~treedec.core.client.EngineError`), likewise; the core's death
(:class:`~treedec.core.client.EngineDeadError` naming its exit code: every later call raises it too); or the caller's
KeyboardInterrupt, the call's requests aborted. :meth:`SyncClient.close` (also at interpreter exit and when the client
is collected) ends the core's process and the loop's thread.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec

from treedec.core.client import EngineDeadError
from treedec.core.messages import CoreReady, IterationStats, PagesReport, dumps
from treedec.core.output_processor import RequestStream
from treedec.core.process_client import ProcessClient, launch_core
from treedec.programs.beam import BeamSearchParams
from treedec.runtime.requests import RequestResult, RequestSpec
from treedec.sampling.params import SamplingParams

__all__ = ["CoreRequest", "SyncClient", "start_core"]

logger = logging.getLogger(__name__)

#: Seconds a call waits for the core to end the requests it aborted (one engine iteration takes them).
ABORT_SECONDS = 60.0

#: Seconds :meth:`SyncClient.close` waits for the core's process to end by itself before it kills it.
CLOSE_SECONDS = 10.0


@dataclass(frozen=True)
class CoreRequest:
    """One request of :meth:`SyncClient.run`: its id (unique among the call's), its prompt's token ids, its
    SamplingParams, and for a beam search its BeamSearchParams (``params.n`` its width)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    beam: BeamSearchParams | None = None


class SyncClient:
    """A launched :class:`~treedec.core.process_client.ProcessClient` (:func:`~treedec.core.process_client.launch_core`)
    on an event loop of its own thread, for blocking callers (see the module docstring). One call at a time."""

    def __init__(self, client: ProcessClient):
        if not isinstance(client, ProcessClient) or client.ready is None:
            raise TypeError(f"client must be a launched ProcessClient (launch_core(...)), got {client!r:.80}")
        self.client = client
        self.loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self.loop.run_forever, name="treedec-core-loop", daemon=True)
        thread.start()
        self._lock = threading.Lock()   # one call at a time
        # (a function of the client, the loop and its thread, not of self: run when self is collected, or at exit)
        self._close = weakref.finalize(self, _close, client, self.loop, thread)
        asyncio.run_coroutine_threadsafe(client.start(), self.loop).result()

    @property
    def ready(self) -> CoreReady:
        """What the core told of its model."""
        return self.client.ready

    @property
    def tokenizer(self):
        """The core's tokenizer (its pickled copy), or None."""
        return self.client.tokenizer

    @property
    def pid(self) -> int:
        """The core's process id."""
        return self.client.pid

    @property
    def closed(self) -> bool:
        """:meth:`close` was called (or the client collected)."""
        return not self._close.alive

    def run(self, requests: Sequence[CoreRequest], on_done: Callable[[list[RequestResult]], None] | None = None,
            on_step: Callable[[IterationStats], None] | None = None) -> list[list[RequestResult]]:
        """Send every request at once and wait for all of them: each request's results (one per output; a beam
        search's hypotheses best first), in the requests' order. ``on_done(results)`` is called as each request
        ends, ``on_step(stats)`` after each of the core's iterations (``stats.steps``: this call's iterations so far);
        both on the loop's thread. Raises what the module docstring lists."""
        if self.closed:
            raise EngineDeadError("the engine core was shut down (its client closed)")
        if not requests:
            return []
        with self._lock:
            finished = threading.Event()
            future = asyncio.run_coroutine_threadsafe(self._run(list(requests), on_done, on_step, finished),
                                                      self.loop)
            try:
                return future.result()
            except BaseException:
                if not future.done():   # (the caller was interrupted: Ctrl-C) the call's requests aborted
                    future.cancel()
                    finished.wait(ABORT_SECONDS)
                raise

    def pages(self) -> PagesReport:
        """The core's page accounting now (:class:`~treedec.core.messages.PagesReport`: idle, nodes, pages held)."""
        return asyncio.run_coroutine_threadsafe(self.client.pages(), self.loop).result()

    def generate(self, specs: Sequence[RequestSpec], on_done: Callable[[list[RequestResult]], None] | None = None,
                 on_step: Callable[[IterationStats], None] | None = None) -> list[list[RequestResult]]:
        """:meth:`run` of generated requests (their prompts encoded: ``prompt_ids``); a request whose logits
        processors cannot be pickled to the core's process is refused first (ValueError naming it)."""
        for spec in specs:
            if spec.params.logits_processors:   # (the one field a pickle may not carry: the user's callables)
                try:
                    dumps(spec.params.logits_processors)
                except Exception as e:
                    raise ValueError(f"request {spec.id!r}: its logits_processors cannot be sent to the engine core's "
                                     f"process ({type(e).__name__}: {e}); give module-level functions or classes, "
                                     f"or use LLM(..., engine_process=False)") from None
        return self.run([CoreRequest(spec.id, list(spec.prompt_ids), spec.params) for spec in specs], on_done,
                        on_step)

    def beam_search(self, prompts: Sequence[list[int]], params: BeamSearchParams,
                    on_done: Callable[[list[RequestResult]], None] | None = None) -> list[list[RequestResult]]:
        """:meth:`run` of a beam search of each prompt (its token ids; request ids ``"0"``, ``"1"``, ...): each
        one's hypotheses, best first, as its outputs (``stats["beam_score"]``). Refused (ValueError) with
        ``structured_outputs`` (the core's beam search takes no grammar) and on a speculative core."""
        if params.structured_outputs is not None:
            raise ValueError("BeamSearchParams.structured_outputs: the engine core's beam search takes no grammar; "
                             "use LLM(..., engine_process=False) for a constrained beam search")
        if self.ready.speculative:
            raise ValueError("beam_search on a speculative LLM with engine_process=True: its engine core decodes "
                             "every request speculatively, and a beam search is not; use LLM(..., "
                             "engine_process=False) (or an LLM without speculative_config)")
        sampling = SamplingParams(n=params.beam_width, temperature=0.0, max_tokens=params.max_tokens)
        return self.run([CoreRequest(str(i), list(p), sampling, params) for i, p in enumerate(prompts)], on_done)

    def close(self) -> bool:
        """End the core (every request in flight aborted) and wait for its process (killed after
        :data:`CLOSE_SECONDS`), then the loop's thread; returns whether the core ended by itself. Nothing the second
        time (True)."""
        return self._close() if self._close.alive else True

    async def _run(self, requests: list[CoreRequest], on_done, on_step, finished: threading.Event
                   ) -> list[list[RequestResult]]:
        client, ended = self.client, set()
        start = 0 if client.stats is None else client.stats.steps
        if on_step is not None:
            client.on_iteration = lambda stats: on_step(msgspec.structs.replace(stats, steps=stats.steps - start))
        # (tasks of their own: an interrupted call still learns which requests the core took, to abort them)
        sent = [asyncio.ensure_future(client.submit(r.request_id, r.prompt_ids, r.params, r.beam)) for r in requests]
        tasks: list[asyncio.Future] = []
        try:
            await asyncio.wait(sent)   # (each accepted or refused by the core's next message)
            refused = [t.exception() for t in sent if t.exception() is not None]
            if refused:   # (the first in the requests' order; the accepted ones aborted below)
                raise refused[0]
            tasks = [asyncio.ensure_future(_results(t.result(), on_done, ended)) for t in sent]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t.exception() for t in tasks if t in done and t.exception() is not None]
            if failed:
                raise failed[0]
            return [t.result() for t in tasks]
        finally:
            try:
                await self._settle(sent, tasks, ended)
            finally:
                client.on_iteration = None
                finished.set()

    async def _settle(self, sent: list[asyncio.Future], tasks: list[asyncio.Future], ended: set) -> None:
        """A call's end, however it ended: the requests the core took and did not end aborted, and waited for (their
        ids free for the next call), as are those that ended here first (:meth:`CoreClient.settled`)."""
        client = self.client
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if sent:
            await asyncio.wait(sent, timeout=ABORT_SECONDS)
        left = [t.result() for t in sent if t.done() and t.exception() is None]
        left = [s for s in left if s.request_id not in ended]
        for stream in left:
            try:
                client.abort(stream.request_id)
            except EngineDeadError:   # (the core is gone: the reader fails its streams)
                pass
        try:
            await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in left), client.settled()), ABORT_SECONDS)
        except asyncio.TimeoutError:   # (an iteration that hangs: the next call may find an id still running)
            logger.warning("the engine core did not end this call's requests within %g s", ABORT_SECONDS)


def start_core(recipe: Callable[[], object], seed: int = 0) -> SyncClient:
    """An engine core built by ``recipe()`` in a process of its own (:func:`~treedec.core.process_client.launch_core`:
    ``treedec serve``'s launcher) that keeps no prefix cache but its LLM's own, as the offline LLM runs, and its
    :class:`SyncClient`; ``seed``: the seeds of sampled requests without one."""
    return SyncClient(launch_core(recipe, seed=seed, prefix_cache=False))


async def _results(stream: RequestStream, on_done, ended: set) -> list[RequestResult]:
    """A request's results, once its stream ends (its error raised); ``ended`` gets its id either way."""
    results = None
    try:
        async for item in stream:
            if item.results is not None:
                results = item.results
    except asyncio.CancelledError:
        raise
    except BaseException:
        ended.add(stream.request_id)
        raise
    ended.add(stream.request_id)
    if on_done is not None:
        on_done(results)
    return results


async def _drain(stream: RequestStream) -> None:
    """An aborted request's stream to its end (its failure)."""
    try:
        async for _ in stream:
            pass
    except Exception:   # (ProgramAborted, or the core's death: the end sought)
        pass


def _close(client: ProcessClient, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> bool:
    """End the core and its process (:meth:`SyncClient.close`), with no new thread: at the interpreter's exit none can
    be started (the loop's executor refuses work then)."""
    if threading.current_thread() is thread:   # (collected on the loop's own thread: nothing to wait on)
        client.shutdown()
        clean = client.stop(CLOSE_SECONDS)
        loop.stop()
        return clean
    try:   # (every request in flight failed and the core told to end, on the loop, which owns the sockets)
        asyncio.run_coroutine_threadsafe(_shutdown(client), loop).result(CLOSE_SECONDS)
        return client.stop(CLOSE_SECONDS)   # (its process joined, killed past the time)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if not thread.is_alive():
            loop.close()


async def _shutdown(client: ProcessClient) -> None:
    client.shutdown()
