"""Medusa drafts (Cai et al. 2024): :class:`MedusaDraft` turns the top-k candidates of Medusa heads
(the network, :class:`~treedec.models.medusa.MedusaHeads`, and its checkpoints are in
:mod:`treedec.models.medusa`) into the token tree of a list of Medusa *choices*.
"""
from __future__ import annotations

from typing import Sequence

import torch

from treedec.engine import Engine
from treedec.models.medusa import MedusaHeads
from treedec.programs.speculative.drafts import DeviceStep, DraftSource, TargetOutput
from treedec.tree.token_tree import TokenTree

#: A small Medusa tree (10 draft tokens, depth 4): top-3 of head 0, top-2 after the best, ...
#: Medusa's tuned trees (e.g. ``mc_sim_7b_63``) can be passed as ``choices`` as they are.
DEFAULT_MEDUSA_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0))
#: Medusa's 64-token tree (63 draft tokens and the root, depth 4: its ``mc_sim_7b_63``, tuned for Vicuna-7B), the
#: tree trained heads are measured with (``treedec spec --medusa-choices mc_sim_7b_63``).
MEDUSA_64_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,),
    (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6),
    (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2),
    (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1),
    (1, 6), (0, 7, 0))


class MedusaDraft(DraftSource):
    """Token trees from Medusa heads: the draft token of choice path ``[a, b, c]`` is the
    a-th candidate of head 0, the b-th of head 1 and the c-th of head 2 (candidates
    sorted by logit, highest first), read from the target's hidden state at the token
    before the root; a path's candidate does not depend on its parent, as in Medusa.

    A draft source for :func:`~treedec.programs.speculative.program.speculative_generate`. As in
    Medusa, the heads run inside the target's verification step, at every verified token
    (:meth:`row_head`, the engine's row head: in the step's CUDA graph on a GPU), and the
    next draft takes the candidates at the last accepted token; ``in_step=False`` runs them
    after the step instead, on that token's hidden state alone (less compute, one step more).

    Parameters
    ----------
    heads : the Medusa heads of the target model.
    choices : index paths, one per draft token (see
        :meth:`~treedec.tree.token_tree.TokenTree.from_medusa_choices`); a path may be at
        most ``heads.num_heads`` long. Default :data:`DEFAULT_MEDUSA_CHOICES`.
    in_step : run the heads inside the verification step (default) or after it.
    """

    def __init__(self, heads: MedusaHeads, choices: Sequence[Sequence[int]] = DEFAULT_MEDUSA_CHOICES,
                 in_step: bool = True):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"heads must be MedusaHeads, got {type(heads).__name__}")
        self.tree = TokenTree.from_medusa_choices(choices)   # validates the paths
        paths = sorted((tuple(p) for p in choices), key=lambda p: (len(p), p))   # token i + 1 is paths[i]
        deep = [list(p) for p in paths if len(p) > heads.num_heads]
        if deep:
            raise ValueError(f"choices path {deep[0]} is {len(deep[0])} deep but there are {heads.num_heads} Medusa "
                             f"heads (one per depth)")
        wide = [list(p) for p in paths if max(p) >= heads.vocab_size]
        if wide:
            raise ValueError(f"choices path {wide[0]} asks for a candidate rank >= the vocabulary size "
                             f"{heads.vocab_size}")
        if not isinstance(in_step, bool):
            raise ValueError(f"in_step must be a bool, got {in_step!r}")
        self.heads = heads
        self.in_step = in_step
        self._paths = paths
        self._top_k = [1 + max(p[-1] for p in paths if len(p) == d) for d in range(1, max(map(len, paths)) + 1)]
        self._candidates = _Candidates(heads, len(self._top_k), max(self._top_k))
        self._observed: tuple[int, int] | None = None   # (length, last token) of the sequence observed
        self._hidden: torch.Tensor | None = None
        self._top: torch.Tensor | None = None   # [depth, max top-k] candidates, from the step
        self._flat_index: tuple[torch.Tensor, int] | None = None   # device_drafts' gather, for a width k

    @property
    def max_depth(self) -> int:
        """The depth of the tree's deepest token (its longest choice path)."""
        return max(self.tree.depth)

    @property
    def needs_hidden(self) -> bool:
        """The target's hidden state is wanted (heads run after the step: ``in_step=False``)."""
        return not self.in_step

    @property
    def row_head(self):
        """The target's row head (:meth:`Engine.add_row_head`) with ``in_step``: hidden states
        ``[rows, hidden_size]`` -> each row's candidates ``[rows, depth, max top-k]`` (token ids,
        best first, per head); else None. Drafts with the same heads and tree depth and width
        have equal row heads: the requests of a batch share one."""
        return self._candidates if self.in_step else None

    @property
    def fixed_tree(self) -> TokenTree | None:
        """The tree of the choices when the heads run inside the step (``in_step``): the tokens then come from
        their candidates on the device (:meth:`device_drafts`); else None."""
        return self.tree if self.in_step else None

    @property
    def batch_key(self):
        """Medusa drafts of the same heads, depth, width and choices draft together (:meth:`row_head_drafts`)."""
        return (self._candidates, tuple(self._paths)) if self.in_step else None

    def device_drafts(self, step: DeviceStep) -> torch.Tensor:
        """The draft tokens from the heads' candidates ``[depth, k]`` at the last accepted token (the
        :attr:`row_head`'s output there, ``step.head``), gathered on the device."""
        if not self.in_step or step.head is None:
            return super().device_drafts(step)
        return self.row_head_drafts(step.head[None])[0]

    def row_head_drafts(self, heads: torch.Tensor) -> torch.Tensor:
        """The draft tokens of ``R`` requests from their heads' candidates ``heads [R, depth, k]`` (the
        :attr:`row_head`'s output at each one's last accepted token): ``[R, tree.size - 1]``, one gather."""
        if not self.in_step:
            return super().row_head_drafts(heads)
        k = heads.shape[-1]
        if self._flat_index is None or self._flat_index[0].device != heads.device or self._flat_index[1] != k:
            index = torch.tensor([(len(p) - 1) * k + p[-1] for p in self._paths], dtype=torch.int64)
            self._flat_index = (index.to(heads.device), k)
        return heads.reshape(len(heads), -1)[:, self._flat_index[0]]

    def start(self, engine: Engine) -> None:
        """Check the heads fit the target model; forget the previous request."""
        c = engine.model.config
        if (self.heads.hidden_size, self.heads.vocab_size) != (c.hidden_size, c.vocab_size):
            raise ValueError(f"the Medusa heads are for hidden size {self.heads.hidden_size} and vocabulary "
                             f"{self.heads.vocab_size}, the target model has {c.hidden_size} and {c.vocab_size}")
        self._observed = self._hidden = self._top = None

    def observe(self, output: TargetOutput) -> None:
        """Keep the heads' candidates (``output.head``) or the target's hidden state at the token
        before the root of ``output.tokens``."""
        if output.head is None and output.hidden is None:
            raise ValueError("MedusaDraft needs the heads' candidates or the target's hidden state (TargetOutput.head "
                             "and TargetOutput.hidden are None)")
        # Its length and last token identify the sequence for propose: comparing whole sequences
        # would cost O(sequence) a step (1-3 ms at 32000 tokens).
        self._observed = (len(output.tokens), int(output.tokens[-1]))
        self._hidden, self._top = output.hidden, output.head

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]:
        last = int(sequence_tokens[-1])
        if (self._top is None and self._hidden is None) or (len(sequence_tokens), last) != self._observed:
            raise ValueError("MedusaDraft.propose needs the target's hidden state for this sequence: run it through "
                             "speculative_generate, or call observe(TargetOutput(sequence, hidden)) first")
        top = self._candidates(self._hidden) if self._top is None else self._top
        top = top.tolist()                                                       # one transfer for every head
        return self.tree, [last] + [top[len(p) - 1][p[-1]] for p in self._paths]


# ================================================================ private


class _Candidates:
    """Hidden states ``[..., hidden_size]`` -> the heads' top-k token ids ``[..., depth, k]``.
    Equal for the same heads, depth and k (the engine keeps one row head for such drafts)."""

    def __init__(self, heads: MedusaHeads, depth: int, k: int):
        self.heads, self.depth, self.k = heads, depth, k

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.heads(hidden)[..., :self.depth, :]                        # [..., depth, vocab]
        return logits.topk(self.k, dim=-1).indices

    def __eq__(self, other) -> bool:
        return isinstance(other, _Candidates) and (other.heads, other.depth, other.k) == (self.heads, self.depth, self.k)

    def __hash__(self) -> int:
        return hash((id(self.heads), self.depth, self.k))
