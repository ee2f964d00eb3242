"""The model families treedec runs, by the checkpoints' Hugging Face ``architectures`` (and ``model_type``).

Each family is a file (:mod:`~treedec.models.llama`, :mod:`~treedec.models.qwen3`, :mod:`~treedec.models.gemma`,
:mod:`~treedec.models.phi3`) declaring a :class:`~treedec.models.family.Family`: how its transformers config
reads, its weight map, its conversion back to transformers. Every family builds a
:class:`~treedec.models.decoder.Decoder` from the config it reads. Adding a family is its file and one line of
:data:`FAMILIES`; ``tests/models/test_registry.py`` lists what the registry knows and checks that each family
has its tests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from treedec.errors import UnsupportedModelError
from treedec.models import gemma, llama, phi3, qwen3
from treedec.models.config import ModelConfig
from treedec.models.decoder import Decoder
from treedec.models.family import Family
from treedec.models.weights import WeightMap

if TYPE_CHECKING:   # (annotations only)
    from treedec.models.quantization import Quantization

__all__ = ["FAMILIES", "build", "config_from_hf", "family_of", "gguf_architectures", "supported", "to_hf_config",
           "weight_map"]

#: The families, one line each.
FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen3.FAMILY,
    gemma.GEMMA2,
    gemma.GEMMA3,
    phi3.FAMILY,
)

_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported() -> str:
    """The architectures treedec runs, in words (for messages)."""
    return "; ".join(f"{f.title}: {', '.join(f.architectures)}" for f in FAMILIES)


def family_of(model_type: str, architectures=None) -> Family:
    """The family of a checkpoint: by its first ``architectures`` entry when it names one treedec knows, else by
    its ``model_type``.

    Raises UnsupportedModelError naming what the checkpoint is and every architecture treedec runs.
    """
    for name in architectures or ():
        if name in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[name]
    if model_type in _BY_MODEL_TYPE and not architectures:
        return _BY_MODEL_TYPE[model_type]
    what = f"model_type {model_type!r}" + (f" (architectures {list(architectures)[:3]})" if architectures else "")
    raise UnsupportedModelError(f"{what} is not supported; treedec runs {supported()} (README: the model table)")


def config_from_hf(hf_config) -> ModelConfig:
    """The :class:`~treedec.models.config.ModelConfig` of a transformers config, read by its family.

    Raises UnsupportedModelError for an architecture outside :data:`FAMILIES` or a feature its family does not
    implement (quantized weights, an activation, a RoPE type); ValueError for values that make no model.
    """
    family = family_of(getattr(hf_config, "model_type", None), getattr(hf_config, "architectures", None))
    return family.config_from_hf(hf_config)


def _family(config: ModelConfig) -> Family:
    if config.model_type not in _BY_MODEL_TYPE:
        raise UnsupportedModelError(f"ModelConfig.model_type {config.model_type!r} is not one of a family's "
                                    f"({sorted(_BY_MODEL_TYPE)})")
    return _BY_MODEL_TYPE[config.model_type]


def weight_map(config: ModelConfig) -> WeightMap:
    """Every checkpoint tensor of ``config``'s model (its family's :class:`~treedec.models.weights.WeightMap`)."""
    return _family(config).weight_map(config)


def to_hf_config(config: ModelConfig):
    """The transformers config of ``config`` (its family's: ``LlamaConfig``, ``Qwen3Config``, ``Gemma2Config``,
    ``Gemma3TextConfig``, ``Phi3Config``, ...)."""
    return _family(config).to_hf_config(config)


def gguf_architectures() -> dict[str, Family]:
    """llama.cpp's ``general.architecture`` -> the family reading its GGUF files."""
    return {a: f for f in FAMILIES for a in f.gguf_architectures}


def build(config: ModelConfig, dtype: torch.dtype | None = None, tensor_parallel=None,
          quantization: Quantization | None = None) -> Decoder:
    """``config``'s model (its family checked): a :class:`~treedec.models.decoder.Decoder`, this rank's part of
    one with ``tensor_parallel``, its projections quantized by ``quantization``. Built where torch's default
    device is (the meta device: no memory)."""
    _family(config)
    weights = None if quantization is None else weight_map(config)
    return Decoder(config, dtype, tensor_parallel, quantization, weights)
