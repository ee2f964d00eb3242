"""ModelConfig: the shape of a Llama-family decoder, from a transformers config or a named size.

Llama 2/3/3.1, Mistral and Qwen2/2.5 share one architecture here: RMSNorm, GQA attention with
RoPE, SwiGLU MLP. They differ in RoPE scaling (Llama 3.1's ``llama3`` rule), projection
biases (Qwen2 has q/k/v biases, Llama's ``attention_bias`` covers q/k/v/o) and sliding-window
attention (Mistral v0.1), which :class:`ModelConfig` records.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from treedec.checks import is_int, is_real, positive_float, positive_int
from treedec.errors import CheckpointError, UnsupportedModelError

logger = logging.getLogger("treedec")

#: ``model_type`` of the transformers configs this decoder implements.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (transformers' ``rope_parameters`` / ``rope_scaling``).

    ``kind`` "linear": every inverse frequency divided by ``factor``. ``kind`` "llama3"
    (Llama 3.1): long wavelengths (> ``original_max_position / low_freq_factor``) divided
    by ``factor``, short ones (< ``original_max_position / high_freq_factor``) kept, the
    band between interpolated smoothly.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"RopeScaling.kind must be 'linear' or 'llama3', got {self.kind!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_real_range(f"RopeScaling.{name}", name, positive_float(f"RopeScaling.{name}", getattr(self, name)),
                             ValueError)
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"llama3 RoPE needs high_freq_factor > low_freq_factor > 0, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder.

    ``qkv_bias`` / ``o_bias`` / ``mlp_bias``: biases of the q/k/v projections, the output
    projection and the MLP projections. ``sliding_window``: None for full attention; else the
    model attends to the last ``sliding_window`` tokens only, which treedec's tree attention
    does not implement (the engine refuses positions past the window).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position: int = 8192
    sliding_window: int | None = None
    model_type: str = "llama"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            positive_int(f"ModelConfig.{name}", getattr(self, name))
        for name in ("rope_theta", "rms_norm_eps"):   # 0, < 0 or NaN make every logit NaN
            check_real_range(f"ModelConfig.{name}", name, positive_float(f"ModelConfig.{name}", getattr(self, name)),
                             ValueError)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type must be one of {SUPPORTED_MODEL_TYPES}, "
                             f"got {self.model_type!r}")

    @property
    def qkv_size(self) -> int:
        """Output features of the fused q/k/v projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (a tied embedding counted once)."""
        d, hq, hd = self.hidden_size, self.num_heads, self.head_dim
        attn = d * self.qkv_size + hq * hd * d + (self.qkv_size if self.qkv_bias else 0) + (d if self.o_bias else 0)
        mlp = 3 * d * self.intermediate_size + ((2 * self.intermediate_size + d) if self.mlp_bias else 0)
        layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelConfig":
        """A named size of :data:`MODEL_SIZES` (random weights: benchmarks and tests), fields overridable."""
        if name not in MODEL_SIZES:
            raise ValueError(f"unknown model size {name!r}; known: {sorted(MODEL_SIZES)}")
        return dataclasses.replace(MODEL_SIZES[name], **overrides)

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        """Read a transformers ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config`` (4.x or 5.x attributes).

        Raises :class:`~treedec.errors.UnsupportedModelError` (a NotImplementedError) for what this
        decoder does not implement (another architecture, naming those it runs; quantized weights; an
        activation other than SiLU, partial rotary, RoPE types other than default / linear / llama3).
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type {model_type!r} is not supported; treedec runs the model types "
                                        f"{', '.join(SUPPORTED_MODEL_TYPES)} (README: the model table)")
        quantization = getattr(hf_config, "quantization_config", None)
        if quantization is not None:
            raise UnsupportedModelError(quantized_message("quantization_config", quantization))
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (SwiGLU with 'silu' only)")
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        theta, scaling = _rope_from_hf(hf_config)
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif model_type == "llama":
            qkv_bias = o_bias = bool(getattr(hf_config, "attention_bias", False))
            mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        else:
            qkv_bias = o_bias = mlp_bias = False
        window = getattr(hf_config, "sliding_window", None)
        if getattr(hf_config, "use_sliding_window", True) is False:  # Qwen2 keeps the size but turns it off
            window = None
        return cls(
            vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=float(theta),
            rope_scaling=scaling, rms_norm_eps=float(hf_config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
            max_position=int(hf_config.max_position_embeddings),
            sliding_window=None if window is None else int(window), model_type=model_type,
        )


def _rope_from_hf(hf_config) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
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
    original = scaling.get("original_max_position_embeddings", hf_config.max_position_embeddings)
    return theta, RopeScaling("llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
                              float(scaling["high_freq_factor"]), int(original))


def quantized_message(what: str, quantization) -> str:
    """Why a quantized checkpoint is refused; ``what`` names where it says so (a field, its tensors)."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", None)
    how = f" with {str(method)[:40]!r}" if method is not None else ""
    return (f"{what} says the weights are quantized{how}: a quantized (AWQ, GPTQ, bitsandbytes, fp8, ...) "
            f"checkpoint, which treedec does not load (yet: fp8 weights are issue #52); it loads float32, float16 "
            f"and bfloat16 weights: use the model's unquantized checkpoint")


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
    UnsupportedModelError : a ``quantization_config`` (a quantized checkpoint, or a config that says so).
    CheckpointError : ``{where}: {name(key)} must be {expected}, got {type} {value}``, for a size
        that is not a positive int, a flag that is not a bool, an ``rms_norm_eps`` or ``rope_theta``
        that is not a finite number > 0 (RMSNorm and RoPE would make NaN) or a real number out of
        :data:`REAL_RANGES` (garbage, not NaN: ``rms_norm_eps`` 1e308), head counts that do not
        divide, an odd head dim; a ``llama3`` RoPE scaling without ``rope_theta`` (transformers'
        default 10000 is known wrong for every such checkpoint).
    """
    def fail(key, expected, value):
        raise CheckpointError(f"{where}: {name(key)} must be {expected}, got {type(value).__name__} {value!r:.80}")

    if raw.get("quantization_config") is not None:   # (over plain weights too: the config says they are not)
        raise UnsupportedModelError(f"{where}: {quantized_message(name('quantization_config'), raw['quantization_config'])}")

    for key in _POSITIVE_INT_FIELDS:
        if key in raw and not (is_int(raw[key]) and raw[key] > 0):
            fail(key, "a positive int", raw[key])
    for key in ("num_key_value_heads", "head_dim", "sliding_window"):
        if raw.get(key) is not None and not (is_int(raw[key]) and raw[key] > 0):
            fail(key, "a positive int or null", raw[key])
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
        if key in raw and not isinstance(raw[key], bool):
            fail(key, "true or false", raw[key])
    for key in ("hidden_act", "model_type"):
        if key in raw and not isinstance(raw[key], str):
            fail(key, "a string", raw[key])
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
    """Log a warning for each of ``rms_norm_eps`` and ``rope_theta`` that ``raw`` lacks, naming the
    default transformers filled in for the config's model type (``config``'s value), which treedec then
    uses too: the logits are transformers', but a checkpoint trained with another value (Llama's 1e-5
    against transformers' 1e-6) gives other ones. Where the default is known wrong (a ``llama3`` RoPE
    without a base), :func:`check_hf_fields` refuses the config instead."""
    for key, present, value in (("rms_norm_eps", "rms_norm_eps" in raw, config.rms_norm_eps),
                                ("rope_theta", _has_theta(raw), config.rope_theta)):
        if not present:
            logger.warning(f"{where}: no {name(key)}; using transformers' default for a {config.model_type} "
                           f"model, {value}, as transformers does (a checkpoint trained with another value "
                           f"gives other logits: set it in the config)")


_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings")
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor")
#: Bounds of a config's real numbers beyond "finite and > 0": (least, most, why), None for no bound. A value out
#: of them makes no NaN, but garbage (an eps of 1e308 flattens every activation to 0; a RoPE factor of 1e308 makes
#: every rotation the identity), so it is refused by name rather than run.
REAL_RANGES: dict[str, tuple[float | None, float | None, str]] = {
    "rms_norm_eps": (None, 1e-2, "checkpoints use 1e-6 to 1e-5; one near the activations' mean square flattens them"),
    "rope_theta": (None, 1e12, "checkpoints use 1e4 to 1e7; past 1e12 every position rotates by ~0"),
    "factor": (1.0, 1024.0, "a RoPE scaling factor stretches the context by it (transformers: >= 1)"),
    "low_freq_factor": (None, 1024.0, "Llama 3.1 uses 1"),
    "high_freq_factor": (None, 1024.0, "Llama 3.1 uses 4"),
    "attention_factor": (None, 16.0, "a scale of cos/sin: checkpoints use ~1 to 1.5"),
}


def check_real_range(name: str, key: str, value: float, error: type[Exception] = CheckpointError) -> float:
    """``value`` (a finite number > 0, checked before) if it is within :data:`REAL_RANGES` ``[key]``, else
    ``error`` ``"{name} must be at most {most} ({why}), got {value}"`` (or ``at least``)."""
    least, most, why = REAL_RANGES[key]
    if least is not None and value < least:
        raise error(f"{name} must be at least {least} ({why}), got {value!r}")
    if most is not None and value > most:
        raise error(f"{name} must be at most {most:g} ({why}), got {value!r}")
    return value


def _rope_groups(raw: dict):
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


_LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position=8192)

#: Named sizes (gpt-fast style). ``tiny`` is for tests: 2 layers, GQA 4:2, head dim 64.
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=64, max_position=4096),
    "llama2-7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                             num_heads=32, num_kv_heads=32, head_dim=128, max_position=4096),
    "llama3-8b": _LLAMA3_8B,
    # Llama-3.2-1B's shape (Llama-3-8B's vocabulary and tokenizer): a draft model for the 8B targets.
    "llama3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                               num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                               tie_word_embeddings=True, max_position=131072,
                               rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
    "llama3.1-8b": dataclasses.replace(_LLAMA3_8B, max_position=131072,
                                       rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
    "mistral-7b": ModelConfig(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position=32768,
                              model_type="mistral"),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                              qkv_bias=True, max_position=32768, model_type="qwen2"),
}
