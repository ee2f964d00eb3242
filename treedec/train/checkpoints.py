"""Trained drafters written in the layouts the ecosystem reads.

- **Medusa heads** as FasterDecoding/Medusa's training scripts save them: ``medusa_lm_head.safetensors`` (the state
  dict of the ``medusa_head`` module list: ``{head}.{block}.linear.weight`` / ``.bias``, ``{head}.{num_layers}.weight``)
  and a ``config.json`` with Medusa's ``MedusaConfig`` fields (``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``), so Medusa's own code, TGI and TensorRT-LLM's converter read the folder, and treedec
  reads it back with :func:`~treedec.models.medusa.load_medusa_heads` (``treedec spec --speculative medusa --medusa
  DIR``, ``SpeculativeConfig(method="medusa", model=DIR)``, ``treedec serve --speculative medusa``).
- **EAGLE-3 drafters** through :func:`~treedec.models.eagle_drafter.save_eagle` (EAGLE's / SGLang SpecForge's layout:
  ``config.json`` + ``model.safetensors`` with ``d2t`` / ``t2d``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from treedec.models.medusa import CHECKPOINT_NAMES, MedusaHeads

__all__ = ["MEDUSA_CONFIG", "save_medusa_heads"]

MEDUSA_CONFIG = "config.json"


def save_medusa_heads(heads: MedusaHeads, out_dir: str | Path, base_model: str, dtype: torch.dtype | None = None
                      ) -> Path:
    """Write ``heads`` to ``out_dir`` (an existing folder) as Medusa's repository does; returns the weights file.

    ``base_model``: the target's name or path (``base_model_name_or_path``); ``dtype``: the tensors' dtype
    (default the heads' own)."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"save_medusa_heads: folder {str(out)!r} does not exist")
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in heads.medusa_head.state_dict().items()}
    file = out / CHECKPOINT_NAMES[0]
    save_file(state, str(file), metadata={"format": "pt"})
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "base_model_name_or_path": str(base_model), "hidden_size": heads.hidden_size,
              "vocab_size": heads.vocab_size, "torch_dtype": str(dtype or next(iter(state.values())).dtype
                                                                  ).removeprefix("torch.")}
    (out / MEDUSA_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return file
