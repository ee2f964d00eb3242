"""Sampling parameters and the draws: :class:`SamplingParams` (vLLM's names and defaults), the processed
distribution (:func:`sampling_probs`: temperature, top-k, top-p, min-p; the penalties and logits processors that
come before it are :mod:`treedec.sampling.logits`') and the one token picker (:func:`sample_tokens`: the argmax at
temperature 0, else a draw; one token per row or ``k`` distinct ones).
What every program builds on (generation, the scheduler's step argmax, a branch controller, ToT, speculative
acceptance); parallel sampling and self-consistency are :mod:`treedec.programs.parallel_sampling`."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Callable, Iterable

import torch

from treedec.checks import FLOAT32_MAX, FLOAT32_TINY, describe, float32_number, fraction, is_int, is_real, positive_int
from treedec.models.text import IncrementalDetokenizer
from treedec.sampling.draw import inverse_cdf
from treedec.sampling.logits import SAMPLING_EPS, warp_scores
from treedec.sampling.stops import StopRule, stop_string_tuple, token_id_tuple
from treedec.sampling.structured import StructuredOutputsParams, structured_outputs


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How a request's outputs are drawn and when they end: vLLM's ``SamplingParams`` (its names and defaults),
    used by every program, the prompts file (:mod:`treedec.commands.requests_file`), the CLI and
    :class:`treedec.LLM`. Checked on construction (a ValueError names the field, the expected and the given
    value); keyword arguments only.

    A next token is drawn from the logits processed in this order (vLLM v1's sampler's, one function each in
    :mod:`treedec.sampling.logits`): the user's ``logits_processors``; ``allowed_token_ids`` (every other token
    -inf: :func:`~treedec.sampling.logits.apply_allowed_tokens`); ``bad_words``
    (:func:`~treedec.sampling.logits.apply_bad_words`); ``min_tokens`` (the stop ids -inf while the output is
    shorter: :func:`~treedec.sampling.logits.mask_stop_tokens`); ``logit_bias``
    (:func:`~treedec.sampling.logits.apply_logit_bias`); the penalties
    (:func:`~treedec.sampling.logits.apply_penalties`); then ``softmax(logits / temperature)`` restricted to the
    ``top_k`` most likely tokens, then to the smallest set of most likely tokens whose probability reaches
    ``top_p``, then to the tokens at least ``min_p`` times as likely as the most likely one (transformers' order
    of its warpers: :func:`~treedec.sampling.logits.warp_scores`), or its argmax at temperature 0. A request whose
    processed row has nothing to draw from (no finite logit, a NaN: e.g. a processor's) fails alone with
    :class:`~treedec.sampling.logits.NonFiniteLogitsError`. Log-probabilities are the raw logits' (vLLM's default).

    Attributes
    ----------
    n : outputs of the request (parallel samples), int >= 1.
    presence_penalty : subtracted from the logit of every token the output holds (vLLM / OpenAI); in [-2, 2]
        (vLLM's and OpenAI's range), 0 for none.
    frequency_penalty : times each token's count in the output, subtracted from its logit; in [-2, 2], 0 for
        none.
    repetition_penalty : > 0 and finite in float32 (in [2**-149, 3.4e38], as vLLM: > 0 and finite); a logit of a
        token in the prompt or the output is divided by it when positive, multiplied when negative
        (transformers' / vLLM's rule); 1 for none. A penalized logit saturates at float32's largest (never +inf).
    temperature : in [0, 3.4e38] (finite in float32); 0 is greedy (the argmax of the processed logits; top_k,
        top_p, min_p moot). A temperature below :data:`SAMPLING_EPS` (1e-5, vLLM's ``_SAMPLING_EPS``, below which
        vLLM samples greedily) is greedy too and is stored as 0.0: ``logits / 1e-45`` would overflow float32.
        (vLLM also raises a temperature in (0, 0.01) to 0.01 with a warning; treedec samples at the temperature
        given, which float32 holds: softmax subtracts the row's largest logit.)
    top_p : in (0, 1]; 1 keeps every token. The most likely token is always kept (a ``top_p`` that is 0 in
        float32, e.g. 1e-300, keeps only it, as in vLLM).
    top_k : int >= 1, or None for no top-k cut (vLLM's -1 and 0 mean None too; ties with the k-th kept).
    min_p : in [0, 1]; 0 keeps every token.
    seed : int in [-2**63, 2**63) (an int64, as vLLM takes), or None: each draw of a request with a seed takes a
        number that is a hash of the seed, the output's index and the draw's index
        (:func:`~treedec.sampling.rng.counter_uniform`), so its outputs do not depend on the other requests of a
        batch, their order or a preemption. The same seed draws the same tokens from the same logits; the logits
        themselves may differ in their last bits when the computation differs (vLLM documents the same limit): a
        prompt read from the prefix cache (its K/V computed with another request's steps) against one computed
        afresh gives logprobs ~1e-6 apart, and a draw whose random number falls that close to a token's boundary
        picks its neighbour. Seeded outputs are reproducible run to run on one engine and cache state, not across a
        cache hit against a miss (``enable_prefix_caching=False`` makes every prompt computed afresh). A negative
        seed is the unsigned 64-bit word of its two's complement (:func:`seed_word`: -1 is 2**64 - 1), so every seed
        is one distinct word of the counter-based generator, which hashes 64-bit words.
    stop : stop strings (a string or a list of non-empty strings; matched on the text, need the tokenizer): at
        most :data:`~treedec.sampling.stops.MAX_STOP_STRINGS` of at most
        :data:`~treedec.sampling.stops.MAX_STOP_STRING_CHARS` characters each (the server takes 4, as vLLM's and
        OpenAI's).
    stop_token_ids : ids that end an output besides the checkpoint's EOS ids (kept as its last token; its text is
        left out of the output's text unless ``include_stop_str_in_output``, as vLLM does).
    ignore_eos : do not stop at the checkpoint's EOS ids (``stop_token_ids`` still stop).
    max_tokens : int >= 1; the most tokens of each output (vLLM's default 16).
    min_tokens : int in [0, max_tokens]; the EOS ids (the checkpoint's, even with ``ignore_eos``) and
        ``stop_token_ids`` are not drawn while an output has fewer tokens, and no stop string ends it before
        (vLLM's ``min_tokens``, transformers' ``MinNewTokensLengthLogitsProcessor``); 0 for none.
    logprobs : None, or the number of most likely tokens whose log-probabilities each output token reports
        besides its own (0: only its own); log-softmax of the model's raw logits (vLLM's default).
    prompt_logprobs : the same for the prompt's tokens (the first has none).
    include_stop_str_in_output : keep a matched stop string at the end of the text.
    logits_processors : callables ``processor(input_ids, scores) -> scores`` with transformers'
        ``LogitsProcessor`` signature (``input_ids`` [1, L] the prompt and the output so far, ``scores``
        [1, vocab] float32), applied in order to each output's raw logits before the penalties;
        transformers' own processors work as they are.
    logit_bias : None, or token id -> bias added to its logit (OpenAI's and vLLM's ``logit_bias``); ids are ints
        >= 0 or their decimal strings (JSON's keys), below the model's vocabulary (checked when the request is
        prepared); biases in [-100, 100] (OpenAI's range: -100 bans a token in effect, 100 all but forces it).
    allowed_token_ids : None (every token), or a non-empty list of ids: the only tokens drawn (vLLM's).
    bad_words : words never generated (vLLM's): each is tokenized alone and with a leading space, and the last
        token of such a sequence is banned whenever the output's previous tokens are the rest of it (matched on
        the output's tokens, not the prompt's). Needs the tokenizer; at most :data:`MAX_BAD_WORDS` words of at
        most :data:`~treedec.sampling.stops.MAX_STOP_STRING_CHARS` characters, and at most
        :data:`MAX_BAD_WORDS_SEQUENCES` token sequences of :data:`MAX_BAD_WORDS_TOKENS` tokens in all after
        tokenization (vLLM's ``VLLM_MAX_NUM_BAD_WORDS`` and ``VLLM_MAX_BAD_WORDS_TOTAL_TOKENS``).
    detokenize : make each output's text (default True); False gives token ids only (``text`` None, no stop
        strings: vLLM refuses them too).
    skip_special_tokens : leave special tokens out of the text (default True, vLLM's).
    spaces_between_special_tokens : vLLM's option (default True); False puts an added token that follows
        another one into the text as its raw content (see
        :class:`~treedec.models.text.IncrementalDetokenizer`).
    truncate_prompt_tokens : None, -1 or an int >= 1: keep only the last k prompt tokens (left truncation; -1:
        the model's positions), vLLM's; the results' ``prompt_ids`` are the truncated prompt.
    structured_outputs : None, or a :class:`~treedec.sampling.structured.StructuredOutputsParams` (or a mapping of
        its fields): every output matches its JSON schema, JSON object, regex, choice or grammar (vLLM's field). Its
        token bitmask is applied to the raw logits before anything above (vLLM's order), at every draw; an output
        whose grammar ends stops (``"eos"``, finish reason ``"stop"``). Compiled once per constraint
        (:class:`~treedec.sampling.grammar.GrammarCompiler`, xgrammar: the ``structured`` extra).
    best_of : None or 1 only: vLLM v1 refuses ``best_of > 1`` ("does not yet support best_of"), so does treedec
        (draw ``n`` outputs with ``logprobs=0`` and rank them by ``cumulative_logprob``).
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
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, _CHECKS[f.name](f.name, getattr(self, f.name)))
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {list(self.stop)!r:.60} are matched on the text: they need "
                             f"detokenize=True (vLLM refuses them too)")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or below :data:`SAMPLING_EPS`, stored as 0): every token is the argmax of the
        processed logits."""
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """A penalty, a logits processor, ``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens`` or
        ``structured_outputs`` changes the logits before the draw (a greedy token is then not the raw logits'
        argmax)."""
        return bool(self.logits_processors) or self.repetition_penalty != 1 or self.presence_penalty != 0 \
            or self.frequency_penalty != 0 or self.logit_bias is not None or self.allowed_token_ids is not None \
            or bool(self.bad_words) or self.min_tokens > 0 or self.structured_outputs is not None

    @property
    def reads_logits(self) -> bool:
        """The program needs each step's logits rows (a draw, penalties, processors or logprobs), not only the
        step's argmax."""
        return not self.greedy or self.processes_logits or self.logprobs is not None

    def stop_rule(self, eos_token_ids=()) -> StopRule:
        """The :class:`~treedec.sampling.stops.StopRule` of each output: ``eos_token_ids`` (the checkpoint's, e.g.
        ``model.eos_token_ids``; dropped with ``ignore_eos``), then ``stop_token_ids``; ``stop``,
        ``max_tokens``, ``include_stop_str_in_output`` (a stop token's text is left out of the output's text
        without it: :attr:`StopRule.stop_token_ids <treedec.sampling.stops.StopRule.stop_token_ids>`)."""
        eos = () if self.ignore_eos else token_id_tuple(eos_token_ids, "eos_token_ids")
        return StopRule(self.max_tokens, eos + self.stop_token_ids, self.stop, self.include_stop_str_in_output,
                        self.min_tokens, stop_token_ids=self.stop_token_ids)

    def detokenizer(self, tokenizer, prompt_ids: Sequence[int]) -> IncrementalDetokenizer | None:
        """An output's :class:`~treedec.models.text.IncrementalDetokenizer` with this request's options
        (``skip_special_tokens``, ``spaces_between_special_tokens``), or None without a tokenizer or with
        ``detokenize=False``."""
        if tokenizer is None or not self.detokenize:
            return None
        return IncrementalDetokenizer(tokenizer, prompt_ids, self.skip_special_tokens,
                                      self.spaces_between_special_tokens)

    def check_vocab(self, vocab_size: int, name: str = "params") -> None:
        """Raise ValueError naming ``name`` and the field when ``allowed_token_ids`` or ``logit_bias`` holds an
        id outside the model's vocabulary ``[0, vocab_size)`` (vLLM refuses them too)."""
        for field, ids in (("allowed_token_ids", self.allowed_token_ids or ()), ("logit_bias", self.logit_bias or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name}: {field} must hold token ids in [0, {vocab_size}) (the model's vocabulary), "
                                 f"got {bad[:5]}")

    def truncated(self, prompt_ids: Sequence[int], positions: int) -> list[int]:
        """``prompt_ids`` after ``truncate_prompt_tokens``: its last k tokens (``positions``, the model's, for
        -1); all of them when None."""
        k = positions if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return list(prompt_ids) if k is None else list(prompt_ids)[-k:]

    def bad_words_token_ids(self, tokenizer) -> tuple[tuple[int, ...], ...]:
        """``bad_words`` as token sequences, as vLLM tokenizes them: each word (its leading spaces stripped)
        alone, and with one leading space when that starts with another token and has as many tokens (a word
        at the start of the text and inside it); ``()`` without bad words.

        Raises ValueError for a word that encodes to no tokens, more than :data:`MAX_BAD_WORDS_SEQUENCES`
        sequences or :data:`MAX_BAD_WORDS_TOKENS` tokens in all (vLLM's bounds), or no tokenizer."""
        if not self.bad_words:
            return ()
        if tokenizer is None:
            raise ValueError(f"bad_words {list(self.bad_words)!r:.60} are words: they need the checkpoint's tokenizer")
        special = hasattr(tokenizer, "all_special_ids")   # (a transformers tokenizer: no BOS added to a word)
        out: list[tuple[int, ...]] = []
        for word in self.bad_words:
            for prefix in ("", " "):
                text = prefix + word.lstrip()
                ids = tuple(tokenizer.encode(text, add_special_tokens=False) if special else tokenizer.encode(text))
                if not ids:
                    if not prefix:
                        raise ValueError(f"bad_words: {word!r:.40} encodes to no tokens")
                    continue
                if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                    out.append(ids)
            if len(out) > MAX_BAD_WORDS_SEQUENCES or sum(map(len, out)) > MAX_BAD_WORDS_TOKENS:
                raise ValueError(f"bad_words make more than {MAX_BAD_WORDS_SEQUENCES} token sequences or "
                                 f"{MAX_BAD_WORDS_TOKENS} tokens in all (vLLM's bounds); give fewer or shorter words")
        return tuple(out)

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
               "include_stop_str_in_output", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
               "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
               "best_of", "structured_outputs")
#: A seed's range: an int64, as vLLM's (numpy's and torch's generators take the unsigned word, :func:`seed_word`).
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1
#: The most ``bad_words`` a request gives (each makes at least one token sequence: vLLM's bound on those).
MAX_BAD_WORDS = 128
#: vLLM's bounds on a request's bad words once tokenized (``VLLM_MAX_NUM_BAD_WORDS``,
#: ``VLLM_MAX_BAD_WORDS_TOTAL_TOKENS``).
MAX_BAD_WORDS_SEQUENCES, MAX_BAD_WORDS_TOKENS = 128, 1024
#: OpenAI's range of a ``logit_bias`` value.
LOGIT_BIAS_MAX = 100.0


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample_tokens` draws from: ``softmax(logits / temperature)`` restricted
    to the ``top_k`` most likely tokens, then to the top-``top_p`` mass, then to the tokens at least ``min_p``
    times as likely as the most likely (:func:`~treedec.sampling.logits.warp_scores`); float32, ``[..., vocab]``.

    ``params.temperature`` must be > 0. A speculative draft that samples its tokens and the
    acceptance rule that verifies them both use it, so the target's ``p`` and the draft's ``q``
    are processed alike (lossless sampling needs that). Penalties and logits processors are applied before
    (they need the request's tokens: :class:`~treedec.programs.generate.GenerateProgram`).
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
    return inverse_cdf(probs, uniform)


# ================================================================ private: the fields' checks


def _top_k(name: str, value) -> int | None:
    if value is None or (is_int(value) and value in (-1, 0)):  # vLLM's "no top-k cut"
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, or None / -1 / 0 for no top-k cut, got {describe(value)}")
    return int(value)


def _seed(name: str, value) -> int | None:
    if value is not None and (not is_int(value) or not SEED_MIN <= value <= SEED_MAX):
        raise ValueError(f"{name} must be an int in [-2**63, 2**63) (an int64) or None, got {describe(value)}")
    return None if value is None else int(value)


def seed_word(seed: int) -> int:
    """``seed`` (an int64, :attr:`SamplingParams.seed`) as the unsigned 64-bit word of its two's complement, in
    ``[0, 2**64)``: what a generator seeded with an unsigned word (``torch.Generator.manual_seed``) takes. The
    counter-based generator's int64 tensors hold the same bits as the seed itself."""
    return int(seed) % 2**64


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


def _min_tokens(name: str, value) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (0: none), got {describe(value)}")
    return int(value)


def _logit_bias(name: str, value) -> Mapping[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping of token id -> bias (or None), got {describe(value)}")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20 else key
        if not is_int(token) or token < 0:
            raise ValueError(f"{name} keys must be token ids (ints >= 0, or their decimal strings), got "
                             f"{describe(key)}")
        out[int(token)] = float32_number(f"{name}[{token}]", bias, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX,
                                         note=" (OpenAI's range)")
    return MappingProxyType(out) if out else None


def _allowed_ids(name: str, value) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = token_id_tuple(value, name)
    if not ids:
        raise ValueError(f"{name} must be None (every token) or a non-empty list of token ids, got []")
    return ids


def _truncate(name: str, value) -> int | None:
    if value is not None and (not is_int(value) or value < -1 or value == 0):
        raise ValueError(f"{name} must be None, -1 (the model's positions) or an int >= 1 (the last k prompt "
                         f"tokens), got {describe(value)}")
    return None if value is None else int(value)


def _best_of(name: str, value) -> int | None:
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {describe(value)}")
    if value is not None and value > 1:
        raise ValueError(f"{name}={value} is not supported (vLLM v1 does not support best_of either): draw n outputs "
                         f"with logprobs=0 and rank them by cumulative_logprob")
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
    "min_tokens": _min_tokens,
    "logit_bias": _logit_bias,
    "allowed_token_ids": _allowed_ids,
    "bad_words": lambda name, v: stop_string_tuple(v, name, MAX_BAD_WORDS),
    "detokenize": _flag,
    "skip_special_tokens": _flag,
    "spaces_between_special_tokens": _flag,
    "truncate_prompt_tokens": _truncate,
    "best_of": _best_of,
    "structured_outputs": lambda name, v: structured_outputs(v),
})

#: Greedy decoding: the argmax (the first of tied logits). (Made here, after the fields' checks.)
GREEDY = SamplingParams(temperature=0.0)
