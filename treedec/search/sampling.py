"""Sampling parameters and the draws: :class:`SamplingParams` (vLLM's names and defaults), the processed
distribution (:func:`sampling_probs`: temperature, top-k, top-p, min-p; the penalties and logits processors that
come before it are :mod:`treedec.search.logits`') and the one token picker (:func:`sample_tokens`: the argmax at
temperature 0, else a draw; one token per row or ``k`` distinct ones).
What every program builds on (generation, the scheduler's step argmax, a branch controller, ToT, speculative
acceptance); parallel sampling and self-consistency are :mod:`treedec.search.parallel_sampling`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Callable, Iterable

import torch

from treedec.checks import FLOAT32_MAX, FLOAT32_TINY, describe, float32_number, fraction, is_int, is_real, positive_int
from treedec.search.logits import SAMPLING_EPS, warp_scores
from treedec.search.stops import StopRule, stop_string_tuple, token_id_tuple


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How a request's outputs are drawn and when they end: vLLM's ``SamplingParams`` (its names and defaults),
    used by every program, the prompts file (:mod:`treedec.search.requests_file`), the CLI and
    :class:`treedec.LLM`. Checked on construction (a ValueError names the field, the expected and the given
    value); keyword arguments only.

    A next token is drawn from the logits processed in this order: the user's ``logits_processors``, then the
    penalties (on the raw logits), then ``softmax(logits / temperature)`` restricted to the ``top_k`` most
    likely tokens, then to the smallest set of most likely tokens whose probability reaches ``top_p``, then to
    the tokens at least ``min_p`` times as likely as the most likely one (transformers' order of its warpers).

    Attributes
    ----------
    n : outputs of the request (parallel samples), int >= 1.
    presence_penalty : subtracted from the logit of every token the output holds (vLLM / OpenAI); in [-2, 2]
        (vLLM's and OpenAI's range), 0 for none.
    frequency_penalty : times each token's count in the output, subtracted from its logit; in [-2, 2], 0 for
        none.
    repetition_penalty : > 0 and finite in float32 (in [2**-149, 3.4e38], as vLLM: > 0 and finite); a logit of a
        token in the prompt or the output is divided by it when positive, multiplied when negative
        (transformers' / vLLM's rule); 1 for none. A penalized logit saturates at float32's range (never inf).
    temperature : in [0, 3.4e38] (finite in float32); 0 is greedy (the argmax of the processed logits; top_k,
        top_p, min_p moot). A temperature below :data:`SAMPLING_EPS` (1e-5, vLLM's ``_SAMPLING_EPS``, below which
        vLLM samples greedily) is greedy too and is stored as 0.0: ``logits / 1e-45`` would overflow float32.
        (vLLM also raises a temperature in (0, 0.01) to 0.01 with a warning; treedec samples at the temperature
        given, which float32 holds: softmax subtracts the row's largest logit.)
    top_p : in (0, 1]; 1 keeps every token. The most likely token is always kept (a ``top_p`` that is 0 in
        float32, e.g. 1e-300, keeps only it, as in vLLM).
    top_k : int >= 1, or None for no top-k cut (vLLM's -1 and 0 mean None too; ties with the k-th kept).
    min_p : in [0, 1]; 0 keeps every token.
    seed : int in [0, 2**63), or None: the outputs of a request with a seed draw from its own generator, so
        they do not depend on the other requests of a batch.
    stop : stop strings (a string or a list of non-empty strings; matched on the text, need the tokenizer).
    stop_token_ids : ids that end an output besides the checkpoint's EOS ids (kept as its last token).
    ignore_eos : do not stop at the checkpoint's EOS ids (``stop_token_ids`` still stop).
    max_tokens : int >= 1; the most tokens of each output (vLLM's default 16).
    logprobs : None, or the number of most likely tokens whose log-probabilities each output token reports
        besides its own (0: only its own); log-softmax of the model's raw logits (vLLM's default).
    prompt_logprobs : the same for the prompt's tokens (the first has none).
    include_stop_str_in_output : keep a matched stop string at the end of the text.
    logits_processors : callables ``processor(input_ids, scores) -> scores`` with transformers'
        ``LogitsProcessor`` signature (``input_ids`` [1, L] the prompt and the output so far, ``scores``
        [1, vocab] float32), applied in order to each output's raw logits before the penalties;
        transformers' own processors work as they are.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    logits_processors: tuple[Callable, ...] = ()

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, _CHECKS[f.name](f.name, getattr(self, f.name)))

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or below :data:`SAMPLING_EPS`, stored as 0): every token is the argmax of the
        processed logits."""
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """A penalty or a logits processor changes the logits before the draw (a greedy token is then not the
        raw logits' argmax)."""
        return bool(self.logits_processors) or self.repetition_penalty != 1 or self.presence_penalty != 0 \
            or self.frequency_penalty != 0

    @property
    def reads_logits(self) -> bool:
        """The program needs each step's logits rows (a draw, penalties, processors or logprobs), not only the
        step's argmax."""
        return not self.greedy or self.processes_logits or self.logprobs is not None

    def stop_rule(self, eos_token_ids=()) -> StopRule:
        """The :class:`~treedec.search.stops.StopRule` of each output: ``eos_token_ids`` (the checkpoint's, e.g.
        ``model.eos_token_ids``; dropped with ``ignore_eos``), then ``stop_token_ids``; ``stop``,
        ``max_tokens``, ``include_stop_str_in_output``."""
        eos = () if self.ignore_eos else token_id_tuple(eos_token_ids, "eos_token_ids")
        return StopRule(self.max_tokens, eos + self.stop_token_ids, self.stop, self.include_stop_str_in_output)

    def replace(self, **changes) -> SamplingParams:
        """A copy with ``changes`` (checked as on construction)."""
        return dataclasses.replace(self, **changes)

    def check_supported(self, supported: Iterable[str], program: str, name: str = "params") -> None:
        """Raise ValueError naming every field set away from its default that ``program`` (e.g.
        ``"speculative decoding"``) does not implement (``supported``: the field names it does), so a request
        never runs with a parameter silently ignored."""
        unsupported = [f.name for f in fields(self) if f.name not in supported and getattr(self, f.name) != f.default]
        if unsupported:
            shown = ", ".join(f"{key}={getattr(self, key)!r}" for key in unsupported)
            raise ValueError(f"{name}: {program} does not implement {shown}; leave "
                             f"{'it' if len(unsupported) == 1 else 'them'} at the default")


#: The names of :class:`SamplingParams`' fields a prompts file or JSON may give (all but ``logits_processors``).
JSON_FIELDS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
               "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "logprobs", "prompt_logprobs",
               "include_stop_str_in_output")
SEED_MAX = 2**63 - 1  # numpy and torch both take seeds in [0, 2**63)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample_tokens` draws from: ``softmax(logits / temperature)`` restricted
    to the ``top_k`` most likely tokens, then to the top-``top_p`` mass, then to the tokens at least ``min_p``
    times as likely as the most likely (:func:`~treedec.search.logits.warp_scores`); float32, ``[..., vocab]``.

    ``params.temperature`` must be > 0. A speculative draft that samples its tokens and the
    acceptance rule that verifies them both use it, so the target's ``p`` and the draft's ``q``
    are processed alike (lossless sampling needs that). Penalties and logits processors are applied before
    (they need the request's tokens: :class:`~treedec.search.batch.GenerateProgram`).
    """
    if params.temperature <= 0:
        raise ValueError(f"sampling_probs needs a temperature > 0, got {params.temperature} (0 is argmax)")
    return warp_scores(logits, params.temperature, params.top_k, params.top_p, params.min_p).softmax(dim=-1)


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
    0-d tensor, a draw [1] ([k] with ``k``). Every id is in ``[0, vocab)``, whatever the row holds: an inverse-CDF
    draw from a row with no distribution (NaN logits, which only a broken model or an unchecked processor gives)
    is clamped on the device (no host sync) to the last id instead of indexing past the vocabulary.
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
    return picked.reshape(-1).clamp_(max=probs.shape[-1] - 1)   # (NaN compares false: it would give vocab)


# ================================================================ private: the fields' checks


def _top_k(name: str, value) -> int | None:
    if value is None or (is_int(value) and value in (-1, 0)):  # vLLM's "no top-k cut"
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, or None / -1 / 0 for no top-k cut, got {describe(value)}")
    return int(value)


def _seed(name: str, value) -> int | None:
    if value is not None and (not is_int(value) or not 0 <= value <= SEED_MAX):
        raise ValueError(f"{name} must be an int in [0, 2**63) or None, got {describe(value)}")
    return None if value is None else int(value)


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {describe(value)}")
    return value


def _logprobs(name: str, value) -> int | None:
    if value is not None and (not is_int(value) or value < 0):
        raise ValueError(f"{name} must be None or an int >= 0 (the most likely tokens reported besides the "
                         f"chosen one), got {describe(value)}")
    return None if value is None else int(value)


def _temperature(name: str, value) -> float:
    value = float32_number(name, value, 0.0, FLOAT32_MAX, note=" (finite in float32; 0 is greedy)")
    return 0.0 if value < SAMPLING_EPS else value   # (vLLM's greedy below _SAMPLING_EPS)


def _penalty(name: str, value) -> float:
    return float32_number(name, value, -2.0, 2.0, note=" (vLLM's and OpenAI's range; 0: no penalty)")


def _min_p(name: str, value) -> float:
    if not is_real(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1] (0: no cut), got {describe(value)}")
    return float(value)


def _processors(name: str, value) -> tuple:
    if callable(value):
        value = (value,)
    try:
        value = tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be a list of callables (input_ids, scores) -> scores, got "
                         f"{describe(value)}") from None
    bad = [p for p in value if not callable(p)]
    if bad:
        raise ValueError(f"{name} must hold callables (input_ids, scores) -> scores, got {describe(bad[0])}")
    return value


# Each field's check: (name, value) -> the value as stored.
_CHECKS = MappingProxyType({
    "n": positive_int,
    "presence_penalty": _penalty,
    "frequency_penalty": _penalty,
    "repetition_penalty": lambda name, v: float32_number(name, v, FLOAT32_TINY, FLOAT32_MAX,
                                                         note=" (> 0 and finite in float32; 1: no penalty)"),
    "temperature": _temperature,
    "top_p": fraction,
    "top_k": _top_k,
    "min_p": _min_p,
    "seed": _seed,
    "stop": lambda name, v: stop_string_tuple(v, name),
    "stop_token_ids": lambda name, v: token_id_tuple(v, name),
    "ignore_eos": _flag,
    "max_tokens": positive_int,
    "logprobs": _logprobs,
    "prompt_logprobs": _logprobs,
    "include_stop_str_in_output": _flag,
    "logits_processors": _processors,
})

#: Greedy decoding: the argmax (the first of tied logits). (Made here, after the fields' checks.)
GREEDY = SamplingParams(temperature=0.0)
