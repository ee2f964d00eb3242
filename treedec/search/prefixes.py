"""Prompt prefixes shared across the requests of a batch: one copy of their K/V.

Requests whose prompts start with the same tokens (a system prompt, few-shot examples) read
one copy of that prefix. Before a run the prompts are matched against each other: sorted,
runs of neighbours whose longest common prefix has at least ``min_tokens`` tokens form a
group, its prefix the run's shortest common one (what every member starts with). A group's
prefix is prefilled once, as a root of the forest, when its first member is admitted; each
member's prompt continues under it as a child node; the prefix is pruned after its last
member retires.

A prefix stops one token short of its shortest member's prompt, so every member has a node
of its own (programs grow and accept tokens on their own prompt's node; a prefix node is
never changed after its prefill).
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
    tokens : the prefix's token ids.
    members : requests that read it and have not retired yet.
    node : its root node once prefilled, else None.
    """

    tokens: list[int]
    members: int
    node: int | None = None

    def admission_pages(self, pool: PagedKVPool) -> int:
        """Pages admitting a member takes for the prefix itself: all of them before its prefill, then 0."""
        return pool.pages_for(len(self.tokens)) if self.node is None else 0

    def acquire(self, engine) -> None:
        """Prefill the prefix if no member has yet (the tree must have no pending tokens)."""
        if self.node is None:
            self.node, _ = engine.prefill(self.tokens)

    def release(self, tree: SequenceTree, all_members: bool = False) -> None:
        """A member retired (``all_members``: the run ended): prune the prefix after its last member."""
        self.members = 0 if all_members else self.members - 1
        if self.members == 0 and self.node is not None:
            if self.node in tree:
                tree.prune(self.node)
            self.node = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def share_prefixes(prompts: Sequence[Sequence[int] | None], min_tokens: int
                   ) -> list[SharedPrefix | None]:
    """Each prompt's :class:`SharedPrefix` (None: it shares none, or it is None).

    A prefix has at least ``min_tokens`` (>= 1) tokens and is shorter than each of its
    members' prompts; members of one group get the same object.
    """
    assert min_tokens >= 1, f"{min_tokens=}"
    out: list[SharedPrefix | None] = [None] * len(prompts)
    order = sorted((i for i, p in enumerate(prompts) if p), key=lambda i: list(prompts[i]))
    groups, run, shared = [], order[:1], None
    for a, b in zip(order, order[1:]):
        common = min(common_prefix(prompts[a], prompts[b]), len(prompts[a]) - 1, len(prompts[b]) - 1)
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
