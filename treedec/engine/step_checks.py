"""What a step accepts: the checks of :meth:`Engine.step`'s and :meth:`Engine.prefill`'s inputs (and of callers
that build steps themselves: the scheduler's prompts, :class:`~treedec.engine.step_chain.StepChain`). Each raises
naming the argument, the expected and the actual value, before anything changes."""
from __future__ import annotations

import numpy as np
import torch

from treedec.tree.validate import int_array

__all__ = ["check_device_tokens", "check_features", "check_rows", "check_token_ids", "check_window",
           "describe_tensor"]


def describe_tensor(value) -> str:
    """A tensor's shape, dtype and device (or the value's type) for error messages: not its values,
    whose repr would wait for the device."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)} on {value.device}"
    return type(value).__name__


def check_features(features: torch.Tensor | None, num_q: int, width: int | None, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """A step's per-query ``features`` (``[num_q, width]`` floats on ``device``, for models that read them:
    ``width`` not None), cast to ``dtype``."""
    if features is None:
        if width is not None:
            raise ValueError(f"this engine's model reads per-query features: step() needs features "
                             f"[{num_q}, {width}]")
        return None
    if width is None:
        raise ValueError("features are for models that read per-query features (EAGLE drafters); this "
                         "engine's model reads token ids only")
    if not isinstance(features, torch.Tensor) or tuple(features.shape) != (num_q, width) \
            or features.device != device or not features.is_floating_point():
        raise ValueError(f"features must be a float tensor of shape [{num_q}, {width}] (one row per pending "
                         f"token) on {device}, got {describe_tensor(features)}")
    return features.to(dtype)


def check_device_tokens(tokens: torch.Tensor | None, num_q: int, device: torch.device,
                        what: str | None = "one per pending token") -> torch.Tensor | None:
    """A step's token ids given on the device (``[num_q]`` int32/int64 on ``device``, ``what``; None: at least
    ``num_q``, one per token row first), as int64."""
    if tokens is None:
        return None
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"tokens must be an int64 or int32 tensor, got {describe_tensor(tokens)}")
    if (tokens.shape != (num_q,) if what is not None else tokens.dim() != 1 or tokens.shape[0] < num_q) \
            or tokens.device != device:
        raise ValueError(f"tokens must have shape [{num_q}] ({what or 'at least one per token row'}) on {device}, got "
                         f"{describe_tensor(tokens)}")
    return tokens.long()


def check_window(sliding_window: int | None, max_position: int) -> None:
    """Refuse positions past a config's sliding window that the model's layers do not attend as a window (the
    engine's ``window_cap``: their attention variants have none; None: no cap)."""
    if sliding_window is not None and max_position >= sliding_window:
        raise NotImplementedError(
            f"position {max_position} is past the model's sliding window of {sliding_window} tokens, which its "
            f"layers' attention variants do not implement (they attend whole paths): the positions stop there")


def check_token_ids(tokens: np.ndarray, vocab: int, name: str) -> None:
    """Every id in ``[0, vocab)``."""
    bad = tokens[(tokens < 0) | (tokens >= vocab)]
    if len(bad):
        raise ValueError(f"{name} must be token ids in [0, {vocab}), got {bad[:5].tolist()}")


def check_rows(rows, num_q: int, name: str = "logits_rows") -> np.ndarray | None:
    """Query rows (ints in ``[0, num_q)``, any 1-D collection or tensor) as an int64 array; None stays None."""
    if rows is None:
        return None
    if type(rows) is np.ndarray and rows.dtype == np.int64 and rows.ndim == 1:
        arr = rows   # (a step's own rows, e.g. the scheduler's: checked without a copy; never written)
    else:
        arr = int_array(rows.cpu() if isinstance(rows, torch.Tensor) else rows, name)
    if len(arr) and (np.minimum.reduce(arr) < 0 or np.maximum.reduce(arr) >= num_q):
        raise ValueError(f"{name} must be query indices in [0, {num_q}), got {arr[:10].tolist()}")
    return arr
