"""Reading a transformers config: its fields checked by name before anything is built from them
(:func:`check_hf_fields`), the defaults it relies on said (:func:`warn_hf_defaults`), and what every family
reads alike (:func:`common_fields`: sizes, positions, sliding-window layers; :func:`rope_from_hf`: RoPE).
A family's file (:mod:`~treedec.models.registry`) adds what is its own.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

from treedec.checks import is_int, is_real
from treedec.errors import CheckpointError, UnsupportedModelError
from treedec.models.config import ModelConfig, RopeScaling, check_real_range

logger = logging.getLogger("treedec")

#: RoPE types (transformers' ``rope_type``) treedec implements.
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# transformers' layer types -> treedec's
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def common_fields(hf_config) -> dict:
    """The :class:`~treedec.models.config.ModelConfig` fields every family reads alike from a transformers
    config (4.x or 5.x attributes): sizes, heads, head dim, norm eps, tied embeddings, positions, the sliding
    window and which layers it applies to (``layer_types``, ``use_sliding_window``), the model type.

    Raises UnsupportedModelError for partial rotary embeddings; NotImplementedError's message names the field.
    (A ``quantization_config`` is the loader's: :func:`~treedec.models.quantization.read_quantization`.)
    """
    heads = hf_config.num_attention_heads
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:   # Qwen2/3 keep the size but turn it off
        window = None
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"layer_types {unknown[:3]} are not supported; treedec runs "
                                        f"{sorted(_LAYER_TYPES)}")
        types = tuple(_LAYER_TYPES[t] for t in types)
        if len(types) != hf_config.num_hidden_layers:
            raise CheckpointError(f"field 'layer_types' must list num_hidden_layers ({hf_config.num_hidden_layers}) "
                                  f"layers, got {len(types)}")
        if window is None or "sliding" not in types:   # no layer slides
            window, types = None, None
        elif "full" not in types:                     # every layer slides
            types = None
    return dict(vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
                intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
                num_heads=heads, num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                rms_norm_eps=float(hf_config.rms_norm_eps),
                tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                max_position=int(hf_config.max_position_embeddings),
                sliding_window=None if window is None else int(window), layer_types=types,
                model_type=hf_config.model_type)


def rope_from_hf(hf_config, params: dict | None = None, head_dim: int | None = None
                 ) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of a transformers config: ``params`` (one layer type's ``rope_parameters``) when given,
    else ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x).

    Raises UnsupportedModelError for a RoPE type outside :data:`ROPE_TYPES` and partial rotary embeddings;
    ValueError for longrope factors that are not ``head_dim / 2`` numbers.
    """
    if params is None:
        params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], params
    else:
        theta = getattr(hf_config, "rope_theta", 10000.0)
        scaling = getattr(hf_config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"RoPE type {kind!r} is not supported; treedec implements {ROPE_TYPES}")
    if scaling.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) not in (None, 1.0):
        raise UnsupportedModelError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    original = scaling.get("original_max_position_embeddings",
                           getattr(hf_config, "original_max_position_embeddings", None)
                           or hf_config.max_position_embeddings)
    if kind == "llama3":
        return theta, RopeScaling("llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                  float(scaling["high_freq_factor"]), int(original))
    short, long = (tuple(float(f) for f in scaling[key]) for key in ("short_factor", "long_factor"))
    if head_dim is not None and not len(short) == len(long) == head_dim // 2:
        raise ValueError(f"longrope's short_factor and long_factor must hold head_dim / 2 ({head_dim // 2}) numbers "
                         f"each, got {len(short)} and {len(long)}")
    factor = scaling.get("factor") or hf_config.max_position_embeddings / int(original)
    attention = scaling.get("attention_factor")
    return theta, RopeScaling("longrope", max(1.0, float(factor)), original_max_position=int(original),
                              short_factor=short, long_factor=long,
                              attention_factor=None if attention is None else float(attention))


def swiglu_fields(hf_config) -> tuple[dict, float, RopeScaling | None]:
    """What the SwiGLU families (Llama / Mistral / Qwen2, Qwen3, Phi-3) read alike: ``(common_fields, rope theta,
    rope scaling)``. Raises UnsupportedModelError for a ``hidden_act`` other than ``"silu"``."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (SwiGLU with 'silu' only)")
    fields = common_fields(hf_config)
    theta, scaling = rope_from_hf(hf_config, head_dim=fields["head_dim"])
    return fields, theta, scaling


def quantized_message(what: str, quantization) -> str:
    """Why a quantized checkpoint is refused; ``what`` names where it says so (a field, its tensors)."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", None)
    how = f" with {str(method)[:40]!r}" if method is not None else ""
    return (f"{what} says the weights are quantized{how}: a quantized (AWQ, GPTQ, bitsandbytes, ...) checkpoint, "
            f"which treedec does not load; it loads float32, float16 and bfloat16 weights and fp8 checkpoints "
            f"(quant_method 'fp8' with per-tensor scales; 'compressed-tensors' float8 with tensor or channel "
            f"scales): use the model's unquantized or fp8 checkpoint, or quantization='fp8' to quantize a float "
            f"one when loading")


def config_field(key: str) -> str:
    """How a message names a transformers config field: ``field 'hidden_size'``."""
    return f"field '{key}'"


def check_hf_fields(raw: dict, where: str, name: Callable[[str], str] = config_field) -> None:
    """Check the fields of a transformers config (a ``config.json`` object, or GGUF metadata under
    transformers' names) before anything is built from them.

    Absent fields are not checked (transformers' defaults fill them). ``where`` (the file) leads
    each message; ``name(key)`` names a field in it (GGUF metadata keys have other names).

    Raises
    ------
    CheckpointError : ``{where}: {name(key)} must be {expected}, got {type} {value}``, for a size
        that is not a positive int, a flag that is not a bool, an ``rms_norm_eps`` or ``rope_theta``
        that is not a finite number > 0 (RMSNorm and RoPE would make NaN) or a real number out of
        :data:`REAL_RANGES` (garbage, not NaN: ``rms_norm_eps`` 1e308), head counts that do not
        divide, an odd head dim; a ``llama3`` RoPE scaling without ``rope_theta`` (transformers'
        default 10000 is known wrong for every such checkpoint).
    """
    def fail(key, expected, value):
        raise CheckpointError(f"{where}: {name(key)} must be {expected}, got {type(value).__name__} {value!r:.80}")

    for key in _POSITIVE_INT_FIELDS:
        if key in raw and not (is_int(raw[key]) and raw[key] > 0):
            fail(key, "a positive int", raw[key])
    for key in ("num_key_value_heads", "head_dim", "sliding_window"):
        if raw.get(key) is not None and not (is_int(raw[key]) and raw[key] > 0):
            fail(key, "a positive int or null", raw[key])
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
        if key in raw and not isinstance(raw[key], bool):
            fail(key, "true or false", raw[key])
    for key in ("hidden_act", "hidden_activation", "model_type"):
        if key in raw and not isinstance(raw[key], str):
            fail(key, "a string", raw[key])
    for key, kind in (("query_pre_attn_scalar", "query_pre_attn_scalar"), ("final_logit_softcapping", "softcap"),
                      ("attn_logit_softcapping", "softcap"), ("rope_local_base_freq", "rope_theta")):
        if raw.get(key) is not None:
            if not (is_real(raw[key]) and raw[key] > 0):
                fail(key, "a finite number > 0 or null", raw[key])
            check_real_range(f"{where}: {name(key)}", kind, raw[key])
    if raw.get("layer_types") is not None and not (isinstance(raw["layer_types"], list)
                                                   and all(isinstance(t, str) for t in raw["layer_types"])):
        fail("layer_types", "a list of strings or null", raw["layer_types"])
    for key in ("rms_norm_eps", "rope_theta"):
        if key in raw:
            if not (is_real(raw[key]) and raw[key] > 0):
                fail(key, "a finite number > 0", raw[key])
            check_real_range(f"{where}: {name(key)}", key, raw[key])
    for group, rope in _rope_groups(raw):
        if not isinstance(rope, dict):
            fail(group, "an object or null", rope)
        for key, value in rope.items():
            if key in _ROPE_NUMBERS:
                if not (is_real(value) and value > 0):
                    fail(f"{group}.{key}", "a finite number > 0", value)
                check_real_range(f"{where}: {name(f'{group}.{key}')}", key, value)
            if key in ("short_factor", "long_factor"):
                if not (isinstance(value, list) and value and all(is_real(f) and f > 0 for f in value)):
                    fail(f"{group}.{key}", "a non-empty list of finite numbers > 0", value)
                for j, f in enumerate(value):
                    check_real_range(f"{where}: {name(f'{group}.{key}')}[{j}]", "rope_factor", f)
            if key == "original_max_position_embeddings" and not (is_int(value) and value > 0):
                fail(f"{group}.{key}", "a positive int", value)
            if key in ("rope_type", "type") and not isinstance(value, str):
                fail(f"{group}.{key}", "a string", value)
        if rope.get("rope_type", rope.get("type")) == "llama3" and not _has_theta(raw):
            raise CheckpointError(
                f"{where}: {name(f'{group}.rope_type')} is 'llama3' (Llama 3.1 and later) but the config has no "
                f"{name('rope_theta')}: transformers' default base (10000) is not these checkpoints' (500000); "
                f"set rope_theta in the config")
    heads, kv_heads, head_dim = raw.get("num_attention_heads"), raw.get("num_key_value_heads"), raw.get("head_dim")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise CheckpointError(f"{where}: {name('num_attention_heads')} ({heads}) must be a multiple of "
                              f"{name('num_key_value_heads')} ({kv_heads})")
    if head_dim is not None and head_dim % 2:
        raise CheckpointError(f"{where}: {name('head_dim')} must be even (RoPE rotates pairs), got {head_dim}")
    hidden = raw.get("hidden_size")
    if head_dim is None and hidden is not None and heads is not None:
        if hidden % heads:
            raise CheckpointError(f"{where}: {name('hidden_size')} ({hidden}) must be a multiple of "
                                  f"{name('num_attention_heads')} ({heads}) when {name('head_dim')} is not given")
        if hidden // heads % 2:
            raise CheckpointError(f"{where}: {name('hidden_size')} / {name('num_attention_heads')} (the head dim, "
                                  f"{hidden // heads}) must be even (RoPE rotates pairs)")


def warn_hf_defaults(raw: dict, config: ModelConfig, where: str, name: Callable[[str], str] = config_field) -> None:
    """Log a warning for each of ``rms_norm_eps``, ``rope_theta`` (and Gemma 3's ``rope_local_base_freq``)
    that ``raw`` lacks, naming the
    default transformers filled in for the config's model type (``config``'s value), which treedec then
    uses too: the logits are transformers', but a checkpoint trained with another value (Llama's 1e-5
    against transformers' 1e-6) gives other ones. Where the default is known wrong (a ``llama3`` RoPE
    without a base), :func:`check_hf_fields` refuses the config instead."""
    checks = [("rms_norm_eps", "rms_norm_eps" in raw, config.rms_norm_eps),
              ("rope_theta", _has_theta(raw), config.rope_theta)]
    if config.local_rope_theta is not None:
        rope = raw.get("rope_parameters")
        local = rope.get("sliding_attention") if isinstance(rope, dict) else None
        checks.append(("rope_local_base_freq", "rope_local_base_freq" in raw or (isinstance(local, dict) and
                                                                                "rope_theta" in local),
                       config.local_rope_theta))
    for key, present, value in checks:
        if not present:
            logger.warning(f"{where}: no {name(key)}; using transformers' default for a {config.model_type} "
                           f"model, {value}, as transformers does (a checkpoint trained with another value "
                           f"gives other logits: set it in the config)")


_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings")
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor")


def _rope_groups(raw: dict) -> Iterator[tuple[str, object]]:
    """(name, object) of each RoPE parameter group of a config: ``rope_parameters`` (transformers 5; per layer
    type, ``rope_parameters.full_attention``, where a family keeps one per attention kind) and ``rope_scaling``."""
    for group in ("rope_parameters", "rope_scaling"):
        rope = raw.get(group)
        if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
            yield from ((f"{group}.{kind}", sub) for kind, sub in rope.items())
        elif rope is not None:
            yield group, rope


def _has_theta(raw: dict) -> bool:
    """Whether a config sets its RoPE base (``rope_theta`` at the top, or in a ``rope_parameters`` group)."""
    return "rope_theta" in raw or any(isinstance(rope, dict) and "rope_theta" in rope
                                      for group, rope in _rope_groups(raw) if group.startswith("rope_parameters"))


