"""Prompts files in, results files out: many requests run as one batch.

A prompts file is JSONL: one JSON object per line, one request each, empty lines skipped::

    {"prompt": "The capital of France is", "max_new_tokens": 16, "stop": ["\\n"]}
    {"messages": [{"role": "user", "content": "Name three primes."}], "temperature": 0.7, "seed": 1}
    {"id": "q3", "prompt_ids": [1, 450, 7483], "stop_token_ids": [13], "n": 4}

Each request has exactly one of ``prompt`` (a text), ``messages`` (chat messages, for the
checkpoint's chat template) or ``prompt_ids`` (token ids), and any of the parameters of
:data:`PARAMETERS` (vLLM's names where treedec has the same thing; ``max_new_tokens``
is vLLM's ``max_tokens``, ``include_stop_str`` its ``include_stop_str_in_output``). A
parameter a line leaves out comes from the ``defaults`` the reader is given (the command
line's flags), else from :data:`DEFAULT_PARAMETERS`. An unknown key, a bad value, a line that
is not a JSON object or a repeated id raises :class:`RequestsFileError` naming the file, the
line and what is wrong, before anything runs.

A results file is JSONL too, one object per result, in the order given
(:func:`write_results_jsonl`); :class:`RequestResult` is the record the programs write.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from treedec.checks import describe, is_int, is_real, positive_int
from treedec.models.text import check_messages
from treedec.search.stops import StopRule, stop_string_tuple, token_id_list, token_id_tuple

__all__ = ["DEFAULT_PARAMETERS", "PARAMETERS", "PROMPT_KEYS", "RequestResult", "RequestSpec", "RequestsFileError",
           "read_requests", "write_results_jsonl"]

#: The keys a request gives its prompt by; each request has exactly one of them.
PROMPT_KEYS = ("prompt", "messages", "prompt_ids")
#: The sampling / stop parameters a request may give (their defaults: :data:`DEFAULT_PARAMETERS`).
PARAMETERS = ("max_new_tokens", "stop", "stop_token_ids", "include_stop_str", "temperature", "top_p", "top_k", "seed",
              "n")
SEED_MAX = 2**63 - 1  # numpy and torch both take seeds in [0, 2**63)


class RequestsFileError(ValueError):
    """A malformed prompts file. The message starts with ``file:line:`` and says what is wrong.

    Attributes
    ----------
    path : the file.
    line : the 1-based line number, or None for the file as a whole (e.g. no requests).
    """

    def __init__(self, path: str | Path, line: int | None, message: str):
        self.path, self.line = str(path), line
        super().__init__(f"{path}:{line}: {message}" if line is not None else f"{path}: {message}")


@dataclass(frozen=True)
class RequestSpec:
    """One request: its prompt, sampling and stop parameters. Checked on construction
    (a ValueError names the field, the expected and the given value).

    Attributes
    ----------
    id : an int or a non-empty string naming the request in the results (a prompts file's
        default: the line number).
    prompt : a non-empty text; or
    messages : chat messages (see :func:`~treedec.models.text.check_messages`), as a tuple of
        dicts, for the checkpoint's chat template; or
    prompt_ids : token ids (ints >= 0; the program checks them against its vocabulary).
        Exactly one of the three is given.
    max_new_tokens : int >= 1.
    stop : stop strings (a string or a list of non-empty strings; needs the tokenizer).
    stop_token_ids : ids that end the output besides the checkpoint's EOS ids.
    include_stop_str : keep a matched stop string at the end of the text.
    temperature : >= 0 (0: greedy).
    top_p : in (0, 1].
    top_k : int >= 1, or None for no top-k cut (vLLM's -1 and 0 mean None too).
    seed : int in [0, 2**63), or None (the program's generator).
    n : outputs of this request (parallel samples), int >= 1.
    line : the prompts file's line it came from (None when built in code).
    """

    id: int | str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_new_tokens: int = 16           # vLLM's SamplingParams defaults, where it has the parameter
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    line: int | None = None

    def __post_init__(self):
        if not (is_int(self.id) or isinstance(self.id, str) and self.id):
            raise ValueError(f"id must be an int or a non-empty string, got {describe(self.id)}")
        if is_int(self.id):
            object.__setattr__(self, "id", int(self.id))
        given = [key for key in PROMPT_KEYS if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(f"a request needs exactly one of {', '.join(PROMPT_KEYS)}, got "
                             f"{' and '.join(given) if given else 'none of them'}")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise ValueError(f"prompt must be a non-empty string, got {describe(self.prompt)}")
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(check_messages(self.messages, "messages")))
        if self.prompt_ids is not None:
            ids = token_id_list(self.prompt_ids, "prompt_ids")
            if not ids:
                raise ValueError("prompt_ids must hold at least one token id, got []")
            object.__setattr__(self, "prompt_ids", tuple(ids))
        for name in PARAMETERS:
            object.__setattr__(self, name, _PARAMETER_CHECKS[name](getattr(self, name), name))
        if self.line is not None:
            positive_int("line", self.line)

    @property
    def name(self) -> str:
        """How errors name the request: ``request 'b'``, with ``(line 3)`` when it came from a file."""
        return f"request {self.id!r}" + ("" if self.line is None else f" (line {self.line})")

    def stop_rule(self, eos_token_ids=()) -> StopRule:
        """The request's :class:`~treedec.search.stops.StopRule`: ``eos_token_ids`` (the
        checkpoint's, e.g. ``model.eos_token_ids``) and then its ``stop_token_ids``."""
        eos = token_id_tuple(eos_token_ids, "eos_token_ids")
        return StopRule(self.max_new_tokens, eos + self.stop_token_ids, self.stop, self.include_stop_str)


#: Each parameter's value when neither a prompts file's line nor the reader's ``defaults`` gives one.
DEFAULT_PARAMETERS = MappingProxyType({f.name: f.default for f in dataclasses.fields(RequestSpec)
                                       if f.name in PARAMETERS})


@dataclass
class RequestResult:
    """One output of one request: a line of a results file.

    Attributes
    ----------
    id : the request's id.
    index : which of the request's ``n`` outputs (0 for the first).
    prompt : the request's text or chat messages; None for a ``prompt_ids`` request.
    prompt_ids : the prompt's token ids (after the chat template).
    output_ids : the output's token ids (an EOS that ended it included).
    text : the output's text (cut at a stop string); None without a tokenizer.
    stop_reason : ``"eos"``, ``"stop_string"`` or ``"length"``.
    stats : the program's counters for this request (steps, accepted lengths, seconds, ...).
    """

    id: int | str
    index: int
    prompt: str | list[dict] | None
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    stop_reason: str
    stats: dict = field(default_factory=dict)


def read_requests(path: str | Path, defaults: Mapping[str, object] | None = None) -> list[RequestSpec]:
    """The requests of a prompts JSONL file, in file order.

    Parameters
    ----------
    path : a UTF-8 file (a leading byte-order mark is allowed), one JSON object per line.
    defaults : parameter -> value for the parameters a line leaves out (keys of
        :data:`DEFAULT_PARAMETERS`); those it leaves out too keep :data:`DEFAULT_PARAMETERS`.

    Returns
    -------
    One :class:`RequestSpec` per non-empty line; ``id`` defaults to the line number.

    Raises
    ------
    FileNotFoundError / OSError
        The file cannot be read.
    ValueError
        ``defaults`` has an unknown key or a bad value (the message names it).
    RequestsFileError
        (a ValueError) A line that is not UTF-8 or not one JSON object, NaN or Infinity, a
        key given twice, an unknown key, none or several of :data:`PROMPT_KEYS`, a bad value,
        an id already used by another line, or a file without requests.
    """
    base = dict(DEFAULT_PARAMETERS)
    base.update(_checked_defaults(defaults))
    requests: list[RequestSpec] = []
    lines_of_id: dict[tuple[type, int | str], int] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise RequestsFileError(path, number, f"not UTF-8 text (byte {e.start + 1}: {e.reason})") from None
            if not text.strip():
                continue
            spec = _request(_json_object(text.rstrip(), path, number), base, path, number)
            key = (str if isinstance(spec.id, str) else int, spec.id)
            if key in lines_of_id:
                raise RequestsFileError(path, number, f"id {spec.id!r} is also the id of line {lines_of_id[key]}; "
                                                      f"ids must be unique (they name the results)")
            lines_of_id[key] = number
            requests.append(spec)
    if not requests:
        raise RequestsFileError(path, None, "no requests (the file has no non-empty line)")
    return requests


def write_results_jsonl(path: str | Path, results: Iterable) -> int:
    """Write one JSON object per result, one per line (UTF-8, non-ASCII text as it is).

    Parameters
    ----------
    path : the file; created or overwritten.
    results : dataclass instances (such as :class:`RequestResult`; nested dataclasses become
        objects) or mappings with string keys, in the order to write. Lists, tuples, numpy
        arrays and tensors become JSON arrays, numpy / torch scalars numbers, paths strings.
        A generator is written as it yields: a run cut short keeps the lines of the results
        it finished.

    Returns
    -------
    The number of lines written.

    Raises
    ------
    TypeError
        A result that is neither a dataclass instance nor a mapping, or a value JSON cannot
        hold (the message names the result's index).
    ValueError
        A NaN or infinite number (not JSON), naming the result's index.
    """
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for i, result in enumerate(results):
            if dataclasses.is_dataclass(result) and not isinstance(result, type):
                record = dataclasses.asdict(result)
            elif isinstance(result, Mapping):
                record = dict(result)
            else:
                raise TypeError(f"results[{i}] must be a dataclass instance or a mapping, got {describe(result)}")
            try:
                line = json.dumps(record, ensure_ascii=False, allow_nan=False, default=_json_value)
            except (TypeError, ValueError) as e:
                raise type(e)(f"results[{i}] cannot be written as JSON: {e}") from None
            f.write(line + "\n")
            f.flush()
            count += 1
    return count


# ================================================================ private


def _request(obj: dict, base: dict, path, number: int) -> RequestSpec:
    """The RequestSpec of one parsed line: its keys over ``base``, checked."""
    known = ("id", *PROMPT_KEYS, *PARAMETERS)
    unknown = [key for key in obj if key not in known]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RequestsFileError(path, number, f"unknown key {key!r}{hint}; a request takes {', '.join(known)}")
    given = [key for key in PROMPT_KEYS if key in obj]
    if len(given) != 1:
        raise RequestsFileError(path, number, f"a request needs exactly one of {', '.join(PROMPT_KEYS)}, got "
                                              f"{' and '.join(given) if given else 'none of them'}")
    if obj[given[0]] is None:
        raise RequestsFileError(path, number, f"{given[0]} is null; give the request's {given[0]}")
    try:
        return RequestSpec(**{"id": number, **base, **obj, "line": number})
    except ValueError as e:
        raise RequestsFileError(path, number, str(e)) from None


def _json_object(text: str, path, number: int) -> dict:
    """The JSON object of one line; RequestsFileError for anything else."""
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise RequestsFileError(path, number, f"not valid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise RequestsFileError(path, number, "not valid JSON: nested too deeply") from None
    except ValueError as e:  # from the hooks: a key given twice, NaN / Infinity
        raise RequestsFileError(path, number, str(e)) from None
    if not isinstance(obj, dict):
        raise RequestsFileError(path, number, f"must be a JSON object (one request), got a JSON "
                                              f"{type(obj).__name__}: {text[:60]}")
    return obj


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    repeated = [key for i, key in enumerate(keys) if key in keys[:i]]
    if repeated:
        raise ValueError(f"key {repeated[0]!r} is given twice")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (give a finite number)")


def _checked_defaults(defaults) -> dict:
    if defaults is None:
        return {}
    if not isinstance(defaults, Mapping):
        raise ValueError(f"defaults must be a mapping of parameter -> value, got {describe(defaults)}")
    unknown = [key for key in defaults if key not in PARAMETERS]
    if unknown:
        raise ValueError(f"defaults has unknown parameter {unknown[0]!r}; the parameters are {', '.join(PARAMETERS)}")
    return {key: _PARAMETER_CHECKS[key](value, f"defaults[{key!r}]") for key, value in defaults.items()}


def _json_value(value):
    """``json.dumps``' fallback: arrays and tensors as lists, numpy / torch scalars as numbers, paths as strings."""
    if isinstance(value, Path):
        return str(value)
    if callable(getattr(value, "tolist", None)):
        return value.tolist()
    raise TypeError(f"{describe(value)} is not JSON serializable")


def _temperature(value, name: str) -> float:
    if not is_real(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {describe(value)}")
    return float(value)


def _top_p(value, name: str) -> float:
    if not is_real(value) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {describe(value)}")
    return float(value)


def _top_k(value, name: str) -> int | None:
    if value is None or (is_int(value) and value in (-1, 0)):  # vLLM's "no top-k cut"
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, or None / -1 / 0 for no top-k cut, got {describe(value)}")
    return int(value)


def _seed(value, name: str) -> int | None:
    if value is not None and (not is_int(value) or not 0 <= value <= SEED_MAX):
        raise ValueError(f"{name} must be an int in [0, 2**63) or None, got {describe(value)}")
    return None if value is None else int(value)


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {describe(value)}")
    return value


# Each parameter's check: (value, name for the message) -> the value as stored.
_PARAMETER_CHECKS = MappingProxyType({
    "max_new_tokens": lambda v, name: positive_int(name, v),
    "stop": lambda v, name: stop_string_tuple(v, name),
    "stop_token_ids": lambda v, name: token_id_tuple(v, name),
    "include_stop_str": _flag,
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _top_k,
    "seed": _seed,
    "n": lambda v, name: positive_int(name, v),
})
