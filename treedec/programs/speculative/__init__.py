"""Speculative decoding: a draft proposes a token tree, one engine step verifies all of it.

The package's face holds what a user of speculative decoding calls; the modules hold the rest:

- :mod:`~treedec.programs.speculative.program`: :func:`speculative_generate` (one request) and
  :class:`SpeculativeProgram` (a request as a scheduler program), :class:`SpeculativeStats`;
- :mod:`~treedec.programs.speculative.batch`: :func:`speculative_batch` (many requests in one forest);
- :mod:`~treedec.programs.speculative.config`: :class:`SpeculativeConfig` (a draft source configured once, for
  :class:`treedec.LLM`);
- :mod:`~treedec.programs.speculative.verify_table`: the pipelined steps of drafts with a fixed tree (step n + 1
  launched before step n's tokens reach the host), batched: every request of a group verified, accepted and
  drafted as one operation per step (:mod:`~treedec.programs.speculative.verify_group`,
  :mod:`~treedec.programs.speculative.verify_rows`);
- :mod:`~treedec.programs.speculative.acceptance` and :mod:`~treedec.programs.speculative.device_acceptance`: the
  acceptance rules (greedy, Medusa's typical, lossless rejection sampling), on the host and on the device;
- draft sources: :mod:`~treedec.programs.speculative.drafts` (the base class, n-gram lookup, fixed trees),
  :mod:`~treedec.programs.speculative.medusa` (the heads' network is :mod:`treedec.models.medusa`),
  :mod:`~treedec.programs.speculative.draft_model`,
  :mod:`~treedec.programs.speculative.eagle` (EAGLE-2 trees; fixed chains:
  :mod:`~treedec.programs.speculative.eagle_chains`);
- drafting for many requests at once: :mod:`~treedec.programs.speculative.drafter_batch` (one drafter step per
  tree layer for every request), :mod:`~treedec.programs.speculative.tree_drafting` (the drafts on an engine of
  their own), :mod:`~treedec.programs.speculative.draft_budget` (verify tokens a step for a batch).
"""
from treedec.programs.speculative.acceptance import (AcceptanceRule, GreedyAcceptance, RejectionSampling,
                                                   TypicalAcceptance)
from treedec.programs.speculative.batch import speculative_batch
from treedec.programs.speculative.config import SpeculativeConfig
from treedec.programs.speculative.draft_budget import DraftBudget
from treedec.programs.speculative.draft_model import DraftModelDraft
from treedec.programs.speculative.drafts import DraftSource, PromptLookupDraft, TargetOutput, TreeDraft
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.programs.speculative.program import SpeculativeProgram, SpeculativeStats, speculative_generate

__all__ = ["AcceptanceRule", "DraftBudget", "DraftModelDraft", "DraftSource", "EagleDraft", "GreedyAcceptance",
           "MedusaDraft", "PromptLookupDraft", "RejectionSampling", "SpeculativeConfig", "SpeculativeProgram",
           "SpeculativeStats",
           "TargetOutput", "TreeDraft", "TypicalAcceptance", "speculative_batch", "speculative_generate"]
