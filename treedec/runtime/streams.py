"""What the online engine (:class:`~treedec.runtime.online.OnlineEngine`) hands a caller: a request's outputs as an
asyncio async iterator of :class:`StreamOutput`, fed from the engine's driving thread.

:class:`OutputStream` is that iterator. The driving thread gives it each output's text as the request's program
streams it (:meth:`OutputStream.text`) and each output's end with its last text (:meth:`OutputStream.end`), says
when the program starts a run (:meth:`OutputStream.restart`: a preempted program runs again from its start, and
streams its text again), and ends it with the request's results (:meth:`OutputStream.finish`) or an error
(:meth:`OutputStream.fail`). The caller sees every character once and every output's end once: a run again repeats
the text the caller already has (the online engine gives every sampled request a seed, so a run again draws the same
tokens), and only what goes past it is passed on. Every output gets one item that ends it (``stop_reason`` set),
carrying its last text, when it ends: from :meth:`OutputStream.end`, or from :meth:`OutputStream.finish` for an
output whose program streams no ends (a speculative one); the final item (``results``) comes after all of them.

A request whose program streams token ids instead of text (a server's engine core, whose frontend detokenizes:
:mod:`treedec.core.engine_core`) is given each step's tokens (:meth:`OutputStream.tokens`) and passes on a
:class:`StreamTokens` per output, counted in tokens: a run again passes on only the tokens past those passed on, and
an output's end once.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from treedec.runtime.decode import OutputTokens
from treedec.runtime.requests import RequestResult

__all__ = ["STREAM_END", "OutputStream", "StreamFailure", "StreamOutput", "StreamTokens"]


@dataclass(frozen=True)
class StreamOutput:
    """One item of an :class:`OutputStream`.

    Attributes
    ----------
    request_id : the request's id.
    index : the output's index (of the request's ``n``) for a text delta or an output's end; None for the final
        item.
    text : the output's new text (a delta; the deltas of an output join to its final ``text``), or "".
    tokens : the output's tokens so far, where its program says (None: it does not, e.g. a speculative one).
    stop_reason : on the item that ends an output (its last): why it ended (``"eos"``, ``"stop_string"``,
        ``"length"``); else None.
    token_ids : on the item that ends an output: its token ids; else None.
    results : the request's final results (one per output, as :func:`~treedec.programs.generate.generate_batch`
        gives them), on the last item only; else None.
    """

    request_id: int | str
    index: int | None = None
    text: str = ""
    tokens: int | None = None
    stop_reason: str | None = None
    token_ids: list[int] | None = None
    results: list[RequestResult] | None = None

    @property
    def finished(self) -> bool:
        """The request's final item (its results)."""
        return self.results is not None

    @property
    def ended(self) -> bool:
        """The item that ends output :attr:`index` (its last text, its stop reason and token ids)."""
        return self.stop_reason is not None


@dataclass(slots=True)   # (one a request a step: a frozen dataclass's __init__ costs 6x a slotted one's)
class StreamTokens:
    """An item of a stream of token ids (:meth:`OutputStream.tokens`): output ``index``'s new ``token_ids``.

    Attributes
    ----------
    request_id, index : the request's id and the output's index.
    token_ids : its new tokens (past those passed on before).
    logprobs : with ``logprobs`` asked for, each new token's ``{token_id: Logprob}``; else None.
    end : its stop reason when its last new token ended it (``"eos"``, ``"length"``), else None.
    cached_tokens : the prompt's tokens the program's current run read from the prefix cache.
    prompt_logprobs : the prompt's logprobs (asked for), on the request's first item only; else None.
    accepted, draft_sizes : a speculative output's verification steps since its last item: the draft tokens each
        accepted and verified; else None.
    """

    request_id: int | str
    index: int
    token_ids: list[int]
    logprobs: list[dict] | None
    end: str | None
    cached_tokens: int
    prompt_logprobs: list[dict | None] | None = None
    accepted: list[int] | None = None
    draft_sizes: list[int] | None = None


class OutputStream:
    """An async iterator of one request's :class:`StreamOutput`, fed from the driving thread through
    ``loop.call_soon_threadsafe`` (see the module docstring). It raises the error the request failed with
    (:class:`~treedec.runtime.online.ProgramAborted` for an aborted one).

    With ``deliver`` the items go to ``deliver(item)`` on the driving thread instead (each :class:`StreamOutput`,
    then :data:`STREAM_END` after the final one, or a :class:`StreamFailure`), and the stream is not iterated: the
    engine core (:mod:`treedec.core.engine_core`) batches them into one message per iteration."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, request_id: int | str,
                 deliver: Callable[[Any], None] | None = None):
        if (loop is None) == (deliver is None):
            raise ValueError("an OutputStream needs a loop (iterated there) or deliver (its items handed on), not both")
        self.loop, self.request_id, self._deliver = loop, request_id, deliver
        self.queue: asyncio.Queue | None = None if loop is None else asyncio.Queue()
        self._sent: dict[int, int] = {}   # output index -> characters passed on
        self._run: dict[int, int] = {}    # output index -> characters streamed by the program's current run
        self._ended: set[int] = set()     # outputs whose end was passed on (a run again ends them again)
        self._sent_tokens: dict[int, int] = {}   # output index -> tokens passed on (a token stream)
        self._run_tokens: dict[int, int] = {}    # output index -> tokens given by the program's current run
        self._prompt_sent = False                # a token stream's prompt logprobs were passed on

    # ------------------------------------------------ the driving thread

    def restart(self) -> None:
        """The program starts a run (its first, or again after a preemption): its text starts again."""
        self._run.clear()
        self._run_tokens.clear()

    def text(self, index: int, delta: str, tokens: int | None = None) -> None:
        """Output ``index`` of the current run streamed ``delta`` (``tokens``: its tokens so far, if known): the
        part past what was passed on goes on."""
        new = self._new(index, delta)
        if new and index not in self._ended:
            self._put(StreamOutput(self.request_id, index, new, tokens))

    def end(self, index: int, delta: str, stop_reason: str, token_ids: list[int]) -> None:
        """Output ``index`` of the current run ended (``stop_reason``, its ``token_ids``) after its last text
        ``delta``: one item with the part of it past what was passed on, once per output."""
        new = self._new(index, delta)
        if index not in self._ended:
            self._ended.add(index)
            self._put(StreamOutput(self.request_id, index, new, len(token_ids), stop_reason, list(token_ids)))

    def tokens(self, news: OutputTokens, cached_tokens: int, prompt_logprobs: list | None) -> None:
        """A step's new tokens of the current run (``cached_tokens``, ``prompt_logprobs``: its prompt's), one per
        output named: as :meth:`output_tokens`."""
        logprobs, output_tokens = news.logprobs, self.output_tokens
        for j, (i, token, end) in enumerate(zip(news.indices, news.tokens, news.ends)):
            output_tokens(i, [token], None if logprobs is None else [logprobs[j]], end, cached_tokens, prompt_logprobs)

    def output_tokens(self, index: int, token_ids: list[int], logprobs: list[dict] | None, end: str | None,
                      cached_tokens: int, prompt_logprobs: list | None = None, accepted: list[int] | None = None,
                      draft_sizes: list[int] | None = None) -> None:
        """Output ``index``'s next ``token_ids`` of the current run (``end``: its stop reason when the last one
        ended it; ``accepted``, ``draft_sizes``: a speculative output's steps that made them): one
        :class:`StreamTokens` with those past the tokens passed on (the prompt's logprobs on the request's first),
        none once the output's end was passed on."""
        run_tokens, sent_tokens, count = self._run_tokens, self._sent_tokens, len(token_ids)
        run, sent = run_tokens.get(index, 0), sent_tokens.get(index, 0)
        run_tokens[index] = run + count
        skip = sent - run if sent > run else 0   # (passed on by an earlier run)
        if index in self._ended or skip >= count and end is None:
            return
        if run + count > sent:
            sent_tokens[index] = run + count
        if end is not None:
            self._ended.add(index)
        first = prompt_logprobs is not None and not self._prompt_sent
        if first:
            self._prompt_sent = True
        self._put(StreamTokens(self.request_id, index, list(token_ids[skip:]),
                               None if logprobs is None else list(logprobs[skip:]), end, cached_tokens,
                               prompt_logprobs if first else None, accepted, draft_sizes))

    def finish(self, results: list[RequestResult]) -> None:
        """The request's results: the end of each output not ended yet (with its text not yet passed on), then the
        final item, then the end."""
        for r in results:
            if r.index not in self._ended:
                sent = self._sent.get(r.index, 0)
                tail = r.text[sent:] if r.text is not None else ""
                self._sent[r.index] = sent + len(tail)
                self._ended.add(r.index)
                self._put(StreamOutput(self.request_id, r.index, tail, len(r.output_ids), r.stop_reason,
                                       list(r.output_ids)))
        self._put(StreamOutput(self.request_id, results=results))
        self._put(STREAM_END)

    def _new(self, index: int, delta: str) -> str:
        """The part of the current run's ``delta`` past what was passed on (counted as passed on now)."""
        run = self._run.get(index, 0) + len(delta)
        self._run[index] = run
        sent = self._sent.get(index, 0)
        if run <= sent:
            return ""
        self._sent[index] = run
        return delta[len(delta) - (run - sent):]

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised to the caller)."""
        self._put(StreamFailure(error))

    def _put(self, item: Any) -> None:
        if self._deliver is not None:
            self._deliver(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # the caller's loop is closed: nobody reads the stream any more
            pass

    # ------------------------------------------------ the caller's loop

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> StreamOutput:
        item = await self.queue.get()
        if item is STREAM_END:
            self.queue.put_nowait(STREAM_END)   # (iterating again ends again)
            raise StopAsyncIteration
        if isinstance(item, StreamFailure):
            raise item.error
        return item


#: The item after a stream's final one.
STREAM_END = object()


@dataclass(frozen=True)
class StreamFailure:
    """The item that ends a failed stream: its error."""

    error: BaseException
