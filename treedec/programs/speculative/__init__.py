"""Speculative decoding: a draft proposes a token tree, one engine step verifies all of it.

The package's face holds what a user of speculative decoding calls; the modules hold the rest:

- :mod:`~treedec.search.speculative.program`: :func:`speculative_generate` (one request) and
  :class:`SpeculativeProgram` (a request as a scheduler program), :class:`SpeculativeStats`;
- :mod:`~treedec.search.speculative.batch`: :func:`speculative_batch` (many requests in one forest);
- :mod:`~treedec.search.speculative.config`: :class:`SpeculativeConfig` (a draft source configured once, for
  :class:`treedec.LLM`);
- :mod:`~treedec.search.speculative.pipeline`: the pipelined loop of drafts with a fixed tree (step n + 1
  launched before step n's tokens reach the host);
- :mod:`~treedec.search.speculative.acceptance` and :mod:`~treedec.search.speculative.device_acceptance`: the
  acceptance rules (greedy, Medusa's typical, lossless rejection sampling), on the host and on the device;
- draft sources: :mod:`~treedec.search.speculative.drafts` (the base class, n-gram lookup, fixed trees),
  :mod:`~treedec.search.speculative.medusa` (the heads' network is :mod:`treedec.models.medusa`),
  :mod:`~treedec.search.speculative.draft_model`,
  :mod:`~treedec.search.speculative.eagle` (EAGLE-2 trees; fixed chains:
  :mod:`~treedec.search.speculative.eagle_chains`);
- drafting for many requests at once: :mod:`~treedec.search.speculative.drafter_batch` (one drafter step per
  tree layer for every request), :mod:`~treedec.search.speculative.tree_drafting` (the drafts on an engine of
  their own), :mod:`~treedec.search.speculative.draft_budget` (draft tokens a step for a batch).
"""
from treedec.search.speculative.acceptance import (AcceptanceRule, GreedyAcceptance, RejectionSampling,
                                                   TypicalAcceptance)
from treedec.search.speculative.batch import speculative_batch
from treedec.search.speculative.config import SpeculativeConfig
from treedec.search.speculative.draft_budget import DraftBudget
from treedec.search.speculative.draft_model import DraftModelDraft
from treedec.search.speculative.drafts import DraftSource, PromptLookupDraft, TargetOutput, TreeDraft
from treedec.search.speculative.eagle import EagleDraft
from treedec.search.speculative.medusa import MedusaDraft
from treedec.search.speculative.program import SpeculativeProgram, SpeculativeStats, speculative_generate

__all__ = ["AcceptanceRule", "DraftBudget", "DraftModelDraft", "DraftSource", "EagleDraft", "GreedyAcceptance",
           "MedusaDraft", "PromptLookupDraft", "RejectionSampling", "SpeculativeConfig", "SpeculativeProgram",
           "SpeculativeStats",
           "TargetOutput", "TreeDraft", "TypicalAcceptance", "speculative_batch", "speculative_generate"]
