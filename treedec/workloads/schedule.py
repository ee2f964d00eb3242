"""Replay schedules: a decoding tree's history as JSON steps of tree operations on node handles.

A schedule forces the *shape* of a decoding run (which node branches, grows, is verified,
is pruned, at which step); the tokens are whatever the model emits, unless an op gives their
ids (a recorded run can give them all: :class:`~treedec.replay.ScheduleRecorder`). The shipped
workloads are turned into schedules by :mod:`treedec.workloads.builders`; users can write their own.
This module holds the schedule document (:class:`Schedule`, :func:`load_schedule`); its ops
are defined in :mod:`treedec.workloads.schedule_ops` and checked in sequence by the symbolic
replay of :mod:`treedec.workloads.schedule_check` (their public names import from here too).

File format (version 1)::

    {"format": "treedec-schedule", "version": 1, "name": "...", "source": "...",
     "steps": [[op, op, ...], ...]}

A step applies its ops in order, then runs **one forward** over the tokens they added (a
step that adds none runs no forward). Node handles are JSON strings or ints chosen by the
schedule; each names one node for its lifetime and is never reused after it is pruned.

``{"op": "prompt", "id": H, "tokens": n | [ids], "parent": H, "pending": true}``
    Prefill a new prompt of ``n`` tokens (ids drawn from a seeded RNG) or of the given
    ids. Without ``parent`` it starts a new tree of the forest; with it, the prompt is a
    continuation under node ``parent``. The prefill runs its own forward(s) at once;
    with ``"pending": true`` the tokens are computed by the step's forward instead, with
    the step's other tokens (as a scheduler computes a prompt chunk beside other
    requests' decoding; later chunks are ``extend`` ops).
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
``{"op": "children", "nodes": [H, ...], "ids": [H, ...], "tokens": [ids]}``
    Give each node ``nodes[i]`` a new one-token child ``ids[i]`` (a node may be named
    several times), packed into shared pages as a token tree's tokens are: one layer of a
    draft tree whose nodes have different parents. Without ``tokens``, each token is the
    model's next token for its parent. The children are token-tree nodes (``accept``
    keeps a chain of them).
``{"op": "accept", "ids": [H, ...]}``
    Keep the accepted path of a verified token tree: ``ids`` is a chain of token-tree
    nodes from a child of the anchor (the node the tree hangs under) downwards. The
    anchor's token-tree children are all removed and the chain's tokens (their K/V
    included, no recompute) are appended to the anchor, which continues the sequence.
``{"op": "truncate", "node": H, "length": n}``
    Keep the first ``n`` (>= 1) of leaf ``node``'s own tokens, freeing the pages only the
    rest held (e.g. a pipelined step run past an end of sequence).
``{"op": "prune", "node": H}``
    Remove ``node`` and its subtree, freeing the KV pages no other node uses.

The tokens that ``extend``, ``token_tree``, ``children`` and pending ``prompt`` ops add are
the step's *pending* tokens, computed by its forward. A prefilled ``prompt`` (which runs its
own forward over a tree without pending tokens) comes before them; a ``prune``, ``accept``
or ``truncate`` may come anywhere in the step but may not remove or change them.

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

from treedec.checks import positive_int
from treedec.workloads.deft import TraceFormatError, load_json
from treedec.workloads.schedule_check import FitLimits, ScheduleStats, check_schedule
from treedec.workloads.schedule_ops import (OPS, TOKEN_ID_LIMIT, Accept, Branch, Children, Extend, Handle, Op, Prompt,
                                            Prune, ScheduleError, TokenTree, Truncate, op_json, parse_op, token_count)

__all__ = ["DEFAULT_MAX_TREE_TOKENS", "FORMAT", "OPS", "TOKEN_ID_LIMIT", "VERSION", "Accept", "Branch", "Children",
           "Extend", "Handle", "Op", "Prompt", "Prune", "Schedule", "ScheduleError", "ScheduleStats", "TokenTree",
           "Truncate", "load_schedule", "token_count"]

FORMAT = "treedec-schedule"
VERSION = 1

#: Default cap on the tokens a schedule's tree may hold at once, where no KV pool size is given
#: (the DeFT workloads peak below 30k; a replay can raise it with an explicit pool size).
DEFAULT_MAX_TREE_TOKENS = 1 << 20


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
        stats = check_schedule(steps, source)
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
            steps.append(tuple(parse_op(op, f"{source}: step {i}, op {j}") for j, op in enumerate(raw)))
        return cls.from_steps(steps, name=name, source=source, meta=meta)

    def to_json(self) -> dict:
        """The JSON document of this schedule (``from_json(s.to_json())`` gives it back)."""
        return {"format": FORMAT, "version": VERSION, "name": self.name, "source": self.source,
                "meta": self.meta, "steps": [[op_json(op) for op in step] for step in self.steps]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")

    def truncated(self, num_steps: int) -> "Schedule":
        """The first ``num_steps`` steps, plus a last step pruning every prompt still alive."""
        positive_int("num_steps", num_steps)
        if num_steps >= len(self.steps):
            return self
        head = self.steps[:num_steps]
        roots = check_schedule(head, self.source).live_roots
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
            if value is not None:
                positive_int(name, value, note=" or None")
        check_schedule(self.steps, self.source, FitLimits(max_tree_tokens, max_position, vocab_size, tokens_limit,
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
        return Schedule.from_json(load_json(path), source=str(path))
    except TraceFormatError as e:
        if isinstance(e, ScheduleError):
            raise
        raise ScheduleError(str(e)) from None
