"""Acceptance of a verified token tree on the device: the outcome in one small tensor, no wait on the way.

The host rules of :mod:`treedec.programs.speculative.acceptance` walk the tree from the root and read values as they
go; :class:`~treedec.programs.speculative.acceptance.RejectionSampling` reads a random number and a probability for
every child it tries (each read a wait for the device: on a GPU a step of a top-8 EAGLE tree paid
dozens). Here the same decisions are tensor operations over the whole tree at once, launched after the
verification step without waiting for it:

- every child is tested as if its parent were reached. That is exact: a child's test in the sequential
  walk depends only on which earlier siblings were rejected, not on the random numbers that rejected
  them, so "the first child of a node that passes its test" is the walk's choice at that node;
- the accepted path is the chain of such first children from the root (an ancestor matrix);
- the bonus token is drawn, for every node, from what is left of its distribution after all its
  children are rejected (a leaf: its whole distribution), and the path's last node picks its own.

:class:`Outcome` is the result: ``[2 + depth]`` int64 on the device (accepted length, bonus, path
padded with -1); a program reads it with the other requests' reads in one copy
(:class:`~treedec.runtime.program.Read`) and :func:`decode_outcome` turns it into ``(path, bonus)``,
the host rules' result. Emitted tokens follow exactly the host rule's distribution (chi-square tests);
the random streams differ, so single draws do not match the host rule's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from treedec.sampling.params import SamplingParams, sampling_probs
from treedec.transfer import to_device
from treedec.tree.token_tree import TokenTree

__all__ = ["DeviceTree", "decode_outcome", "greedy_outcome", "rejection_outcome"]

_CACHED_SHAPES = 128  # tree shapes whose device tensors are kept (a batch's budget cuts a fixed tree many ways)


@dataclass(frozen=True)
class DeviceTree:
    """A token tree's topology as device tensors (made once per shape and device, then reused).

    Attributes
    ----------
    size : tokens, root included (N).
    depth : the deepest token's depth.
    parents : [N] int64, the root's parent given as 0 (it is never tested).
    children : [N, K] int64, each node's children in order, -1 past the last (K: the most children).
    earlier_sibling : [N, N] bool, ``[i, j]``: j is a sibling of i before it.
    ancestors : [N, N] bool, ``[i, j]``: j is i or an ancestor of i other than the root.
    depths : [N] int64.
    non_root : [N] bool, False at the root (a mask: assigning a Python value into a CUDA tensor waits for it).
    """

    size: int
    depth: int
    parents: torch.Tensor
    children: torch.Tensor
    earlier_sibling: torch.Tensor
    ancestors: torch.Tensor
    depths: torch.Tensor
    non_root: torch.Tensor

    @classmethod
    def of(cls, tree: TokenTree, device: torch.device | str) -> DeviceTree:
        """The device tensors of ``tree``'s shape on ``device`` (cached)."""
        device = torch.device(device)
        key = (tree.parents, device)
        hit = _CACHE.get(key)
        if hit is None:
            if len(_CACHE) >= _CACHED_SHAPES:
                _GreedyGraph.drop(_CACHE.pop(next(iter(_CACHE))))
            hit = _CACHE[key] = cls._build(tree, device)
        return hit

    @classmethod
    def _build(cls, tree: TokenTree, device: torch.device) -> DeviceTree:
        parents = np.array(tree.parents, dtype=np.int64)
        n = len(parents)
        parents[0] = 0
        kids = [tree.children(i) for i in range(n)]
        width = max(1, max(map(len, kids)))
        children = np.full((n, width), -1, dtype=np.int64)
        for i, k in enumerate(kids):
            children[i, :len(k)] = k
        index = np.arange(n)
        earlier = (parents[:, None] == parents[None, :]) & (index[None, :] < index[:, None])
        earlier[0, :] = earlier[:, 0] = False
        ancestors = np.zeros((n, n), dtype=bool)
        for i in range(1, n):   # parents come first: a parent's row is complete before its children's
            ancestors[i] = ancestors[parents[i]]
            ancestors[i, i] = True
        ancestors[:, 0] = False
        def put(a):   # from pinned memory, without waiting (a pageable copy would wait for the device)
            return to_device(a, device)
        return cls(n, max(tree.depth), put(parents), put(children), put(earlier), put(ancestors),
                   put(np.array(tree.depth, dtype=np.int64)), put(index > 0))


_CACHE: dict[tuple, DeviceTree] = {}


def greedy_outcome(tree: TokenTree, tokens: torch.Tensor | Sequence[int], argmax: torch.Tensor) -> torch.Tensor:
    """:func:`~treedec.programs.speculative.acceptance.greedy_path`'s decision on the device: a child passes when its
    token is the target's argmax at its parent (the first such sibling wins), the bonus is the argmax at the path's last
    node. ``argmax`` [N] int64 on the device; returns the outcome tensor (see :func:`rejection_outcome`)."""
    shape = DeviceTree.of(tree, argmax.device)
    tokens = torch.as_tensor(tokens, dtype=torch.int64, device=argmax.device)
    if argmax.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        return _GreedyGraph.run(shape, tokens, argmax)
    return _greedy(shape, tokens, argmax)


def _greedy(shape: DeviceTree, tokens: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    return _walk(shape, (tokens == argmax[shape.parents]) & shape.non_root, argmax)


class _GreedyGraph:
    """:func:`greedy_outcome` of one tree shape as a CUDA graph, captured at the shape's second use (the first
    runs eagerly): its ~25 small operations launched as one replay. Eagerly they cost ~0.45 ms of host time a
    call on an H100 host (their Python and launch overheads), a request's in every pipelined step. Captured
    with the low-level API on a side stream: no wait for the device (``torch.cuda.graph`` synchronizes);
    the graphs share one memory pool (replays are serial on the stream, each output copied out)."""

    _seen: set = set()
    _graphs: dict = {}
    _pool = None

    def __init__(self, shape: DeviceTree):
        device = shape.parents.device
        self.tokens = torch.zeros(shape.size, dtype=torch.int64, device=device)
        self.argmax = torch.zeros_like(self.tokens)
        if _GreedyGraph._pool is None:
            _GreedyGraph._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))   # (the zeros above, in stream order)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            self.graph.capture_begin(pool=_GreedyGraph._pool)
            try:
                self.out = _greedy(shape, self.tokens, self.argmax)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)

    @classmethod
    def run(cls, shape: DeviceTree, tokens: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
        key = id(shape)   # (a DeviceTree lives in the shape cache; its graph is dropped with it, see DeviceTree.of)
        graphed = cls._graphs.get(key)
        if graphed is None:
            if key not in cls._seen:
                cls._seen.add(key)
                return _greedy(shape, tokens, argmax)
            graphed = cls._graphs[key] = cls(shape)
        graphed.tokens.copy_(tokens)
        graphed.argmax.copy_(argmax)
        graphed.graph.replay()
        return graphed.out.clone()

    @classmethod
    def drop(cls, shape: DeviceTree) -> None:
        cls._seen.discard(id(shape))
        cls._graphs.pop(id(shape), None)


def rejection_outcome(tree: TokenTree, tokens: torch.Tensor | Sequence[int], logits: torch.Tensor,
                      params: SamplingParams, generator: torch.Generator,
                      draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`~treedec.programs.speculative.acceptance.RejectionSampling`'s decision on the device.

    Parameters
    ----------
    tree : the verified tree's shape.
    tokens : [N] its tokens (a host sequence or a device tensor).
    logits : [N, vocab] the target's logits at every tree token.
    params : temperature, top-k, top-p (the target's ``p`` and a sampled draft's ``q`` are processed alike).
    generator : the rule's random stream, on ``logits``' device.
    draft_probs : [N, vocab], optional: row j the distribution node j's children were sampled from without
        replacement, in child order; None: a deterministic draft (each child a point mass at its token).

    Returns
    -------
    [2 + depth] int64 on ``logits``' device: accepted length, bonus token, the path's tree indices (-1 past
    the accepted length). :func:`decode_outcome` reads it.
    """
    device = logits.device
    shape = DeviceTree.of(tree, device)
    tokens = torch.as_tensor(tokens, dtype=torch.int64, device=device)
    n, width = shape.children.shape
    rows = torch.arange(n, device=device)
    target = sampling_probs(logits, params)                            # [N, V]: p at every node
    residual = target.clone()                                          # then what its rejected children leave
    mass = residual.sum(dim=-1)                                        # its total (not renormalised each time)
    q_left = None if draft_probs is None else draft_probs.float().clone()
    uniform = torch.rand(n, width, generator=generator, device=device)
    passed = torch.zeros(n + 1, dtype=torch.bool, device=device)       # node i passes its test (parent reached);
    spare = torch.full_like(rows, n)                                   # [n]: where the missing children's go
    for r in range(width):                                             # the r-th child of every node at once
        kid = shape.children[:, r]
        has = kid >= 0
        token = tokens[kid.clamp(min=0)]
        p_x = residual[rows, token]
        if q_left is None:      # a point mass: accept with p(x) / mass; a rejected x leaves the residual
            test = uniform[:, r] * mass < p_x
            residual[rows, token] = torch.where(has, torch.zeros_like(p_x), p_x)
        else:                   # q without the siblings drawn before: accept with min(1, p(x) / q(x))
            q = q_left / q_left.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            test = uniform[:, r] * q[rows, token] * mass < p_x
            residual = torch.where(has[:, None], torch.clamp(residual - q * mass[:, None], min=0.0), residual)
            q_left[rows, token] = torch.where(has, torch.zeros_like(p_x), q_left[rows, token])
        mass = residual.sum(dim=-1)
        # Nothing left after a rejection means p <= q everywhere, so p == q: a rounding miss (the host rule's).
        passed[torch.where(has, kid, spare)] = test | (mass <= 0)   # (no boolean index: it would wait)
    # Every node's bonus, if the walk ends there: from what its rejected children left (a leaf: all of p).
    bonus = torch.multinomial(torch.where((mass > 0)[:, None], residual, target), 1, generator=generator)
    return _walk(shape, passed[:n], bonus.squeeze(1))


def decode_outcome(values: Sequence[int]) -> tuple[list[int], int]:
    """``(path, bonus)`` from an outcome's values read back (``[length, bonus, path...]``)."""
    length = int(values[0])
    return [int(i) for i in values[2:2 + length]], int(values[1])


def _walk(shape: DeviceTree, passed: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """The outcome tensor: the chain of first passing children from the root, and its last node's bonus."""
    first = passed & ~(shape.earlier_sibling & passed[None, :]).any(dim=1)
    on_path = ~(shape.ancestors & ~first[None, :]).any(dim=1) & shape.non_root
    length = on_path.sum().reshape(1)
    path = torch.full((shape.depth + 1,), -1, dtype=torch.int64, device=passed.device)
    index = torch.arange(shape.size, device=passed.device)
    path.scatter_(0, torch.where(on_path, shape.depths - 1, shape.depth), index)   # off-path nodes: the spare slot
    last = torch.where(length > 0, path[(length - 1).clamp(min=0)], torch.zeros_like(length))
    return torch.cat([length, bonus[last], path[:shape.depth]])
