"""Drafters trained for the user's own model by self-distillation (``treedec train-drafter``).

- :mod:`treedec.train.data`: the target answers prompts through treedec's batched generation; its hidden states
  at every answer position go to disk in shards (:func:`distill`);
- :mod:`treedec.train.medusa`: Medusa-1 heads on the frozen target (:func:`train_medusa`);
- :mod:`treedec.train.eagle3`: an EAGLE-3 drafter with its training-time test (:func:`train_eagle3`);
- :mod:`treedec.train.checkpoints`: the checkpoints in Medusa's / EAGLE's layouts (:func:`save_medusa_heads`);
- :mod:`treedec.train.evaluate`: acceptance on held-out prompts with treedec's speculative decoding
  (:func:`evaluate_medusa`);
- :data:`DEFAULT_PROMPTS` / :data:`HELDOUT_PROMPTS`: the project's own instruction files (rewriting, explanation,
  lists, code, arithmetic; no downloaded dataset).
"""
from pathlib import Path

from treedec.train.checkpoints import save_medusa_heads
from treedec.train.data import DistillConfig, DistillManifest, DistillSummary, distill, read_manifest, read_shard
from treedec.train.eagle3 import Eagle3TrainConfig, Eagle3TrainResult, train_eagle3
from treedec.train.evaluate import Acceptance, evaluate_eagle3, evaluate_medusa
from treedec.train.medusa import MedusaTrainConfig, MedusaTrainResult, train_medusa

#: The training prompts shipped with treedec (JSONL, one ``{"prompt": ...}`` a line: treedec's prompts file format).
DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")
#: Held-out prompts of the same kinds (none of them in :data:`DEFAULT_PROMPTS`).
HELDOUT_PROMPTS = Path(__file__).with_name("heldout.jsonl")

__all__ = ["DEFAULT_PROMPTS", "HELDOUT_PROMPTS", "Acceptance", "DistillConfig", "DistillManifest", "DistillSummary",
           "Eagle3TrainConfig", "Eagle3TrainResult", "MedusaTrainConfig", "MedusaTrainResult", "distill",
           "evaluate_eagle3", "evaluate_medusa", "read_manifest", "read_shard", "save_medusa_heads", "train_eagle3",
           "train_medusa"]
