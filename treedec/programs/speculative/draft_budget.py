"""How many draft tokens each request of a speculative batch verifies a step.

One request alone verifies its draft's whole tree (a Medusa-64 tree, EAGLE-2's 63 tokens): a step of
64 query tokens still reads the weights at about the cost of one. A batch of 32 such trees is 2048
query tokens a step, far past the point where the verification's GEMMs stop being bound by reading
the weights and start being bound by arithmetic: every extra token then costs its full compute while
most draft tokens are rejected. So a batch shares a *step budget* of verify tokens among its requests
(EAGLE-2's and SGLang's ``num_draft_tokens``, made per batch):

- ``step_tokens`` (T): verify tokens a step for the whole batch, each request's root (the token it verifies
  whatever its draft) included, so that the step's rows are T: with R live requests the drafts share
  ``T - R``. ``"auto"``: 256 on a CUDA device (an H200 runs a Llama-3-8B step's GEMMs in 5.3 ms at 64 rows,
  5.5 at 128, 6.9 at 256, 8.1 at 320 and 11.2 at 512, ``bench/results/2026-12-02-nvidia-h200-gemm-rows-s19.json``:
  the knee is near 256), no limit on the CPU (reported when chosen);
- each live request ``i`` gets a share of ``T - R`` by its measured acceptance: weight
  ``w_i = 1 + a_i``, ``a_i`` the running mean (exponential, ``smoothing``) of the draft tokens it
  accepted per step, so that a request whose drafts are accepted verifies larger trees than one whose
  drafts are not; before its first step ``a_i = 0``; ``n_i = floor((T - R) * w_i / sum(w))``, at least
  ``min_tokens``, at most its draft's tree;
- its proposed tree is cut to its first ``n_i`` draft tokens (trees list parents first, so the cut is a
  tree; drafts order their tokens best first: EAGLE by depth then score, Medusa trees by their choices'
  order), and what the cut removes is never verified.

Each step's budget is recorded (:attr:`DraftBudget.history`): the batch size, T and every share.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from treedec.checks import fraction, nonnegative_int, positive_int
from treedec.tree.token_tree import TokenTree

logger = logging.getLogger("treedec")

__all__ = ["DraftBudget", "cut_tree"]

#: ``step_tokens="auto"`` on a CUDA device (see the module docstring).
AUTO_CUDA_STEP_TOKENS = 256


@dataclass
class DraftBudget:
    """The draft-token budget of a speculative batch (see the module docstring).

    Parameters
    ----------
    step_tokens : verify tokens a step for all requests together (their roots included), an int >= 1, ``"auto"``,
        or None (no limit).
    min_tokens : draft tokens a request verifies at least, when its draft proposes them (>= 0).
    smoothing : weight of the newest step in each request's running acceptance, in (0, 1].

    Attributes
    ----------
    history : one dict a budget decision: ``{"requests": live requests, "step_tokens": T, "tokens": that
        request's share}``.
    """

    step_tokens: int | str | None = "auto"
    min_tokens: int = 1
    smoothing: float = 0.3
    history: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if self.step_tokens not in ("auto", None):
            positive_int("step_tokens", self.step_tokens, note=", 'auto' or None")
        nonnegative_int("min_tokens", self.min_tokens)
        fraction("smoothing", self.smoothing)
        # Each live program's running acceptance in a slot of one array (slots assigned at join, freed at leave),
        # so that a verify group's step reads and updates its rows' with a few array operations; ``_order`` lists
        # the live slots in join order: the shares sum the acceptances in that order, as Python floats.
        self._slot: dict[int, int] = {}   # id(program) -> its slot
        self._acceptance = np.zeros(0, dtype=np.float64)
        self._order = np.zeros(0, dtype=np.int64)
        self._free: list[int] = []
        self._total: int | None = None

    def resolve(self, device: torch.device) -> int | None:
        """T for a batch on ``device`` (None: no limit); an automatic choice is logged once."""
        if self.step_tokens != "auto":
            return self.step_tokens
        if self._total is None:
            self._total = AUTO_CUDA_STEP_TOKENS if device.type == "cuda" else 0
            logger.info("speculative batch draft budget: %s (auto, %s)", f"{self._total} verify tokens a step"
                        if self._total else "no limit", device.type)
        return self._total or None

    def join(self, program) -> None:
        """``program`` runs from now on (its share counts; joined again, its acceptance starts again from 0)."""
        slot = self._slot.get(id(program))
        if slot is None:
            if not self._free:
                had = len(self._acceptance)
                self._acceptance = np.concatenate([self._acceptance, np.zeros(max(16, had))])
                self._free = list(range(len(self._acceptance) - 1, had - 1, -1))   # (the lowest popped first)
            slot = self._slot[id(program)] = self._free.pop()
            self._order = np.append(self._order, slot)
        self._acceptance[slot] = 0.0

    def leave(self, program) -> None:
        slot = self._slot.pop(id(program), None)
        if slot is not None:
            self._order = self._order[self._order != slot]
            self._free.append(slot)

    def slot(self, program) -> int:
        """``program``'s slot while it runs (the index :meth:`observe_many` and :meth:`group_tokens` take), -1 when
        it has not joined."""
        return self._slot.get(id(program), -1)

    def observe(self, program, accepted: int) -> None:
        """``program``'s step accepted ``accepted`` draft tokens."""
        self.observe_many(np.array([self.slot(program)]), np.array([accepted]))

    def observe_many(self, slots: np.ndarray, accepted: np.ndarray) -> None:
        """The programs of ``slots`` (``[k]`` int64, :meth:`slot`; -1: not joined, skipped) accepted ``accepted``
        (``[k]`` ints) draft tokens at their step: a batched verify group's step."""
        live = slots >= 0
        at = slots[live]
        self._acceptance[at] = (1 - self.smoothing) * self._acceptance[at] + self.smoothing * accepted[live]

    def group_tokens(self, slots: np.ndarray, device: torch.device, proposed: int) -> int:
        """Draft tokens each of the programs of ``slots`` (``[k]`` int64, :meth:`slot`) verifies this step when they
        verify trees cut alike (a batched verify group, :mod:`~treedec.programs.speculative.verify_table`): the mean
        of their shares, at least ``min_tokens``, at most ``proposed``; recorded once per program in
        :attr:`history`."""
        total = self.resolve(device)
        live = slots[slots >= 0]
        if total is None or not len(live):
            return proposed
        share = int(self._drafts(total) * sum((1.0 + self._acceptance[live]).tolist()) / (self._weights() * len(live)))
        n = min(proposed, max(self.min_tokens, share))
        self.history.extend([{"requests": len(self._order), "step_tokens": total, "tokens": n}] * len(live))
        return n

    def tokens(self, program, device: torch.device, proposed: int) -> int:
        """Draft tokens ``program`` verifies this step, of the ``proposed`` its draft made."""
        total = self.resolve(device)
        slot = self.slot(program)
        if total is None or slot < 0:
            return proposed
        share = int(self._drafts(total) * (1.0 + float(self._acceptance[slot])) / self._weights())
        n = min(proposed, max(self.min_tokens, share))
        self.history.append({"requests": len(self._order), "step_tokens": total, "tokens": n})
        return n

    def _drafts(self, total: int) -> int:
        """The draft tokens the live programs share of a budget of ``total`` verify tokens: less their roots."""
        return max(total - len(self._order), 0)

    def _weights(self) -> float:
        """The sum of the live programs' weights ``1 + a``: their count plus their acceptances summed in join order
        (Python's float sum: the shares do not depend on the slots)."""
        return len(self._order) + sum(self._acceptance[self._order].tolist())


def cut_tree(tree: TokenTree, tokens: list[int], draft_tokens: int, probs: torch.Tensor | None = None
             ) -> tuple[TokenTree, list[int], torch.Tensor | None]:
    """The first ``draft_tokens`` draft tokens of a proposal (and the root): a tree, since parents come
    first; ``probs`` (a sampled draft's ``[tree.size, vocab]``) cut to match."""
    keep = draft_tokens + 1
    if keep >= tree.size:
        return tree, tokens, probs
    return TokenTree(tree.parents[:keep]), tokens[:keep], None if probs is None else probs[:keep]
