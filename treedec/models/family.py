"""What a model family is to treedec (:class:`Family`): one file per family declares one, and one line of
:mod:`~treedec.models.registry` lists it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from treedec.models.config import ModelConfig
from treedec.models.weights import WeightMap

__all__ = ["Family"]


@dataclass(frozen=True)
class Family:
    """A model family: the checkpoints it reads and how, built as a :class:`~treedec.models.decoder.Decoder`.

    Attributes
    ----------
    name : the family's name (the README's model table).
    title : the models it is, in words ("Llama 2/3/3.1, Mistral, Qwen2/2.5").
    architectures : the Hugging Face ``architectures`` entries it reads (aliases sharing this implementation).
    model_types : the transformers ``model_type`` values it reads (a config without ``architectures``).
    gguf_architectures : llama.cpp's ``general.architecture`` of its GGUF files (transformers converts them).
    config_from_hf : a transformers config -> :class:`~treedec.models.config.ModelConfig` (raises
        :class:`~treedec.errors.UnsupportedModelError` for what the family's block does not implement).
    weight_map : a config -> its :class:`~treedec.models.weights.WeightMap` (every checkpoint tensor).
    to_hf_config : a config -> the transformers config of the same model (the conversion back).
    tests : the test module that checks the family against transformers (the registry's test reads it).
    """

    name: str
    title: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    config_from_hf: Callable[[Any], ModelConfig]
    weight_map: Callable[[ModelConfig], WeightMap]
    to_hf_config: Callable[[ModelConfig], Any]
    tests: str
