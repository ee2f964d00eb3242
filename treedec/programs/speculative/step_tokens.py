"""A speculative request's output streamed as token ids (:attr:`SpeculativeProgram.on_tokens
<treedec.programs.speculative.program.SpeculativeProgram>`): a server's engine core, whose frontend detokenizes
them and matches the stop strings (:mod:`treedec.core.output_processor`), as it does for generated requests.

After each verification step the program hands on the tokens it accepted since the last hand-off (several a step:
the accepted path and the bonus token), their logprobs, the output's end once its stop rule (EOS and stop ids,
``max_tokens``) ended it, and the steps' draft accounting (accepted and verified draft tokens, for the server's
speculative metrics); its last tokens and its end go on when its run ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from treedec.sampling.stops import StopChecker

__all__ = ["StepTokens", "TokenHandOff"]


@dataclass(frozen=True)
class StepTokens:
    """A speculative output's tokens since the last hand-off.

    Attributes
    ----------
    tokens : its new token ids, in order.
    logprobs : with ``params.logprobs``, each new token's ``{token_id: Logprob}`` (the raw target's); else None.
    end : its stop reason (``"eos"``: an EOS or stop id; ``"length"``) when its last new token ended it, else None.
    cached_tokens : the prompt's tokens the run read from the prefix cache.
    accepted, draft_sizes : the verification steps since the last hand-off: the draft tokens each accepted and
        verified (empty for the first token alone, drawn at the prompt).
    """

    tokens: list[int]
    logprobs: list[dict] | None
    end: str | None
    cached_tokens: int
    accepted: list[int]
    draft_sizes: list[int]


class TokenHandOff:
    """What one run of a speculative program has handed ``on_tokens`` so far (a run again starts from nothing: the
    stream it feeds drops the tokens it passed on before, :class:`~treedec.runtime.streams.OutputStream`)."""

    def __init__(self, on_tokens: Callable[[StepTokens], None]):
        if not callable(on_tokens):
            raise TypeError(f"on_tokens must be callable, got {type(on_tokens).__name__}")
        self.on_tokens = on_tokens
        self.restart()

    def restart(self) -> None:
        self._tokens, self._steps, self._ended = 0, 0, False

    def hand_off(self, checker: StopChecker, stats) -> None:
        """The tokens of ``checker`` past those handed on, its end (once), and the steps of ``stats`` (a
        :class:`~treedec.programs.speculative.program.SpeculativeStats`: ``accepted``, ``draft_sizes``,
        ``logprobs``) past those handed on; nothing when there is nothing new."""
        ids = checker.token_ids
        end = checker.stop_reason if checker.stopped and not self._ended else None
        if len(ids) == self._tokens and end is None:
            return
        logprobs = None if stats.logprobs is None else stats.logprobs[self._tokens:len(ids)]
        assert logprobs is None or len(logprobs) == len(ids) - self._tokens, \
            f"{len(stats.logprobs)=} entries for {len(ids)=} tokens"
        news = StepTokens(ids[self._tokens:], logprobs, end, stats.cached_tokens, stats.accepted[self._steps:],
                          stats.draft_sizes[self._steps:])
        self._tokens, self._steps, self._ended = len(ids), len(stats.accepted), self._ended or end is not None
        self.on_tokens(news)
