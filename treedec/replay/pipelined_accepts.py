"""How :class:`~treedec.replay.recorder.ScheduleRecorder` writes a pipelined speculative step's edits
(:mod:`treedec.programs.speculative.verify_table`): slots reserved for the last step's root and accepted path before
that path is known, their K/V moved there by one ``engine.pool.copy_slots``, and the verify group's token trees kept
from step to step.

- ``extend_computed`` / ``extend_computed_many`` and the copy into the slots they reserved -> ``accept`` of the chain
  whose K/V the copy reads (the token tree's root, then its accepted path), in place of that tree's ``prune``.
- ``advance_token_trees`` -> for each tree, the cut of its leaf's unused reserved slots (a ``truncate`` only where the
  cut reaches the schedule's tokens), its ``prune`` that the copy after makes an ``accept``, and after that accept a
  ``token_tree`` of the same shape under the leaf. The engine's tree keeps the trees' node ids, which a schedule
  never reuses, so the new tree's nodes get fresh handles: ``"<id>.<k>"`` after node ``id``'s ``k``-th re-hang
  (:meth:`PipelinedAccepts.handle`; the first hang's handle is the id itself).

Several reservations may be made before the one copy that fills them all (a verify group's advancing trees and its
trees of another size: ``VerifyGroup._regrow``); the copy's destinations are the reservations' slots, each
reservation's in its order. The reserved slots past the accepted path are not in the schedule (masked by the step,
cut by a later ``truncate`` or advance): its tree is the one the unpipelined loop grows.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.errors import RecordingError, TreeError
from treedec.workloads.schedule import Accept, Handle, Prune, TokenTree

__all__ = ["PipelinedAccepts", "RESERVING"]

#: The calls that may come between a reservation and the copy that fills it (more reservations, then the copy).
RESERVING = ("copy_slots", "extend_computed", "extend_computed_many", "advance_token_trees")


class PipelinedAccepts:
    """The recorder's pipelined accepts (see the module docstring); its state is the recorder's: ``_reservation``
    (the reservations the next copy fills, ``(node, slots)`` each, or None), ``_hangs`` (node -> how many times its
    token tree was hung again), ``_retired`` (a kept tree's node -> its handle before the advance, until the copy
    accepts it) and ``_rehung`` (leaf -> the token-tree op written after its accept)."""

    def handle(self, node: int) -> Handle:
        """The schedule's handle of the engine's node ``node`` now: its id, or ``"<id>.<k>"`` once
        ``advance_token_trees`` hung its token tree again ``k`` times (the replay's node of the same tokens)."""
        k = self._hangs.get(node, 0)
        return f"{node}.{k}" if k else node

    def _reserve(self, nodes: list[int], slots: list[list[int]]) -> None:
        self._reservation = (self._reservation or []) + list(zip(nodes, slots))

    def _extend_computed(self, slots, arguments, _) -> None:
        self._reserve([int(arguments["node_id"])], [np.asarray(slots).tolist()])

    def _extend_computed_many(self, slots, arguments, _) -> None:
        nodes = np.asarray(arguments["node_ids"]).reshape(-1).tolist()
        if nodes and slots.shape[1]:   # (their slots filled by one copy, reservation after reservation)
            self._reserve(nodes, slots.tolist())

    def _before_advance_token_trees(self, arguments) -> list[tuple[int, int, list[int], tuple[int, ...]]] | None:
        """Each tree's ``(leaf, its length, nodes, parents)`` before the advance (None for bad arguments: the advance
        raises); refuses a cut that leaves the leaf reserved slots the schedule has not (its growth would follow
        them)."""
        tree = self.tree
        try:
            rows = np.asarray(arguments["trees"]).tolist()
            cuts = np.asarray(arguments["cuts"]).reshape(-1).tolist()
            trees = []
            for row in rows:
                leaf = tree.parent(row[0])
                index = {node: i for i, node in enumerate(row)}
                parents = tuple(-1 if p == leaf else index[p] for p in map(tree.parent, row))
                trees.append((leaf, tree.node_length(leaf), row, parents))
        except (TreeError, TypeError, ValueError, KeyError, IndexError):
            return None
        if int(arguments["count"]):
            for (leaf, *_), cut in zip(trees, cuts):
                if 0 <= cut < self._reserved.get(leaf, 0):
                    raise RecordingError(f"tree.advance_token_trees grows node {leaf}, which holds "
                                         f"{self._reserved[leaf]} reserved slot(s) past its accepted path and cuts "
                                         f"{cut}; cut them all first")
        return trees

    def _advance_token_trees(self, slots, arguments, trees) -> None:
        count = int(arguments["count"])
        for (leaf, length, row, parents), cut, reserved in zip(trees, np.asarray(arguments["cuts"]).tolist(),
                                                                slots.tolist()):
            if cut:
                self._truncate(None, {"node_id": leaf, "length": length - cut}, length)
            old = [self.handle(n) for n in row]
            for n in row:
                self._hangs[n] = self._hangs.get(n, 0) + 1
            self._add(Prune(old[0]))
            hung = TokenTree(self.handle(leaf), parents, tuple(self.handle(n) for n in row))
            where = [(n, 0) for n in row] if self.prompt_ids else None
            if count:   # the copy after accepts the old tree's path, then the tree is hung again
                self._retired.update(zip(row, old))
                self._rehung[leaf] = (hung, where)
                self._reserve([leaf], [reserved])
            else:
                self._add(hung, where)

    def _before_copy(self, arguments) -> list[tuple[Handle, ...]] | None:
        """The accepted chain whose K/V the copy moves into each reservation's slots (checked before it runs)."""
        if self._reservation is None:
            raise RecordingError("engine.pool.copy_slots outside a tree edit moves K/V that no schedule op names; "
                                 "the recorder takes it only into the slots tree.extend_computed just reserved (the "
                                 "accept of a pipelined speculative step)")
        src, dst = _host_ints(arguments["src_slots"]), _host_ints(arguments["dst_slots"])
        if src is None or dst is None or len(src) != len(dst):
            return None   # not slots: the copy raises its own error
        first = {slots[0]: i for i, (_, slots) in enumerate(self._reservation)}
        sources: list[list[int] | None] = [None] * len(self._reservation)
        at = 0
        while at < len(dst):   # (the reservations' slots, each reservation's in order)
            i = first.get(dst[at])
            slots = self._reservation[i][1] if i is not None else ()
            if i is None or sources[i] is not None or dst[at:at + len(slots)] != slots:
                break
            sources[i] = src[at:at + len(slots)]
            at += len(slots)
        if at != len(dst) or any(s is None for s in sources):
            reserved = [slot for _, slots in self._reservation for slot in slots]
            node = self._reservation[0][0]
            raise RecordingError(f"engine.pool.copy_slots into slots {dst[:8]}: the recorder takes a copy only into "
                                 f"the {len(reserved)} slot(s) tree.extend_computed just reserved on node {node} "
                                 f"({reserved[:8]})")
        return [self._chain(node, s) for (node, _), s in zip(self._reservation, sources)]

    def _chain(self, node: int, src: list[int]) -> tuple[Handle, ...]:
        """The token-tree chain (root, then the accepted path) whose slots ``src`` a copy into ``node``'s reservation
        reads, by handle."""
        drafts = self._drafts
        chain, parent = [], node
        for slot in src:
            if chain and slot == src[0]:
                break   # past the accepted path: the root's K/V again
            draft = drafts.get(slot)
            if draft is None or draft[1] != parent:
                found = "no token-tree node's" if draft is None else f"node {draft[0]}, a child of {draft[1]}"
                raise RecordingError(
                    f"engine.pool.copy_slots into the slots reserved on node {node}: the recorder writes it as an "
                    f"accept, so its sources must be a token tree's root under that node and a path below it, then the "
                    f"root's slot again; slot {slot} is {found} (sources {src[:8]})")
            chain.append(draft[0])
            parent = draft[0]
        if any(slot != src[0] for slot in src[len(chain):]):
            raise RecordingError(f"engine.pool.copy_slots into the slots reserved on node {node}: past the accepted "
                                 f"path the sources must repeat the root's slot {src[0]}, got {src[len(chain):][:8]}")
        retired = self._retired
        handles = tuple(retired[n] if n in retired else self.handle(n) for n in chain)
        if (chain[0] in self.tree and chain[0] not in retired) or Prune(handles[0]) not in self._ops:
            raise RecordingError(f"engine.pool.copy_slots into the slots reserved on node {node} accepts the token "
                                 f"tree of node {chain[0]}: prune that tree first, after the step that verified it "
                                 f"(the schedule's accept frees it)")
        return handles

    def _copied(self, result, arguments, chains: list[tuple[Handle, ...]]) -> None:
        reservations, self._reservation = self._reservation, None
        for (node, reserved), chain in zip(reservations, chains):
            # The token tree's prune becomes its accept, where the copy ran (after the reserved slots were cut).
            at = len(self._ops) - 1 - self._ops[::-1].index(Prune(chain[0]))
            del self._ops[at]
            self._ids_of = {i - (i > at): where for i, where in self._ids_of.items()}
            self._add(Accept(chain))
            if len(reserved) > len(chain):
                self._reserved[node] = len(reserved) - len(chain)
            if node in self._rehung:   # (a kept tree: hung again behind its accepted path)
                self._add(*self._rehung.pop(node))
        self._retired.clear()


def _host_ints(slots) -> list[int] | None:
    """Slots as host ints (a device tensor is read back: the recorder waits for it); None if they are not ints."""
    try:
        values = slots.reshape(-1).tolist() if isinstance(slots, torch.Tensor) else np.asarray(slots).reshape(-1)
        return [int(v) for v in values]
    except (TypeError, ValueError):
        return None
