"""ScheduleRecorder: writes any engine run as a replay schedule.

    recorder = ScheduleRecorder(engine, name="my-search", token_ids=True)
    ... engine.prefill(...), tree edits, engine.step(), run_programs(engine, programs) (any controller)
    recorder.close().save("my-search.json")      # treedec replay my-search.json

It observes the engine from outside: until :meth:`close` it wraps ``engine.prefill``,
``engine.step``, the edits of ``engine.tree`` and ``engine.pool.copy_slots`` (on those objects,
not their classes: an engine without a recorder runs its own methods, at no cost) and writes
each edit, in the order it ran, as the op that makes it again:

- ``engine.prefill`` -> ``prompt`` (prefilled: its own forwards);
- ``tree.add_prompt`` (a scheduler's prompt, computed by the next step with the other
  requests' tokens) -> ``prompt`` with ``pending``; its later chunks -> ``extend``;
- ``branch`` -> ``branch`` and an ``extend`` per child given tokens (``branch_many``: one each); ``extend``,
  ``extend_many``, ``append_tokens`` -> ``extend``; ``add_token_tree`` -> ``token_tree`` (``add_token_trees``: one
  each); ``add_children`` -> ``children``; ``truncate`` -> ``truncate`` (``truncate_many``: one each); ``prune`` ->
  ``prune``; ``prune_many`` -> a ``prune`` each;
- ``accept`` -> ``accept`` of a chain of token-tree nodes (made by ``add_token_tree`` or
  ``add_children``); a chain of other nodes -> ``prune`` of the anchor's children and an
  ``extend`` of the anchor by the chain's tokens, which end the step (the replay computes
  them again: same tree, one forward more);
- ``extend_computed`` (or ``extend_computed_many``: several nodes' reservations) and the ``engine.pool.copy_slots``
  that fills the slots it reserved with the K/V of a token tree's root and accepted path (a pipelined speculative
  step, :mod:`treedec.programs.speculative.verify_table`) -> ``accept`` of that chain, in place of the token
  tree's ``prune``; ``advance_token_trees`` (the verify group's trees kept from step to step) -> that accept, then a
  ``token_tree`` of fresh handles (:mod:`treedec.replay.pipelined_accepts`). The reserved slots past the path (masked
  by the step, cut by a later ``truncate``) are not in the schedule: its tree is the one the unpipelined loop grows.

Each ``engine.step`` ends a step (its pending tokens are the ops' since the last one); a
prefill ends a step of its own; :meth:`close` writes the edits after the last step as a
last step. Edits made inside a recorded call (a prefill's steps, ``extend`` through
``extend_many``) are part of it. Node ids are the handles (the tree never reuses one), but for a token tree that
``advance_token_trees`` hung again with the same ids: ``"<id>.<k>"`` after its ``k``-th (:meth:`handle`).
``pause``, ``resume``, ``set_tokens``, ``set_tokens_many`` and ``set_last_tokens`` are not recorded: a schedule
names every node it grows, and a placeholder's real id is read from the step that computed it (below).

Tokens are recorded as counts by default (the shape: a replay's model chooses them). With
``token_ids`` every token is recorded by its id, so a replay rebuilds the same tree token by
token whatever chose them (sampling, beams, draft sources): the id of a pending token is
the one its step computed (``engine.step(tokens=...)``'s device ids where a pipelined program
left placeholders in the tree). With ``prompt_ids`` every token is recorded by its id but
those appended one at a time to a leaf (decoding), which stay counts, the replay's greedy
choices: a greedy program's replay then chooses the same tokens again.

What no op can say raises :class:`~treedec.errors.RecordingError` before the call runs (it
changes nothing): a ``copy_slots`` that is not a reservation's accept, a call other than that
copy (or another reservation) right after ``extend_computed``, and an edit that grows a node past reserved slots not
cut yet (``add_token_tree`` under it excepted: the pipelined step masks them).
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator

import numpy as np
import torch

from treedec.engine import Engine
from treedec.errors import RecordingError, TreeError
from treedec.replay.pipelined_accepts import RESERVING, PipelinedAccepts
from treedec.workloads.schedule import (Accept, Branch, Children, Extend, Handle, Op, Prompt, Prune, Schedule,
                                        TokenTree, Truncate)

#: The tree's edits that a recorder wraps (the others change nothing a replay needs).
TREE_EDITS = ("add_prompt", "extend", "extend_many", "append_tokens", "branch", "branch_many", "add_token_tree",
              "add_token_trees", "add_children", "accept", "truncate", "truncate_many", "prune", "prune_many",
              "extend_computed", "extend_computed_many", "advance_token_trees")

#: Each edit's arguments naming the nodes it grows (an edit may not grow a node holding reserved slots).
_GROWN = {"extend": "node_id", "extend_many": "tokens_by_node", "append_tokens": "node_ids", "branch": "node_id",
          "branch_many": "node_ids", "add_children": "node_ids",
          "accept": "anchor", "extend_computed": "node_id", "extend_computed_many": "node_ids"}


class _Recorded:
    """A recorded method: an instance attribute of the engine, its tree or its pool until the recorder closes."""

    __slots__ = ("call",)

    def __init__(self, call):
        self.call = call

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


class ScheduleRecorder(PipelinedAccepts):
    """Records ``engine``'s run until :meth:`close`, which returns the :class:`Schedule`.

    Parameters
    ----------
    engine : Engine
        The engine to record; its tree must be empty and no other recorder may be recording it.
        Its ``prefill`` and ``step``, its tree's edits and its pool's ``copy_slots`` are wrapped
        until ``close``.
    name : str
        The schedule's name.
    prompt_ids : bool
        Record every token by its id but decoded ones (appended one at a time to a leaf), which
        stay counts (default: every token as a count).
    token_ids : bool
        Record every token by its id.

    Raises
    ------
    TypeError, ValueError
        A bad argument, or a tree that is not empty.
    RecordingError
        Another recorder records ``engine`` (close it first).
    """

    def __init__(self, engine: Engine, name: str = "recorded", prompt_ids: bool = False, token_ids: bool = False):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {type(name).__name__}")
        for flag, value in (("prompt_ids", prompt_ids), ("token_ids", token_ids)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        targets = _targets(engine)
        held = next((f"{label}.{method}" for label, obj, method in targets
                     if isinstance(vars(obj).get(method), _Recorded)), None)
        if held is not None:
            raise RecordingError(f"engine is already recorded by another ScheduleRecorder ({held} is its wrapper); "
                                 f"close that one first")
        if engine.tree.num_nodes:
            raise ValueError(f"start the recorder on an empty tree; this one has {engine.tree.num_nodes} node(s)")
        self.engine, self.tree, self.name = engine, engine.tree, name
        self.token_ids = token_ids
        self.prompt_ids = prompt_ids or token_ids
        self._steps: list[tuple[Op, ...]] = []
        self._ops: list[Op] = []                               # the step being recorded
        self._ids_of: dict[int, list[tuple[int, int]]] = {}    # op index -> (node, token index) of its ids
        self._token_tree: set[int] = set()                     # nodes made by add_token_tree / add_children
        self._drafts: dict[int, tuple[int, int]] = {}          # first slot -> (token-tree node, parent)
        self._reservation: list[tuple[int, list[int]]] | None = None   # extend_computed's (node, slots) to fill
        self._hangs: dict[int, int] = {}                       # node -> its token tree's re-hangs (its handle)
        self._retired: dict[int, Handle] = {}                  # a kept tree's node -> its handle until the copy
        self._rehung: dict[int, tuple[Op, list | None]] = {}   # leaf -> its kept tree's op, after its accept
        self._reserved: dict[int, int] = {}                    # node -> its last tokens not in the schedule
        self._prompts: set[int] = set()                        # prompt nodes whose next extend may be a chunk
        self._depth = 0                                        # inside a recorded call
        self._installed: list[tuple[object, str, str, object, _Recorded]] = []
        befores = {"accept": self._before_accept, "truncate": self._before_truncate,
                   "truncate_many": self._before_truncate_many,
                   "advance_token_trees": self._before_advance_token_trees}
        for label, obj, method in targets:
            if obj is engine:
                record, before = (self._prefilled, None) if method == "prefill" else (self._stepped, self._before_step)
            elif obj is engine.pool:
                record, before = self._copied, self._before_copy
            else:
                record, before = getattr(self, f"_{method}"), befores.get(method)
            self._install(obj, label, method, record, before)

    def close(self) -> Schedule:
        """Stop recording (the wrapped methods are restored) and return the validated schedule; the
        edits after the last step form a last step.

        Raises
        ------
        RecordingError
            A recorded method was wrapped again after the recorder started (nothing is restored:
            remove that wrapper, then close), or the run ended between ``extend_computed`` and the
            copy into its slots (the methods are restored).
        """
        if self._installed:
            replaced = [f"{label}.{method}" for obj, label, method, _, mine in self._installed
                        if vars(obj).get(method) is not mine]
            if replaced:
                raise RecordingError(f"{', '.join(replaced)} was replaced after the recorder started; remove that "
                                     f"wrapper first, then close the recorder (which restores the methods)")
            for obj, _, method, saved, _ in reversed(self._installed):
                if saved is None:
                    delattr(obj, method)
                else:
                    setattr(obj, method, saved)
            self._installed = []
        if self._reservation is not None:
            node, slots = self._reservation[0]
            raise RecordingError(f"the run ended after tree.extend_computed reserved {len(slots)} slot(s) on node "
                                 f"{node}, before engine.pool.copy_slots filled them: no schedule op says where their "
                                 f"K/V came from")
        if self._ops:
            self._end_step()
        return Schedule.from_steps(self._steps, name=self.name, source="ScheduleRecorder",
                                   meta={"recorded_steps": len(self._steps)})

    # ================================================================ wrapping

    def _install(self, obj, label: str, name: str, record, before=None) -> None:
        """Wrap ``obj.name``: call it, then ``record(result, arguments, state)``, ``state`` being what
        ``before(arguments)`` returned before the call (calls made inside a recorded one pass through)."""
        original = getattr(obj, name)   # the method, or what wraps it already
        signature = inspect.signature(getattr(type(obj), name))   # the method's own parameters (self first)
        grown = _GROWN.get(name) if obj is self.tree else None

        def recorded(*args, **kwargs):
            if self._depth:
                return original(*args, **kwargs)
            try:
                bound = signature.bind(obj, *args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)   # raises the method's own error
            bound.apply_defaults()
            if self._reservation is not None and name not in RESERVING:
                node, slots = self._reservation[0]
                raise RecordingError(f"{label}.{name} called between tree.extend_computed (node {node}, {len(slots)} "
                                     f"slot(s)) and the engine.pool.copy_slots that fills them: the recorder writes "
                                     f"the two as one accept")
            if grown is not None and self._reserved:
                self._refuse_reserved(label, name, bound.arguments[grown])
            self._depth += 1
            try:
                state = before(bound.arguments) if before is not None else None
                result = original(*bound.args[1:], **bound.kwargs)
            finally:
                self._depth -= 1
            record(result, bound.arguments, state)
            return result

        wrapper = _Recorded(recorded)
        self._installed.append((obj, label, name, vars(obj).get(name), wrapper))
        setattr(obj, name, wrapper)

    def _refuse_reserved(self, label: str, name: str, nodes) -> None:
        """Raise if the edit grows a node that holds reserved slots not in the schedule (their positions
        would be the schedule's next tokens')."""
        if isinstance(nodes, (int, np.integer)):
            nodes = [nodes]
        try:
            held = next((n for n in nodes if self._reserved.get(n)), None)
        except TypeError:
            return   # not nodes: the edit raises its own error
        if held is not None:
            raise RecordingError(f"{label}.{name} grows node {held}, which holds {self._reserved[held]} reserved "
                                 f"slot(s) past its accepted path (tree.extend_computed); truncate them first")

    # ================================================================ engine calls

    def _prefilled(self, result, arguments, _) -> None:
        node = result.node
        tokens = self.tree.tokens(node)
        parent = arguments["parent"]
        self._ops.append(Prompt(node, tuple(tokens) if self.prompt_ids else len(tokens),
                                None if parent is None else self.handle(int(parent))))
        self._end_step()

    def _before_step(self, arguments) -> dict | None:
        """The ids the step computes by (node, token index), where it reads them on the device (the tree
        may hold placeholders for them) and the recorder wants them."""
        tokens = arguments["tokens"]
        if not isinstance(tokens, torch.Tensor) or not self._ids_of:   # (a bad one: the step raises)
            return None
        layout = self.tree.layout()
        at = list(zip(layout.node_ids[layout.query_node].tolist(), layout.query_offset.tolist()))
        ids = tokens.reshape(-1).tolist()   # a device read: the step's tokens are ready first
        rows = arguments.get("token_rows")
        if rows is None:   # an id for every pending token
            return dict(zip(at, ids))
        # ``tokens``' first ids are those of the query rows ``token_rows`` (the others' ids: the tree's)
        return {at[r]: ids[i] for i, r in enumerate(np.asarray(rows, dtype=np.int64).reshape(-1).tolist())}

    def _stepped(self, result, arguments, computed) -> None:
        self._end_step(computed)

    def _end_step(self, computed: dict | None = None) -> None:
        """Give the step's ops their token ids (``computed``: those the step read on the device, by (node,
        token index); the others from the tree) and close the step."""
        if self._ids_of:
            computed = computed or {}
            held: dict[int, list[int]] = {}
            for i, where in self._ids_of.items():
                ids = tuple(computed[(n, k)] if (n, k) in computed
                            else held.setdefault(n, self.tree.tokens(n))[k] for n, k in where)
                self._ops[i] = dataclasses.replace(self._ops[i], tokens=ids)
            self._ids_of.clear()
        self._steps.append(tuple(self._ops))
        self._ops.clear()
        tree = self.tree
        # Pruned nodes are named no more (a pipelined step's accept names those pruned since the last step).
        self._drafts = {slot: draft for slot, draft in self._drafts.items() if draft[0] in tree}
        self._reserved = {n: k for n, k in self._reserved.items() if n in tree}
        self._hangs = {n: k for n, k in self._hangs.items() if n in tree}

    # ================================================================ tree edits

    def _add(self, op: Op, where: list[tuple[int, int]] | None = None) -> None:
        """Append ``op``; with ``where``, its tokens are the ids there, read when the step ends."""
        if where is not None:
            self._ids_of[len(self._ops)] = where
        self._ops.append(op)

    def _grow(self, node: int, count: int, by_id: bool) -> None:
        """An ``extend`` of ``node`` by its last ``count`` tokens."""
        if count:
            length = len(self.tree.tokens(node))
            self._add(Extend(self.handle(node), count),
                      [(node, k) for k in range(length - count, length)] if by_id else None)

    def _note_prompt(self, node: int, count: int) -> None:
        """A prompt's node: its next extend is a chunk of the prompt when this one was a whole chunk."""
        if count == self.engine.prefill_chunk:
            self._prompts.add(node)
        else:
            self._prompts.discard(node)

    def _add_prompt(self, node, arguments, _) -> None:
        n = len(self.tree.tokens(node))
        self._add(Prompt(node, n, pending=True), [(node, k) for k in range(n)] if self.prompt_ids else None)
        self._note_prompt(node, n)

    def _extend(self, slots, arguments, _) -> None:
        self._extended(int(arguments["node_id"]), len(slots))

    def _extend_many(self, slots_by_node, arguments, _) -> None:
        for node, slots in slots_by_node.items():
            self._extended(int(node), len(slots))

    def _append_tokens(self, slots, arguments, _) -> None:   # (one token to each node: the lanes' decode step)
        for node in np.asarray(arguments["node_ids"]).reshape(-1).tolist():
            self._extended(int(node), 1)

    def _extended(self, node: int, count: int) -> None:
        chunk = node in self._prompts
        self._grow(node, count, self.token_ids or (self.prompt_ids and (count > 1 or chunk)))
        if chunk:
            self._note_prompt(node, count)

    def _branch(self, ids, arguments, _) -> None:
        self._add(Branch(self.handle(int(arguments["node_id"])), tuple(ids)))
        for child in ids:
            n = len(self.tree.tokens(child))
            self._grow(child, n, self.prompt_ids)
            if n:
                self._note_prompt(child, n)   # a prompt continued under the node (or a branch's first token)

    def _branch_many(self, ids, arguments, _) -> None:   # (a branch of each node, in order)
        for parent, child in zip(np.asarray(arguments["node_ids"]).reshape(-1).tolist(), ids.tolist()):
            self._branch([child], {"node_id": parent}, None)

    def _add_token_tree(self, ids, arguments, _) -> None:
        anchor, index = int(arguments["node_id"]), {node: i for i, node in enumerate(ids)}
        parents = tuple(-1 if p == anchor else index[p] for p in map(self.tree.parent, ids))
        self._add(TokenTree(self.handle(anchor), parents, tuple(ids)),
                  [(n, 0) for n in ids] if self.prompt_ids else None)
        self._note_drafts(ids)

    def _add_token_trees(self, ids, arguments, _) -> None:
        for anchor, row in zip(np.asarray(arguments["node_ids"]).reshape(-1).tolist(), ids.tolist()):
            self._add_token_tree(row, {"node_id": anchor}, None)   # (one token tree each, in order)

    def _add_children(self, ids, arguments, _) -> None:
        self._add(Children(tuple(self.handle(self.tree.parent(n)) for n in ids), tuple(ids)),
                  [(n, 0) for n in ids] if self.prompt_ids else None)
        self._note_drafts(ids)

    def _note_drafts(self, ids: list[int]) -> None:
        """Token-tree nodes: an accept keeps a chain of them, and a pipelined step's copy names them by slot."""
        self._token_tree.update(ids)
        tree = self.tree
        self._drafts.update(zip(tree.first_slots(ids).tolist(), ((n, tree.parent(n)) for n in ids)))

    def _before_accept(self, arguments) -> list[int] | None:
        """The anchor's children before the accept (None for a bad anchor: the accept raises)."""
        if isinstance(arguments["path"], Iterator):   # read once here, once by the accept
            arguments["path"] = list(arguments["path"])
        try:
            return self.tree.children(arguments["anchor"])
        except (TreeError, TypeError):
            return None

    def _accept(self, slots, arguments, children: list[int]) -> None:
        anchor, chain = int(arguments["anchor"]), [int(n) for n in arguments["path"]]
        drafts = self._token_tree
        if chain and anchor not in drafts and all(n in drafts for n in chain + children):
            self._add(Accept(tuple(map(self.handle, chain))))
            return
        # Not a token tree's path: the anchor's children go, its new tokens are computed again.
        for child in children:
            self._add(Prune(self.handle(child)))
        tokens = self.tree.tokens(anchor)[-len(slots):] if len(slots) else []
        if tokens:
            self._add(Extend(self.handle(anchor), tuple(tokens) if self.prompt_ids else len(tokens)))
            self._end_step()

    def _before_truncate(self, arguments) -> int | None:
        """The node's length before (None for a bad node: the truncate raises)."""
        try:
            return self.tree.node_length(arguments["node_id"])
        except (TreeError, TypeError):
            return None

    def _truncate(self, freed, arguments, length_before: int) -> None:
        node, length = int(arguments["node_id"]), int(arguments["length"])
        scheduled = length_before - self._reserved.pop(node, 0)   # the node's length in the schedule
        if length < scheduled:
            self._add(Truncate(self.handle(node), length))
        elif length > scheduled:   # only reserved slots were cut, of which these are left
            self._reserved[node] = length - scheduled
        self._prompts.discard(node)

    def _before_truncate_many(self, arguments) -> list[int | None]:
        try:
            nodes = np.asarray(arguments["node_ids"]).reshape(-1).tolist()
        except (TypeError, ValueError):
            return []
        return [self._before_truncate({"node_id": n}) for n in nodes]

    def _truncate_many(self, freed, arguments, lengths_before: list[int]) -> None:
        nodes = np.asarray(arguments["node_ids"]).reshape(-1).tolist()
        lengths = np.asarray(arguments["lengths"]).reshape(-1).tolist()
        for node, length, before in zip(nodes, lengths, lengths_before):   # (a truncate each, in order)
            self._truncate(None, {"node_id": node, "length": length}, before)

    def _prune(self, freed, arguments, _) -> None:
        self._add(Prune(self.handle(int(arguments["node_id"]))))

    def _prune_many(self, freed, arguments, _) -> None:
        for node in np.asarray(arguments["node_ids"]).reshape(-1).tolist():
            self._add(Prune(self.handle(int(node))))


def _targets(engine: Engine) -> list[tuple[str, object, str]]:
    """The methods a recorder wraps: (how errors name the object, the object, the method)."""
    return ([("engine", engine, "prefill"), ("engine", engine, "step")]
            + [("tree", engine.tree, edit) for edit in TREE_EDITS] + [("engine.pool", engine.pool, "copy_slots")])
