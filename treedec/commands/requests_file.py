"""Prompts files in, results files out: many requests run as one batch.

A prompts file is JSONL: one JSON object per line, one request each, empty lines skipped::

    {"prompt": "The capital of France is", "max_tokens": 16, "stop": ["\\n"]}
    {"messages": [{"role": "user", "content": "Name three primes."}], "temperature": 0.7, "seed": 1}
    {"id": "q3", "prompt_ids": [1, 450, 7483], "stop_token_ids": [13], "n": 4}

Each request has exactly one of ``prompt`` (a text), ``messages`` (chat messages, for the
checkpoint's chat template) or ``prompt_ids`` (token ids), and any of the parameters of
:data:`PARAMETERS`: the fields of :class:`~treedec.sampling.params.SamplingParams` (vLLM's names and
defaults) but ``logits_processors`` (not JSON); ``logit_bias``'s keys are token ids as JSON's strings
(``{"logit_bias": {"50256": -100}}``, as OpenAI's API takes them). A
parameter a line leaves out comes from the ``defaults`` the reader is given (the command
line's flags), else from :data:`DEFAULT_PARAMETERS`. An unknown key, a bad value, a line that
is not a JSON object or a repeated id raises :class:`RequestsFileError` naming the file, the
line and what is wrong, before anything runs.

A results file is JSONL too, one object per result, in the order given
(:func:`write_results_jsonl`) of :class:`~treedec.runtime.requests.RequestResult`, the record the programs write;
a line of a prompts file is a :class:`~treedec.runtime.requests.RequestSpec`.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

from treedec.checks import describe
from treedec.sampling.params import JSON_FIELDS, SamplingParams
from treedec.runtime.requests import PROMPT_KEYS, RequestSpec

__all__ = ["DEFAULT_PARAMETERS", "PARAMETERS", "RequestsFileError", "read_requests", "write_results_jsonl"]
#: The sampling / stop parameters a request may give (their defaults: :data:`DEFAULT_PARAMETERS`).
PARAMETERS = JSON_FIELDS


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


#: Each parameter's value when neither a prompts file's line nor the reader's ``defaults`` gives one.
DEFAULT_PARAMETERS = MappingProxyType({name: getattr(SamplingParams(), name) for name in PARAMETERS})


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
        params = SamplingParams(**{**base, **{key: obj[key] for key in PARAMETERS if key in obj}})
        prompt = {key: obj[key] for key in ("id", *PROMPT_KEYS) if key in obj}
        return RequestSpec(**{"id": number, **prompt, "params": params, "line": number})
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
    try:
        params = SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"defaults: {e}") from None
    return {key: getattr(params, key) for key in defaults}


def _json_value(value):
    """``json.dumps``' fallback: arrays and tensors as lists, numpy / torch scalars as numbers, paths as strings."""
    if isinstance(value, Path):
        return str(value)
    if callable(getattr(value, "tolist", None)):
        return value.tolist()
    raise TypeError(f"{describe(value)} is not JSON serializable")
