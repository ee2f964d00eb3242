"""ModelConfig: the shape and the block of a decoder (every family's), from a transformers config or a named size.

One dataclass for every family (:mod:`~treedec.models.registry`): the sizes every engine reads (layers, heads,
head dim, vocabulary, positions), RoPE (Llama 3.1's ``llama3``, ``linear``, Phi-3's ``longrope``; Gemma 3's own
base on its sliding-window layers), biases, and what a family's block adds to Llama's (per-head q/k RMSNorm,
``(1 + w)`` RMSNorm, four norms a layer, GeLU-tanh, scaled embeddings, soft-caps, the attention scale,
sliding-window layers). The defaults are Llama's. A family's file reads its transformers config into one
(:func:`~treedec.models.registry.config_from_hf`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from treedec.checks import positive_float, positive_int
from treedec.errors import CheckpointError

#: The MLP activations (``gate, up -> act(gate) * up``): SwiGLU's SiLU, Gemma's tanh-approximated GeLU.
ACTIVATIONS = ("silu", "gelu_tanh")
#: What a layer attends to: its whole root path, or a sliding window of ``sliding_window`` keys.
LAYER_TYPES = ("full", "sliding")
#: RoPE scalings (besides none).
ROPE_SCALINGS = ("linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (transformers' ``rope_parameters`` / ``rope_scaling``).

    ``kind`` "linear": every inverse frequency divided by ``factor``. ``kind`` "llama3"
    (Llama 3.1): long wavelengths (> ``original_max_position / low_freq_factor``) divided
    by ``factor``, short ones (< ``original_max_position / high_freq_factor``) kept, the
    band between interpolated smoothly. ``kind`` "longrope" (Phi-3 128k, Phi-3.5): each inverse
    frequency divided by its own factor, ``long_factor`` when the model's ``max_position`` is past
    ``original_max_position`` (else ``short_factor``: vLLM's rule, fixed for the model, so that the K/V of a
    sequence never mixes two rotations; transformers picks per forward call by the call's longest
    sequence), and cos/sin multiplied by ``attention_factor`` (default
    ``sqrt(1 + ln(factor) / ln(original_max_position))``, ``factor`` the context's ratio to the original).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RopeScaling.kind must be one of {ROPE_SCALINGS}, got {self.kind!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_real_range(f"RopeScaling.{name}", name, positive_float(f"RopeScaling.{name}", getattr(self, name)),
                             ValueError)
        positive_int("RopeScaling.original_max_position", self.original_max_position)
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"llama3 RoPE needs high_freq_factor > low_freq_factor > 0, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")
        if self.attention_factor is not None:
            check_real_range("RopeScaling.attention_factor", "attention_factor",
                             positive_float("RopeScaling.attention_factor", self.attention_factor), ValueError)
        if self.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = getattr(self, name)
                if not isinstance(factors, tuple) or not factors:
                    raise ValueError(f"longrope RoPE needs RopeScaling.{name}, a non-empty tuple of numbers, got "
                                     f"{factors!r:.80}")
                for j, f in enumerate(factors):
                    check_real_range(f"RopeScaling.{name}[{j}]", "rope_factor",
                                     positive_float(f"RopeScaling.{name}[{j}]", f), ValueError)
            if len(self.short_factor) != len(self.long_factor):
                raise ValueError(f"longrope RoPE needs as many short as long factors, got "
                                 f"{len(self.short_factor)} and {len(self.long_factor)}")
        elif self.short_factor or self.long_factor:
            raise ValueError(f"RopeScaling.short_factor / long_factor are longrope's, not {self.kind!r}'s")

    def longrope_attention_factor(self, max_position: int) -> float:
        """The cos/sin scale of a longrope model of ``max_position`` positions (transformers' default rule)."""
        if self.attention_factor is not None:
            return self.attention_factor
        factor = max_position / self.original_max_position
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original_max_position))


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder (any family's; the defaults are Llama's).

    ``qkv_bias`` / ``o_bias`` / ``mlp_bias``: biases of the q/k/v projections, the output
    projection and the MLP projections. ``sliding_window``: None for full attention; else the
    sliding layers (``layer_types``; every layer when it is None) attend to their last ``sliding_window``
    keys only (:meth:`layer_window`: their :class:`~treedec.attention.variant.AttentionVariant`'s window).

    The block (Llama's by default): ``qk_norm`` a per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3);
    ``norm_offset`` 1.0 for RMSNorms that scale by ``1 + w`` in float32 (Gemma); ``sandwich_norms``: norms
    after attention and after the MLP as well (Gemma's four a layer); ``activation`` of :data:`ACTIVATIONS`;
    ``embed_scale``: embeddings times ``sqrt(hidden_size)`` (rounded to the model dtype, as transformers
    does); ``final_logit_softcap`` ``c``: logits become ``c * tanh(logits / c)`` (Gemma 2);
    ``attn_logit_softcap``: the same on attention logits (the layers' variant); ``query_pre_attn_scalar``
    ``s``: the softmax scale ``s ** -0.5`` (None: ``head_dim ** -0.5``); ``layer_types``: each layer's kind
    of :data:`LAYER_TYPES` (None: all alike); ``local_rope_theta``: the sliding layers' own RoPE base,
    unscaled (Gemma 3; None: every layer takes ``rope_theta`` and ``rope_scaling``).
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
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None

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
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ValueError(f"ModelConfig.model_type must be a non-empty str, got {self.model_type!r}")
        if self.sliding_window is not None:
            positive_int("ModelConfig.sliding_window", self.sliding_window, note=" or None")
        if self.norm_offset not in (0.0, 1.0):
            raise ValueError(f"ModelConfig.norm_offset must be 0.0 (w) or 1.0 (1 + w), got {self.norm_offset!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for name in ("final_logit_softcap", "attn_logit_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None:
                check_real_range(f"ModelConfig.{name}", "query_pre_attn_scalar" if name.startswith("query") else
                                 "softcap", positive_float(f"ModelConfig.{name}", value, note=" or None"), ValueError)
        if self.local_rope_theta is not None:
            check_real_range("ModelConfig.local_rope_theta", "rope_theta",
                             positive_float("ModelConfig.local_rope_theta", self.local_rope_theta, note=" or None"),
                             ValueError)
        if self.layer_types is not None:
            if not (isinstance(self.layer_types, tuple) and len(self.layer_types) == self.num_layers
                    and all(t in LAYER_TYPES for t in self.layer_types)):
                raise ValueError(f"ModelConfig.layer_types must be None or a tuple of num_layers "
                                 f"({self.num_layers}) of {LAYER_TYPES}, got {self.layer_types!r:.120}")
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ValueError("ModelConfig.layer_types has sliding layers but sliding_window is None")

    @property
    def qkv_size(self) -> int:
        """Output features of the fused q/k/v projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: its whole root path)."""
        sliding = self.layer_types is None or self.layer_types[layer] == "sliding"
        return self.sliding_window if sliding else None

    def layer_rope(self, layer: int) -> int:
        """Which RoPE layer ``layer`` takes: 0 the model's (``rope_theta``, ``rope_scaling``), 1 the sliding
        layers' own (``local_rope_theta``)."""
        return int(self.local_rope_theta is not None and self.layer_window(layer) is not None)

    def num_parameters(self) -> int:
        """Parameter count (a tied embedding counted once)."""
        d, hq, hd = self.hidden_size, self.num_heads, self.head_dim
        attn = d * self.qkv_size + hq * hd * d + (self.qkv_size if self.qkv_bias else 0) + (d if self.o_bias else 0)
        mlp = 3 * d * self.intermediate_size + ((2 * self.intermediate_size + d) if self.mlp_bias else 0)
        norms = (4 if self.sandwich_norms else 2) * d + (2 * hd if self.qk_norm else 0)
        layer = attn + mlp + norms
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelConfig":
        """A named size of :data:`MODEL_SIZES` (random weights: benchmarks and tests), fields overridable."""
        if name not in MODEL_SIZES:
            raise ValueError(f"unknown model size {name!r}; known: {sorted(MODEL_SIZES)}")
        return dataclasses.replace(MODEL_SIZES[name], **overrides)


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
    "rope_factor": (None, 1024.0, "longrope's per-frequency factors: checkpoints use 1 to ~100"),
    "softcap": (1.0, 1e4, "Gemma 2 caps logits at 30 and attention logits at 50"),
    "query_pre_attn_scalar": (1.0, 1e6, "Gemma scales attention logits by it ** -0.5: checkpoints use 144 or 256"),
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


_LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position=8192)

def _alternating(layers: int, every: int) -> tuple[str, ...]:
    """Gemma's layer types: each ``every``-th layer (1-based) global, the others sliding-window."""
    return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(layers))


# Gemma 2 and 3's block: (1 + w) RMSNorms, four a layer, GeLU-tanh, embeddings x sqrt(hidden)
_GEMMA = dict(norm_offset=1.0, sandwich_norms=True, activation="gelu_tanh", embed_scale=True)

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
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                            qk_norm=True, max_position=40960, model_type="qwen3"),
    "gemma2-9b": ModelConfig(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42,
                             num_heads=16, num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             sliding_window=4096, layer_types=_alternating(42, 2), query_pre_attn_scalar=256.0,
                             attn_logit_softcap=50.0, final_logit_softcap=30.0, max_position=8192, model_type="gemma2", **_GEMMA),
    # Gemma 3 text: five local (sliding-window, RoPE base 10000) layers to each global one (base 1e6, linear 8x
    # from 4B up); gemma3-270m is the real checkpoint's shape (the known name gemma3-270m)
    "gemma3-270m": ModelConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                               num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1e6, rms_norm_eps=1e-6,
                               tie_word_embeddings=True, max_position=32768, sliding_window=512,
                               layer_types=_alternating(18, 6), local_rope_theta=10000.0, qk_norm=True,
                               query_pre_attn_scalar=256.0, model_type="gemma3_text", **_GEMMA),
    "gemma3-4b": ModelConfig(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
                             num_heads=8, num_kv_heads=4, head_dim=256, rope_theta=1e6, rms_norm_eps=1e-6,
                             rope_scaling=RopeScaling("linear", 8.0), tie_word_embeddings=True, max_position=131072,
                             sliding_window=1024, layer_types=_alternating(34, 6), local_rope_theta=10000.0,
                             qk_norm=True, query_pre_attn_scalar=256.0, model_type="gemma3_text", **_GEMMA),
    "gemma3-12b": ModelConfig(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_layers=48,
                              num_heads=16, num_kv_heads=8, head_dim=256, rope_theta=1e6, rms_norm_eps=1e-6,
                              rope_scaling=RopeScaling("linear", 8.0), tie_word_embeddings=True, max_position=131072,
                              sliding_window=1024, layer_types=_alternating(48, 6), local_rope_theta=10000.0,
                              qk_norm=True, query_pre_attn_scalar=256.0, model_type="gemma3_text", **_GEMMA),
    # Phi-3-mini-4k: a window of 2047 on every layer
    "phi3-mini-4k": ModelConfig(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_layers=32,
                                num_heads=32, num_kv_heads=32, head_dim=96, max_position=4096, sliding_window=2047,
                                model_type="phi3"),
}
