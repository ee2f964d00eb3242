"""What the online engine (:class:`~treedec.runtime.online.OnlineEngine`) hands a caller: a request's outputs as an
asyncio async iterator of :class:`StreamOutput`, fed from the engine's driving thread.

:class:`OutputStream` is that iterator. The driving thread gives it each output's text as the request's program
streams it (:meth:`OutputStream.text`), says when the program starts a run (:meth:`OutputStream.restart`: a
preempted program runs again from its start, and streams its text again), and ends it with the request's results
(:meth:`OutputStream.finish`) or an error (:meth:`OutputStream.fail`). The caller sees every character once: a run
again repeats the text the caller already has (the online engine gives every sampled request a seed, so a run again
draws the same tokens), and only what goes past it is passed on; the final item's deltas complete each output's
text (what its last step streamed, or a request that ended before its first step streamed anything).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from treedec.runtime.requests import RequestResult

__all__ = ["OutputStream", "StreamOutput"]


@dataclass(frozen=True)
class StreamOutput:
    """One item of an :class:`OutputStream`.

    Attributes
    ----------
    request_id : the request's id.
    index : the output's index (of the request's ``n``) for a text delta; None for the final item.
    text : the output's new text (a delta; the deltas of an output join to its final ``text``), or "".
    results : the request's final results (one per output, as :func:`~treedec.programs.generate.generate_batch`
        gives them), on the last item only; else None.
    """

    request_id: int | str
    index: int | None = None
    text: str = ""
    results: list[RequestResult] | None = None

    @property
    def finished(self) -> bool:
        return self.results is not None


class OutputStream:
    """An async iterator of one request's :class:`StreamOutput`, fed from the driving thread through
    ``loop.call_soon_threadsafe`` (see the module docstring). It raises the error the request failed with
    (:class:`~treedec.runtime.online.ProgramAborted` for an aborted one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: int | str):
        self.loop, self.request_id = loop, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self._sent: dict[int, int] = {}   # output index -> characters passed on
        self._run: dict[int, int] = {}    # output index -> characters streamed by the program's current run

    # ------------------------------------------------ the driving thread

    def restart(self) -> None:
        """The program starts a run (its first, or again after a preemption): its text starts again."""
        self._run.clear()

    def text(self, index: int, delta: str) -> None:
        """Output ``index`` of the current run streamed ``delta``: the part past what was passed on goes on."""
        run = self._run.get(index, 0) + len(delta)
        self._run[index] = run
        sent = self._sent.get(index, 0)
        if run > sent:
            self._put(StreamOutput(self.request_id, index, delta[len(delta) - (run - sent):]))
            self._sent[index] = run

    def finish(self, results: list[RequestResult]) -> None:
        """The request's results: each output's text not yet passed on, then the final item, then the end."""
        for r in results:
            sent = self._sent.get(r.index, 0)
            if r.text is not None and len(r.text) > sent:
                self._put(StreamOutput(self.request_id, r.index, r.text[sent:]))
                self._sent[r.index] = len(r.text)
        self._put(StreamOutput(self.request_id, results=results))
        self._put(_END)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised to the caller)."""
        self._put(_Failure(error))

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # the caller's loop is closed: nobody reads the stream any more
            pass

    # ------------------------------------------------ the caller's loop

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> StreamOutput:
        item = await self.queue.get()
        if item is _END:
            self.queue.put_nowait(_END)   # (iterating again ends again)
            raise StopAsyncIteration
        if isinstance(item, _Failure):
            raise item.error
        return item


_END = object()


@dataclass(frozen=True)
class _Failure:
    error: BaseException
