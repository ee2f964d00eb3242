"""TreeLayout: a read-only snapshot of a decoding tree for one step, as flat arrays.

This is what a planner sees. Nodes are in depth-first preorder, so a node's parent comes
before it and a subtree is a contiguous range of nodes; the KV slots of all nodes are
concatenated in the same order (the *flattened* tree). A query is one token of the
tree: it reads every token of its node's ancestors, and its own node's tokens up to
and including itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from treedec.checks import describe
from treedec.errors import TreeError
from treedec.tree.validate import int_array, rows


@dataclass(frozen=True)
class TreeLayout:
    """Flat arrays describing the tree's KV and the step's queries.

    Attributes
    ----------
    node_ids : [N] int64
        Caller's node ids, in depth-first preorder.
    parent : [N] int64
        Index (into this order) of each node's parent; -1 for roots (a forest has several).
    kv_start : [N + 1] int64
        CSR offsets: node i's tokens are ``kv_slots[kv_start[i]:kv_start[i + 1]]``.
    kv_slots : [T] int64
        Physical KV-pool slot of every token, flattened depth-first.
    query_node : [Q] int64
        Node index of each query token.
    query_offset : [Q] int64
        Offset of each query token within its node.
    """

    node_ids: np.ndarray
    parent: np.ndarray
    kv_start: np.ndarray
    kv_slots: np.ndarray
    query_node: np.ndarray
    query_offset: np.ndarray
    _prefix: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def num_tokens(self) -> int:
        return len(self.kv_slots)

    @property
    def num_queries(self) -> int:
        return len(self.query_node)

    @property
    def node_len(self) -> np.ndarray:
        """[N] int64 token count of each node."""
        return np.diff(self.kv_start)

    @property
    def node_prefix_len(self) -> np.ndarray:
        """[N] int64 number of tokens on the path above each node (its first token's position).

        A :class:`~treedec.tree.SequenceTree`'s layout carries it (a column of the tree); any other layout
        computes it once, by pointer jumping: O(N log depth) in numpy."""
        if self._prefix is None:
            object.__setattr__(self, "_prefix", _tokens_above(self.parent, self.node_len))
        return self._prefix

    @property
    def query_position(self) -> np.ndarray:
        """[Q] int64 position of each query token in its own token sequence (for RoPE)."""
        return self.node_prefix_len[self.query_node] + self.query_offset

    @property
    def query_slot(self) -> np.ndarray:
        """[Q] int64 KV slot of each query token."""
        return self.kv_slots[self.kv_start[self.query_node] + self.query_offset]

    @classmethod
    def from_parents(
        cls,
        parents,
        lengths,
        queries,
        slots=None,
        node_ids=None,
    ) -> "TreeLayout":
        """Build a layout from a parent list in any order.

        Parameters
        ----------
        parents : sequence of int, length N
            ``parents[i]`` is the index of node i's parent, or -1 for a root.
        lengths : sequence of int, length N
            Tokens per node (0 allowed).
        queries : sequence of (node, offset) pairs
            The step's query tokens.
        slots : sequence of int arrays, optional
            Per node, its ``lengths[i]`` KV slots. Default: tokens numbered consecutively
            in the given node order (a contiguous pool with page size 1).
        node_ids : sequence of int, optional
            Default: ``range(N)``.

        Raises
        ------
        TypeError : an argument holds something other than integers (strings, floats, bools, ...).
        TreeError : the integers do not describe a forest and its queries.
        """
        parents = int_array(parents, "parents")
        lengths = int_array(lengths, "lengths")
        n = len(parents)
        if len(lengths) != n:
            raise TreeError(f"parents and lengths must have the same length, got {n} and {len(lengths)}")
        if np.any(lengths < 0):
            raise TreeError(f"node lengths must be >= 0, got {lengths[lengths < 0][:5].tolist()}")
        bad = (parents < -1) | (parents >= n) | (parents == np.arange(n))
        if np.any(bad):
            i = int(np.flatnonzero(bad)[0])
            raise TreeError(f"parents[{i}] = {int(parents[i])} is not a node index in [-1, {n}) other than {i}")
        if slots is None:
            starts = np.concatenate([[0], np.cumsum(lengths)])
            slots = [np.arange(starts[i], starts[i + 1], dtype=np.int64) for i in range(n)]
        else:
            slots = [int_array(s, f"slots[{i}]") for i, s in enumerate(rows(slots, "slots"))]
            if len(slots) != n:
                raise TreeError(f"slots must have one array per node ({n}), got {len(slots)}")
            for i, s in enumerate(slots):
                if len(s) != lengths[i]:
                    raise TreeError(f"slots[{i}] has {len(s)} slots but lengths[{i}] = {int(lengths[i])}")
        node_ids = np.arange(n, dtype=np.int64) if node_ids is None else int_array(node_ids, "node_ids")
        if len(node_ids) != n or len(np.unique(node_ids)) != n:
            raise TreeError(f"node_ids must be {n} distinct ints (one per node), got {describe(node_ids)}")
        children: list[list[int]] = [[] for _ in range(n)]
        roots = []
        for i, p in enumerate(parents.tolist()):
            (roots if p < 0 else children[p]).append(i)
        order = depth_first_order(roots, children)
        if len(order) != n:
            unreached = sorted(set(range(n)) - set(order))
            raise TreeError(f"nodes {unreached[:10]} are not reachable from a root: the parents form a cycle")
        queries = _query_pairs(queries)
        if len(queries) and (np.any(queries[:, 0] < 0) or np.any(queries[:, 0] >= n)):
            raise TreeError(f"query nodes must be in [0, {n}), got {queries[:, 0].tolist()[:10]}")
        if len(queries) and (np.any(queries[:, 1] < 0) or np.any(queries[:, 1] >= lengths[queries[:, 0]])):
            raise TreeError("every query offset must be in [0, length of its node)")
        return cls.from_preorder(
            node_ids=node_ids[order],
            parent_ids=[int(node_ids[parents[i]]) if parents[i] >= 0 else None for i in order],
            node_slots=[slots[i] for i in order],
            queries=[(int(node_ids[a]), int(b)) for a, b in queries],
        )

    @classmethod
    def from_preorder(cls, node_ids, parent_ids, node_slots, queries) -> "TreeLayout":
        """Build from nodes already in depth-first preorder (no validation of the order).

        ``parent_ids`` holds caller ids (None for roots); ``queries`` holds (node id, offset).
        """
        node_ids = np.asarray(node_ids, dtype=np.int64)
        index = {int(nid): i for i, nid in enumerate(node_ids.tolist())}
        parent = np.array([-1 if p is None else index[p] for p in parent_ids], dtype=np.int64)
        lens = np.fromiter((len(s) for s in node_slots), dtype=np.int64, count=len(node_slots))
        kv_start = np.zeros(len(node_slots) + 1, dtype=np.int64)
        np.cumsum(lens, out=kv_start[1:])
        kv_slots = np.concatenate(node_slots).astype(np.int64, copy=False) if len(node_slots) else np.zeros(0, np.int64)
        query_node = np.fromiter((index[q[0]] for q in queries), dtype=np.int64, count=len(queries))
        query_offset = np.fromiter((q[1] for q in queries), dtype=np.int64, count=len(queries))
        return cls(node_ids, parent, kv_start, kv_slots, query_node, query_offset)


def _tokens_above(parent: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """[N] int64: the sum of ``lens`` over each node's proper ancestors (``parent``: ``[N]`` int64 indices, -1
    for roots; acyclic). Each round, every node adds the sum its current far ancestor has gathered and jumps
    to that one's far ancestor, so the rounds are log2 of the depth."""
    has_up = parent >= 0
    total = np.where(has_up, lens[np.maximum(parent, 0)], 0)   # the parent's tokens
    far = np.where(has_up, parent[np.maximum(parent, 0)], -1)  # the ancestor whose tokens are not in total yet
    while (far >= 0).any():
        jump = np.flatnonzero(far >= 0)
        at = far[jump]
        total[jump] += lens[at] + total[at]   # (numpy reads the right side whole before it writes)
        far[jump] = far[at]
    return total


def depth_first_order(roots: list[int], children: list[list[int]]) -> list[int]:
    """Preorder of the forest given by ``roots`` and per-node ``children`` lists.

    Children are visited in list order. Nodes on a cycle are never reached (the caller
    compares the length of the result with the node count).
    """
    order: list[int] = []
    stack = list(reversed(roots))
    seen = set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        order.append(i)
        stack.extend(reversed(children[i]))
    return order


def _query_pairs(queries) -> np.ndarray:
    """``queries`` as a ``[Q, 2]`` int64 array of (node, offset) pairs."""
    pairs = [int_array(q, f"queries[{i}]") for i, q in enumerate(rows(queries, "queries"))]
    wrong = [i for i, q in enumerate(pairs) if len(q) != 2]
    if wrong:
        raise TreeError(f"queries[{wrong[0]}] must be a (node, offset) pair, got {len(pairs[wrong[0]])} values")
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)
