"""What happens to a step's logits between the model and the token picker, as pure tensor functions (vLLM's and
HF ``generate``'s semantics; the programs pass plain arguments):

- token masks and biases (vLLM v1's, in its order): ``allowed_token_ids`` (:func:`apply_allowed_tokens`),
  ``bad_words`` (:func:`apply_bad_words`), ``min_tokens`` (:func:`mask_stop_tokens`), ``logit_bias``
  (:func:`apply_logit_bias`);
- penalties (:func:`apply_penalties`): repetition (prompt and output tokens), presence and frequency (output
  tokens), from a prompt mask (:func:`token_mask`) and per-row output counts kept on the device
  (:func:`output_token_counts`, :func:`count_tokens_`); a processed row's check (:func:`drawable_rows`);
- the warpers (:func:`warp_scores`): temperature, top-k, top-p, min-p (:func:`min_p_filter`), in transformers'
  order; ``softmax`` of its scores is the distribution a token is drawn from;
- user logits processors (:func:`apply_logits_processors`): transformers' ``LogitsProcessor`` callables, one
  output row at a time;
- log-probabilities (:func:`token_logprobs`, :func:`prompt_logprobs`): the chosen tokens' log-probabilities under
  the raw logits (vLLM's default ``raw_logprobs``), their ranks and the top-k, as a :class:`TokenLogprobs`.

Everything but the user processors is device ops only (no host sync; the bad words' bans are found on the host
from the tokens it has and copied without a wait): it runs inside a decode step, on the GPU too. Scalar
parameters are Python numbers, checked on the host. :class:`~treedec.sampling.params.SamplingParams`' docstring
is where the order and the meaning of every field is written; these functions are its one definition.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from treedec.checks import (FLOAT32_TINY, finite_float, float32_number, fraction, nonnegative_int,
                            positive_int, show)
from treedec.sampling.sampler import penalize, warp
from treedec.transfer import to_device
from treedec.tree.validate import int_list, rows

__all__ = ["SAMPLING_EPS", "LogitsProcessor", "LogitsProcessorError", "Logprob", "NonFiniteLogitsError",
           "TokenLogprobs", "apply_allowed_tokens", "apply_bad_words", "apply_logit_bias", "apply_logits_processors",
           "apply_penalties", "bad_word_bans", "count_tokens_", "drawable_rows", "mask_stop_tokens", "min_p_filter",
           "output_token_counts", "prompt_logprobs", "token_logprobs", "token_mask", "warp_scores"]

#: The smallest temperature that samples (vLLM's ``_SAMPLING_EPS``): below it a request is greedy
#: (:class:`~treedec.sampling.params.SamplingParams` stores it as 0).
SAMPLING_EPS = 1e-5

#: A user logits processor, transformers' signature: ``(input_ids [1, L] int64, scores [1, V] float) ->
#: scores [1, V]``, where ``input_ids`` is the prompt and the output so far.
LogitsProcessor = Callable[[torch.LongTensor, torch.FloatTensor], torch.FloatTensor]


class LogitsProcessorError(RuntimeError):
    """A user logits processor raised, or returned something other than a float tensor of the scores' shape."""


class NonFiniteLogitsError(ValueError):
    """A request's processed logits row holds nothing to draw from: no finite logit, or a NaN or +inf (e.g. a
    logits processor that returned NaN); the request fails, the others go on (:func:`drawable_rows`)."""


# ================================================================ penalties


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0) -> torch.Tensor:
    """The penalized logits, as vLLM computes them (before temperature):

    - repetition (HF's ``RepetitionPenaltyLogitsProcessor``): a token of the prompt or of the output so far gets
      ``logit / repetition_penalty`` if its logit is > 0, else ``logit * repetition_penalty``;
    - then ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` with ``count`` the token's
      number of occurrences in the output (the prompt does not count; OpenAI's formula).

    Parameters
    ----------
    logits : [m, V] float, any float dtype (not modified).
    prompt_mask : [m, V] or [1, V] bool, the tokens present in each row's prompt (:func:`token_mask`).
    output_counts : [m, V] int, each token's count in each row's output so far (:func:`output_token_counts`,
        :func:`count_tokens_`).
    repetition_penalty : > 0 and finite in float32 (``[2**-149, 3.4e38]``); 1 is none, > 1 discourages repeats.
    presence_penalty, frequency_penalty : finite float32 numbers; 0 is none, > 0 discourages repeats (vLLM's
        :class:`~treedec.sampling.params.SamplingParams` bounds them to [-2, 2]).

    Returns
    -------
    [m, V] float32, a new tensor on ``logits.device``. A finite logit that a penalty takes past float32's
    largest saturates at 3.4e38 (never +inf, which would make the row's softmax NaN); one taken below its lowest
    is -inf (its probability is 0 either way; a row left with no finite logit fails its request:
    :func:`drawable_rows`); an infinite one (a masked token) stays.
    """
    repetition_penalty = float32_number("repetition_penalty", repetition_penalty, FLOAT32_TINY,
                                        note=" (> 0 and finite in float32)")
    presence_penalty = float32_number("presence_penalty", presence_penalty)
    frequency_penalty = float32_number("frequency_penalty", frequency_penalty)
    _check_rows(logits, prompt_mask, output_counts)
    return penalize(logits, prompt_mask, output_counts, repetition_penalty, presence_penalty, frequency_penalty)


def drawable_rows(scores: torch.Tensor) -> torch.Tensor:
    """``[m]`` bool on ``scores.device``: whether each row of processed logits ``[m, V]`` can be drawn from (a
    finite logit, no NaN, no +inf: else its softmax is NaN). Device ops only (no host sync); a program reads it
    with the drawn tokens (:class:`~treedec.programs.generate.GenerateProgram`), so it costs no wait of its own."""
    return torch.isfinite(scores.amax(dim=-1))   # (the max is NaN with a NaN, inf with a +inf, -inf with no finite)


def token_mask(token_ids: Sequence[int], vocab_size: int, device: torch.device | str | None = None,
               name: str = "token_ids") -> torch.Tensor:
    """``[1, vocab_size]`` bool on ``device``: True at ``token_ids`` (ids in ``[0, vocab_size)``, checked on the
    host: ValueError naming ``name``). A prompt's is the ``prompt_mask`` of :func:`apply_penalties` (rows of one
    prompt share it); ``allowed_token_ids``' the mask of :func:`apply_allowed_tokens`."""
    positive_int("vocab_size", vocab_size)
    ids = int_list(token_ids, name, low=0, high=vocab_size - 1)
    mask = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
    mask[0, torch.tensor(ids, dtype=torch.int64, device=device)] = True
    return mask


def output_token_counts(token_ids_per_row: Sequence[Sequence[int]], vocab_size: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """``[m, vocab_size]`` int32 on ``device``: how often each token occurs in each row's output so far (all zeros
    for empty outputs), the ``output_counts`` of :func:`apply_penalties`; :func:`count_tokens_` keeps it current."""
    positive_int("vocab_size", vocab_size)
    histories = [int_list(ids, f"token_ids_per_row[{i}]", low=0, high=vocab_size - 1)
                 for i, ids in enumerate(rows(token_ids_per_row, "token_ids_per_row"))]
    counts = torch.zeros(len(histories), vocab_size, dtype=torch.int32, device=device)
    row = [i for i, ids in enumerate(histories) for _ in ids]
    if row:
        flat = torch.tensor([t for ids in histories for t in ids], dtype=torch.int64, device=device)
        counts.index_put_((torch.tensor(row, dtype=torch.int64, device=device), flat),
                          torch.ones(len(row), dtype=torch.int32, device=device), accumulate=True)
    return counts


def count_tokens_(counts: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Add the drawn ``tokens`` to ``counts`` in place, on the device (no host sync); returns ``counts``.

    Parameters
    ----------
    counts : [m, V] int (:func:`output_token_counts`).
    tokens : [m] or [m, k] int64, row i's new token(s), ids in ``[0, V)`` (a device tensor is not checked: that
        would wait for it).
    valid : bool, the shape of ``tokens``, optional: count only the tokens where it is True (e.g. the accepted
        prefix of each row's speculative tokens). None counts them all.
    """
    if counts.dim() != 2 or counts.is_floating_point() or counts.dtype == torch.bool:
        raise ValueError(f"counts must be an int tensor [m, V], got {counts.dtype} {tuple(counts.shape)}")
    columns = tokens.reshape(tokens.shape[0], -1) if tokens.dim() in (1, 2) else None
    if columns is None or tokens.shape[0] != counts.shape[0] or tokens.is_floating_point():
        raise ValueError(f"tokens must be int [m] or [m, k] with m = {counts.shape[0]} rows of counts, "
                         f"got {tokens.dtype} {tuple(tokens.shape)}")
    if valid is None:
        add = torch.ones(columns.shape, dtype=counts.dtype, device=counts.device)
    elif valid.shape != tokens.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool of tokens' shape {tuple(tokens.shape)}, "
                         f"got {valid.dtype} {tuple(valid.shape)}")
    else:
        add = valid.reshape(columns.shape).to(counts.dtype)
    return counts.scatter_add_(1, columns.long(), add)


def _check_rows(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [m, V], got {logits.dtype} {tuple(logits.shape)}")
    m, vocab = logits.shape
    if prompt_mask.dtype != torch.bool or prompt_mask.dim() != 2 or prompt_mask.shape[0] not in (1, m) \
            or prompt_mask.shape[1] != vocab:
        raise ValueError(f"prompt_mask must be bool [{m}, {vocab}] or [1, {vocab}], "
                         f"got {prompt_mask.dtype} {tuple(prompt_mask.shape)}")
    if output_counts.shape != logits.shape or output_counts.is_floating_point() or output_counts.dtype == torch.bool:
        raise ValueError(f"output_counts must be an int tensor [{m}, {vocab}], "
                         f"got {output_counts.dtype} {tuple(output_counts.shape)}")


# ================================================================ token masks and biases (vLLM v1's order)


def apply_allowed_tokens(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``scores`` [m, V] float with ``-inf`` at every token outside ``allowed`` ([1, V] or [m, V] bool,
    :func:`token_mask` of vLLM's ``allowed_token_ids``); a new float32 tensor, device ops only."""
    return scores.float().masked_fill(~allowed, float("-inf"))


def bad_word_bans(bad_words: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """The (row, token) pairs that vLLM's ``bad_words`` ban: for each token sequence of ``bad_words``, its last
    token in each row whose output so far (``outputs[row]``, its last tokens at least) ends with the rest of the
    sequence (a one-token word: always). Host lists; O(rows x sequences x their length)."""
    bans = []
    for row, output in enumerate(outputs):
        for word in bad_words:
            head = len(word) - 1
            if head <= len(output) and (head == 0 or list(output[len(output) - head:]) == list(word[:head])):
                bans.append((row, word[-1]))
    return bans


def apply_bad_words(scores: torch.Tensor, bad_words: Sequence[Sequence[int]],
                    outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """``scores`` [m, V] with ``-inf`` at every token :func:`bad_word_bans` bans (row i's output so far:
    ``outputs[i]``); a new float32 tensor (one small host-to-device copy of the bans, no wait)."""
    bans = bad_word_bans(bad_words, outputs)
    scores = scores.float()
    if not bans:
        return scores
    where = to_device(np.array(bans, dtype=np.int64), scores.device)
    return scores.index_put((where[:, 0], where[:, 1]), torch.tensor(float("-inf"), device=scores.device))


def mask_stop_tokens(scores: torch.Tensor, stop_ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's ``min_tokens``: ``scores`` [m, V] with ``-inf`` at ``stop_ids`` ([k] int64 on its device: the EOS ids
    and ``stop_token_ids``) in ``rows`` ([r] int64, the rows whose output is shorter than ``min_tokens``; None:
    every row); transformers' ``MinNewTokensLengthLogitsProcessor``. A new float32 tensor, device ops only."""
    scores = scores.float().clone()
    if rows is None:
        scores[:, stop_ids] = float("-inf")
    else:
        scores[rows.unsqueeze(1), stop_ids.unsqueeze(0)] = float("-inf")
    return scores


def apply_logit_bias(scores: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """OpenAI's ``logit_bias``: ``scores`` [m, V] with ``bias`` ([k] float32) added at ``token_ids`` ([k] int64,
    distinct) in every row (a masked ``-inf`` stays ``-inf``); a new float32 tensor, device ops only."""
    scores = scores.float()
    return scores.index_add(1, token_ids, bias.unsqueeze(0).expand(scores.shape[0], -1))


# ================================================================ warpers


def warp_scores(logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float = 1.0,
                min_p: float = 0.0) -> torch.Tensor:
    """The scores a token is drawn from: ``logits / temperature``, then every token outside the ``top_k`` largest
    (ties with the k-th are kept), outside the smallest set of most likely tokens whose probability reaches
    ``top_p``, or below ``min_p`` times the most likely token's probability set to ``-inf`` (transformers'
    warpers, in their order; the most likely token is always kept). ``softmax`` of the result is the distribution.

    Parameters
    ----------
    logits : [..., V] any float dtype.
    temperature : in [1e-5, 3.4e38] (:data:`SAMPLING_EPS` and float32's largest: below,
        sampling is greedy decoding, the argmax; no distribution).
    top_k : int >= 1, or None for no top-k cut.
    top_p : in (0, 1]; 1 keeps every token. A ``top_p`` that float32 rounds to 0 (below 1.4e-45) keeps only
        the most likely token, as any ``top_p`` small enough does.
    min_p : in [0, 1]; 0 keeps every token.

    Returns
    -------
    [..., V] float32, ``-inf`` at the removed tokens; a logit whose scaling passes float32's largest saturates at
    3.4e38 (never +inf: its softmax would be NaN), one below its lowest is -inf (probability 0 either way).
    """
    float32_number("temperature", temperature, SAMPLING_EPS,
                   note=" (below 1e-5 sampling is greedy decoding: the argmax)")
    if top_k is not None:
        positive_int("top_k", top_k)
    fraction("top_p", top_p)
    min_p = _min_p(min_p)
    shape = logits.shape
    scores = warp(logits.reshape(-1, shape[-1]), float(temperature),
                  top_k if top_k is not None and top_k < shape[-1] else None, top_p if top_p < 1 else None,
                  min_p if min_p > 0 else None)
    return scores.reshape(shape)


def min_p_filter(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """``scores`` with ``-inf`` at every token whose probability (``softmax(scores)``) is below ``min_p`` times the
    most likely token's (transformers' ``MinPLogitsWarper``; applied to temperature-scaled scores, it keeps the most
    likely token). ``scores`` [..., V] float; ``min_p`` in [0, 1]. Returns a new float32 tensor of that shape."""
    min_p = _min_p(min_p)
    scores = scores.float()
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def _min_p(min_p) -> float:
    value = finite_float("min_p", min_p, note=" in [0, 1]")
    if not 0 <= value <= 1:
        raise ValueError(f"min_p must be a finite number in [0, 1], got {show(min_p)}")
    return value


# ================================================================ user logits processors


def apply_logits_processors(processors: Sequence[LogitsProcessor], token_ids_per_row: Sequence[Sequence[int]],
                            logits: torch.Tensor) -> torch.Tensor:
    """The logits after the user's processors, applied in order, one row at a time.

    Each processor is called as transformers calls a ``LogitsProcessor``: ``processor(input_ids, scores)`` with
    ``input_ids`` ``[1, L]`` int64 (row i's prompt and output so far, ``token_ids_per_row[i]``) and ``scores``
    ``[1, V]`` (a copy of row i, after the processors before it), returning the new ``[1, V]`` float scores. This
    runs on the host, row by row (user code): it costs a Python call per processor and row every step.

    Parameters
    ----------
    processors : callables with transformers' ``LogitsProcessor`` signature.
    token_ids_per_row : m token id lists, one per row of ``logits``.
    logits : [m, V] float (not modified).

    Returns
    -------
    [m, V] float32 on ``logits.device``.

    Raises
    ------
    LogitsProcessorError : a processor raised, or returned something other than a float tensor ``[1, V]`` on
        ``logits.device``; the message names the processor and the row.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [m, V], got {logits.dtype} {tuple(logits.shape)}")
    histories = rows(token_ids_per_row, "token_ids_per_row")
    if len(histories) != logits.shape[0]:
        raise ValueError(f"token_ids_per_row must have one token list per row of logits ({logits.shape[0]}), "
                         f"got {len(histories)}")
    processors = list(processors)
    for p in processors:
        if not callable(p):
            raise TypeError(f"a logits processor must be callable, got {show(p)}")
    out = logits.to(torch.float32, copy=True)
    if not processors:
        return out
    for i, ids in enumerate(histories):
        input_ids = torch.tensor([int_list(ids, f"token_ids_per_row[{i}]", low=0)], dtype=torch.int64,
                                 device=logits.device)
        scores = out[i:i + 1].clone()
        for p in processors:
            scores = _run_processor(p, input_ids, scores, i)
        out[i] = scores[0]
    return out


def _run_processor(processor: LogitsProcessor, input_ids: torch.Tensor, scores: torch.Tensor, row: int
                   ) -> torch.Tensor:
    name = _processor_name(processor)
    try:
        result = processor(input_ids, scores)
    except Exception as e:
        raise LogitsProcessorError(f"logits processor {name} raised on row {row}: {type(e).__name__}: {e}") from e
    if not isinstance(result, torch.Tensor) or not result.is_floating_point() or result.shape != scores.shape \
            or result.device != scores.device:
        got = (f"{result.dtype} {tuple(result.shape)} on {result.device}" if isinstance(result, torch.Tensor)
               else show(result))
        raise LogitsProcessorError(f"logits processor {name} must return a float tensor {tuple(scores.shape)} on "
                                   f"{scores.device} (row {row}), got {got}")
    return result.float()


def _processor_name(processor) -> str:
    """A function's or class's own name; an instance (transformers' processors) is named by its class."""
    named = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)
    return processor.__qualname__ if isinstance(processor, named) else type(processor).__qualname__


# ================================================================ log-probabilities


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability and rank (1 = the most likely), as in vLLM's per-position dicts."""

    logprob: float
    rank: int


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of chosen tokens under ``log_softmax`` of the raw logits, one row per position, device
    tensors (read them when the tokens are emitted).

    Attributes
    ----------
    token_ids : [m] int64, the chosen tokens.
    logprobs : [m] float32, their log-probabilities.
    ranks : [m] int64, 1 + the number of tokens more likely than the chosen one (tied tokens share a rank).
    top_ids : [m, k] int64, each row's k most likely tokens, most likely first (k = 0: none asked for).
    top_logprobs : [m, k] float32, their log-probabilities.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_dicts(self) -> list[dict[int, Logprob]]:
        """Per row, vLLM's ``{token_id: Logprob}``: the top-k tokens (ranks 1..k) and the chosen token with its own
        rank (reads the tensors back: one host sync)."""
        chosen = zip(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())
        out = []
        for (token, logprob, rank), ids, lps in zip(chosen, self.top_ids.tolist(), self.top_logprobs.tolist()):
            row = {t: Logprob(lp, r) for r, (t, lp) in enumerate(zip(ids, lps), start=1)}
            row[token] = Logprob(logprob, rank)
            out.append(row)
        return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int = 0) -> TokenLogprobs:
    """The log-probabilities of ``tokens`` under ``log_softmax(logits)`` in float32, their ranks and each row's
    ``k`` most likely tokens: vLLM's sample logprobs (pass the raw logits, before penalties and warpers).

    Parameters
    ----------
    logits : [m, V] any float dtype.
    tokens : [m] int, row i's chosen token (a device tensor is not checked against V: that would wait for it).
    k : int >= 0, the number of top tokens per row (at most V).

    Returns
    -------
    :class:`TokenLogprobs`, device tensors on ``logits.device``; no host sync.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [m, V], got {logits.dtype} {tuple(logits.shape)}")
    if tokens.dim() != 1 or tokens.shape[0] != logits.shape[0] or tokens.is_floating_point() \
            or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be int [{logits.shape[0]}] (one per row of logits), "
                         f"got {tokens.dtype} {tuple(tokens.shape)}")
    nonnegative_int("k", k)
    if k > logits.shape[1]:
        raise ValueError(f"k must be at most the vocabulary size {logits.shape[1]}, got {k}")
    logprobs = logits.float().log_softmax(dim=-1)
    tokens = tokens.long()
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top = logprobs.topk(k, dim=-1)
    return TokenLogprobs(tokens, chosen.squeeze(1), ranks, top.indices, top.values)


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int] | torch.Tensor, k: int = 0) -> TokenLogprobs:
    """The log-probabilities of the prompt's tokens 1..L-1, each under the logits of the position before it
    (vLLM's ``prompt_logprobs``; token 0 has none: vLLM gives None for it).

    Parameters
    ----------
    logits : [L-1, V] or [L, V] float, the logits at prompt positions 0.. (an L-th row, the next token's
        distribution after the prompt, is ignored).
    prompt_ids : L token ids (a list or a [L] int tensor).
    k : int >= 0, top tokens per position.

    Returns
    -------
    :class:`TokenLogprobs` with L-1 rows (row j for prompt token j+1).
    """
    ids = prompt_ids if isinstance(prompt_ids, torch.Tensor) else \
        torch.tensor(int_list(prompt_ids, "prompt_ids", low=0), dtype=torch.int64)
    if ids.dim() != 1 or ids.shape[0] < 1 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"prompt_ids must be L >= 1 int token ids, got {ids.dtype} {tuple(ids.shape)}")
    length = ids.shape[0]
    if logits.dim() != 2 or logits.shape[0] not in (length - 1, length):
        raise ValueError(f"logits must be [L-1, V] or [L, V] with L = {length} prompt tokens, "
                         f"got {tuple(logits.shape)}")
    return token_logprobs(logits[:length - 1], ids[1:].to(logits.device), k)
