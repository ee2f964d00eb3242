"""Symbolic replay of a schedule: its ops applied in order to a tree of handles only.

``check_schedule`` validates a whole schedule before anything runs (unknown, pruned or reused
handles, extended non-leaves, token-tree parents, accepted chains, truncations, the step's
pending tokens: a prefill needs none, and a prune, accept or truncate may not touch them)
and sizes it (:class:`ScheduleStats`); given ``FitLimits`` it also names the first op that
goes past a token capacity, a position limit or a vocabulary. Nothing is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

from treedec.tree.validate import on_cycle
from treedec.workloads.schedule_ops import (OPS, Accept, Branch, Children, Extend, Handle, Op, Prompt, Prune,
                                            ScheduleError, TokenTree, Truncate, token_count)


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


# ================================================================ symbolic replay


@dataclass(frozen=True)
class FitLimits:
    """What :meth:`Schedule.check_fits` checks each op against (None: no limit); names for the messages."""

    max_tree_tokens: int | None = None
    max_position: int | None = None
    vocab_size: int | None = None
    tokens_limit: str = "max_tree_tokens"
    position_limit: str = "max_position"


class _Shape:
    """The tree as handles only: enough to check every op and size the run."""

    def __init__(self, limits: FitLimits):
        self.limits = limits
        self.parent: dict[Handle, Handle | None] = {}
        # children and roots are insertion-ordered dicts (as sets): removing one is O(1)
        self.children: dict[Handle, dict[Handle, None]] = {}
        self.length: dict[Handle, int] = {}
        self.end: dict[Handle, int] = {}           # sequence length up to the end of the node
        self.in_token_tree: set[Handle] = set()
        self.pending: set[Handle] = set()          # nodes holding tokens of the step's forward
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

    def subtree(self, h: Handle) -> list[Handle]:
        out, stack = [], [h]
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(self.children[x])
        return out

    def not_pending(self, nodes: list[Handle], where: str, what: str) -> None:
        """Refuse an op that would change tokens the step's forward has not computed yet."""
        busy = [x for x in nodes if x in self.pending]
        if busy:
            raise ScheduleError(f"{where}: {what} node(s) {busy[:5]!r}, whose tokens an earlier op of this step "
                                f"added for the step's forward; do it before those ops, or in a later step")


def check_schedule(steps: tuple[tuple[Op, ...], ...], source: str, limits: FitLimits = FitLimits()) -> ScheduleStats:
    """Replay ``steps`` on handles: the :class:`ScheduleStats` of a valid schedule, else the
    :class:`ScheduleError` of its first bad op (``source``, step and op named); ``limits`` adds the capacity,
    position and vocabulary checks of :meth:`Schedule.check_fits`."""
    shape = _Shape(limits)
    forward_steps = 0
    max_token_id = -1
    widest_branch = 0
    for i, step in enumerate(steps):
        for j, op in enumerate(step):
            if not isinstance(op, OPS):
                raise ScheduleError(f"{source}: step {i}, op {j}: {type(op).__name__} is not a schedule op (one of "
                                    f"{', '.join(kind.__name__ for kind in OPS)})")
            where = f"{source}: step {i}, op {j} ({op.op})"
            if isinstance(op, Prompt) and not op.pending and shape.pending:
                raise ScheduleError(f"{where}: field 'op': a prefilled 'prompt' op must come before the step's ops "
                                    f"that add tokens for its forward (extend, token_tree, children, pending "
                                    f"prompts): a prefill runs its own forward over a tree with no pending tokens")
            if isinstance(op, (Prompt, Extend, TokenTree, Children)) and op.tokens is not None \
                    and not isinstance(op.tokens, int):
                top = max(op.tokens, default=-1)
                max_token_id = max(max_token_id, top)
                if limits.vocab_size is not None and top >= limits.vocab_size:
                    k = op.tokens.index(top)
                    raise ScheduleError(f"{where}: field 'tokens[{k}]' = {top} is outside the model's vocabulary "
                                        f"of {limits.vocab_size}")
            _apply(shape, op, where)
            if isinstance(op, Branch):
                widest_branch = max(widest_branch, len(op.ids))
        forward_steps += bool(shape.pending)
        shape.pending.clear()   # the step's forward computes them
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
        if op.pending:
            shape.pending.add(op.id)
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
        shape.pending.add(op.node)
    elif isinstance(op, TokenTree):
        _apply_token_tree(shape, op, where)
    elif isinstance(op, Children):
        _apply_children(shape, op, where)
    elif isinstance(op, Accept):
        _apply_accept(shape, op, where)
    elif isinstance(op, Truncate):
        _apply_truncate(shape, op, where)
    elif isinstance(op, Prune):
        shape.alive(op.node, where, "node")
        shape.not_pending(shape.subtree(op.node), where, f"field 'node': pruning {op.node!r} would remove")
        shape.remove(op.node)
    else:  # check_schedule admits the OPS only
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
            kind = "a cycle" if on_cycle(op.parents, k) else "a forward reference"
            raise ScheduleError(f"{where}: field 'parents[{k}]' = {p}: parents must come before their "
                                f"children ({kind})")
    for k, (h, p) in enumerate(zip(op.ids, op.parents)):
        shape.create(h, op.node if p < 0 else op.ids[p], 1, where, f"ids[{k}]")
        shape.in_token_tree.add(h)
        shape.pending.add(h)


def _apply_children(shape: _Shape, op: Children, where: str) -> None:
    m = len(op.nodes)
    if len(op.ids) != m:
        raise ScheduleError(f"{where}: field 'ids' must have one handle per node: {len(op.ids)} ids for {m} nodes")
    if op.tokens is not None and len(op.tokens) != m:
        raise ScheduleError(f"{where}: field 'tokens' must have one id per node: {len(op.tokens)} for {m} nodes")
    if len(set(op.ids)) != m:
        raise ScheduleError(f"{where}: field 'ids' lists a handle twice")
    for k, h in enumerate(op.nodes):
        shape.alive(h, where, f"nodes[{k}]")
    for k, (h, parent) in enumerate(zip(op.ids, op.nodes)):
        shape.create(h, parent, 1, where, f"ids[{k}]")
        shape.in_token_tree.add(h)   # draft nodes, as a token tree's: an accept may keep a chain of them
        shape.pending.add(h)


def _apply_truncate(shape: _Shape, op: Truncate, where: str) -> None:
    shape.alive(op.node, where, "node")
    if shape.children[op.node]:
        raise ScheduleError(f"{where}: field 'node': node {op.node!r} has children "
                            f"{list(shape.children[op.node])[:5]!r}; only leaves are truncated")
    if op.length > shape.length[op.node]:
        raise ScheduleError(f"{where}: field 'length' = {op.length}: node {op.node!r} holds "
                            f"{shape.length[op.node]} token(s); a truncate keeps at most all of them")
    shape.not_pending([op.node], where, "field 'node': truncate would drop tokens of")
    dropped = shape.length[op.node] - op.length
    shape.length[op.node] -= dropped
    shape.end[op.node] -= dropped
    shape.tokens -= dropped


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
    shape.not_pending(shape.subtree(anchor), where, "field 'ids': the accept would change")
    others = [c for c in shape.children[anchor] if c not in shape.in_token_tree]
    if others:
        raise ScheduleError(f"{where}: field 'ids': the anchor {anchor!r} also has non-token-tree child(ren) "
                            f"{others[:5]!r}, which accept would remove; prune them first")
    accepted = sum(shape.length[h] for h in op.ids)   # a token-tree node may have been extended since
    for child in list(shape.children[anchor]):
        shape.remove(child)
    shape.grow(anchor, accepted, where)
