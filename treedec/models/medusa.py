"""Medusa heads (Cai et al. 2024): extra decoding heads on the base model's last hidden state.

Head ``i`` maps the final-norm hidden state at position ``t`` to logits for position
``t + 2 + i`` (``lm_head`` itself gives ``t + 1``): a stack of residual blocks
``x + SiLU(Linear(x))`` then ``Linear(hidden, vocab, bias=False)``. The draft source that turns
the heads' top-k candidates into token trees is
:class:`~treedec.programs.speculative.medusa.MedusaDraft`.

Checkpoints: the Medusa project's ``medusa_lm_head.safetensors`` / ``medusa_lm_head.pt``,
the state dict of an ``nn.ModuleList`` of ``nn.Sequential`` heads, keys
``{head}.{block}.linear.weight`` [hidden, hidden], ``{head}.{block}.linear.bias`` [hidden]
and ``{head}.{num_layers}.weight`` [vocab, hidden] (optionally under ``medusa_head.``).
:class:`MedusaHeads` keeps that module list as ``medusa_head``, as Medusa does, so
``heads.medusa_head.state_dict()`` is such a checkpoint.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from treedec.checks import nonnegative_int, positive_int
from treedec.models.base import DecoderModel
from treedec.models.linear import Linear
from treedec.models.loading import read_state_dict

CHECKPOINT_NAMES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))`` with ``linear: hidden -> hidden`` (with bias)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size, True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` Medusa heads, each ``num_layers`` :class:`ResBlock` then ``Linear(hidden, vocab)``.

    Build with :func:`load_medusa_heads` (a checkpoint) or :meth:`untrained` (Medusa's
    initialisation, for tests and demos). Calling it maps hidden states
    ``[..., hidden_size]`` to logits ``[..., num_heads, vocab_size]``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 dtype: torch.dtype | None = None, device=None):
        for name, value in [("hidden_size", hidden_size), ("vocab_size", vocab_size), ("num_heads", num_heads)]:
            positive_int(f"MedusaHeads {name}", value)
        nonnegative_int("MedusaHeads num_layers", num_layers)
        super().__init__()
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size, dtype, device) for _ in range(num_layers)],
                          Linear(hidden_size, vocab_size, False, dtype, device))
            for _ in range(num_heads))
        self.hidden_size, self.vocab_size, self.num_layers = hidden_size, vocab_size, num_layers

    @property
    def num_heads(self) -> int:
        return len(self.medusa_head)

    @classmethod
    def untrained(cls, model: DecoderModel, num_heads: int = 4, num_layers: int = 1, seed: int = 0) -> MedusaHeads:
        """Heads as Medusa initialises them before training: zero ResBlock weights (default
        bias init, seeded) and every head's output layer a copy of the model's ``lm_head``."""
        c = model.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            heads = cls(c.hidden_size, c.vocab_size, num_heads, num_layers, dtype=torch.float32)
        with torch.no_grad():
            for head in heads.medusa_head:
                for block in head[:-1]:
                    block.linear.weight.zero_()
                head[-1].weight.copy_(model.lm_head.weight)
        return heads.to(dtype=model.dtype, device=model.device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., hidden_size]`` -> logits ``[..., num_heads, vocab_size]``."""
        with torch.no_grad():   # not inference_mode: the engine may call it inside torch.compile
            return torch.stack([head(hidden) for head in self.medusa_head], dim=-2)


def load_medusa_heads(path: str | Path, model: DecoderModel) -> MedusaHeads:
    """Load a Medusa head checkpoint for ``model`` (its dtype and device).

    ``path``: a ``.safetensors`` / ``.pt`` / ``.bin`` file, or a directory holding one of
    :data:`CHECKPOINT_NAMES`. The number of heads and of ResBlocks per head come from the
    keys; every tensor is checked against ``model``'s hidden size and vocabulary. Raises
    FileNotFoundError or ValueError naming the file, key, expected and actual shape.
    """
    file = _checkpoint_file(Path(path))
    state = read_state_dict(file, "Medusa head checkpoint")
    if state and all(k.startswith("medusa_head.") for k in state):
        state = {k[len("medusa_head."):]: v for k, v in state.items()}
    parsed, unknown = {}, []
    for key in state:
        m = _KEY.fullmatch(key)
        if m is None:
            unknown.append(key)
        else:
            parsed[key] = (int(m[1]), int(m[2]), m[3])
    if unknown or not parsed:
        raise ValueError(f"{file} is not a Medusa head checkpoint: expected keys like '0.0.linear.weight', "
                         f"'0.1.weight', got {(unknown or list(state))[:5]}")
    num_heads = 1 + max(h for h, _, _ in parsed.values())
    final = {h: j for h, j, kind in parsed.values() if kind == "weight"}
    if sorted(final) != list(range(num_heads)):
        raise ValueError(f"{file}: every head 0..{num_heads - 1} needs an output layer '{{head}}.{{n}}.weight'; "
                         f"found it for heads {sorted(final)}")
    num_layers = final[0]
    c = model.config
    expected = {}
    for h in range(num_heads):
        for j in range(num_layers):
            expected[f"{h}.{j}.linear.weight"] = (c.hidden_size, c.hidden_size)
            expected[f"{h}.{j}.linear.bias"] = (c.hidden_size,)
        expected[f"{h}.{num_layers}.weight"] = (c.vocab_size, c.hidden_size)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{file}: {num_heads} heads with {num_layers} ResBlock(s) each (from head 0) expect other "
                         f"keys: missing {missing[:5]}, unexpected {extra[:5]}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{file}: '{key}' has shape {list(state[key].shape)}, expected {list(shape)} for a "
                             f"model of hidden size {c.hidden_size} and vocabulary {c.vocab_size}")
    heads = MedusaHeads(c.hidden_size, c.vocab_size, num_heads, num_layers, dtype=model.dtype, device="meta")
    heads.medusa_head.load_state_dict({k: v.to(model.dtype) for k, v in state.items()}, assign=True)
    return heads.to(model.device)


# ================================================================ private


def _checkpoint_file(path: Path) -> Path:
    if path.is_dir():
        for name in CHECKPOINT_NAMES:
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path} holds no Medusa head checkpoint (looked for {', '.join(CHECKPOINT_NAMES)})")
    if not path.is_file():
        raise FileNotFoundError(f"Medusa head checkpoint {str(path)!r} does not exist")
    return path
