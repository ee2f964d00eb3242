"""When a request's output ends: EOS ids, stop strings, a token budget.

A :class:`StopRule` says when (the same fields for every program); a :class:`StopChecker`
applies it to one output as its tokens are accepted, one at a time (plain decoding) or
several at once (a speculative path, a chunk of replayed tokens). For every new token, in
order:

1. *EOS*: the token is one of ``eos_token_ids`` -> stop with reason ``"eos"``. The EOS token
   is **kept** as the output's last token, as every treedec program returns it ("the new
   tokens up to and including the first EOS id"); its text is what the detokenizer makes of
   it (nothing for a special token, which is skipped by default), except for a request's
   ``stop_token_ids``: their text is left out of the output's text unless ``include_stop_str``
   (vLLM's rule; vLLM leaves an EOS token's text out too, treedec keeps the EOS rule above).
   An EOS in the middle of a speculative path cuts the path right after it.
2. *stop string*: the output's text now contains one of ``stop_strings`` -> stop with reason
   ``"stop_string"``. The tokens are kept up to and including the token that completed the
   stop string (tokens are never split); the *text* is cut before the stop string, or after
   it with ``include_stop_str`` (vLLM's ``include_stop_str_in_output``), and whatever that
   token wrote after the stop string is dropped. A stop string may span several tokens and
   may end anywhere inside a token; when several are completed by the same token, the one
   that completes first in the text wins (vLLM's rule: text "abc" with stop strings
   ``["abc", "b"]`` gives "a", stopped by "b"), the longer one (starting first) when they end at
   the same character, so the text never contains a whole stop string, and the result is the
   one a stream of one character a token would give, however the tokens fall.
3. *length*: the output has ``max_new_tokens`` tokens -> stop with reason ``"length"``.

With ``min_tokens`` (vLLM's), neither an EOS id nor a stop string ends an output of ``min_tokens`` tokens or
fewer (a stop string counts when it ends in the text of a later token); the sampler also keeps the EOS and
stop ids from being drawn that early (:func:`~treedec.sampling.logits.mask_stop_tokens`).

Stop strings are matched on the detokenized text (:class:`~treedec.models.text.IncrementalDetokenizer`),
so they need the checkpoint's tokenizer; a character is matched once its last byte has
arrived, never against half of it. Each stop string is followed by a prefix-function (Knuth-Morris-Pratt)
matcher over the characters as they arrive: a token costs the host O(its characters x the number of stop
strings), whatever their lengths and the text's, for both the match and the hold-back of
:attr:`StopChecker.streamable_text` (the longest end of the text that is the start of a stop string).
A rule holds at most :data:`MAX_STOP_STRINGS` stop strings of at most :data:`MAX_STOP_STRING_CHARS`
characters each (checked before anything runs).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from treedec.checks import describe, int_in_range, is_int, positive_int
from treedec.models.text import IncrementalDetokenizer
from treedec.tree.validate import int_list

__all__ = ["MAX_STOP_STRINGS", "MAX_STOP_STRING_CHARS", "STOP_REASONS", "StopChecker", "StopDecision", "StopRule",
           "stop_string_tuple", "token_id_list", "token_id_tuple"]

#: The reasons a :class:`StopChecker` stops for, in the order it checks them for each token.
STOP_REASONS = ("eos", "stop_string", "length")
#: The most stop strings a rule (a request) has. vLLM's server takes 4 (``VLLM_MAX_STOP_STRINGS``), as OpenAI's API
#: does, and its ``SamplingParams`` has no bound; treedec's server takes 4 too, this bound is every other surface's.
MAX_STOP_STRINGS = 64
#: The most characters of one stop string: a client-controlled size, bounded before any work (neither vLLM nor
#: OpenAI bounds it; each character costs a matcher table entry once per request).
MAX_STOP_STRING_CHARS = 1024


@dataclass(frozen=True)
class StopRule:
    """When one output ends. Checked on construction (a ValueError names the field).

    Attributes
    ----------
    max_new_tokens : int >= 1; the output's token budget (EOS included).
    eos_token_ids : ids that end the output (kept as its last token); an id or a sequence of
        ids >= 0, stored as a tuple without repeats. Empty: no EOS stop. Programs give the
        checkpoint's EOS ids here (``model.eos_token_ids``) plus a request's extra stop ids.
    stop_strings : texts that end the output; a string or a sequence of non-empty strings,
        stored as a tuple without repeats. They need a detokenizer (see :class:`StopChecker`).
    include_stop_str : keep the stop string at the end of the text (default False: the text
        ends before it).
    min_tokens : int in [0, max_new_tokens]; an output of ``min_tokens`` tokens or fewer is not ended by an EOS
        id or a stop string (vLLM's ``min_tokens``); 0 for none.
    stop_token_ids : the ids of ``eos_token_ids`` that are a request's ``stop_token_ids`` (vLLM's): one ends the
        output as an EOS id does (reason ``"eos"``, kept as its last token), but its text is left out of the
        output's text unless ``include_stop_str``. Stored as a tuple without repeats; each must be one of
        ``eos_token_ids``.
    """

    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    include_stop_str: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        positive_int("max_new_tokens", self.max_new_tokens)
        object.__setattr__(self, "eos_token_ids", token_id_tuple(self.eos_token_ids, "eos_token_ids"))
        object.__setattr__(self, "stop_strings", stop_string_tuple(self.stop_strings, "stop_strings"))
        if not isinstance(self.include_stop_str, bool):
            raise ValueError(f"include_stop_str must be a bool, got {describe(self.include_stop_str)}")
        int_in_range("min_tokens", self.min_tokens, 0, self.max_new_tokens, note=" (max_new_tokens)")
        object.__setattr__(self, "stop_token_ids", token_id_tuple(self.stop_token_ids, "stop_token_ids"))
        outside = [t for t in self.stop_token_ids if t not in self.eos_token_ids]
        if outside:
            raise ValueError(f"stop_token_ids must be among eos_token_ids (the ids that end the output), got "
                             f"{outside[0]} not in {list(self.eos_token_ids)!r:.80}")

    @cached_property
    def borders(self) -> tuple[list[int], ...]:
        """Per stop string ``s``, its prefix function: ``borders[j][i]`` is the length of the longest proper
        prefix of ``s[:i + 1]`` that is also its suffix (Knuth-Morris-Pratt's failure table), made once per
        rule in O(len(s))."""
        return tuple(_prefix_function(s) for s in self.stop_strings)


class StopDecision(NamedTuple):
    """What :meth:`StopChecker.accept` decided about the tokens it was given.

    Attributes
    ----------
    keep : how many of the given tokens belong to the output (a prefix of them).
    reason : ``"eos"``, ``"stop_string"`` or ``"length"`` when the output ended with the
        last kept token; None when it goes on (then every token was kept).
    """

    keep: int
    reason: str | None


class StopChecker:
    """Applies a :class:`StopRule` to one output, as its tokens are accepted.

    Parameters
    ----------
    rule : the :class:`StopRule`.
    detokenizer : a fresh :class:`~treedec.models.text.IncrementalDetokenizer` of the request
        (made with its prompt ids, nothing fed yet); the checker feeds it every kept token
        and finishes it when the output ends. Needed for stop strings; without one the
        checker works on token ids only (``text`` is None).

    Raises
    ------
    TypeError
        ``rule`` is not a StopRule, or ``detokenizer`` not an IncrementalDetokenizer.
    ValueError
        ``rule`` has stop strings but there is no detokenizer, or the detokenizer was fed.
    """

    def __init__(self, rule: StopRule, detokenizer: IncrementalDetokenizer | None = None):
        if not isinstance(rule, StopRule):
            raise TypeError(f"rule must be a StopRule, got {describe(rule)}")
        if detokenizer is not None and not isinstance(detokenizer, IncrementalDetokenizer):
            raise TypeError(f"detokenizer must be an IncrementalDetokenizer or None, got {describe(detokenizer)}")
        if rule.stop_strings and detokenizer is None:
            raise ValueError(f"stop strings {list(rule.stop_strings)!r:.80} are matched on the output text and need "
                             f"a detokenizer (IncrementalDetokenizer(tokenizer, prompt_ids)); without the checkpoint's "
                             f"tokenizer, stop on token ids (eos_token_ids) instead")
        if detokenizer is not None and (detokenizer.output_ids or detokenizer.finished):
            finished = " and is finished" if detokenizer.finished else ""
            raise ValueError(f"detokenizer must be fresh (no output ids fed, not finished), it has "
                             f"{len(detokenizer.output_ids)} output ids{finished}")
        self.rule = rule
        self._detok = detokenizer
        self._eos = frozenset(rule.eos_token_ids)
        # (a stop token's text is left out: it is never fed to the detokenizer, as vLLM's detokenizer skips it)
        self._textless = frozenset(() if rule.include_stop_str else rule.stop_token_ids)
        self._borders = rule.borders if rule.stop_strings else ()
        # Per stop string, how many of its first characters the text ends with (never all: that is a match).
        self._matched = [0] * len(rule.stop_strings)
        self._length = 0   # characters of text so far (the detokenizer's, before any cut)
        self._ids: list[int] = []
        self._reason: str | None = None
        self._stop_string: str | None = None
        self._cut: int | None = None  # where the text ends when a stop string was found

    @property
    def token_ids(self) -> list[int]:
        """The output's tokens so far (kept ones only); a copy."""
        return list(self._ids)

    @property
    def num_tokens(self) -> int:
        """How many tokens the output has so far (kept ones only)."""
        return len(self._ids)

    def last_tokens(self, k: int) -> list[int]:
        """The output's last ``k`` tokens (fewer while it is shorter), without copying the rest."""
        return self._ids[max(len(self._ids) - k, 0):] if k > 0 else []

    @property
    def text(self) -> str | None:
        """The output's text so far, cut at the stop string; None without a detokenizer."""
        if self._detok is None:
            return None
        text = self._detok.text
        return text if self._cut is None else text[:self._cut]

    @property
    def streamable_text(self) -> str | None:
        """The text that can be shown (streamed) now: all of it once the output ended, else without a tail that
        may still become a stop string (it would then be cut); None without a detokenizer."""
        text = self.text
        return None if text is None else text[:self.streamable_length]

    @property
    def streamable_length(self) -> int:
        """``len(streamable_text)`` without building it (0 without a detokenizer): O(number of stop strings)."""
        if self._detok is None:
            return 0
        if self._cut is not None:
            return self._cut
        if self.stopped:
            return self._length
        return self._length - max(self._matched, default=0)

    def text_from(self, start: int) -> str:
        """``streamable_text[start:]``, joining only the text past ``start`` (a stream's next delta costs its own
        length, not the whole text's); '' without a detokenizer."""
        end = self.streamable_length
        return self._detok.text_from(start)[:max(end - start, 0)] if self._detok is not None and end > start else ""

    @property
    def stop_reason(self) -> str | None:
        """``"eos"``, ``"stop_string"`` or ``"length"`` once the output ended; None before."""
        return self._reason

    @property
    def stopped(self) -> bool:
        """Whether the output ended (:meth:`accept` takes no more tokens)."""
        return self._reason is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string the text was cut at, if any."""
        return self._stop_string

    @property
    def remaining(self) -> int:
        """Tokens the output may still take (0 once it ended): a bound for a speculative draft."""
        return 0 if self.stopped else self.rule.max_new_tokens - len(self._ids)

    def accept(self, token_ids: int | Sequence[int]) -> StopDecision:
        """Take newly accepted tokens (one or several, in order); say how many to keep and why the output ended.

        Parameters
        ----------
        token_ids : an id or a sequence of ids (e.g. a verified speculative path and its bonus
            token). Checked first (ints >= 0, below the detokenizer's vocabulary): nothing is
            taken when they are not.

        Returns
        -------
        :class:`StopDecision`: ``keep`` (the first ``keep`` of ``token_ids`` are the output's,
        the rest are to be dropped) and ``reason`` (None: the output goes on, all were kept).

        Raises
        ------
        RuntimeError
            The output already ended.
        """
        if self._reason is not None:
            raise RuntimeError(f"the output already ended ({self._reason!r}); it takes no more tokens")
        high = 2**63 - 1
        if self._detok is not None and self._detok.vocab_size is not None:
            high = self._detok.vocab_size - 1
        ids = int_list([int(token_ids)] if is_int(token_ids) else token_ids, "token_ids", low=0, high=high)
        rule, start = self.rule, len(self._ids)
        # The tokens this call may take: those within the budget, to the first EOS id that counts (a token counts
        # past min_tokens); the first ``quiet`` of them do not count. Their text is made in one pass (a stop string
        # is found after it, at the token whose text completed it).
        end = min(len(ids), rule.max_new_tokens - start)
        quiet = min(max(rule.min_tokens - start, 0), end)
        eos = None
        if self._eos and not self._eos.isdisjoint(ids[quiet:end]):
            eos = next(i for i in range(quiet, end) if ids[i] in self._eos)
            end = eos + 1
        taken = ids[:end] if end < len(ids) else ids
        self._ids += taken
        match, stop = None, None
        if self._detok is not None:
            if quiet:   # (a stop string completed in them does not count: they are matched on, their end ignored)
                self._scan(self._detok.feed_checked(taken[:quiet]))
            counted = taken[quiet:end - 1] if eos is not None and ids[eos] in self._textless else taken[quiet:]
            if counted:
                ends, at = [0] * len(counted), self._length - self._detok.text_length
                match = self._scan(self._detok.feed_checked(counted, ends))
                if match is not None:   # (the tokens after the one completing it were fed: the text is cut there)
                    stop = quiet + bisect.bisect_left(ends, match[0] + len(match[1]) - at)
        if stop is not None:
            keep, reason = stop + 1, "eos" if stop == eos else "stop_string"
            del self._ids[start + keep:]
        elif eos is not None:
            keep, reason = end, "eos"
        elif start + end >= rule.max_new_tokens:
            keep, reason = end, "length"
        else:
            return StopDecision(len(ids), None)
        self._end(reason, match)
        return StopDecision(keep, reason)

    def end(self, reason: str) -> None:
        """End the output for ``reason`` found elsewhere, after its last accepted token (a server's engine core ended
        it by a token-level stop the checker's rule does not hold, e.g. a grammar's own stop ids): its text is
        finished as at any end (a stop string the held-back bytes complete still cuts it)."""
        if self._reason is not None:
            raise RuntimeError(f"the output already ended ({self._reason!r})")
        if reason not in ("eos", "length"):   # (a stop string is found by the checker alone)
            raise ValueError(f"reason must be 'eos' or 'length', got {reason!r}")
        self._end(reason, None)

    # ------------------------------------------------------------ private

    def _end(self, reason: str, match: tuple[int, str] | None) -> None:
        """Stop for ``reason``; ``match``: the first stop string the last token's text completed, if any (None
        also when it does not count, within ``min_tokens``)."""
        self._reason = reason
        if self._detok is None:
            return
        # The output is whole: bytes still held back are shown as a one-shot decode shows them.
        tail = self._scan(self._detok.finish())
        if tail is not None and len(self._ids) > self.rule.min_tokens:
            match = tail if match is None or _first_completed(tail) < _first_completed(match) else match
        if match is not None:
            start, self._stop_string = match
            self._cut = start + len(self._stop_string) if self.rule.include_stop_str else start
        assert reason != "stop_string" or match is not None, f"{reason=} without a stop string in {self.text!r:.80}"

    def _scan(self, delta: str) -> tuple[int, str] | None:
        """Feed the text's next characters ``delta`` to every stop string's matcher; returns (start, stop string)
        of the stop string completed inside ``delta`` that completes first in the text (the longer on a tie), or
        None. O(len(delta)) per stop string, amortized (each character moves a matcher forward once, and its
        fall-backs never undo more than it moved)."""
        at = self._length
        self._length += len(delta)
        if not delta or not self._borders:
            return None
        best = None
        for j, (stop, border) in enumerate(zip(self.rule.stop_strings, self._borders)):
            k, found, size = self._matched[j], None, len(stop)
            for offset, c in enumerate(delta):
                while k and stop[k] != c:
                    k = border[k - 1]
                if stop[k] == c:
                    k += 1
                if k == size:
                    if found is None:
                        found = at + offset + 1 - k
                    k = border[k - 1]
            self._matched[j] = k
            if found is not None and (best is None or _first_completed((found, stop)) < _first_completed(best)):
                best = (found, stop)
        return best


def _first_completed(match: tuple[int, str]) -> tuple[int, int]:
    """The order in which stop strings completed in one token win: the one ending first in the text, the longer
    (starting first) of those ending at the same character (``match``: its start and the stop string)."""
    start, stop = match
    return start + len(stop), -len(stop)


def token_id_tuple(value, name: str) -> tuple[int, ...]:
    """An id or a sequence of ids >= 0 as a tuple without repeats (the first of each kept, in order);
    ValueError naming ``name`` otherwise."""
    ids = [value] if is_int(value) else value
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
        raise ValueError(f"{name} must be a token id or a sequence of token ids, got {describe(value)}")
    return tuple(dict.fromkeys(token_id_list(ids, name)))


def token_id_list(value, name: str) -> list[int]:
    """A sequence of token ids (ints >= 0, in order, repeats kept) as a list; ValueError naming ``name``
    otherwise."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of token ids, got {describe(value)}")
    ids = list(value)
    bad = [t for t in ids if not is_int(t) or t < 0]
    if bad:
        raise ValueError(f"{name} must be token ids (ints >= 0), got {describe(bad[0])} in {describe(value)}")
    return [int(t) for t in ids]


def stop_string_tuple(value, name: str, max_strings: int = MAX_STOP_STRINGS,
                      max_chars: int = MAX_STOP_STRING_CHARS) -> tuple[str, ...]:
    """A string or a sequence of at most ``max_strings`` non-empty strings of at most ``max_chars`` characters
    each, as a tuple without repeats; ValueError naming ``name`` otherwise (the sizes are checked before the
    strings are read)."""
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, Sequence) or isinstance(strings, bytes):
        raise ValueError(f"{name} must be a string or a sequence of strings, got {describe(value)}")
    if len(strings) > max_strings:
        raise ValueError(f"{name} must hold at most {max_strings} strings, got {len(strings)}")
    bad = [s for s in strings if not isinstance(s, str) or not s]
    if bad:
        raise ValueError(f"{name} must be non-empty strings, got {describe(bad[0])} in {describe(value)}")
    long = [i for i, s in enumerate(strings) if len(s) > max_chars]
    if long:
        raise ValueError(f"{name}[{long[0]}] must be at most {max_chars} characters, got {len(strings[long[0]])}")
    return tuple(dict.fromkeys(strings))


def _prefix_function(s: str) -> list[int]:
    """Knuth-Morris-Pratt's failure table of ``s``: entry i is the length of the longest proper prefix of
    ``s[:i + 1]`` that is also its suffix. O(len(s))."""
    border = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = border[k - 1]
        if s[i] == s[k]:
            k += 1
        border[i] = k
    return border
