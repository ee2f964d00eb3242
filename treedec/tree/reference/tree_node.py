"""TreeNode: one node of a :class:`~treedec.tree.SequenceTree` (internal; the tree's methods are the API)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True, eq=False)
class TreeNode:
    """A run of tokens extending its parent's sequence, and the pool slots and pages that hold their K/V."""

    id: int
    parent: int | None
    tokens: list[int]
    slots: np.ndarray                      # capacity buffer; the first len(tokens) are valid
    pages: list[int]                       # distinct pages this node holds a reference on
    tail_room: int = 0                     # free slots after the last token that this node may fill
    pending: int = 0                       # trailing tokens not yet committed
    paused: bool = False
    shared: bool = False                   # a shared root: computed tokens in pages others hold too
    children: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)
