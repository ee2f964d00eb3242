"""Every GEMM of a model is a :class:`Linear`: its tensor-parallel mode, its fused output shards, and a
quantization method (:class:`LinearMethod`) that owns its weight tensors.

- Modes: ``"replicated"`` (the whole weight in every process), ``"column"`` (this rank's output rows:
  fused shards such as ``[q_r | k_r | v_r]``; no collective), ``"row"`` (this rank's input columns:
  ``sum over ranks (x_r @ W_r.T)`` by one all-reduce, the bias, whole on every rank, added once after it).
  Without a tensor-parallel group every mode computes ``F.linear(x, weight, bias)``.
- Shards: the output sizes of the projections fused in the weight (``(q, kv, kv)`` for ``qkv_proj``,
  ``(inter, inter)`` for ``gate_up_proj``, one size for a plain projection); a checkpoint tensor fills
  the rows of one shard (or of all of them, when the checkpoint fuses them too).
- Methods: :class:`Unquantized` (the default: ``weight [out, in]`` in the model dtype, ``F.linear``, what
  ``nn.Linear`` computes) or fp8 (:mod:`~treedec.models.fp8`). A method creates the layer's tensors, says
  which checkpoint tensors (names, shapes, dtypes) one output range of it reads (the header check reads this
  before anything is built), loads one of them, finishes after loading, and applies the layer.

A quantization scheme is a method, not a module swap: the parameter names of the unquantized model
(``qkv_proj.weight``, ``o_proj.bias``) are those of every method.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from treedec.errors import CheckpointError

if TYPE_CHECKING:   # (annotations only)
    from treedec.models.tensor_parallel import TensorParallel

__all__ = ["MODES", "Linear", "LinearMethod", "TensorSpec", "UNQUANTIZED", "Unquantized"]

#: The tensor-parallel modes of a :class:`Linear`.
MODES = ("replicated", "column", "row")


@dataclass(frozen=True)
class TensorSpec:
    """A checkpoint tensor a method reads for ``rows`` output rows of its layer.

    Attributes
    ----------
    shapes : the shapes it may have (a per-tensor scale is ``()`` in some formats, ``(1,)`` in others).
    dtypes : the dtypes it may have; None: a float weight, of any dtype the loader reads (a copy converts).
    per_row : its first dim is the layer's output rows (cut with them by tensor parallelism); else it is
        whole on every rank (a per-tensor scale, an input scale).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...] | None
    per_row: bool


class LinearMethod(Protocol):
    """How a :class:`Linear` stores and applies its weight (a quantization scheme, or none).

    Attributes
    ----------
    name : the scheme in words, for reports (``"bf16"``, ``"fp8 e4m3, per-channel weight scales"``).
    quantized : whether the weight is stored in another dtype than the model's (``to_hf_state_dict`` and
        the checks that read ``weight`` as the model's weight refuse such layers).
    """

    name: str
    quantized: bool

    def create_weights(self, layer: "Linear", dtype: torch.dtype | None) -> None:
        """Register the layer's weight tensors (``weight`` always; its scales) on the current device."""

    def checkpoint_tensors(self, rows: int, cols: int) -> dict[str, TensorSpec]:
        """Suffix (``"weight"``, ``"weight_scale"``, ...) -> :class:`TensorSpec` of each checkpoint tensor
        that fills ``rows`` output rows of ``cols`` inputs (one fused shard, or a fused checkpoint tensor)."""

    def load(self, layer: "Linear", suffix: str, tensor: torch.Tensor, rows: slice, name: str, file: str) -> None:
        """Copy checkpoint tensor ``name`` (of ``file``; its ``suffix``, shape and dtype already checked against
        :meth:`checkpoint_tensors`) into output ``rows`` of ``layer``; CheckpointError naming it for bad values."""

    def finish(self, layer: "Linear") -> None:
        """After every tensor is loaded: derive what :meth:`apply` reads (e.g. per-row scales) and choose
        (and record in :attr:`Linear.path`) the path :meth:`apply` runs on the layer's device."""

    def apply(self, layer: "Linear", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., in_features] -> x @ W.T (+ bias) [..., out_features]`` in ``x``'s dtype."""


class Unquantized:
    """Weights in the model dtype, ``F.linear``: bit-identical to ``nn.Linear`` (same layout, same call)."""

    name = "unquantized"
    quantized = False

    def create_weights(self, layer: "Linear", dtype: torch.dtype | None) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype))

    def checkpoint_tensors(self, rows: int, cols: int) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec(((rows, cols),), None, per_row=True)}

    def load(self, layer: "Linear", suffix: str, tensor: torch.Tensor, rows: slice, name: str, file: str) -> None:
        layer.weight[rows].copy_(tensor)

    def finish(self, layer: "Linear") -> None:
        layer.path = "F.linear"

    def apply(self, layer: "Linear", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


#: The default method (stateless: one instance serves every layer).
UNQUANTIZED = Unquantized()


class Linear(nn.Module):
    """``y = x @ W.T + b`` of one projection (several fused ones), in a tensor-parallel mode, through a
    :class:`LinearMethod`.

    Parameters
    ----------
    in_features, out_features : this process's sizes (a rank's part under tensor parallelism).
    bias : whether it has a bias (``bias [out_features]``, in the model dtype, unquantized).
    dtype, device : of the parameters (``weight`` in ``dtype`` for the unquantized method).
    mode : one of :data:`MODES`; ``"row"`` all-reduces over ``tensor_parallel``.
    shards : the output sizes of the fused projections (default one: ``(out_features,)``); they sum to
        ``out_features``.
    tensor_parallel : the group a ``"row"`` layer sums over (None: one process; every mode is then
        ``F.linear``).
    method : default :data:`UNQUANTIZED`.

    Attributes
    ----------
    dtype : the model dtype (the activations', the bias's; an unquantized weight's).
    weight : ``[out_features, in_features]``, in the method's storage dtype; ``bias`` ``[out_features]`` or None.
    path : the compute path :meth:`LinearMethod.finish` chose (``"F.linear"``, ``"torch._scaled_mm"``,
        ``"de-quantize + F.linear"``), or None before loading.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None,
                 device=None, mode: str = "replicated", shards: tuple[int, ...] | None = None,
                 tensor_parallel: TensorParallel | None = None, method: LinearMethod = UNQUANTIZED):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        shards = (out_features,) if shards is None else tuple(shards)
        if sum(shards) != out_features:
            raise ValueError(f"shards {shards} must sum to out_features ({out_features})")
        if mode == "row" and tensor_parallel is None:
            mode = "replicated"   # a group of one: nothing to sum
        self.in_features, self.out_features, self.mode, self.shards = in_features, out_features, mode, shards
        self.tp = tensor_parallel if mode == "row" else None
        self.path: str | None = None
        self.dtype = torch.get_default_dtype() if dtype is None else dtype
        self.method = method
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
            method.create_weights(self, dtype)
        if not method.quantized and self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (Kaiming-uniform weight, uniform bias), from the global generator."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def finish_loading(self) -> None:
        """The method's :meth:`LinearMethod.finish` (after its tensors are loaded)."""
        self.method.finish(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.method.apply(self, x, self.bias)
        y = self.tp.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={self.mode}, shards={self.shards}, method={self.method.name}")


def check_loaded_value(ok: bool, name: str, file: str, what: str) -> None:
    """CheckpointError ``{file}: tensor {name} {what}`` unless ``ok`` (a method's checks of loaded values)."""
    if not ok:
        raise CheckpointError(f"{file}: tensor {name} {what}")
