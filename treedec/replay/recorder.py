"""ScheduleRecorder: writes any engine run as a replay schedule.

    recorder = ScheduleRecorder(engine, name="my-search", token_ids=True)
    ... engine.prefill(...), tree edits, engine.step(), run_programs(engine, programs) (any controller)
    recorder.close().save("my-search.json")      # treedec replay my-search.json

It observes the engine from outside: until :meth:`close` it wraps ``engine.prefill`` and
``engine.step`` and the edits of ``engine.tree`` (on those two objects, not their classes)
and writes each edit, in the order it ran, as the op that makes it again:

- ``engine.prefill`` -> ``prompt`` (prefilled: its own forwards);
- ``tree.add_prompt`` (a scheduler's prompt, computed by the next step with the other
  requests' tokens) -> ``prompt`` with ``pending``; its later chunks -> ``extend``;
- ``branch`` -> ``branch`` and an ``extend`` per child given tokens; ``extend``,
  ``extend_many`` -> ``extend``; ``add_token_tree`` -> ``token_tree``; ``add_children`` ->
  ``children``; ``truncate`` -> ``truncate``; ``prune`` -> ``prune``;
- ``accept`` -> ``accept`` of a chain of token-tree nodes (made by ``add_token_tree`` or
  ``add_children``); a chain of other nodes -> ``prune`` of the anchor's children and an
  ``extend`` of the anchor by the chain's tokens, which end the step (the replay computes
  them again: same tree, one forward more).

Each ``engine.step`` ends a step (its pending tokens are the ops' since the last one); a
prefill ends a step of its own; :meth:`close` writes the edits after the last step as a
last step. Edits made inside a recorded call (a prefill's steps, ``extend`` through
``extend_many``) are part of it. Node ids are the handles (the tree never reuses one).
``pause``, ``resume`` and ``set_tokens`` are not recorded: a schedule names every node it
grows, and a placeholder's real id is read from the step that computed it (below).

Tokens are recorded as counts by default (the shape: a replay's model chooses them). With
``token_ids`` every token is recorded by its id, so a replay rebuilds the same tree token by
token whatever chose them (sampling, beams, draft sources): the id of a pending token is
the one its step computed (``engine.step(tokens=...)``'s device ids where a pipelined program
left placeholders in the tree). With ``prompt_ids`` every token is recorded by its id but
those appended one at a time to a leaf (decoding), which stay counts, the replay's greedy
choices: a greedy program's replay then chooses the same tokens again.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator

import torch

from treedec.engine import Engine
from treedec.errors import TreeError
from treedec.workloads.schedule import (Accept, Branch, Children, Extend, Op, Prompt, Prune, Schedule, TokenTree,
                                        Truncate)

#: The tree's edits that a recorder wraps (the others change nothing a replay needs).
TREE_EDITS = ("add_prompt", "extend", "extend_many", "branch", "add_token_tree", "add_children", "accept", "truncate",
              "prune")


class ScheduleRecorder:
    """Records ``engine``'s run until :meth:`close`, which returns the :class:`Schedule`.

    Parameters
    ----------
    engine : Engine
        The engine to record; its tree must be empty. Its ``prefill`` and ``step`` and its tree's
        edits are wrapped until ``close``.
    name : str
        The schedule's name.
    prompt_ids : bool
        Record every token by its id but decoded ones (appended one at a time to a leaf), which
        stay counts (default: every token as a count).
    token_ids : bool
        Record every token by its id.
    """

    def __init__(self, engine: Engine, name: str = "recorded", prompt_ids: bool = False, token_ids: bool = False):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {type(name).__name__}")
        for flag, value in (("prompt_ids", prompt_ids), ("token_ids", token_ids)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        if engine.tree.num_nodes:
            raise ValueError(f"start the recorder on an empty tree; this one has {engine.tree.num_nodes} node(s)")
        self.engine, self.tree, self.name = engine, engine.tree, name
        self.token_ids = token_ids
        self.prompt_ids = prompt_ids or token_ids
        self._steps: list[tuple[Op, ...]] = []
        self._ops: list[Op] = []                               # the step being recorded
        self._ids_of: dict[int, list[tuple[int, int]]] = {}    # op index -> (node, token index) of its ids
        self._token_tree: set[int] = set()                     # nodes made by add_token_tree / add_children
        self._prompts: set[int] = set()                        # prompt nodes whose next extend may be a chunk
        self._depth = 0                                        # inside a recorded call
        self._installed: list[tuple[object, str, object]] = []
        self._install(engine, "prefill", self._prefilled)
        self._install(engine, "step", self._stepped, before=self._before_step)
        for edit in TREE_EDITS:
            self._install(self.tree, edit, getattr(self, f"_{edit}"),
                          before=self._before_accept if edit == "accept" else None)

    def close(self) -> Schedule:
        """Stop recording (the wrapped methods are restored) and return the validated schedule; the
        edits after the last step form a last step."""
        if self._installed:
            for obj, name, saved in reversed(self._installed):
                if saved is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, saved)
            self._installed = []
            if self._ops:
                self._end_step()
        return Schedule.from_steps(self._steps, name=self.name, source="ScheduleRecorder",
                                   meta={"recorded_steps": len(self._steps)})

    # ================================================================ wrapping

    def _install(self, obj, name: str, record, before=None) -> None:
        """Wrap ``obj.name``: call it, then ``record(result, arguments, state)``, ``state`` being what
        ``before(arguments)`` returned before the call (calls made inside a recorded one pass through)."""
        original = getattr(obj, name)   # the method, or what wraps it already
        signature = inspect.signature(getattr(type(obj), name))   # the method's own parameters (self first)

        def recorded(*args, **kwargs):
            if self._depth:
                return original(*args, **kwargs)
            try:
                bound = signature.bind(obj, *args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)   # raises the method's own error
            bound.apply_defaults()
            self._depth += 1
            try:
                state = before(bound.arguments) if before is not None else None
                result = original(*bound.args[1:], **bound.kwargs)
            finally:
                self._depth -= 1
            record(result, bound.arguments, state)
            return result

        self._installed.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, recorded)

    # ================================================================ engine calls

    def _prefilled(self, result, arguments, _) -> None:
        node = result.node
        tokens = self.tree.tokens(node)
        parent = arguments["parent"]
        self._ops.append(Prompt(node, tuple(tokens) if self.prompt_ids else len(tokens),
                                None if parent is None else int(parent)))
        self._end_step()

    def _before_step(self, arguments) -> dict | None:
        """The ids the step computes by (node, token index), where it reads them on the device (the tree
        may hold placeholders for them) and the recorder wants them."""
        tokens = arguments["tokens"]
        if not isinstance(tokens, torch.Tensor) or not self._ids_of:   # (a bad one: the step raises)
            return None
        layout = self.tree.layout()
        at = zip(layout.node_ids[layout.query_node].tolist(), layout.query_offset.tolist())
        return dict(zip(at, tokens.reshape(-1).tolist()))   # a device read: the step's tokens are ready first

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
            self._add(Extend(node, count), [(node, k) for k in range(length - count, length)] if by_id else None)

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

    def _extended(self, node: int, count: int) -> None:
        chunk = node in self._prompts
        self._grow(node, count, self.token_ids or (self.prompt_ids and (count > 1 or chunk)))
        if chunk:
            self._note_prompt(node, count)

    def _branch(self, ids, arguments, _) -> None:
        self._add(Branch(int(arguments["node_id"]), tuple(ids)))
        for child in ids:
            n = len(self.tree.tokens(child))
            self._grow(child, n, self.prompt_ids)
            if n:
                self._note_prompt(child, n)   # a prompt continued under the node (or a branch's first token)

    def _add_token_tree(self, ids, arguments, _) -> None:
        anchor, index = int(arguments["node_id"]), {node: i for i, node in enumerate(ids)}
        parents = tuple(-1 if p == anchor else index[p] for p in map(self.tree.parent, ids))
        self._add(TokenTree(anchor, parents, tuple(ids)), [(n, 0) for n in ids] if self.prompt_ids else None)
        self._token_tree.update(ids)

    def _add_children(self, ids, arguments, _) -> None:
        self._add(Children(tuple(map(self.tree.parent, ids)), tuple(ids)),
                  [(n, 0) for n in ids] if self.prompt_ids else None)
        self._token_tree.update(ids)

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
            self._add(Accept(tuple(chain)))
            return
        # Not a token tree's path: the anchor's children go, its new tokens are computed again.
        for child in children:
            self._add(Prune(child))
        tokens = self.tree.tokens(anchor)[-len(slots):] if len(slots) else []
        if tokens:
            self._add(Extend(anchor, tuple(tokens) if self.prompt_ids else len(tokens)))
            self._end_step()

    def _truncate(self, freed, arguments, _) -> None:
        node = int(arguments["node_id"])
        self._add(Truncate(node, len(self.tree.tokens(node))))
        self._prompts.discard(node)

    def _prune(self, freed, arguments, _) -> None:
        self._add(Prune(int(arguments["node_id"])))
