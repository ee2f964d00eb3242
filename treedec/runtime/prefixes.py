"""Prompt prefixes shared across the requests of a batch: one copy of their K/V.

Requests whose prompts start with the same tokens (a system prompt, few-shot examples) read
one copy of that prefix. Before a run the prompts are matched against each other: sorted,
runs of neighbours whose longest common prefix has at least ``min_tokens`` tokens form a
group, its prefix the run's shortest common one (what every member starts with), rounded
down to whole KV pages. A group's prefix is prefilled once, as a root of the forest, when a
member is admitted and none holds it; each member's prompt continues under it as a child
node.

A prefix holds whole pages so that a member with its prefix takes exactly the pages it takes
alone (a child node starts on a page of its own: a prefix ending mid-page would cost each
member a page more, and a request that fits the pool alone might not fit it shared). It
stops short of its shortest member's prompt, so every member has a node of its own
(programs grow and accept tokens on their own prompt's node; a prefix node is never changed
after its prefill).

The scheduler counts a prefix's pages as its group's: it is held while a member runs
(:attr:`SharedPrefix.live`); once none runs it is *idle*, kept for the members still queued
but evicted (pruned, prefilled again for the next member) when its pages are needed; it is
evicted at once when its last running member is preempted, and pruned for good after its
last member retires.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from treedec.tree import PagedKVPool, SequenceTree

__all__ = ["SharedPrefix", "common_prefix", "share_prefixes"]


@dataclass(eq=False)
class SharedPrefix:
    """A prompt prefix read by several requests.

    Attributes
    ----------
    tokens : the prefix's token ids (whole pages of the pool it was made for).
    members : requests that read it and have not retired yet.
    live : those of them running now (admitted and neither retired nor preempted).
    node : its root node while prefilled, else None.
    """

    tokens: list[int]
    members: int
    live: int = 0
    node: int | None = None

    @property
    def idle(self) -> bool:
        """Prefilled but read by no running member: its pages may be taken back (:meth:`evict`)."""
        return self.node is not None and self.live == 0

    def pages(self, pool: PagedKVPool) -> int:
        """The pages it holds once prefilled."""
        return pool.pages_for(len(self.tokens))

    def admission_pages(self, pool: PagedKVPool) -> int:
        """Pages admitting a member takes for the prefix itself: all of them unless it is prefilled."""
        return self.pages(pool) if self.node is None else 0

    def acquire(self, engine) -> None:
        """A member starts: prefill the prefix unless it is held (the tree must have no pending tokens)."""
        if self.node is None:
            self.node = engine.prefill(self.tokens).node
        self.live += 1

    def leave(self, tree: SequenceTree, retired: bool) -> None:
        """A running member ``retired`` (it will not read the prefix again) or was preempted (queued to
        run again): the prefix is pruned after its last member, and when its last running member is
        preempted (the pages are wanted now; it is prefilled again when a member is next admitted)."""
        assert self.live > 0 and self.members > 0, f"{self.live=}, {self.members=}"
        self.live -= 1
        self.members -= retired
        if self.members == 0 or (self.live == 0 and not retired):
            self.evict(tree)

    def evict(self, tree: SequenceTree) -> None:
        """Prune the prefix's node (its members' nodes with it) if it is in the tree."""
        if self.node is not None and self.node in tree:
            tree.prune(self.node)
        self.node = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def share_prefixes(prompts: Sequence[Sequence[int] | None], min_tokens: int, page_size: int
                   ) -> list[SharedPrefix | None]:
    """Each prompt's :class:`SharedPrefix` (None: it shares none, or it is None).

    A prefix has at least ``min_tokens`` (>= 1) tokens, a multiple of ``page_size``, and is
    shorter than each of its members' prompts; members of one group get the same object.
    """
    assert min_tokens >= 1 and page_size >= 1, f"{min_tokens=}, {page_size=}"
    out: list[SharedPrefix | None] = [None] * len(prompts)
    order = sorted((i for i, p in enumerate(prompts) if p), key=lambda i: list(prompts[i]))
    groups, run, shared = [], order[:1], None
    for a, b in zip(order, order[1:]):
        common = min(common_prefix(prompts[a], prompts[b]), len(prompts[a]) - 1, len(prompts[b]) - 1)
        common -= common % page_size
        if common >= min_tokens:
            run.append(b)
            shared = common if shared is None else min(shared, common)
        else:
            if len(run) > 1:
                groups.append((run, shared))
            run, shared = [b], None
    if len(run) > 1:
        groups.append((run, shared))
    for members, length in groups:
        prefix = SharedPrefix(list(prompts[members[0]][:length]), len(members))
        for i in members:
            out[i] = prefix
    return out
