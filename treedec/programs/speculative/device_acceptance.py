"""Acceptance of a verified token tree on the device: the outcome in one small tensor, no wait on the way.

The host rules of :mod:`treedec.programs.speculative.acceptance` walk the tree from the root and read values as they
go; :class:`~treedec.programs.speculative.acceptance.RejectionSampling` reads a random number and a probability for
every child it tries (each read a wait for the device: on a GPU a step of a top-8 EAGLE tree paid
dozens). Here the same decisions are tensor operations over the whole tree at once, launched after the
verification step without waiting for it, for the ``R`` trees of one shape of a batch at once (the verify
table's group, :mod:`~treedec.programs.speculative.verify_table`; one request alone is ``R = 1``):

- every child is tested as if its parent were reached. That is exact: a child's test in the sequential
  walk depends only on which earlier siblings were rejected, not on the random numbers that rejected
  them, so "the first child of a node that passes its test" is the walk's choice at that node;
- the accepted path is the chain of such first children from the root (an ancestor matrix);
- the bonus token is drawn at the path's last node from what is left of its distribution after all its
  children are rejected (a leaf: its whole distribution), by inverse CDF.

The result is ``[R, 2 + depth]`` int64 on the device (per tree: accepted length, bonus, path padded with -1); it
is read back with the batch's other reads in one copy and :func:`decode_outcome` turns a row into ``(path,
bonus)``, the host rules' result. Rejection sampling's random numbers are counter-based
(:func:`~treedec.sampling.rng.counter_uniform` of the request's seed, its verification step and the number's
index), so a seeded request draws the same numbers alone, batched or unpipelined. Emitted tokens follow exactly
the host rule's distribution (chi-square tests); the host rule's own stream differs, so single draws do not
match it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from treedec.sampling.draw import inverse_cdf
from treedec.sampling.params import SamplingParams, sampling_probs
from treedec.sampling.rng import counter_uniform
from treedec.transfer import to_device
from treedec.tree.token_tree import TokenTree

__all__ = ["DeviceTree", "decode_outcome", "greedy_outcomes", "rejection_outcomes"]

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
                del _CACHE[next(iter(_CACHE))]
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


def greedy_outcomes(tree: TokenTree, tokens: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """:func:`~treedec.programs.speculative.acceptance.greedy_path`'s decision on the device for ``R`` trees of one
    shape at once: a child passes when its token is the target's argmax at its parent (the first such sibling
    wins), the bonus is the argmax at the path's last node.

    Parameters
    ----------
    tree : the trees' shape (``N`` tokens, depth ``D``).
    tokens : [R, N] int64 on the device: each tree's tokens.
    argmax : [R, N] int64 on the device: the target's argmax at every tree token.

    Returns
    -------
    [R, 2 + D] int64: each tree's outcome (accepted length, bonus, the path's tree indices, -1 past the length).
    """
    shape = DeviceTree.of(tree, argmax.device)
    return _walk(shape, (tokens == argmax[:, shape.parents]) & shape.non_root, argmax)


def rejection_outcomes(tree: TokenTree, tokens: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
                       seeds: torch.Tensor, steps: torch.Tensor, draft_probs: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """:class:`~treedec.programs.speculative.acceptance.RejectionSampling`'s decision on the device for ``R`` trees
    of one shape at once, each drawing from its own counter-based stream (:func:`~treedec.sampling.rng.counter_uniform`
    of its seed, stream ``1 + step``): a seeded request's outcome depends on nothing but its own rows, whatever
    the batch.

    Parameters
    ----------
    tree : the trees' shape (``N`` tokens, depth ``D``).
    tokens : [R, N] int64: each tree's tokens.
    logits : [R, N, vocab] the target's logits at every tree token.
    params : temperature, top-k, top-p (the target's ``p`` and a sampled draft's ``q`` are processed alike).
    seeds : [R] int64: each request's seed; steps : [R] int64: each one's verification step (its stream).
    draft_probs : [R, N, vocab], optional: row j the distribution node j's children were sampled from without
        replacement, in child order; None: a deterministic draft (each child a point mass at its token).

    Returns
    -------
    [R, 2 + D] int64 on ``logits``' device, as :func:`greedy_outcomes`.
    """
    device = logits.device
    shape = DeviceTree.of(tree, device)
    r_count, (n, width) = tokens.shape[0], shape.children.shape
    target = sampling_probs(logits, params)                            # [R, N, V]: p at every node
    residual = target.clone()                                          # then what its rejected children leave
    mass = residual.sum(dim=-1)                                        # its total (not renormalised each time)
    q_left = None if draft_probs is None else draft_probs.float().clone()
    draws = torch.arange(n * width + 1, device=device)                 # the tests' numbers, then the bonus's
    uniform = counter_uniform(seeds[:, None], steps[:, None] + 1, draws[None, :]).float()
    tests = uniform[:, :n * width].reshape(r_count, n, width)
    passed = torch.zeros(r_count, n + 1, dtype=torch.bool, device=device)   # node i passes its test (parent
    spare = torch.full((n,), n, dtype=torch.int64, device=device)           # reached); the missing children's
    for r in range(width):                                             # the r-th child of every node at once
        kid = shape.children[:, r]
        has = kid >= 0
        token = tokens[:, kid.clamp(min=0)][..., None]                 # [R, N, 1]
        p_x = residual.gather(2, token)[..., 0]
        if q_left is None:      # a point mass: accept with p(x) / mass; a rejected x leaves the residual
            test = tests[:, :, r] * mass < p_x
            residual.scatter_(2, token, torch.where(has, torch.zeros_like(p_x), p_x)[..., None])
        else:                   # q without the siblings drawn before: accept with min(1, p(x) / q(x))
            q = q_left / q_left.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            test = tests[:, :, r] * q.gather(2, token)[..., 0] * mass < p_x
            residual = torch.where(has[None, :, None], torch.clamp(residual - q * mass[..., None], min=0.0), residual)
            left = q_left.gather(2, token)[..., 0]
            q_left.scatter_(2, token, torch.where(has, torch.zeros_like(p_x), left)[..., None])
        mass = residual.sum(dim=-1)
        # Nothing left after a rejection means p <= q everywhere, so p == q: a rounding miss (the host rule's).
        passed[:, torch.where(has, kid, spare)] = test | (mass <= 0)   # (no boolean index: it would wait)
    length, path, last = _path(shape, passed[:, :n])
    # The bonus at the path's last node: from what its rejected children left (a leaf: all of p).
    rows = torch.arange(r_count, device=device)
    left = residual[rows, last]
    weights = torch.where((mass[rows, last] > 0)[:, None], left, target[rows, last])
    bonus = inverse_cdf(weights, uniform[:, -1])
    return torch.cat([length[:, None], bonus[:, None], path[:, :shape.depth]], dim=1)


def decode_outcome(values: Sequence[int]) -> tuple[list[int], int]:
    """``(path, bonus)`` from an outcome's values read back (``[length, bonus, path...]``)."""
    length = int(values[0])
    return [int(i) for i in values[2:2 + length]], int(values[1])


def _path(shape: DeviceTree, passed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain of first passing children from the root of each tree (``passed`` [R, N] bool): its length [R],
    its nodes [R, D + 1] (-1 past the length; the last column a spare) and its last node [R] (0: the root)."""
    first = passed & ~(shape.earlier_sibling[None] & passed[:, None, :]).any(dim=2)
    on_path = ~(shape.ancestors[None] & ~first[:, None, :]).any(dim=2) & shape.non_root
    length = on_path.sum(dim=1)
    r_count = passed.shape[0]
    path = torch.full((r_count, shape.depth + 1), -1, dtype=torch.int64, device=passed.device)
    index = torch.arange(shape.size, device=passed.device).expand(r_count, -1)
    path.scatter_(1, torch.where(on_path, shape.depths - 1, shape.depth), index)   # off-path nodes: the spare slot
    last = torch.where(length > 0, path.gather(1, (length - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(length))
    return length, path, last


def _walk(shape: DeviceTree, passed: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """The outcome tensors [R, 2 + D]: each tree's chain of first passing children, and its last node's bonus
    (``bonus`` [R, N]: every node's)."""
    length, path, last = _path(shape, passed)
    return torch.cat([length[:, None], bonus.gather(1, last[:, None]), path[:, :shape.depth]], dim=1)
