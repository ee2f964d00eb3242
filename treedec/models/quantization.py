"""A model's weight quantization (:class:`Quantization`): which :class:`~treedec.models.linear.LinearMethod`
each projection uses, read from a checkpoint's ``quantization_config`` (:func:`read_quantization`) or asked
for (:func:`quantize_on_load`: ``quantization="fp8"`` over a float checkpoint).

Checkpoint formats read (the tensor names and shapes vLLM reads; ``{p}`` a projection, ``rows`` its outputs):

- ``quant_method: "fp8"`` (AutoFP8, vLLM's ``Fp8Config``): ``{p}.weight`` float8_e4m3fn, ``{p}.weight_scale``
  float32 of shape ``()`` or ``(1,)`` (per tensor), with ``activation_scheme: "static"`` also
  ``{p}.input_scale`` (per tensor); ``ignored_layers`` (or transformers' ``modules_to_not_convert``) stay
  unquantized. Block-wise scales (``weight_block_size``, ``weight_scale_inv``) are refused (not implemented).
- ``quant_method: "compressed-tensors"`` (llm-compressor), ``format: "float-quantized"`` (or
  ``"naive-quantized"``) with one config group targeting ``Linear``: 8-bit float weights, ``strategy``
  ``"tensor"`` (``weight_scale`` ``()`` / ``(1,)``) or ``"channel"`` (``weight_scale`` ``[rows, 1]``), scales
  float32 or the model dtype; ``input_activations`` dynamic per token, static per tensor (``input_scale``),
  or none (weight-only); ``ignore`` lists module names or ``re:`` patterns (``lm_head``); a ``kv_cache_scheme``
  of 8-bit floats per tensor (its ``k_scale`` / ``v_scale`` tensors: :mod:`~treedec.models.kv_scales`).

Module names are the checkpoint's (``model.layers.0.self_attn.q_proj``, ``lm_head``); a treedec projection
fusing several (``qkv_proj``) takes their method, which must be one. The LM head stays unquantized.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from treedec.errors import CheckpointError, UnsupportedModelError
from treedec.models.fp8 import Fp8Linear
from treedec.models.hf_config import quantized_message
from treedec.models.linear import UNQUANTIZED, LinearMethod
from treedec.models.weights import WeightMap

__all__ = ["QUANTIZATIONS", "Quantization", "quantize_on_load", "read_quantization"]

#: The values of ``quantization=`` (quantize-on-load) and ``--quantization``.
QUANTIZATIONS = ("fp8",)
FIELD = "field 'quantization_config'"
_LINEAR_WEIGHT = re.compile(r"(.+)\.weight")
_LAYER_MODULE = re.compile(r"layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Quantization:
    """The quantization of a model's projections.

    Attributes
    ----------
    method : the method of every projection not ignored.
    ignore : checkpoint module names (``lm_head``, ``model.layers.0.mlp.down_proj``) or ``re:<pattern>``
        (matched in full) that stay unquantized.
    format : where it comes from, in words (``"fp8 checkpoint"``, ``"compressed-tensors checkpoint"``,
        ``"quantized on load"``), for reports.
    """

    method: Fp8Linear
    ignore: tuple[str, ...] = ("lm_head",)
    format: str = "quantized on load"

    def method_of(self, module: str) -> LinearMethod:
        """The method of checkpoint module ``module``: unquantized if :attr:`ignore` names it."""
        for pattern in self.ignore:
            if pattern == module or (pattern.startswith("re:") and re.fullmatch(pattern[3:], module)):
                return UNQUANTIZED
        return self.method

    def methods(self, weights: WeightMap) -> Callable[[str], LinearMethod]:
        """treedec projection name (``layers.3.qkv_proj``, ``lm_head``) -> its method, from the checkpoint modules
        the weight map fills it from (read from its templates: no walk over the layers). UnsupportedModelError
        when those disagree (a fused projection half ignored) or the LM head would be quantized."""
        modules: dict[str, list[str]] = {}
        for w in (*weights.globals, *weights.layer):
            m, h = _LINEAR_WEIGHT.fullmatch(w.param), _LINEAR_WEIGHT.fullmatch(w.hf)
            if m is not None and h is not None:
                modules.setdefault(m[1], []).append(h[1])

        def method(name: str) -> LinearMethod:
            layer = _LAYER_MODULE.fullmatch(name)
            key = name if layer is None else f"layers.{{i}}.{layer[2]}"
            names = [hf if layer is None else hf.format(i=layer[1]) for hf in modules.get(key, ())]
            found = {hf: self.method_of(hf) for hf in names}
            if len(set(found.values())) > 1:
                raise UnsupportedModelError(f"the {self.format} quantizes some of {sorted(found)} and not the others; "
                                            f"treedec fuses them into one projection ({name})")
            chosen = next(iter(found.values()), UNQUANTIZED)
            if name == "lm_head" and chosen is not UNQUANTIZED:
                raise UnsupportedModelError(f"the {self.format} quantizes lm_head, which treedec keeps unquantized "
                                            f"(fp8 checkpoints list it in 'ignore')")
            return chosen

        return method


def quantize_on_load(name: str) -> Quantization:
    """The :class:`Quantization` of ``quantization=name`` over a float checkpoint: ``"fp8"`` is every
    projection but the LM head quantized per output row when loaded (:class:`~treedec.models.fp8.Fp8Linear`)."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {name!r:.60}")
    return Quantization(Fp8Linear("quantize"))


def read_quantization(raw_config: dict, where: str) -> Quantization | None:
    """The :class:`Quantization` a ``config.json`` object's ``quantization_config`` declares (None without one).

    Raises
    ------
    UnsupportedModelError : a quantization treedec does not load (AWQ, GPTQ, bitsandbytes, block-wise fp8,
        compressed-tensors int or mixed schemes, a KV-cache scheme other than 8-bit float per tensor), naming it and
        what is read.
    CheckpointError : a malformed fp8 ``quantization_config`` (naming the field).
    """
    q = raw_config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: field 'quantization_config' must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_config(q, where)
    if method == "compressed-tensors":
        return _compressed_tensors(q, where)
    raise UnsupportedModelError(f"{where}: {quantized_message(FIELD, q)}")


# ===================================================================== private


def _fp8_config(q: dict, where: str) -> Quantization:
    field = "field 'quantization_config"
    if q.get("weight_block_size") is not None:
        raise UnsupportedModelError(f"{where}: {field}.weight_block_size' is {q['weight_block_size']!r:.40}: "
                                    f"block-wise fp8 scales (weight_scale_inv) are not implemented; treedec reads "
                                    f"per-tensor fp8 scales and compressed-tensors per-channel ones")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(f"{where}: {field}.fmt' is {fmt!r:.40}; treedec reads e4m3 fp8 weights")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise CheckpointError(f"{where}: {field}.activation_scheme' must be 'dynamic' or 'static', got "
                              f"{scheme!r:.40}")
    ignore = _names(q, "ignored_layers", where) + _names(q, "modules_to_not_convert", where)
    return Quantization(Fp8Linear("checkpoint", "tensor", "dynamic", scheme == "static"),
                        tuple(dict.fromkeys(("lm_head", *ignore))), "fp8 checkpoint")


def _compressed_tensors(q: dict, where: str) -> Quantization:
    field = "field 'quantization_config"
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise UnsupportedModelError(f"{where}: {field}.format' is {fmt!r:.40}: treedec reads compressed-tensors "
                                    f"fp8 checkpoints ('float-quantized'), not other compressed formats")
    kv = q.get("kv_cache_scheme")
    if kv is not None and not (isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float" and
                               kv.get("strategy", "tensor") == "tensor" and kv.get("dynamic") in (False, None)):
        raise UnsupportedModelError(f"{where}: {field}.kv_cache_scheme' is {kv!r:.80}: treedec reads static per-tensor "
                                    f"8-bit float KV-cache scales (k_scale / v_scale, used with kv_cache_dtype='fp8')")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise UnsupportedModelError(f"{where}: {field}.config_groups' must hold one group (treedec reads one fp8 "
                                    f"scheme for every Linear), got {groups!r:.80}")
    name, group = next(iter(groups.items()))
    at = f"{field}.config_groups.{name}"
    if not isinstance(group, dict) or group.get("targets") != ["Linear"]:
        raise UnsupportedModelError(f"{where}: {at}.targets' must be ['Linear'], got "
                                    f"{group.get('targets') if isinstance(group, dict) else group!r:.80}")
    w = group.get("weights")
    if not (isinstance(w, dict) and w.get("num_bits") == 8 and w.get("type") == "float"):
        raise UnsupportedModelError(f"{where}: {at}.weights' is not an 8-bit float scheme ({w!r:.80}); treedec reads "
                                    f"fp8 compressed-tensors checkpoints only")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel") or w.get("dynamic") not in (False, None) or \
            w.get("symmetric", True) is not True:
        raise UnsupportedModelError(f"{where}: {at}.weights' strategy {strategy!r:.20} (dynamic "
                                    f"{w.get('dynamic')!r:.10}, symmetric {w.get('symmetric')!r:.10}): treedec reads "
                                    f"static symmetric 'tensor' or 'channel' fp8 weight scales")
    a = group.get("input_activations")
    if a is None:
        activations, static = "none", False
    elif isinstance(a, dict) and a.get("num_bits") == 8 and a.get("type") == "float" and \
            (a.get("dynamic") is True and a.get("strategy") == "token" or
             a.get("dynamic") is False and a.get("strategy") == "tensor"):
        activations, static = "dynamic", a.get("dynamic") is False
    else:
        raise UnsupportedModelError(f"{where}: {at}.input_activations' is {a!r:.80}; treedec reads fp8 activations "
                                    f"dynamic per token, static per tensor, or none")
    ignore = _names(q, "ignore", where)
    return Quantization(Fp8Linear("checkpoint", strategy, activations, static),
                        tuple(dict.fromkeys(("lm_head", *ignore))), "compressed-tensors checkpoint")


def _names(q: dict, key: str, where: str) -> tuple[str, ...]:
    value = q.get(key) or []
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise CheckpointError(f"{where}: field 'quantization_config.{key}' must be a list of module names, got "
                              f"{value!r:.80}")
    return tuple(value)
