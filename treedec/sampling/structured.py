"""Structured outputs: what a request's output must match (vLLM's ``StructuredOutputsParams``: a JSON schema, any
JSON object, a regular expression, one of a list of choices, or a grammar), checked and bounded on construction.

The constraint is compiled for a tokenizer by :class:`~treedec.sampling.grammar.GrammarCompiler` (xgrammar) and
applied to every draw as a token bitmask (:mod:`treedec.sampling.grammar`); this module holds only the user's
request, so that it needs no grammar engine installed.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from treedec.checks import describe

__all__ = ["MAX_CHOICES", "MAX_CHOICE_CHARS", "MAX_GRAMMAR_CHARS", "MAX_REGEX_CHARS", "MAX_SCHEMA_CHARS",
           "MAX_SCHEMA_DEPTH", "StructuredOutputsParams", "structured_outputs"]

#: The bounds of what a client gives, checked before anything is compiled: a JSON schema's length (as compact
#: JSON) and nesting depth, a regular expression's and a grammar's length, the choices and each choice's length.
MAX_SCHEMA_CHARS = 32768
MAX_SCHEMA_DEPTH = 32
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_CHARS = 32768
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 256

#: The kinds of constraint, one of which a :class:`StructuredOutputsParams` gives.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """What an output must match: exactly one of the fields below (vLLM's ``StructuredOutputsParams``, its names).
    Checked on construction: a ValueError names the field, the bound or the problem.

    Attributes
    ----------
    json : a JSON schema (a dict, or its JSON text): the output is one JSON value valid against it; at most
        :data:`MAX_SCHEMA_CHARS` characters as compact JSON and :data:`MAX_SCHEMA_DEPTH` levels deep. Stored as
        the schema's compact JSON text (its keys in their order: the properties' order in the output), its cache key.
    regex : a regular expression the whole output matches (at most :data:`MAX_REGEX_CHARS` characters).
    choice : the output is exactly one of these strings (1 to :data:`MAX_CHOICES`, each 1 to
        :data:`MAX_CHOICE_CHARS` characters).
    grammar : a context-free grammar in EBNF (xgrammar's / GBNF's notation, rule ``root`` first: e.g.
        ``root ::= "yes" | "no"``), at most :data:`MAX_GRAMMAR_CHARS` characters.
    json_object : True: the output is a JSON object, any (OpenAI's ``response_format`` ``json_object``; vLLM's
        xgrammar backend takes any JSON value, an array too).
    disable_any_whitespace : JSON without whitespace between its tokens (vLLM's option; by default a JSON
        output may put any whitespace where JSON allows it).
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)} (vLLM: one kind of "
                             f"constraint), got {' and '.join(given) if given else 'none of them'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.regex is not None:
            _text("regex", self.regex, MAX_REGEX_CHARS)
        if self.grammar is not None:
            _text("grammar", self.grammar, MAX_GRAMMAR_CHARS)
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {describe(self.json_object)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be true or false, got "
                             f"{describe(self.disable_any_whitespace)}")

    @property
    def kind(self) -> str:
        """Which constraint it is: one of ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"``, ``"json_object"``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What its compiled grammar is cached by (equal constraints share one compiled grammar)."""
        return (self.kind, getattr(self, self.kind), self.disable_any_whitespace)


def structured_outputs(value) -> StructuredOutputsParams | None:
    """``value`` as a :class:`StructuredOutputsParams`: one already, a mapping of its fields (a prompts file's or a
    request's JSON), or None (no constraint); else ValueError."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {*KINDS, "disable_any_whitespace"})
        if unknown:
            raise ValueError(f"structured_outputs has no field {unknown[0]!r} (it takes {', '.join(KINDS)} and "
                             f"disable_any_whitespace)")
        return StructuredOutputsParams(**value)
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams, a mapping of its fields or None, got "
                     f"{describe(value)}")


# ================================================================ private


def _text(name: str, value, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {describe(value)}")
    if len(value) > limit:
        raise ValueError(f"structured_outputs.{name} has {len(value)} characters; at most {limit}")
    return value


def _depth(value, limit: int, level: int = 1) -> int:
    """The nesting depth of a JSON value, counted no further than ``limit + 1``."""
    if level > limit or not isinstance(value, (dict, list)):
        return level
    children = value.values() if isinstance(value, dict) else value
    return max((_depth(v, limit, level + 1) for v in children), default=level)


def _schema_text(value) -> str:
    if isinstance(value, str):
        if len(value) > 4 * MAX_SCHEMA_CHARS:   # (bounded before it is parsed)
            raise ValueError(f"structured_outputs.json has {len(value)} characters; at most {MAX_SCHEMA_CHARS} as "
                             f"compact JSON")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as error:
            raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON schema (an object, or true / false), got "
                         f"{describe(value)}")
    if _depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"structured_outputs.json is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)   # (key order kept: the output's)
    except (TypeError, ValueError) as error:
        raise ValueError(f"structured_outputs.json is not a JSON value: {error}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"structured_outputs.json has {len(text)} characters as compact JSON; at most "
                         f"{MAX_SCHEMA_CHARS}")
    return text


def _choices(value) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"structured_outputs.choice must be a list of strings, got {describe(value)}")
    if not 1 <= len(value) <= MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice must hold 1 to {MAX_CHOICES} strings, got {len(value)}")
    for c in value:
        if not isinstance(c, str) or not 1 <= len(c) <= MAX_CHOICE_CHARS:
            raise ValueError(f"structured_outputs.choice must hold strings of 1 to {MAX_CHOICE_CHARS} characters, "
                             f"got {describe(c)}")
    return tuple(value)
