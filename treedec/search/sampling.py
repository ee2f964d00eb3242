"""Sampling parameters and the draws: :class:`SamplingParams` (vLLM's names and defaults), the processed
distribution (:func:`sampling_probs`: temperature, top-k, top-p) and the one token picker (:func:`sample_tokens`:
the argmax at temperature 0, else a draw; one token per row or ``k`` distinct ones).
What every program builds on (generation, the scheduler's step argmax, a branch controller, ToT, speculative
acceptance); parallel sampling and self-consistency are :mod:`treedec.search.parallel_sampling`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treedec.checks import fraction, nonnegative_float, positive_int


@dataclass(frozen=True)
class SamplingParams:
    """How a next token is drawn from logits: ``softmax(logits / temperature)`` restricted to
    the ``top_k`` most likely tokens, then to the smallest set of most likely tokens whose
    probability reaches ``top_p`` (the same order as transformers' warpers).

    Attributes
    ----------
    temperature : >= 0; 0 is greedy (argmax: no randomness, top_k and top_p are moot).
    top_k : int >= 1, or None for no top-k cut (ties with the k-th logit are kept).
    top_p : in (0, 1]; 1 keeps every token. The most likely token is always kept.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        nonnegative_float("temperature", self.temperature)
        if self.top_k is not None:
            positive_int("top_k", self.top_k)
        fraction("top_p", self.top_p)


#: Greedy decoding: the argmax (the first of tied logits).
GREEDY = SamplingParams(temperature=0.0)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample_tokens` draws from: ``softmax(logits / temperature)`` restricted
    to the ``top_k`` most likely tokens, then to the top-``top_p`` mass; float32, ``[..., vocab]``.

    ``params.temperature`` must be > 0. A speculative draft that samples its tokens and the
    acceptance rule that verifies them both use it, so the target's ``p`` and the draft's ``q``
    are processed alike (lossless sampling needs that).
    """
    if params.temperature <= 0:
        raise ValueError(f"sampling_probs needs a temperature > 0, got {params.temperature} (0 is argmax)")
    scores = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs        # of the tokens ranked above each token
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= params.top_p)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                  uniform: torch.Tensor | None = None, k: int | None = None) -> torch.Tensor:
    """The token picker: one token per row of ``logits``, or ``k`` distinct ones. Every program picks its
    tokens here (greedy decoding with :data:`GREEDY`).

    Parameters
    ----------
    logits : [m, vocab] any float dtype, or one row [vocab].
    params : the :class:`SamplingParams`; temperature 0 is the argmax (ties: the first), no randomness.
    generator : torch.Generator on ``logits.device``, for reproducible draws.
    uniform : [m] floats in [0, 1) on ``logits.device``, optional: row i draws the token at
        ``uniform[i]`` of its distribution's cumulative sum (inverse CDF) instead of from
        ``generator``, so that a caller decides which random number each row gets (one token per
        row only).
    k : pick ``k`` distinct tokens per row (branching): temperature 0 the ``k`` largest logits
        (``topk``), else ``k`` drawn without replacement. None: one token per row.

    Returns
    -------
    [m] int64 token ids ([m, k] with ``k``), on ``logits.device``; for one [vocab] row the argmax is a
    0-d tensor, a draw [1] ([k] with ``k``).
    """
    if k is not None:
        positive_int("k", k)
        if uniform is not None:
            raise ValueError("uniform gives each row one number: it draws one token per row, not k")
        if params.temperature == 0:
            return logits.topk(k).indices
        return torch.multinomial(sampling_probs(logits, params), k, replacement=False, generator=generator)
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, params)
    if uniform is None:
        return torch.multinomial(probs, 1, generator=generator).reshape(-1)
    # The first token whose cumulative mass passes u * total: a token of zero probability never
    # is (its cumulative sum equals its predecessor's). In float64, u < 1 (a float32) times the
    # total stays below the total, so some token always passes it.
    cdf = probs.double().cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniform.double() * cdf[:, -1]).unsqueeze(-1), right=True)
    return picked.reshape(-1)
