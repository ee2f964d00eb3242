"""The types a program and the lanes exchange (:mod:`treedec.runtime.lanes`): what a program yields to decode
outputs token by token (:class:`Decode`), what it is resumed with (:class:`DecodeResult` of :class:`LaneOutput`),
and what a step places (:class:`PlacedLanes`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from treedec.sampling.grammar import Grammar
from treedec.sampling.params import SamplingParams
from treedec.sampling.stops import StopChecker, StopRule

__all__ = ["Decode", "DecodeResult", "LaneOutput", "OutputTokens", "PlacedLanes"]


@dataclass(slots=True)   # (one a request a step: not frozen, whose __init__ costs 4x a slotted one's)
class OutputTokens:
    """One step's new tokens of some of a :class:`Decode`'s outputs (:attr:`Decode.on_tokens`), in lane order: one
    token per output named.

    Attributes
    ----------
    indices : the outputs' indices (of the Decode's ``count``).
    tokens : each one's new token.
    ends : each one's stop reason (``"eos"``, ``"length"``, ``"stop_string"``) when the token ended it, else None.
    logprobs : with ``params.logprobs``: each token's ``{token_id: Logprob}`` (as :attr:`LaneOutput.logprobs`'),
        else None.
    """

    indices: list[int]
    tokens: list[int]
    ends: list[str | None]
    logprobs: list[dict] | None = None


@dataclass(frozen=True)
class Decode:
    """Yielded by a program: decode ``count`` outputs after node ``parent``, every step with every other lane,
    until each one's stop rule ends it; the program is resumed with a :class:`DecodeResult`.

    Attributes
    ----------
    parent : the node the outputs start after (its tokens computed), or one node per output (``count`` of them).
    logits : [V] or [count, V] device tensor: the next-token logits at ``parent``'s last token (the first draw's
        row), e.g. a prompt step's row; not needed with ``first``.
    params : the outputs' :class:`~treedec.sampling.params.SamplingParams` (the stop fields are ``rule``'s).
    rule : each output's :class:`~treedec.sampling.stops.StopRule`.
    count : the outputs (lanes), numbered 0 .. count - 1 (a seeded request's ``n`` outputs differ by number).
    first : [count] int64 device tensor, optional: the outputs' first tokens, chosen already (e.g. distinct ones).
    on_parent : the one output grows on ``parent`` itself (``count`` 1); ``parent`` stays when it ends.
    keep : an ended output's node stays (a child of ``parent``) with its last token computed; its result holds
        the node and the logits after its last token. Else the node is pruned when the output ends (and with
        ``on_parent`` a token computed past the end is truncated away).
    last_pending : with ``keep``: an ended output whose last token is not computed yet gets it appended as a
        pending token of the tree when the program is resumed, for the program's next step to compute (with its own
        tokens, reading its rows: e.g. ToT's thoughts and their value prompts in one step); its ``logits`` are then
        None. (An output whose last token a pipelined step computed already has its logits.)
    offer : called as ``offer(node, length)`` before an ended output's node is pruned (its conversation, to the
        prefix cache: :meth:`~treedec.runtime.program.ProgramContext.offer`).
    prompt_ids : the sequence before the outputs (the penalties' prompt mask, the processors' input ids and the
        detokenizer's context).
    tokenizer : detokenizes the outputs (stop strings and ``on_text`` need it).
    on_text : streaming: ``on_text(index, delta, checker)`` with each output's new text as its tokens are accepted,
        and once when the output ends, with its last text (possibly ""; so its last text and its end arrive
        together); ``checker`` is the output's :class:`~treedec.sampling.stops.StopChecker` (its token count so
        far; once it ended, its stop reason and tokens).
    on_tokens : streaming token ids: ``on_tokens(news)`` once a step with an :class:`OutputTokens` of the outputs
        that took a token in it (their ends included), before the outputs' ends are processed; no text is made for
        it (a server's frontend detokenizes them).
    seed : the seed of the outputs' draws when ``params.seed`` is None (the scheduler gives one).
    bad_words : ``params.bad_words`` as token sequences
        (:meth:`~treedec.sampling.params.SamplingParams.bad_words_token_ids`).
    min_tokens_stop_ids : the ids ``params.min_tokens`` keeps from being drawn (the checkpoint's EOS ids even with
        ``ignore_eos``, and the stop ids: vLLM's).
    name : how errors name the request (e.g. ``"request 'a'"``).
    grammar : ``params.structured_outputs`` compiled (:class:`~treedec.sampling.grammar.Grammar`), or None: each
        output gets its own matcher, whose token bitmask masks its every draw, advanced with each token drawn.
    """

    parent: int | Sequence[int]
    params: SamplingParams
    rule: StopRule
    logits: torch.Tensor | None = None
    count: int = 1
    first: torch.Tensor | None = None
    on_parent: bool = False
    keep: bool = False
    last_pending: bool = False
    offer: Callable[[int, int], None] | None = None
    prompt_ids: Sequence[int] = ()
    tokenizer: Any = None
    on_text: Callable[[int, str, StopChecker], None] | None = None
    on_tokens: Callable[[OutputTokens], None] | None = None
    seed: int | None = None
    bad_words: Sequence[Sequence[int]] = ()
    min_tokens_stop_ids: tuple[int, ...] = ()
    name: str = "the request"
    grammar: Grammar | None = None


@dataclass
class LaneOutput:
    """One ended output of a :class:`Decode`.

    Attributes
    ----------
    token_ids : its tokens (an EOS or stop id kept as its last).
    stop_reason : ``"eos"``, ``"stop_string"`` or ``"length"`` (:data:`~treedec.sampling.stops.STOP_REASONS`).
    text, stop_string : its text (cut at a stop string) and the stop string matched, with a tokenizer; else None.
    logprobs : per token, vLLM's ``{token_id: Logprob}`` (the params' ``logprobs``), else None.
    node : the node holding it (``keep`` or ``on_parent``), else None (pruned).
    logits : ``keep``: [V] the logits after its last token (device).
    """

    token_ids: list[int]
    stop_reason: str
    text: str | None = None
    stop_string: str | None = None
    logprobs: list[dict] | None = None
    node: int | None = None
    logits: torch.Tensor | None = None


@dataclass
class DecodeResult:
    """What a program that yielded a :class:`Decode` is resumed with: its outputs, in order (``pending``: with
    ``last_pending``, the outputs whose last token the scheduler places, pending, as the program is resumed:
    ``(output index, parent, token)``; :meth:`Lanes.place_pending`)."""

    outputs: list[LaneOutput]
    pending: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class PlacedLanes:
    """The lanes :meth:`Lanes.place` put in the tree for a step.

    Attributes
    ----------
    nodes : [k] int64, the node of each lane placed (one pending token each), in lane order: their rows of the
        step's logits come in this order.
    tokens : [k] int64 device tensor or None: each placed lane's token id on the device, when some are
        placeholders (drawn, not read back yet: pipelined); None when the tree holds every one's id.
    groups : the Decodes with a lane placed.
    """

    nodes: np.ndarray
    tokens: torch.Tensor | None
    groups: int


PlacedLanes.NONE = PlacedLanes(np.zeros(0, dtype=np.int64), None, 0)
