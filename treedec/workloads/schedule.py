"""Replay schedules: a decoding tree's history as JSON steps of tree operations on node handles.

A schedule forces the *shape* of a decoding run (which node branches, grows, is verified,
is pruned, at which step); the tokens are whatever the model emits. The shipped workloads
are turned into schedules by :mod:`treedec.workloads.builders`; users can write their own.

File format (version 1)::

    {"format": "treedec-schedule", "version": 1, "name": "...", "source": "...",
     "steps": [[op, op, ...], ...]}

A step applies its ops in order, then runs **one forward** over the tokens they added (a
step that adds none runs no forward). Node handles are JSON strings or ints chosen by the
schedule; each names one node for its lifetime and is never reused after it is pruned.

``{"op": "prompt", "id": H, "tokens": n | [ids], "parent": H}``
    Prefill a new prompt of ``n`` tokens (ids drawn from a seeded RNG) or of the given
    ids. Without ``parent`` it starts a new tree of the forest; with it, the prompt is a
    continuation under node ``parent``. The prefill runs its own forward(s) at once.
``{"op": "branch", "node": H, "ids": [H, ...]}``
    Give ``node`` one new, empty child per handle in ``ids``.
``{"op": "extend", "node": H, "tokens": n | [ids]}``
    Append ``n`` tokens to leaf ``node`` (decode: the first is the model's greedy next
    token for ``node`` -- for an empty node, its parent's -- the others, if any, are RNG
    filler, i.e. a forced continuation), or the given ids.
``{"op": "token_tree", "node": H, "parents": [p, ...], "ids": [H, ...], "tokens": [ids]}``
    Hang a speculative token tree under ``node``, one node per token: ``parents[i]`` is
    the index of token i's parent token (-1: a child of ``node``), parents before
    children. Without ``tokens``, tokens with parent -1 are the model's next token for
    ``node`` and the others RNG filler (the candidates of a draft model).
``{"op": "accept", "ids": [H, ...]}``
    Keep the accepted path of a verified token tree: ``ids`` is a chain of token-tree
    nodes from a child of the anchor (the node the tree hangs under) downwards. The
    anchor's token-tree children are all removed and the chain's tokens (their K/V
    included, no recompute) are appended to the anchor, which continues the sequence.
``{"op": "prune", "node": H}``
    Remove ``node`` and its subtree, freeing the KV pages no other node uses.

Within a step, ``prompt``, ``accept`` and ``prune`` ops come before ``extend`` and
``token_tree`` ops (those add the step's pending tokens, which cannot be pruned, and which
``prompt``/``accept`` would otherwise commit before their forward).

:func:`load_schedule` / :meth:`Schedule.from_json` validate the whole schedule before
anything runs (a symbolic replay of every op); an error is a :class:`ScheduleError` that
names the file, the step, the op and the field. Token ids are ints in [0, 2**31).

Sizes are checked before anything is allocated: a count is only a number in the JSON, so
a few bytes can ask for 10^9 tokens. :meth:`Schedule.check_fits` replays the schedule
symbolically against a token capacity (the KV pool's), a position limit (the model's
``max_position``) and a vocabulary, and names the first op that goes past one; the replay
(:func:`treedec.replay.replay`, :func:`treedec.replay.dry_run`) calls it first.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from treedec.workloads.deft import TraceFormatError, _load_json

FORMAT = "treedec-schedule"
VERSION = 1

Handle = Union[str, int]

#: Explicit token ids must be below this (an int32 holds them; every vocabulary is smaller).
TOKEN_ID_LIMIT = 2**31
#: Default cap on the tokens a schedule's tree may hold at once, where no KV pool size is given
#: (the DeFT workloads peak below 30k; a replay can raise it with an explicit pool size).
DEFAULT_MAX_TREE_TOKENS = 1 << 20


class ScheduleError(TraceFormatError):
    """A schedule that does not follow the format, or whose ops are invalid in sequence."""


# ================================================================ ops


@dataclass(frozen=True)
class Prompt:
    id: Handle
    tokens: int | tuple[int, ...]
    parent: Handle | None = None
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
class Accept:
    ids: tuple[Handle, ...]
    op = "accept"


@dataclass(frozen=True)
class Prune:
    node: Handle
    op = "prune"


Op = Union[Prompt, Branch, Extend, TokenTree, Accept, Prune]
_ADDS_PENDING = (Extend, TokenTree)
_MUST_COME_FIRST = (Prompt, Accept, Prune)


def token_count(tokens: int | tuple[int, ...]) -> int:
    """Tokens an op's ``tokens`` field stands for (a count, or explicit ids)."""
    return tokens if isinstance(tokens, int) else len(tokens)


# ================================================================ schedule


@dataclass(frozen=True)
class ScheduleStats:
    """What a validated schedule needs, computed by the symbolic replay.

    Attributes
    ----------
    forward_steps : int
        Steps that add pending tokens (run a forward), prompts' prefills not counted.
    max_position : int
        Largest token position (depth in its sequence, from 0) any node reaches.
    peak_tree_tokens : int
        Most tokens held by the tree at once.
    max_token_id : int
        Largest explicit token id in the schedule (-1 if none): must be < the model's vocab.
    live_roots : tuple
        Handles of the prompts still alive after the last step.
    widest_branch : int
        Most children one ``branch`` op creates (0 if none): a KV pool needs at least that
        many pages, as each child's first token starts a page of its own.
    """

    forward_steps: int
    max_position: int
    peak_tree_tokens: int
    max_token_id: int
    live_roots: tuple
    widest_branch: int = 0


@dataclass(frozen=True)
class Schedule:
    """A validated list of steps, each a tuple of ops (construct with :meth:`from_json` or :func:`load_schedule`)."""

    steps: tuple[tuple[Op, ...], ...]
    name: str = "schedule"
    source: str = "<memory>"
    meta: dict = field(default_factory=dict, compare=False)
    stats: ScheduleStats | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.steps)

    @classmethod
    def from_steps(cls, steps, name: str = "schedule", source: str = "<memory>", meta: dict | None = None
                   ) -> "Schedule":
        """Validate ops already built as dataclasses (the builders use this)."""
        steps = tuple(tuple(s) for s in steps)
        stats = _check(steps, source)
        return cls(steps, name, source, dict(meta or {}), stats)

    @classmethod
    def from_json(cls, data, source: str = "<memory>") -> "Schedule":
        """Parse and validate a decoded JSON document (see the module docstring).

        Raises :class:`ScheduleError` (naming ``source``, the step, the op and the field) for
        anything that does not follow the format; nothing is sized beyond the document.
        """
        if not isinstance(data, dict):
            raise ScheduleError(f"{source}: the top level must be a JSON object with 'format' and 'steps', "
                                f"got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ScheduleError(f"{source}: field 'format' must be {FORMAT!r}, got {data.get('format')!r:.60}")
        if data.get("version") != VERSION:
            raise ScheduleError(f"{source}: field 'version' must be {VERSION}, got {data.get('version')!r:.60}")
        raw_steps = data.get("steps")
        if not isinstance(raw_steps, list):
            raise ScheduleError(f"{source}: field 'steps' must be a list of steps, got {type(raw_steps).__name__}")
        name = data.get("name", Path(source).stem)
        if not isinstance(name, str):
            raise ScheduleError(f"{source}: field 'name' must be a string, got {type(name).__name__}")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ScheduleError(f"{source}: field 'meta' must be an object, got {type(meta).__name__}")
        steps = []
        for i, raw in enumerate(raw_steps):
            if not isinstance(raw, list):
                raise ScheduleError(f"{source}: step {i}: a step must be a list of ops, got {type(raw).__name__}")
            steps.append(tuple(_parse_op(op, f"{source}: step {i}, op {j}") for j, op in enumerate(raw)))
        return cls.from_steps(steps, name=name, source=source, meta=meta)

    def to_json(self) -> dict:
        """The JSON document of this schedule (``from_json(s.to_json())`` gives it back)."""
        return {"format": FORMAT, "version": VERSION, "name": self.name, "source": self.source,
                "meta": self.meta, "steps": [[_op_json(op) for op in step] for step in self.steps]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")

    def truncated(self, num_steps: int) -> "Schedule":
        """The first ``num_steps`` steps, plus a last step pruning every prompt still alive."""
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
        if num_steps >= len(self.steps):
            return self
        head = self.steps[:num_steps]
        roots = _check(head, self.source).live_roots
        steps = head + ((tuple(Prune(r) for r in roots),) if roots else ())
        return Schedule.from_steps(steps, name=self.name, source=f"{self.source}[:{num_steps}]",
                                   meta={**self.meta, "truncated_to_steps": num_steps})

    def check_fits(self, max_tree_tokens: int | None = None, max_position: int | None = None,
                   vocab_size: int | None = None, *, tokens_limit: str = "max_tree_tokens",
                   position_limit: str = "max_position") -> None:
        """Raise :class:`ScheduleError` at the first op that goes past a limit; allocates nothing.

        Parameters
        ----------
        max_tree_tokens : int, optional
            Most tokens the tree may hold at once (a KV pool's capacity in tokens).
        max_position : int, optional
            Positions must be ``< max_position`` (a model's ``max_position_embeddings``, or
            its sliding window).
        vocab_size : int, optional
            Explicit token ids must be ``< vocab_size``.
        tokens_limit, position_limit : str
            What the limits are, for the message (e.g. ``"kv_tokens"``).
        """
        for name, value in (("max_tree_tokens", max_tree_tokens), ("max_position", max_position),
                            ("vocab_size", vocab_size)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        _check(self.steps, self.source, _Limits(max_tree_tokens, max_position, vocab_size, tokens_limit,
                                                position_limit))


def load_schedule(path: str | Path) -> Schedule:
    """Read and validate a schedule file; errors name the file, step, op and field.

    Raises
    ------
    ScheduleError
        (a ValueError) The file is not JSON, does not follow the format, or its ops are
        invalid in sequence (unknown or reused handles, a cycle, a non-leaf extended, ...).
    FileNotFoundError, OSError
        The file is missing or cannot be read.

    Nothing is sized here beyond the file itself: check a schedule against a model and a
    KV pool with :meth:`Schedule.check_fits` before running it.
    """
    path = Path(path)
    try:
        return Schedule.from_json(_load_json(path), source=str(path))
    except TraceFormatError as e:
        if isinstance(e, ScheduleError):
            raise
        raise ScheduleError(str(e)) from None


# ================================================================ parsing


_OP_FIELDS = {
    "prompt": ({"id", "tokens"}, {"parent"}),
    "branch": ({"node", "ids"}, set()),
    "extend": ({"node", "tokens"}, set()),
    "token_tree": ({"node", "parents", "ids"}, {"tokens"}),
    "accept": ({"ids"}, set()),
    "prune": ({"node"}, set()),
}


def _parse_op(raw, where: str) -> Op:
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
        return Prompt(_handle(raw["id"], where, "id"), _tokens(raw["tokens"], where),
                      None if parent is None else _handle(parent, where, "parent"))
    if kind == "branch":
        return Branch(_handle(raw["node"], where, "node"), _handles(raw["ids"], where, "ids"))
    if kind == "extend":
        return Extend(_handle(raw["node"], where, "node"), _tokens(raw["tokens"], where))
    if kind == "token_tree":
        tokens = raw.get("tokens")
        return TokenTree(_handle(raw["node"], where, "node"), _int_list(raw["parents"], where, "parents", -1),
                         _handles(raw["ids"], where, "ids"),
                         None if tokens is None else _int_list(tokens, where, "tokens", 0, TOKEN_ID_LIMIT))
    if kind == "accept":
        return Accept(_handles(raw["ids"], where, "ids"))
    return Prune(_handle(raw["node"], where, "node"))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _handle(x, where: str, name: str) -> Handle:
    if not (isinstance(x, str) or _is_int(x)):
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
        if not _is_int(v) or v < minimum:
            raise ScheduleError(f"{where}: field '{name}[{i}]' must be an int >= {minimum}, got {v!r:.60}")
        if limit is not None and v >= limit:
            raise ScheduleError(f"{where}: field '{name}[{i}]' must be an int < {limit}, got {v!r:.60}")
    return tuple(x)


def _tokens(x, where: str) -> int | tuple[int, ...]:
    if _is_int(x):
        if x < 1:
            raise ScheduleError(f"{where}: field 'tokens' must be a count >= 1 or a list of token ids, got {x}")
        return x
    ids = _int_list(x, where, "tokens", 0, TOKEN_ID_LIMIT)
    if not ids:
        raise ScheduleError(f"{where}: field 'tokens' must not be an empty list")
    return ids


def _op_json(op: Op) -> dict:
    out: dict = {"op": op.op}
    for name, value in op.__dict__.items():
        if value is None:
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


# ================================================================ symbolic replay


@dataclass(frozen=True)
class _Limits:
    """What :meth:`Schedule.check_fits` checks each op against (None: no limit); names for the messages."""

    max_tree_tokens: int | None = None
    max_position: int | None = None
    vocab_size: int | None = None
    tokens_limit: str = "max_tree_tokens"
    position_limit: str = "max_position"


class _Shape:
    """The tree as handles only: enough to check every op and size the run."""

    def __init__(self, limits: _Limits):
        self.limits = limits
        self.parent: dict[Handle, Handle | None] = {}
        # children and roots are insertion-ordered dicts (as sets): removing one is O(1)
        self.children: dict[Handle, dict[Handle, None]] = {}
        self.length: dict[Handle, int] = {}
        self.end: dict[Handle, int] = {}           # sequence length up to the end of the node
        self.in_token_tree: set[Handle] = set()
        self.used: dict[Handle, str] = {}          # every handle ever created -> where
        self.roots: dict[Handle, None] = {}
        self.tokens = 0
        self.peak_tokens = 0
        self.max_position = -1

    def alive(self, h: Handle, where: str, name: str) -> None:
        if h not in self.parent:
            if h in self.used:
                raise ScheduleError(f"{where}: field '{name}' names node {h!r}, which was pruned "
                                    f"(created at {self.used[h]})")
            raise ScheduleError(f"{where}: field '{name}' names unknown node {h!r} (never created)")

    def create(self, h: Handle, parent: Handle | None, length: int, where: str, name: str) -> None:
        if h in self.used:
            raise ScheduleError(f"{where}: field '{name}' reuses node handle {h!r} (created at {self.used[h]}); "
                                f"handles are never reused")
        self.used[h] = where.split(" (")[0]
        self.parent[h] = parent
        self.children[h] = {}
        self.length[h] = 0
        self.end[h] = 0 if parent is None else self.end[parent]
        if parent is None:
            self.roots[h] = None
        else:
            self.children[parent][h] = None
        self.grow(h, length, where)

    def grow(self, h: Handle, n: int, where: str) -> None:
        self.length[h] += n
        self.end[h] += n
        self.tokens += n
        self.peak_tokens = max(self.peak_tokens, self.tokens)
        self.max_position = max(self.max_position, self.end[h] - 1)
        limits = self.limits
        if limits.max_tree_tokens is not None and self.tokens > limits.max_tree_tokens:
            raise ScheduleError(f"{where}: node {h!r} grows the tree to {self.tokens} tokens, more than "
                                f"{limits.tokens_limit} = {limits.max_tree_tokens}")
        if limits.max_position is not None and self.end[h] > limits.max_position:
            raise ScheduleError(f"{where}: node {h!r} reaches position {self.end[h] - 1} (sequence length "
                                f"{self.end[h]}), past {limits.position_limit} = {limits.max_position}")

    def remove(self, h: Handle) -> None:
        stack = [h]
        parent = self.parent[h]
        if parent is None:
            del self.roots[h]
        else:
            del self.children[parent][h]
        while stack:
            x = stack.pop()
            stack.extend(self.children.pop(x))
            self.tokens -= self.length.pop(x)
            del self.parent[x], self.end[x]
            self.in_token_tree.discard(x)


def _check(steps: tuple[tuple[Op, ...], ...], source: str, limits: _Limits = _Limits()) -> ScheduleStats:
    shape = _Shape(limits)
    forward_steps = 0
    max_token_id = -1
    widest_branch = 0
    for i, step in enumerate(steps):
        adds = False
        for j, op in enumerate(step):
            where = f"{source}: step {i}, op {j} ({op.op})"
            if isinstance(op, _MUST_COME_FIRST) and adds:
                raise ScheduleError(f"{where}: field 'op': a '{op.op}' op must come before the step's extend and "
                                    f"token_tree ops (they add the step's pending tokens)")
            if isinstance(op, (Prompt, Extend, TokenTree)) and op.tokens is not None and not isinstance(op.tokens, int):
                top = max(op.tokens, default=-1)
                max_token_id = max(max_token_id, top)
                if limits.vocab_size is not None and top >= limits.vocab_size:
                    k = op.tokens.index(top)
                    raise ScheduleError(f"{where}: field 'tokens[{k}]' = {top} is outside the model's vocabulary "
                                        f"of {limits.vocab_size}")
            _apply(shape, op, where)
            if isinstance(op, Branch):
                widest_branch = max(widest_branch, len(op.ids))
            adds = adds or isinstance(op, _ADDS_PENDING)
        forward_steps += adds
    return ScheduleStats(forward_steps=forward_steps, max_position=shape.max_position,
                         peak_tree_tokens=shape.peak_tokens, max_token_id=max_token_id,
                         live_roots=tuple(shape.roots), widest_branch=widest_branch)


def _apply(shape: _Shape, op: Op, where: str) -> None:
    if isinstance(op, (Prompt, Extend)) and token_count(op.tokens) < 1:
        raise ScheduleError(f"{where}: field 'tokens' must be a count >= 1 or a non-empty list, got {op.tokens!r:.60}")
    if isinstance(op, Prompt):
        if op.parent is not None:
            shape.alive(op.parent, where, "parent")
        shape.create(op.id, op.parent, token_count(op.tokens), where, "id")
    elif isinstance(op, Branch):
        shape.alive(op.node, where, "node")
        if len(set(op.ids)) != len(op.ids):
            raise ScheduleError(f"{where}: field 'ids' lists a handle twice: {list(op.ids)!r:.80}")
        for k, h in enumerate(op.ids):
            shape.create(h, op.node, 0, where, f"ids[{k}]")
    elif isinstance(op, Extend):
        shape.alive(op.node, where, "node")
        if shape.children[op.node]:
            raise ScheduleError(f"{where}: field 'node': node {op.node!r} has children "
                                f"{list(shape.children[op.node])[:5]!r}; only leaves are extended")
        shape.grow(op.node, token_count(op.tokens), where)
    elif isinstance(op, TokenTree):
        _apply_token_tree(shape, op, where)
    elif isinstance(op, Accept):
        _apply_accept(shape, op, where)
    elif isinstance(op, Prune):
        shape.alive(op.node, where, "node")
        shape.remove(op.node)
    else:  # _parse_op and the dataclasses admit nothing else
        raise AssertionError(f"unknown op {op!r}")


def _apply_token_tree(shape: _Shape, op: TokenTree, where: str) -> None:
    shape.alive(op.node, where, "node")
    m = len(op.parents)
    if m == 0 or len(op.ids) != m:
        raise ScheduleError(f"{where}: field 'ids' must have one handle per token: {len(op.ids)} ids for "
                            f"{m} parents")
    if op.tokens is not None and len(op.tokens) != m:
        raise ScheduleError(f"{where}: field 'tokens' must have one id per token: {len(op.tokens)} for {m} parents")
    if len(set(op.ids)) != m:
        raise ScheduleError(f"{where}: field 'ids' lists a handle twice")
    for k, p in enumerate(op.parents):
        if not -1 <= p < m:
            raise ScheduleError(f"{where}: field 'parents[{k}]' = {p} is not a token index in [-1, {m})")
        if p >= k:
            kind = "a cycle" if _on_cycle(op.parents, k) else "a forward reference"
            raise ScheduleError(f"{where}: field 'parents[{k}]' = {p}: parents must come before their "
                                f"children ({kind})")
    for k, (h, p) in enumerate(zip(op.ids, op.parents)):
        shape.create(h, op.node if p < 0 else op.ids[p], 1, where, f"ids[{k}]")
        shape.in_token_tree.add(h)


def _apply_accept(shape: _Shape, op: Accept, where: str) -> None:
    for k, h in enumerate(op.ids):
        shape.alive(h, where, f"ids[{k}]")
        if h not in shape.in_token_tree:
            raise ScheduleError(f"{where}: field 'ids[{k}]': node {h!r} is not a token-tree node")
        if k and shape.parent[h] != op.ids[k - 1]:
            raise ScheduleError(f"{where}: field 'ids[{k}]': node {h!r} is not a child of ids[{k - 1}] = "
                                f"{op.ids[k - 1]!r}; the accepted ids must be a root-to-leaf chain")
    anchor = shape.parent[op.ids[0]]
    if anchor in shape.in_token_tree:
        raise ScheduleError(f"{where}: field 'ids[0]': node {op.ids[0]!r} is not a root of its token tree "
                            f"(its parent {anchor!r} is a token-tree node too)")
    others = [c for c in shape.children[anchor] if c not in shape.in_token_tree]
    if others:
        raise ScheduleError(f"{where}: field 'ids': the anchor {anchor!r} also has non-token-tree child(ren) "
                            f"{others[:5]!r}, which accept would remove; prune them first")
    for child in list(shape.children[anchor]):
        shape.remove(child)
    shape.grow(anchor, len(op.ids), where)


def _on_cycle(parents: tuple[int, ...], start: int) -> bool:
    seen = set()
    i = start
    while 0 <= i < len(parents) and i not in seen:
        seen.add(i)
        i = parents[i]
    return i == start
