"""The messages between the server's frontend and its engine core (:mod:`treedec.core.engine_core`,
:mod:`treedec.core.client`), as msgspec structs, sent over ZMQ as msgpack (:class:`MessageCodec`).

Into the core (:data:`CoreInput`, tagged): :class:`AddRequest` (a request: its prompt's token ids, its
:class:`~treedec.sampling.params.SamplingParams`), :class:`AbortRequests`, :class:`PagesQuery` (the core's page
accounting, for tests and soaks), :class:`Shutdown`. Out of it (:data:`CoreOutput`, tagged): :class:`CoreReady`
once it is built (or :class:`CoreStartupFailed`), then ONE :class:`IterationOutputs` per engine iteration (every
request's new token ids and ends, or new text for the requests the core detokenizes, the finished requests' results,
the failed ones' errors, the requests accepted since the last message, and :class:`IterationStats`), and
:class:`PagesReport` answers.

A generated request (``AddRequest.stream_tokens``) streams token ids (:class:`TokenDelta`: per output its new ids, their
logprobs, its end by EOS / stop ids / length, the prompt's cached tokens): the frontend detokenizes them, checks the
stop strings and builds the request's results (:mod:`treedec.core.output_processor`), as vLLM v1's ``OutputProcessor``
does; the core makes no text for it; a speculative request streams so too, each verification step's accepted tokens at
once. A beam search still streams text made in the core (:class:`OutputDelta`) and sends its results
(:class:`RequestFinished`).

``SamplingParams`` and ``BeamSearchParams`` travel pickled (``AddRequest.params``, ``.beam``), and so do a finished
request's :class:`~treedec.runtime.requests.RequestResult` list and the core's tokenizer: they are the project's own
dataclasses (log-probability dicts, logits processors, the fields other features add), frontend and core are the
same code on one machine, and a pickle carries every field without a protocol edit. Everything per iteration and per
token (text deltas, token counts, token ids, stats) is a typed struct field.
"""
from __future__ import annotations

import copyreg
import io
import pickle
from types import MappingProxyType
from typing import Union

import msgspec

from treedec.sampling.logits import Logprob

__all__ = ["AbortRequests", "AddRequest", "CoreInput", "CoreOutput", "CoreReady", "CoreStartupFailed",
           "IterationOutputs", "IterationStats", "MessageCodec", "OutputDelta", "PagesQuery", "PagesReport",
           "PositionLogprobs", "RequestFailure", "RequestFinished", "Shutdown", "TokenDelta", "dumps", "loads"]


def dumps(value) -> bytes:
    """A pickled field (see the module docstring); a read-only mapping (``SamplingParams.logit_bias``) travels as
    one."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(value)
    return out.getvalue()


def read_only(mapping: dict) -> MappingProxyType:
    """A read-only view of ``mapping`` (how :func:`loads` rebuilds a ``MappingProxyType``)."""
    return MappingProxyType(mapping)


#: :func:`dumps`' reducers: copyreg's, and a ``MappingProxyType`` as one over a copy of its dict (pickle has none).
_DISPATCH = {**copyreg.dispatch_table, MappingProxyType: lambda m: (read_only, (dict(m),))}


def loads(data: bytes):
    """A pickled field back (the frontend and its own core only: never bytes from a client)."""
    return pickle.loads(data)


# ------------------------------------------------------------------ into the core

class AddRequest(msgspec.Struct, tag=True, frozen=True):
    """A request: ``request_id`` (unique among the running ones), its prompt's ``prompt_ids``, its pickled
    ``SamplingParams`` and, for a beam search, its pickled ``BeamSearchParams``; ``stream_tokens``: its outputs
    stream as token ids (:class:`TokenDelta`; the frontend makes their text and matches their stop strings), else as
    text made in the core (:class:`OutputDelta`: a beam search)."""

    request_id: str
    prompt_ids: list[int]
    params: bytes
    beam: bytes | None = None
    stream_tokens: bool = False


class AbortRequests(msgspec.Struct, tag=True, frozen=True):
    """Abort these requests (a client went away, or a frontend found a reason to stop them). ``kept`` (or None):
    for each of them, each output's tokens the frontend kept (its stop string ended it there; 0: none), the
    conversations to there offered to the prefix cache before their pages are freed (a chat's next turn reads
    them)."""

    request_ids: list[str]
    kept: list[list[int]] | None = None


class PagesQuery(msgspec.Struct, tag=True, frozen=True):
    """Ask for a :class:`PagesReport` (``token`` comes back in it)."""

    token: int


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    """Abort every request and end the core."""


CoreInput = Union[AddRequest, AbortRequests, PagesQuery, Shutdown]


# ------------------------------------------------------------------ out of the core

class CoreReady(msgspec.Struct, tag=True, frozen=True):
    """The core is built: what the frontend needs of its model (``positions``: the model's, which
    ``truncate_prompt_tokens=-1`` keeps; ``tokenizer``: pickled, or None; ``eos_token_ids``: the checkpoint's, the
    frontend's stop rules start from them as the core's do)."""

    name: str
    max_model_len: int
    positions: int
    vocab_size: int
    speculative: bool
    device: str
    kv_tokens: int
    kv_cache_dtype: str
    page_size: int
    batch_invariant: bool
    note: str
    tokenizer: bytes | None
    pid: int
    eos_token_ids: list[int]


class CoreStartupFailed(msgspec.Struct, tag=True, frozen=True):
    """The core could not be built (a bad model path, too little memory): the name of the error's nearest built-in
    class (``FileNotFoundError``, ``ValueError``, ...) and its message."""

    kind: str
    message: str


class OutputDelta(msgspec.Struct, array_like=True, frozen=True):
    """One output's news of an iteration (:class:`~treedec.runtime.streams.StreamOutput`'s fields): its new
    ``text``, its ``tokens`` so far (None: not known), and on its end ``stop_reason`` and its ``token_ids``."""

    request_id: str
    index: int
    text: str
    tokens: int | None = None
    stop_reason: str | None = None
    token_ids: list[int] | None = None


class PositionLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """One position's ``{token_id: Logprob}`` (:class:`~treedec.sampling.logits.Logprob`), in its order: ``ids``,
    their ``logprobs`` and ``ranks``."""

    ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    @classmethod
    def of(cls, entry: dict) -> "PositionLogprobs":
        return cls(list(entry), [lp.logprob for lp in entry.values()], [lp.rank for lp in entry.values()])

    def to_dict(self) -> dict:
        return {t: Logprob(lp, r) for t, lp, r in zip(self.ids, self.logprobs, self.ranks)}


class TokenDelta(msgspec.Struct, array_like=True, frozen=True):
    """One output's new tokens of an iteration, for a request that streams token ids
    (:class:`~treedec.runtime.streams.StreamTokens`' fields): its new ``token_ids`` (each once, a preempted run's
    again left out), their ``logprobs`` (asked for, else None), its ``end`` when its last one ended it in the core
    (``"eos"``: an EOS or stop id; ``"length"``), the prompt's ``cached_tokens`` (the current run's), on the
    request's first delta its ``prompt_logprobs`` (asked for; None for the prompt's first token), and for a
    speculative request the verification steps that made the ids (several a step): the draft tokens each ``accepted``
    and verified (``draft_sizes``), for the server's speculative metrics."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    end: str | None
    cached_tokens: int
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    accepted: list[int] | None = None
    draft_sizes: list[int] | None = None


class RequestFinished(msgspec.Struct, array_like=True, frozen=True):
    """A request's final results (a pickled ``list[RequestResult]``, one per output); None for a request that
    streams token ids (its :class:`TokenDelta` ended every output: the frontend has its results)."""

    request_id: str
    results: bytes | None


class RequestFailure(msgspec.Struct, array_like=True, frozen=True):
    """A request refused at its arrival or failed while it ran: ``kind`` is the error's class (one of
    :data:`treedec.core.engine_core.ERROR_KINDS`; another is an engine failure), ``message`` its text."""

    request_id: str
    kind: str
    message: str


class IterationStats(msgspec.Struct, frozen=True):
    """The core's state after an iteration (or an arrival): ``seconds`` the iteration's wall time (0.0 for a
    message that follows no iteration), the scheduler's counters and queue, the pool's free pages and the pages the
    prefix cache holds (``cache_pages``: once every request has ended, ``free_pages + cache_pages == num_pages``)."""

    seconds: float
    steps: int
    num_running: int
    num_waiting: int
    waiting_outputs: int
    prompt_tokens: int
    cached_tokens: int
    preemptions: int
    free_pages: int
    num_pages: int
    queries: int
    cache_pages: int = 0


class IterationOutputs(msgspec.Struct, tag=True, frozen=True):
    """ONE message per engine iteration: the requests accepted since the last one, every output's news (``tokens``
    of the requests that stream token ids, ``outputs`` of those that stream text), the finished and the failed
    requests, and the core's stats."""

    accepted: list[str]
    tokens: list[TokenDelta]
    outputs: list[OutputDelta]
    finished: list[RequestFinished]
    failed: list[RequestFailure]
    stats: IterationStats


class PagesReport(msgspec.Struct, tag=True, frozen=True):
    """The core's page accounting (a :class:`PagesQuery`'s ``token``): whether its scheduler is ``idle``, its tree's
    nodes, the pool's pages held by anything but the prefix cache, and the tree's invariant check (None: they hold)."""

    token: int
    idle: bool
    num_nodes: int
    held_pages: int
    cache_pages: int
    invariants: str | None


CoreOutput = Union[CoreReady, CoreStartupFailed, IterationOutputs, PagesReport]


class MessageCodec:
    """msgpack for the messages one way (``kind``: :data:`CoreInput` or :data:`CoreOutput`); one encoder and one
    decoder, reused."""

    def __init__(self, kind):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(kind)

    def encode(self, message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):
        return self._decoder.decode(data)
