"""Structured outputs over speculative token trees: the draft filter of :class:`~treedec.programs.speculative.program.
SpeculativeProgram` (its one hook into the loop).

Each step, before the tree is submitted, every draft token is checked against the grammar state of its parent node
(one xgrammar traversal of the tree from the sequence's state: :class:`~treedec.sampling.grammar.DraftGrammar`), and
the drafts the grammar rejects are pruned with their subtrees: they are never verified. After the step the target's
logits at every kept node are masked by that node's bitmask, so greedy acceptance compares each draft with the argmax
of the masked distribution: the accepted path and the bonus token are the tokens plain greedy decoding under the
grammar picks (greedy speculative + grammar == greedy + grammar, tested). A pruned draft is one whose masked
probability is 0, which greedy acceptance would have rejected anyway.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from treedec.sampling.grammar import DraftGrammar, Grammar, apply_bitmask
from treedec.tree.token_tree import TokenTree

__all__ = ["DraftFilter"]


class DraftFilter:
    """One request's grammar over its speculative steps (greedy acceptance): :meth:`first` masks the prompt's row,
    :meth:`prune` filters a proposal before it is submitted, :meth:`choice` is the masked argmax at every node of the
    step, :meth:`advance` takes the emitted tokens."""

    def __init__(self, grammar: Grammar, device: torch.device, stop_token_ids: Sequence[int]):
        self._state = DraftGrammar(grammar, device, stop_token_ids)
        self._masks: torch.Tensor | None = None   # [tree.size, ceil(V/32)]: the submitted tree's, by node

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """The prompt's last row [V] masked at the grammar's start (the first token's draw)."""
        return self._state.mask_first(logits)

    def prune(self, tree: TokenTree, tokens: list[int], probs: torch.Tensor | None
              ) -> tuple[TokenTree, list[int], torch.Tensor | None]:
        """The proposal without the drafts the grammar rejects at their parent's state (and their subtrees); kept
        nodes keep their order (parents first), ``probs`` rows cut to match."""
        kept, masks = self._state.prune(tree.parents, tokens)
        self._masks = masks
        if len(kept) == tree.size:
            return tree, tokens, probs
        new = np.full(tree.size, -1, dtype=np.int64)
        new[kept] = np.arange(len(kept))
        parents = [-1] + [int(new[tree.parents[i]]) for i in kept[1:].tolist()]
        return (TokenTree(parents), [tokens[i] for i in kept.tolist()],
                None if probs is None else probs[torch.as_tensor(kept, device=probs.device)])

    def cut(self, size: int) -> None:
        """The submitted tree is the first ``size`` nodes of the pruned one (a draft budget's cut)."""
        self._masks = self._masks[:size]

    def choice(self, logits: torch.Tensor) -> torch.Tensor:
        """[tree.size] int64 on the device: the argmax of each node's row of the step's ``logits`` under its
        bitmask (what greedy acceptance compares the drafts with)."""
        return apply_bitmask(logits.float().clone(), self._masks).argmax(dim=-1)

    def advance(self, tokens: Sequence[int]) -> None:
        """The tokens the step emitted (its accepted drafts and the bonus token)."""
        self._state.advance(tokens)
