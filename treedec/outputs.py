"""What :class:`~treedec.LLM` returns, in vLLM's shapes (vLLM's ``vllm/outputs.py`` and ``vllm/beam_search.py``):
:class:`RequestOutput` (one prompt of :meth:`~treedec.LLM.generate` / :meth:`~treedec.LLM.chat`) with its
:class:`CompletionOutput` s, and :class:`BeamSearchOutput` (one prompt of :meth:`~treedec.LLM.beam_search`) with its
:class:`BeamSearchSequence` s. Plain data, at the bottom of the layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BeamSearchOutput", "BeamSearchSequence", "CompletionOutput", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One output of a request (vLLM's ``CompletionOutput``).

    Attributes
    ----------
    index : which of the request's ``n`` outputs.
    text : the output's text (cut at a stop string unless ``include_stop_str_in_output``).
    token_ids : its tokens (an EOS or stop token that ended it included).
    cumulative_logprob : the sum of its tokens' log-probabilities, with ``SamplingParams.logprobs``; else None.
    logprobs : with ``SamplingParams.logprobs``: per token, token id -> :class:`~treedec.sampling.logits.Logprob`.
    finish_reason : ``"stop"`` (an EOS, a stop token or a stop string) or ``"length"`` (``max_tokens``).
    stop_reason : the stop string or stop token id that ended it; None for the model's EOS or ``"length"``.
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict] | None
    finish_reason: str
    stop_reason: str | int | None


@dataclass
class RequestOutput:
    """What :meth:`LLM.generate` returns for one prompt (vLLM's ``RequestOutput``).

    Attributes
    ----------
    request_id : the prompt's index in the call (a string, as vLLM's).
    prompt : the prompt's text or chat messages (None for token ids).
    prompt_token_ids : the prompt's tokens (after the chat template).
    prompt_logprobs : with ``SamplingParams.prompt_logprobs``: per prompt token (None for the first).
    outputs : its ``n`` :class:`CompletionOutput`.
    finished : always True (an offline call returns finished requests).
    stats : the request's counters: ``steps`` (engine steps), ``seconds`` (admission to retirement),
        ``tokens_per_step``, ``prompt_tokens``, ``cached_tokens`` (its prompt's tokens read from the prefix cache);
        speculative decoding adds ``accepted`` (draft tokens accepted each step). An ``LLM(engine_process=True)``'s
        engine steps in another process, which sends no ``steps`` (nor ``tokens_per_step``, ``queries_per_step``):
        ``seconds`` is then from the request's sending to its end.
    """

    request_id: str
    prompt: str | list[dict] | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    stats: dict = field(default_factory=dict)


@dataclass
class BeamSearchSequence:
    """One finished hypothesis of :meth:`LLM.beam_search` (vLLM's ``BeamSearchSequence``).

    Attributes
    ----------
    tokens : the prompt's token ids, then the hypothesis' (an EOS that ended it included), as vLLM's.
    text : the text of ``tokens`` (special tokens skipped); None without a tokenizer.
    cum_logprob : the sum of the new tokens' log-probabilities (from ``score``, float32).
    score : what the beams are ranked by: ``cum_logprob / new tokens ** length_penalty`` (transformers').
    finish_reason : ``"stop"`` (an EOS id) or ``"length"`` (``max_tokens``).
    """

    tokens: list[int]
    text: str | None
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """What :meth:`LLM.beam_search` returns for one prompt (vLLM's ``BeamSearchOutput``): ``sequences``, its
    ``beam_width`` :class:`BeamSearchSequence`, best first."""

    sequences: list[BeamSearchSequence]
