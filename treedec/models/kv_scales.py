"""The fp8 KV-cache scales an FP8 checkpoint holds (``model.kv_scales``): one K and one V scale per layer.

The tensor names vLLM reads (``maybe_remap_kv_scale_name``), ``{a}`` = ``model.layers.<i>.self_attn``:

- ``{a}.k_proj.k_scale``, ``{a}.v_proj.v_scale`` (AutoFP8 / ModelOpt);
- ``{a}.k_scale``, ``{a}.v_scale`` (compressed-tensors' ``kv_cache_scheme``);
- ``{a}.kv_scale`` (the legacy single scale: K's and V's).

Each is one float (shape ``()`` or ``[1]``, float32 / bf16 / fp16), finite and > 0, a stored e4m3 value times it
being the value. A checkpoint holds them for every layer or for none; an engine with ``kv_cache_dtype="fp8"`` stores
K/V with them (:mod:`treedec.engine.kv_cache`), any other ignores them, as vLLM does. Under tensor parallelism every
rank reads them whole (a scale per layer serves every KV head).
"""
from __future__ import annotations

import math
import re

import torch

from treedec.errors import CheckpointError

__all__ = ["KV_SCALE_DTYPES", "KVScaleReader", "check_kv_scale_header", "is_kv_scale"]

_NAME = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.self_attn\."
                   r"(k_proj\.k_scale|v_proj\.v_scale|k_scale|v_scale|kv_scale)")
_WHICH = {"k_proj.k_scale": (0,), "k_scale": (0,), "v_proj.v_scale": (1,), "v_scale": (1,), "kv_scale": (0, 1)}
#: The dtypes a scale may be stored in (safetensors' names, as the header check reads them).
KV_SCALE_DTYPES = ("float32", "bfloat16", "float16")
_SHAPES = ((), (1,))


def is_kv_scale(name: str) -> bool:
    """Whether ``name`` is one of the KV-cache scale tensors (the module docstring's names)."""
    return _NAME.fullmatch(name) is not None


def check_kv_scale_header(name: str, shape: tuple[int, ...], dtype: str, num_layers: int, file: str) -> None:
    """CheckpointError unless the scale ``name`` (:func:`is_kv_scale`) has one value of a float dtype and names a
    layer of the config."""
    layer = int(_NAME.fullmatch(name)[1])
    if layer >= num_layers:
        raise CheckpointError(f"{file}: tensor {name} is the KV scale of layer {layer}, but the config has "
                              f"{num_layers} layers")
    if tuple(shape) not in _SHAPES or dtype.removeprefix("torch.") not in KV_SCALE_DTYPES:
        raise CheckpointError(f"{file}: tensor {name} must be one float (shape () or (1,), one of "
                              f"{list(KV_SCALE_DTYPES)}), got shape {tuple(shape)} of {dtype}")


class KVScaleReader:
    """Collects a checkpoint's KV scales as its tensors stream by (:meth:`take`), then gives them as one tensor
    (:meth:`result`)."""

    def __init__(self, num_layers: int, source: str):
        self.num_layers, self.source = num_layers, source
        self._values: dict[tuple[int, int], tuple[float, str]] = {}

    def take(self, name: str, tensor: torch.Tensor, file: str) -> bool:
        """Keep ``tensor`` if ``name`` is a KV scale (True; CheckpointError for a bad one, or a layer's scale given
        twice), else False."""
        m = _NAME.fullmatch(name)
        if m is None:
            return False
        dtype = str(tensor.dtype).removeprefix("torch.")
        check_kv_scale_header(name, tuple(tensor.shape), dtype, self.num_layers, file)
        value = float(tensor.float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise CheckpointError(f"{file}: tensor {name} must be finite and > 0 (a KV-cache scale), got {value}")
        layer = int(m[1])
        for which in _WHICH[m[2]]:
            if (layer, which) in self._values:
                raise CheckpointError(f"{file}: layer {layer}'s {'kv'[which].upper()} scale is given twice ({name} "
                                      f"and {self._values[layer, which][1]})")
            self._values[layer, which] = (value, name)
        return True

    def result(self) -> torch.Tensor | None:
        """``[num_layers, 2]`` float32 (K's, V's scale per layer), or None for a checkpoint without them;
        CheckpointError for one that has some layers' and not others'."""
        if not self._values:
            return None
        missing = [f"{'kv'[w].upper()} of layer {i}" for i in range(self.num_layers) for w in (0, 1)
                   if (i, w) not in self._values]
        if missing:
            raise CheckpointError(f"{self.source}: the checkpoint has KV-cache scales (k_scale / v_scale) for some "
                                  f"layers only: it lacks {len(missing)}, e.g. {missing[:4]}")
        return torch.tensor([[self._values[i, w][0] for w in (0, 1)] for i in range(self.num_layers)],
                            dtype=torch.float32)
