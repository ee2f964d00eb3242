"""The ``config.json`` of an EAGLE reference checkpoint: a transformers ``LlamaConfig`` of one layer,
plus ``draft_vocab_size``, ``bias`` (EAGLE-1's ``fc.bias``) and ``eagle_config`` (EAGLE-3's target
layers), checked field by field and read into what :func:`~treedec.models.eagle_drafter.load_eagle` builds."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from treedec.checks import is_int
from treedec.errors import CheckpointError, UnsupportedModelError
from treedec.models import llama
from treedec.models.config import ModelConfig
from treedec.models.hf_config import check_hf_fields, quantized_message, warn_hf_defaults


@dataclass(frozen=True)
class EagleConfig:
    """What an EAGLE ``config.json`` says of its drafter.

    ``config``: the drafter's one-layer :class:`~treedec.models.ModelConfig`. ``draft_vocab_size``:
    EAGLE-3's draft vocabulary (None for EAGLE-1). ``aux_layers``: EAGLE-3's target layers whose
    inputs it fuses (() for EAGLE-1). ``fc_bias``: whether ``fc`` has a bias (EAGLE-1).
    """

    config: ModelConfig
    draft_vocab_size: int | None
    aux_layers: tuple[int, ...]
    fc_bias: bool


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default target layers: the inputs of layers 2, L // 2 and L - 3 (low, middle, high);
    for targets of 3 to 6 layers (test models), of the first, middle and last layer."""
    if num_layers >= 7:
        return 2, num_layers // 2, num_layers - 3
    if num_layers >= 3:
        return 0, num_layers // 2, num_layers - 1
    raise ValueError(f"EAGLE-3 reads three distinct target layers; a {num_layers}-layer target has fewer")


def read_eagle_config(raw: dict, file: Path, eagle3: bool, target: ModelConfig) -> EagleConfig:
    """Check ``raw`` (the JSON object of ``file``) for an EAGLE-3 (``eagle3``) or EAGLE-1 drafter of
    ``target`` and read it.

    Raises
    ------
    CheckpointError : naming ``file``, the field, the expected and the actual value (the fields of
        :func:`~treedec.models.hf_config.check_hf_fields`; ``draft_vocab_size`` a positive int at most
        the target's vocabulary; ``bias`` a bool; the aux layer ids 3 distinct layer outputs).
    NotImplementedError : a drafter of more than one layer.
    """
    check_hf_fields(raw, str(file))
    if raw.get("quantization_config") is not None:   # (the drafter loads in the target's float dtype)
        raise UnsupportedModelError(f"{file}: " + quantized_message("field 'quantization_config'",
                                                                    raw["quantization_config"]))
    _check_eagle_fields(raw, file, eagle3, target)
    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise NotImplementedError(f"{file}: EAGLE drafters of {layers} layers are not supported (one layer)")
    config = _drafter_config(raw, file)
    if not eagle3:
        return EagleConfig(config, None, (), raw.get("bias", True))
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    # the reference names layer outputs: the input of the next layer
    layers = default_aux_layers(target.num_layers) if ids is None else tuple(i + 1 for i in ids)
    return EagleConfig(config, raw.get("draft_vocab_size") or target.vocab_size, layers, False)


# ================================================================ private


def _check_eagle_fields(raw: dict, file: Path, eagle3: bool, target: ModelConfig) -> None:
    def fail(key, expected, value):
        raise CheckpointError(f"{file}: field '{key}' must be {expected}, got {type(value).__name__} {value!r:.80}")

    for key in ("draft_vocab_size", "target_hidden_size"):
        value = raw.get(key)
        if value is not None and not (is_int(value) and value > 0):
            fail(key, "a positive int", value)
    if eagle3 and (raw.get("draft_vocab_size") or 0) > target.vocab_size:
        raise CheckpointError(f"{file}: field 'draft_vocab_size' ({raw['draft_vocab_size']}) must be at most the "
                              f"target's vocabulary ({target.vocab_size})")
    if "bias" in raw and not isinstance(raw["bias"], bool):
        fail("bias", "true or false", raw["bias"])
    eagle_config = raw.get("eagle_config")
    if eagle_config is not None and not isinstance(eagle_config, dict):
        fail("eagle_config", "an object or null", eagle_config)
    ids = (eagle_config or {}).get("eagle_aux_hidden_state_layer_ids")
    if eagle3 and ids is not None:   # layer outputs: -1 (the embeddings) to L - 2 (the last layer's input)
        valid = range(-1, target.num_layers - 1)
        if not (isinstance(ids, list) and len(ids) == 3 and len(set(ids)) == 3
                and all(is_int(i) and i in valid for i in ids)):
            fail("eagle_config.eagle_aux_hidden_state_layer_ids",
                 f"a list of 3 distinct layer ids in [-1, {target.num_layers - 2}]", ids)


def _drafter_config(raw: dict, file: Path) -> ModelConfig:
    from transformers import LlamaConfig
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    try:
        hf = LlamaConfig(**fields)
    except Exception as e:   # transformers 5's config classes raise their own errors (StrictDataclassError)
        raise CheckpointError(f"{file}: not a Llama config ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    # EAGLE configs name the target's family, or "llama": their own layer is Llama's whatever the target
    hf.model_type = raw["model_type"] if raw.get("model_type") in llama.FAMILY.model_types else "llama"
    try:
        config = llama.FAMILY.config_from_hf(hf)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: {e}") from None
    warn_hf_defaults(raw, config, str(file))
    return config
