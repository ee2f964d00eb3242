"""Forests of requests as layouts over one paged pool, for the batch-invariance tests: a request's layout alone and
inside any forest reads the same slots (the same K/V), so its outputs can be compared bit for bit.

A *group* is one prompt (a root node, or that prompt split over two chained nodes, as a prefix-cache hit stores it)
under which one or more requests hang their own subtrees; a request's queries are decode tokens, token trees (a
speculative verify) and causal prompt rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from treedec.tree import TreeLayout


@dataclass
class Request:
    """A request's nodes (parents are indices into ``nodes``; -1 hangs under its group's prompt) and queries
    ``(node, offset)``."""

    parents: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    queries: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Forest:
    """Groups of requests over one pool: ``prompts[g]`` the group's prompt length, ``requests[g]`` its requests,
    ``slots`` every node's pool slots (by ``(group, request, node)``, the prompt as ``(group, -1, 0)``)."""

    prompts: list[int]
    requests: list[list[Request]]
    slots: dict
    page_size: int

    def layout(self, members: list[tuple[int, int]], splits: dict | None = None) -> tuple[TreeLayout, list]:
        """The layout of the requests ``members`` (``(group, request)`` pairs, in that order) with their groups'
        prompts, and each query's ``(group, request, index)`` in row order. ``splits[group] = at`` stores that
        prompt as two chained nodes, ``[0, at)`` and ``[at, n)``."""
        parents, lengths, slots, queries, rows = [], [], [], [], []
        prompt_at = {}   # each group's prompt: (its last node, where that node starts in the prompt)
        for g, r in members:
            if g not in prompt_at:
                at = (splits or {}).get(g)
                whole = self.slots[g, -1, 0]
                pieces = [whole] if at is None else [whole[:at], whole[at:]]
                for i, piece in enumerate(pieces):
                    parents.append(-1 if i == 0 else len(parents) - 1)
                    lengths.append(len(piece))
                    slots.append(piece)
                prompt_at[g] = (len(parents) - 1, 0 if at is None else at)
            request, base = self.requests[g][r], len(parents)
            last, start = prompt_at[g]
            for i, (p, n) in enumerate(zip(request.parents, request.lengths)):
                parents.append(last if p < 0 else base + p)
                lengths.append(n)
                slots.append(self.slots[g, r, i])
            for j, (node, offset) in enumerate(request.queries):
                if node >= 0:
                    queries.append((node + base, offset))
                else:            # a prompt row: in the prompt's last node, or (split before it) the one above
                    queries.append((last, offset - start) if offset >= start else (last - 1, offset))
                rows.append((g, r, j))
        return TreeLayout.from_parents(parents, lengths, queries, slots), rows

    def kv(self, hkv: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Random K/V caches ``[num_pages, page_size, hkv, head_dim]`` of the pool."""
        used = max(int(s.max()) for s in self.slots.values() if len(s)) + 1
        pages = -(-used // self.page_size)
        gen = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(pages, self.page_size, hkv, head_dim, generator=gen).to(dtype) for _ in range(2))


def random_forest_of_requests(rng: np.random.Generator, page_size: int, chunk_size: int, groups: int = 3,
                              max_requests: int = 3) -> Forest:
    """1..``groups`` prompts (0.5 to 3 chunks long, now and then a multiple of the chunk), each with
    1..``max_requests`` requests: branches of a few nodes, and queries that decode (now and then at a token whose
    path ends on a chunk border), verify a token tree, or run causal rows of the request's last node (a prompt
    chunk); a group's first request sometimes queries the prompt itself (rows at its end)."""
    prompts, requests = [], []
    for g in range(int(rng.integers(1, groups + 1))):
        n = int(chunk_size * rng.choice([1, 2, 3])) if rng.random() < 0.3 else int(rng.integers(chunk_size // 2,
                                                                                               3 * chunk_size + 1))
        prompts.append(n)
        group = []
        for r in range(int(rng.integers(1, max_requests + 1))):
            req = Request()
            for i in range(int(rng.integers(1, 4))):
                req.parents.append(int(rng.integers(-1, i)))
                req.lengths.append(int(rng.integers(1, chunk_size + 8)))
            leaf = len(req.parents) - 1
            above = n   # the leaf's first position
            node = req.parents[leaf]
            while node >= 0:
                above, node = above + req.lengths[node], req.parents[node]
            kind = rng.random()
            if kind < 0.35:     # decode: the leaf's last token, or now and then the one whose path ends a chunk
                border = -(-(above + 1) // chunk_size) * chunk_size - 1 - above
                last = req.lengths[leaf] - 1
                req.queries.append((leaf, border if border <= last and rng.random() < 0.5 else last))
            elif kind < 0.7:    # a token tree under the leaf
                base = len(req.parents)
                for i in range(int(rng.integers(1, 10))):
                    req.parents.append(leaf if i == 0 else base + int(rng.integers(0, i)))
                    req.lengths.append(1)
                    req.queries.append((base + i, 0))
            else:               # causal rows: the leaf's last few tokens
                rows = int(rng.integers(1, min(req.lengths[leaf], 12) + 1))
                req.queries += [(leaf, req.lengths[leaf] - rows + i) for i in range(rows)]
            if r == 0 and rng.random() < 0.2:   # rows at the prompt's end
                req.queries += [(-1, n - 1 - i) for i in range(int(rng.integers(1, 4)))]
            group.append(req)
        requests.append(group)
    return forest_of(prompts, requests, page_size, rng)


def forest_of(prompts: list[int], requests: list[list[Request]], page_size: int, rng: np.random.Generator) -> Forest:
    """The :class:`Forest` of these groups, every node's tokens in pages of ``page_size`` slots, the pool's pages in
    random order."""
    lengths = {}
    for g, n in enumerate(prompts):
        lengths[g, -1, 0] = n
        for r, req in enumerate(requests[g]):
            for i, m in enumerate(req.lengths):
                lengths[g, r, i] = m
    keys = list(lengths)
    pages = rng.permutation(sum(-(-lengths[k] // page_size) for k in keys) + 4)
    slots, used = {}, 0
    for k in keys:
        count = -(-lengths[k] // page_size)
        slots[k] = (pages[used:used + count, None] * page_size + np.arange(page_size)).reshape(-1)[:lengths[k]]
        used += count
    return Forest(prompts, requests, slots, page_size)
