"""A speculative request's penalties on the target's logits at its tree's tokens, and its logprobs.

Plain decoding penalizes each step's logits by the output so far (:func:`~treedec.sampling.logits.apply_penalties`:
repetition over the prompt and the output, presence and frequency over the output). In a verified tree the logits
at node ``j`` give the token after ``j``, whose output so far is the request's emitted tokens (the tree's root, the
last of them, included) and then the draft tokens on the path from the root down to ``j``: :class:`TargetProcessing`
penalizes every row with its own path's counts (vLLM's rejection sampler does the same for its chains:
``_combine_outputs_with_spec_tokens``), so greedy acceptance picks plain greedy decoding's tokens with the same
penalties, and rejection sampling draws from the penalized distribution (its ``min_p`` is the rule's warper, as its
temperature, top-k and top-p are). A sampled draft's ``draft_probs`` are left as the drafter drew from them: lossless
rejection needs the ``q`` the draft tokens were drawn from.

Logprobs are the raw target's (vLLM's default ``logprobs_mode="raw_logprobs"``: before penalties and warpers, as
plain decoding reports them, :func:`~treedec.sampling.logits.token_logprobs`), each emitted token's under the row
of its parent.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.sampling.logits import TokenLogprobs, apply_penalties, count_tokens_, token_logprobs, token_mask
from treedec.sampling.params import SamplingParams
from treedec.transfer import to_device
from treedec.tree.token_tree import TokenTree

__all__ = ["TargetProcessing", "path_pairs"]


class TargetProcessing:
    """One run of a speculative request's penalties (device counts of its output) and logprobs (the entries so far).

    Parameters
    ----------
    params : the request's :class:`~treedec.sampling.params.SamplingParams` (``repetition_penalty``,
        ``presence_penalty``, ``frequency_penalty``, ``logprobs``).
    prompt_ids : its prompt (repetition counts its tokens).
    vocab_size, device : the target's.
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device: torch.device):
        self.params, self.device = params, device
        self.penalized = penalizes(params)
        self.prompt_mask = token_mask(prompt_ids, vocab_size, device, "prompt_ids") if self.penalized else None
        self.counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=device) if self.penalized else None
        self.records: list[TokenLogprobs] = []   # (not read yet)
        self.entries: list[dict] = []            # the read records' entries, one per emitted token
        self._pairs: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """The prompt's last logits ``[1, V]`` penalized (nothing emitted yet: repetition only)."""
        return self._penalize(logits, self.counts) if self.penalized else logits

    def tree(self, tree: TokenTree, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``logits [tree.size, V]`` at the tree's tokens (``tokens [tree.size]`` int64 on the device) penalized,
        each row by the emitted tokens and its path's draft tokens."""
        if not self.penalized:
            return logits
        rows, along = self._pairs.get(tree.parents) or self._pairs.setdefault(tree.parents, path_pairs(tree,
                                                                                                        self.device))
        counts = self.counts.expand(tree.size, -1).clone()
        if len(rows):
            counts.index_put_((rows, tokens.index_select(0, along)), torch.ones_like(rows, dtype=counts.dtype),
                              accumulate=True)
        return self._penalize(logits, counts)

    def emitted(self, raw: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
        """``tokens`` were emitted, each drawn at row ``rows[i]`` of the raw logits ``raw``: counted, and their
        logprobs recorded (device work, no wait)."""
        if not tokens:
            return
        ids = to_device(np.asarray(tokens, dtype=np.int64), self.device)
        if self.penalized:
            count_tokens_(self.counts, ids.reshape(1, -1))
        if self.params.logprobs is not None:
            picked = raw.index_select(0, to_device(np.asarray(rows, dtype=np.int64), raw.device))
            self.records.append(token_logprobs(picked, ids, self.params.logprobs))

    def logprobs(self) -> list[dict] | None:
        """Every emitted token's ``{token_id: Logprob}`` (the records not read yet read once each), or None when not
        asked for."""
        if self.params.logprobs is None:
            return None
        records, self.records = self.records, []
        for record in records:
            self.entries.extend(record.to_dicts())
        return self.entries

    def _penalize(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        p = self.params
        return apply_penalties(logits, self.prompt_mask, counts, p.repetition_penalty, p.presence_penalty,
                               p.frequency_penalty)


def penalizes(params: SamplingParams) -> bool:
    """Whether ``params`` set a penalty (repetition, presence or frequency)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def path_pairs(tree: TokenTree, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, along)`` int64 on ``device``: every pair of a tree node ``rows[i]`` and a draft token ``along[i]`` on
    its path from the root (itself included, the root not): the draft tokens each row's counts add."""
    rows, along = [], []
    for j in range(1, tree.size):
        a = j
        while a:
            rows.append(j)
            along.append(a)
            a = tree.parents[a]
    both = to_device(np.array([rows, along], dtype=np.int64).reshape(2, -1), device)
    return both[0], both[1]
