"""The frontend's side of a request whose engine core streams token ids (vLLM v1's ``OutputProcessor``): its outputs'
text made incrementally, their stop strings matched, their stream items and its results built here, so that the
core makes no text for it (:attr:`~treedec.core.messages.AddRequest.stream_tokens`).

:class:`RequestOutputs` keeps one :class:`~treedec.sampling.stops.StopChecker` per output, over the request's
detokenizer (its ``skip_special_tokens`` / ``spaces_between_special_tokens``), with the rule the core applies
(the checkpoint's EOS ids, ``stop_token_ids``, ``max_tokens``, ``min_tokens``) plus the stop strings, which only it
holds. Each :class:`~treedec.core.messages.TokenDelta` is fed to its output's checker; the stream items are the ones
the core made when it detokenized (a text delta when the text that can be shown grew, each output's end once with its
last text and token ids), so a client sees the same chunks. An output the core ended (an EOS or stop id, its length,
a grammar's end) ends here at the same token; one whose stop string is found here ends here, and the tokens the core
sent past it (a step late) are dropped. A speculative output's delta is a verification step's accepted run: a stop
string found inside it cuts it at the token the non-speculative path would stop at. Once every output has ended the
request is done: :attr:`needs_abort` says whether the core still runs it (some output ended here first), for the
client to abort it there.

:class:`RequestStream` is a request's stream of items in the frontend (:mod:`treedec.core.client`'s), with its
:class:`RequestOutputs` when the core streams its token ids.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from treedec.runtime.requests import RequestResult
from treedec.runtime.streams import STREAM_END, StreamFailure, StreamOutput
from treedec.sampling.params import SamplingParams
from treedec.sampling.stops import StopChecker
from treedec.core.messages import TokenDelta

__all__ = ["RequestOutputs", "RequestStream"]


class RequestOutputs:
    """One request's outputs in the frontend (see the module docstring).

    Parameters
    ----------
    request_id : the request's id (its results' ``id``).
    prompt_ids : its prompt's token ids.
    params : its SamplingParams, stop strings included.
    tokenizer : the core's tokenizer (None: no text, as a core without one makes none).
    eos_token_ids : the checkpoint's EOS ids (:attr:`~treedec.core.messages.CoreReady.eos_token_ids`).
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer,
                 eos_token_ids: list[int]):
        self.request_id, self.prompt_ids, self.params = request_id, list(prompt_ids), params
        self._rule, self._tokenizer = params.stop_rule(tuple(eos_token_ids)), tokenizer
        self.checkers: list[StopChecker] = []   # (made at the first tokens: the core checks the prompt first)
        self._shown = [0] * params.n          # characters of each output's text passed on
        self._core_ended = [False] * params.n  # outputs the core ended (at the token they end at here, or later)
        self._logprobs: list[list[dict]] | None = None if params.logprobs is None else [[] for _ in range(params.n)]
        self._prompt_logprobs: list[dict | None] | None = None
        self._cached_tokens = 0
        self._drafts: list[tuple[list[int], list[int]] | None] = [None] * params.n   # speculative: (accepted, sizes)
        self._left = params.n
        self._start = time.perf_counter()

    @property
    def done(self) -> bool:
        """Every output has ended."""
        return self._left == 0

    @property
    def needs_abort(self) -> bool:
        """The core still runs the request (some output ended here before it ended there)."""
        return not all(self._core_ended)

    @property
    def kept_tokens(self) -> list[int]:
        """Each output's tokens when it ended here while the core still runs it (a stop string), else 0."""
        return [0 if ended or not c.stopped else c.num_tokens for c, ended in zip(self.checkers, self._core_ended)]

    def take(self, delta: TokenDelta) -> list[StreamOutput]:
        """Output ``delta.index``'s new tokens: the stream items they make (a text delta, or the output's end with
        its last text). Raises ValueError for a token (or a prompt id) its detokenizer cannot take (outside the
        tokenizer's vocabulary: the request fails, as it did in the core)."""
        if not self.checkers:
            self.checkers = [StopChecker(self._rule, self.params.detokenizer(self._tokenizer, self.prompt_ids))
                             for _ in range(self.params.n)]
        i = delta.index
        checker = self.checkers[i]
        self._core_ended[i] = self._core_ended[i] or delta.end is not None
        if checker.stopped:   # (ended here by a stop string: the core's tokens past it dropped)
            return []
        self._cached_tokens = delta.cached_tokens
        if delta.accepted is not None:   # (a speculative output: its steps' draft accounting)
            accepted, sizes = self._drafts[i] = self._drafts[i] or ([], [])
            accepted.extend(delta.accepted)
            sizes.extend(delta.draft_sizes)
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = [None if e is None else e.to_dict() for e in delta.prompt_logprobs]
        decision = checker.accept(delta.token_ids)
        if self._logprobs is not None:
            self._logprobs[i].extend(e.to_dict() for e in delta.logprobs[:decision.keep])
        if not checker.stopped and delta.end is not None:   # (a stop the rule here does not hold: a grammar's)
            checker.end(delta.end)
        shown, end = self._shown[i], checker.streamable_length
        text = checker.text_from(shown) if end > shown else ""
        self._shown[i] = max(shown, end)
        if checker.stopped:
            self._left -= 1
            return [StreamOutput(self.request_id, i, text, checker.num_tokens, checker.stop_reason,
                                 checker.token_ids)]
        return [StreamOutput(self.request_id, i, text, checker.num_tokens)] if text else []

    def results(self) -> list[RequestResult]:
        """The request's results, one per output (every output ended): as the core's programs build them
        (:func:`~treedec.programs.generate.request_results`), their ``stats`` the prompt's ``prompt_tokens`` and
        ``cached_tokens``, the frontend's ``seconds``, an output's ``stop_string`` and a speculative output's
        ``accepted`` and ``draft_sizes`` (per verification step, as
        :func:`~treedec.programs.speculative.batch.speculative_results` gives them)."""
        assert self.done, f"{self._left=} outputs of {self.request_id!r} have not ended"
        stats = {"prompt_tokens": len(self.prompt_ids), "cached_tokens": self._cached_tokens,
                 "seconds": time.perf_counter() - self._start}
        results = []
        for i, checker in enumerate(self.checkers):
            ids = checker.token_ids
            logprobs = None if self._logprobs is None else self._logprobs[i]
            mine = dict(stats) if checker.stop_string is None else {**stats, "stop_string": checker.stop_string}
            if self._drafts[i] is not None:
                mine.update(accepted=self._drafts[i][0], draft_sizes=self._drafts[i][1])
            results.append(RequestResult(
                self.request_id, i, None, list(self.prompt_ids), ids, checker.text, checker.stop_reason, mine,
                logprobs=logprobs, prompt_logprobs=self._prompt_logprobs,
                cumulative_logprob=None if logprobs is None else sum(e[t].logprob for e, t in zip(logprobs, ids))))
        return results


class RequestStream:
    """One request's :class:`~treedec.runtime.streams.StreamOutput` items as the core sends them (an async iterator,
    on the client's loop); raises the error the request failed with. ``processor``: its outputs' text and results,
    made here from the core's token ids (None: the core streams its text)."""

    def __init__(self, request_id: str, outputs: int, processor: RequestOutputs | None = None):
        self.request_id, self.outputs, self.processor = request_id, outputs, processor
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    def put(self, item: Any) -> None:
        self.queue.put_nowait(item)

    def take(self, delta: TokenDelta) -> bool:
        """A token stream's ``delta`` through its processor, the items it makes queued; returns whether the request
        ended here: every output ended (its results queued), or a token the frontend cannot detokenize (its error
        queued: that request alone fails)."""
        try:
            items = self.processor.take(delta)
        except ValueError as e:
            self.put(StreamFailure(e))
            return True
        for item in items:
            self.put(item)
        if not self.processor.done:
            return False
        self.put(StreamOutput(self.request_id, results=self.processor.results()))
        self.put(STREAM_END)
        return True

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamOutput:
        item = await self.queue.get()
        if item is STREAM_END:
            self.queue.put_nowait(STREAM_END)
            raise StopAsyncIteration
        if isinstance(item, StreamFailure):
            raise item.error
        return item
