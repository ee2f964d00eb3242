"""What a checkpoint of a config holds, tensor by tensor (:class:`CheckpointLayout`): each tensor's shapes, dtypes,
tensor-parallel cut and the treedec tensor it fills — the weight map's tensors, each projection's as its
quantization method reads them (an fp8 weight's scales too).

Read from the model itself built on the meta device with one layer (every layer has the same shapes); a layer's
tensors also depend on its projections' methods (an ``ignore``d layer keeps float weights), computed per layer
on demand, so that a config of a billion layers costs nothing until its tensors are walked that far.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from treedec.errors import CheckpointError
from treedec.models.config import ModelConfig
from treedec.models.linear import UNQUANTIZED, Linear, LinearMethod
from treedec.models.registry import build, weight_map
from treedec.models.weights import Split, Weight

if TYPE_CHECKING:   # (annotations only)
    from treedec.models.quantization import Quantization

__all__ = ["CheckpointLayout", "CheckpointTensor", "weight_shapes"]

_LAYER0 = "layers.0."


@dataclass(frozen=True)
class CheckpointTensor:
    """A tensor a checkpoint holds, and where it goes.

    Attributes
    ----------
    param : the treedec tensor it fills (``layers.{i}.qkv_proj.weight``, ``...weight_scale``).
    rows : ``(start, stop)`` rows of it (a fused part), or None for all.
    shapes : the shapes it may have in the checkpoint (one, but for a per-tensor scale: ``()`` or ``(1,)``).
    dtypes : the dtypes it may have, or None: a float tensor of any dtype the loader reads.
    split : how tensor parallelism cuts it (None: whole on every rank).
    """

    param: str
    rows: tuple[int, int] | None
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...] | None
    split: Split | None

    def row_slice(self) -> slice:
        """:attr:`rows` as a slice of :attr:`param`."""
        return slice(None) if self.rows is None else slice(*self.rows)


@dataclass(frozen=True)
class _Projection:
    """A weight-map tensor that is a projection's weight: its module (after ``layers.{i}.`` for a layer's) and the
    shape of its rows."""

    weight: Weight
    module: str
    shape: tuple[int, int]


class CheckpointLayout:
    """Every tensor of ``config``'s checkpoint, its projections quantized by ``quantization`` (None: float).

    Attributes
    ----------
    config, quantization : as given.
    globals : HF name -> :class:`CheckpointTensor` of the global tensors (embedding, final norm, LM head).

    Raises
    ------
    CheckpointError : sizes no tensor can have (built on the meta device, the model overflows).
    """

    def __init__(self, config: ModelConfig, quantization: Quantization | None = None):
        self.config, self.quantization = config, quantization
        one = dataclasses.replace(config, num_layers=1, layer_types=None if config.layer_types is None else
                                  config.layer_types[:1])
        try:
            with torch.device("meta"):
                model = build(one)
        except RuntimeError as e:   # a size past what any tensor can hold ("Storage size calculation overflowed")
            raise CheckpointError(f"the config's sizes make tensors too large to exist (hidden_size "
                                  f"{config.hidden_size}, intermediate_size {config.intermediate_size}, vocab_size "
                                  f"{config.vocab_size}, heads {config.num_heads} x head_dim {config.head_dim}: "
                                  f"{str(e)[:80]})") from None
        self._methods = (lambda name: UNQUANTIZED) if quantization is None else \
            quantization.methods(weight_map(config))
        params, modules = dict(model.named_parameters(remove_duplicate=False)), dict(model.named_modules())
        self._plain: dict[str, CheckpointTensor] = {}   # layer 0's tensors that are not a projection's weight
        self._projections: list[_Projection] = []       # layer 0's projection weights
        self.globals: dict[str, CheckpointTensor] = {}
        weights = weight_map(one)
        for w in weights:
            module, _, kind = w.param.rpartition(".")
            shape = tuple(params[w.param][w.row_slice()].shape)
            if isinstance(modules.get(module), Linear) and kind == "weight":
                if w in weights.globals:
                    self.globals.update(_tensors(w, module, shape, self._methods(module)))
                else:
                    self._projections.append(_Projection(w, module[len(_LAYER0):], shape))
            elif w in weights.globals:
                self.globals[w.hf] = CheckpointTensor(w.param, w.rows, (shape,), None, w.split)
            else:
                self._plain[w.hf] = CheckpointTensor(w.param, w.rows, (shape,), None, w.split)
        self._templates: dict[tuple, dict[str, CheckpointTensor]] = {}

    def layer(self, i: int) -> dict[str, CheckpointTensor]:
        """Name after ``model.layers.{i}.`` -> :class:`CheckpointTensor` of layer ``i``'s tensors (their
        :attr:`~CheckpointTensor.param` named in layer 0: :meth:`at` names them in layer ``i``)."""
        methods = tuple(self._methods(f"layers.{i}.{p.module}") for p in self._projections)
        if methods not in self._templates:
            tensors = dict(self._plain)
            for p, method in zip(self._projections, methods):
                tensors.update(_tensors(p.weight, _LAYER0 + p.module, p.shape, method))
            prefix = "model." + _LAYER0
            self._templates[methods] = {name[len(prefix):]: t for name, t in tensors.items()}
        return self._templates[methods]

    @staticmethod
    def at(tensor: CheckpointTensor, i: int) -> CheckpointTensor:
        """A :meth:`layer` tensor with its parameter named in layer ``i``."""
        return dataclasses.replace(tensor, param=f"layers.{i}.{tensor.param[len(_LAYER0):]}")

    def get(self, name: str, layer: int | None, suffix: str) -> CheckpointTensor | None:
        """The tensor ``name`` (a global one when ``layer`` is None, else ``suffix`` of layer ``layer``)."""
        if layer is None:
            return self.globals.get(name)
        return self.layer(layer).get(suffix) if layer < self.config.num_layers else None

    def __iter__(self) -> Iterator[tuple[str, CheckpointTensor]]:
        """(HF name, tensor) of every tensor, the globals then layer by layer (parameters named in their layer)."""
        yield from self.globals.items()
        for i in range(self.config.num_layers):
            for suffix, t in self.layer(i).items():
                yield f"model.layers.{i}.{suffix}", self.at(t, i)

    def has_more_than(self, count: int) -> bool:
        """Whether the checkpoint holds more than ``count`` tensors (a walk no longer than ``count`` tensors)."""
        total = len(self.globals)
        for i in range(self.config.num_layers):
            if total > count:
                return True
            total += len(self.layer(i))
        return total > count


def weight_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """``(global, layer)``: the shape of every global checkpoint tensor of the float model by name, and of one
    layer's by its name after ``model.layers.{i}.``."""
    layout = CheckpointLayout(config)
    return ({name: t.shapes[0] for name, t in layout.globals.items()},
            {name: t.shapes[0] for name, t in layout.layer(0).items()})


def _tensors(w: Weight, module: str, shape: tuple[int, int], method: LinearMethod) -> dict[str, CheckpointTensor]:
    """The checkpoint tensors of projection weight ``w`` (rows ``shape`` of ``module``) as ``method`` reads them."""
    base = w.hf[:-len("weight")]
    return {base + suffix: CheckpointTensor(f"{module}.{suffix}", w.rows, spec.shapes, spec.dtypes,
                                            _split(suffix, spec.per_row, w.split))
            for suffix, spec in method.checkpoint_tensors(*shape).items()}


def _split(suffix: str, per_row: bool, split: Split | None) -> Split | None:
    """A projection tensor's cut: the weight's own; a per-row scale's the weight's rows when those are cut
    (column-parallel), else whole (a row-parallel layer's rows are every rank's); other scales whole."""
    if suffix == "weight":
        return split
    return split if per_row and split is not None and split.dim == 0 else None
