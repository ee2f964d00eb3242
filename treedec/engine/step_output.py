"""What :meth:`Engine.step <treedec.engine.Engine.step>` and :meth:`Engine.prefill <treedec.engine.Engine.prefill>`
return: named fields, the same type whichever outputs were asked for (those not asked for are None)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepOutput:
    """What one engine step returns at the asked rows.

    Attributes
    ----------
    logits : [r, vocab] tensor
        At the step's ``logits_rows`` (default every query), in the model dtype, on its device.
    hidden : [h, hidden_size] tensor or None
        The final-norm hidden states (the ``lm_head`` input) at ``hidden_rows`` (default
        ``logits_rows``), when the step was asked ``return_hidden``.
    aux : [h, len(hidden_layers), hidden_size] tensor or None
        The residual stream entering each layer of :attr:`Engine.hidden_layers` at ``hidden_rows``,
        when the step was asked ``return_aux``.
    heads : dict of str to [r, ...] tensor, or None
        Each row head's output (:meth:`Engine.add_row_head`) at ``logits_rows``, by the head's name,
        when the step was asked ``return_heads``.
    """
    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    heads: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class PrefillOutput:
    """What :meth:`Engine.prefill <treedec.engine.Engine.prefill>` returns: the prompt's node and its last token's outputs.

    Attributes
    ----------
    node : int
        The new node holding the prompt.
    logits : [vocab] tensor
        At the prompt's last token.
    hidden : [hidden_size] tensor or None
        The last token's final-norm hidden state, when the prefill was asked ``return_hidden``.
    heads : dict of str to [...] tensor, or None
        Each row head's output at the last token, by the head's name, when the prefill was asked
        ``return_heads``.
    """
    node: int
    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    heads: dict[str, torch.Tensor] | None = None
