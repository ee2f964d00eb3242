"""The ops of a replay schedule: one frozen dataclass per op kind, and their JSON objects.

Each op is a tree operation on node handles (:class:`Prompt`, :class:`Branch`,
:class:`Extend`, :class:`TokenTree`, :class:`Children`, :class:`Accept`, :class:`Truncate`,
:class:`Prune`); ``parse_op`` reads
one from its JSON object, checking every field on its own, and ``op_json`` writes it back;
:class:`ScheduleError` is what every check of a schedule raises.
The file format they belong to is described in :mod:`treedec.workloads.schedule`; whether
ops are valid in sequence is checked by the symbolic replay of
:mod:`treedec.workloads.schedule_check`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from treedec.checks import positive_int
from treedec.workloads.deft import TraceFormatError

Handle = Union[str, int]

#: Explicit token ids must be below this (an int32 holds them; every vocabulary is smaller).
TOKEN_ID_LIMIT = 2**31


class ScheduleError(TraceFormatError):
    """A schedule that does not follow the format, or whose ops are invalid in sequence."""


# ================================================================ ops


@dataclass(frozen=True)
class Prompt:
    id: Handle
    tokens: int | tuple[int, ...]
    parent: Handle | None = None
    pending: bool = False   # computed by the step's forward with its other tokens, not prefilled at once
    op = "prompt"


@dataclass(frozen=True)
class Branch:
    node: Handle
    ids: tuple[Handle, ...]
    op = "branch"


@dataclass(frozen=True)
class Extend:
    node: Handle
    tokens: int | tuple[int, ...]
    op = "extend"


@dataclass(frozen=True)
class TokenTree:
    node: Handle
    parents: tuple[int, ...]
    ids: tuple[Handle, ...]
    tokens: tuple[int, ...] | None = None
    op = "token_tree"


@dataclass(frozen=True)
class Children:
    nodes: tuple[Handle, ...]
    ids: tuple[Handle, ...]
    tokens: tuple[int, ...] | None = None
    op = "children"


@dataclass(frozen=True)
class Accept:
    ids: tuple[Handle, ...]
    op = "accept"


@dataclass(frozen=True)
class Truncate:
    node: Handle
    length: int
    op = "truncate"


@dataclass(frozen=True)
class Prune:
    node: Handle
    op = "prune"


Op = Union[Prompt, Branch, Extend, TokenTree, Children, Accept, Truncate, Prune]
#: Every op kind (what a schedule's steps may hold).
OPS = (Prompt, Branch, Extend, TokenTree, Children, Accept, Truncate, Prune)


def token_count(tokens: int | tuple[int, ...]) -> int:
    """Tokens an op's ``tokens`` field stands for (a count, or explicit ids)."""
    return tokens if isinstance(tokens, int) else len(tokens)


# ================================================================ parsing


_OP_FIELDS = {
    "prompt": ({"id", "tokens"}, {"parent", "pending"}),
    "branch": ({"node", "ids"}, set()),
    "extend": ({"node", "tokens"}, set()),
    "token_tree": ({"node", "parents", "ids"}, {"tokens"}),
    "children": ({"nodes", "ids"}, {"tokens"}),
    "accept": ({"ids"}, set()),
    "truncate": ({"node", "length"}, set()),
    "prune": ({"node"}, set()),
}


def parse_op(raw, where: str) -> Op:
    """The op of a schedule's JSON object ``raw``, every field checked; ScheduleError naming ``where`` and the field."""
    if not isinstance(raw, dict):
        raise ScheduleError(f"{where}: an op must be a JSON object, got {type(raw).__name__} {raw!r:.60}")
    kind = raw.get("op")
    if not isinstance(kind, str) or kind not in _OP_FIELDS:
        raise ScheduleError(f"{where}: field 'op' must be one of {sorted(_OP_FIELDS)}, got {kind!r:.60}")
    where = f"{where} ({kind})"
    required, optional = _OP_FIELDS[kind]
    missing = sorted(required - set(raw))
    if missing:
        raise ScheduleError(f"{where}: missing field '{missing[0]}'")
    extra = [k for k in raw if k not in required and k not in optional and k != "op"]
    if extra:
        raise ScheduleError(f"{where}: unknown field '{extra[0]!s:.60}' (fields: {sorted(required | optional)})")
    if kind == "prompt":
        parent = raw.get("parent")
        pending = raw.get("pending", False)
        if not isinstance(pending, bool):
            raise ScheduleError(f"{where}: field 'pending' must be true or false, got {pending!r:.60}")
        return Prompt(_handle(raw["id"], where, "id"), _tokens(raw["tokens"], where),
                      None if parent is None else _handle(parent, where, "parent"), pending)
    if kind == "branch":
        return Branch(_handle(raw["node"], where, "node"), _handles(raw["ids"], where, "ids"))
    if kind == "extend":
        return Extend(_handle(raw["node"], where, "node"), _tokens(raw["tokens"], where))
    if kind == "token_tree":
        tokens = raw.get("tokens")
        return TokenTree(_handle(raw["node"], where, "node"), _int_list(raw["parents"], where, "parents", -1),
                         _handles(raw["ids"], where, "ids"),
                         None if tokens is None else _int_list(tokens, where, "tokens", 0, TOKEN_ID_LIMIT))
    if kind == "children":
        tokens = raw.get("tokens")
        return Children(_handles(raw["nodes"], where, "nodes"), _handles(raw["ids"], where, "ids"),
                        None if tokens is None else _int_list(tokens, where, "tokens", 0, TOKEN_ID_LIMIT))
    if kind == "accept":
        return Accept(_handles(raw["ids"], where, "ids"))
    if kind == "truncate":
        length = raw["length"]
        positive_int(f"{where}: field 'length'", length, error=ScheduleError, note=" (the tokens the node keeps)")
        return Truncate(_handle(raw["node"], where, "node"), length)
    return Prune(_handle(raw["node"], where, "node"))


def is_json_int(x) -> bool:
    """Whether ``x`` is a Python int and not a bool: what a schedule field holds (numpy ints would not write back)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _handle(x, where: str, name: str) -> Handle:
    if not (isinstance(x, str) or is_json_int(x)):
        raise ScheduleError(f"{where}: field '{name}' must be a node handle (string or int), "
                            f"got {type(x).__name__} {x!r:.60}")
    return x


def _handles(x, where: str, name: str) -> tuple[Handle, ...]:
    if not isinstance(x, list) or not x:
        raise ScheduleError(f"{where}: field '{name}' must be a non-empty list of node handles, got {x!r:.60}")
    return tuple(_handle(h, where, f"{name}[{i}]") for i, h in enumerate(x))


def _int_list(x, where: str, name: str, minimum: int, limit: int | None = None) -> tuple[int, ...]:
    if not isinstance(x, list):
        raise ScheduleError(f"{where}: field '{name}' must be a list of ints, got {type(x).__name__} {x!r:.60}")
    for i, v in enumerate(x):
        if not is_json_int(v) or v < minimum:
            raise ScheduleError(f"{where}: field '{name}[{i}]' must be an int >= {minimum}, got {v!r:.60}")
        if limit is not None and v >= limit:
            raise ScheduleError(f"{where}: field '{name}[{i}]' must be an int < {limit}, got {v!r:.60}")
    return tuple(x)


def _tokens(x, where: str) -> int | tuple[int, ...]:
    if is_json_int(x):
        if x < 1:
            raise ScheduleError(f"{where}: field 'tokens' must be a count >= 1 or a list of token ids, got {x}")
        return x
    ids = _int_list(x, where, "tokens", 0, TOKEN_ID_LIMIT)
    if not ids:
        raise ScheduleError(f"{where}: field 'tokens' must not be an empty list")
    return ids


def op_json(op: Op) -> dict:
    """The JSON object of ``op`` (:func:`parse_op` reads it back equal); absent optional fields are left out."""
    out: dict = {"op": op.op}
    for name, value in op.__dict__.items():
        if value is None or value is False:   # an absent optional field (a prompt is not pending by default)
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out
