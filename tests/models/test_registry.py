"""What the registry knows: every family, its architectures and model types, its weight map, and its tests."""
import math
from pathlib import Path

import pytest

from treedec.errors import UnsupportedModelError
from treedec.models import FAMILIES, MODEL_SIZES, ModelConfig
from treedec.models.checkpoint_layout import weight_shapes
from treedec.models.registry import family_of, gguf_architectures, weight_map

ROOT = Path(__file__).resolve().parents[2]


def test_the_registry_lists_its_families():
    assert [f.name for f in FAMILIES] == ["llama", "qwen3", "gemma2", "gemma3", "phi3"]
    architectures = [a for f in FAMILIES for a in f.architectures]
    assert len(architectures) == len(set(architectures)) and "Gemma3ForCausalLM" in architectures
    assert set(gguf_architectures()) == {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"}
    for f in FAMILIES:
        for a in f.architectures:
            assert family_of("whatever", [a]) is f   # aliases share one implementation
        for t in f.model_types:
            assert family_of(t) is f


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_each_family_has_its_tests(family):
    """Its test module exists, compares with transformers and names each of its architectures' model types."""
    text = (ROOT / family.tests).read_text()
    assert "transformers" in text and "def test_" in text
    assert family.name in Path(__file__).read_text()
    assert family.name in (ROOT / "tests/models/test_families_tp.py").read_text()   # TP == TP=1 for it


def test_every_named_size_has_a_family_and_consistent_shapes():
    for name, config in MODEL_SIZES.items():
        weights = weight_map(config)
        global_shapes, layer = weight_shapes(config)
        assert len(weights) == len(global_shapes) + config.num_layers * len(layer), name
        total = sum(math.prod(s) for s in global_shapes.values()) + config.num_layers * sum(
            math.prod(s) for s in layer.values())
        assert total == config.num_parameters(), name   # (a tied head: no tensor of its own)


def test_what_the_registry_does_not_know_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="model_type 'gemma3' \\(architectures "
                                                    "\\['Gemma3ForConditionalGeneration'\\]\\) is not supported"):
        family_of("gemma3", ["Gemma3ForConditionalGeneration"])
    with pytest.raises(UnsupportedModelError, match="'mixtral'"):
        weight_map(ModelConfig.from_name("tiny", model_type="mixtral"))
