"""fp8 (e4m3) weights: the :class:`Fp8Linear` method of a :class:`~treedec.models.linear.Linear`.

Storage: ``weight [out, in]`` ``float8_e4m3fn`` and ``weight_scale [out]`` float32, one scale per output
row, whatever the checkpoint stored: a per-tensor scale (one per checkpoint tensor: q, k, v, gate and up
each have theirs) fills the rows of its shard, a per-channel one (``[rows, 1]``) is copied row by row. A
fused layer thus keeps each shard's own scale, exactly (nothing is requantized to a common scale), and the
row-wise scale is what a row-wise ``torch._scaled_mm`` reads. ``W = weight.float() * weight_scale[:, None]``.

Sources (:attr:`Fp8Linear.source`):

- ``"checkpoint"``: fp8 weights and their scales read from an FP8 checkpoint (``weight_scale``; the
  checkpoint's ``input_scale``, when its activations are static, is checked and not used: activations are
  scaled per token, dynamically, which is at least as precise).
- ``"quantize"``: float weights quantized when loaded, per output row (``amax / 448``). Under tensor
  parallelism a row-parallel layer's rows are scaled over this rank's columns only (not TP=1's scales).

Apply (chosen per layer when loading ends, by device, and recorded in :attr:`Linear.path`):

- :data:`SCALED_MM`: on a CUDA device of compute capability >= 8.9 (Ada, Hopper), bf16 activations,
  sizes multiples of 16 and dynamic activations: each row of ``x`` quantized to fp8 with its own scale
  (``amax / 448``), ``torch._scaled_mm`` with row-wise scales on both sides, bf16 out.
- :data:`DEQUANTIZE`: ``F.linear(x, W.to(x.dtype), bias)`` — the reference, what the CPU runs (and a
  weight-only scheme, or a GPU without fp8 tensor cores).

On a CUDA device with Triton, steps of at most :data:`~treedec.kernels.fp8_gemv.MAX_ROWS` rows (a decode
step of few requests) go to the weight-only fp8 GEMV (:mod:`treedec.kernels.fp8_gemv`: the e4m3 weight tiles
converted in registers, the activations unquantized), chosen per call by the number of rows. Steps of up to
:data:`~treedec.kernels.fp8_matmul.MAX_ROWS` rows (decode batches, verify trees) run the dynamic scheme on the fp8 x
fp8 Triton GEMM sized for decode steps (:mod:`treedec.kernels.fp8_matmul`, the rows quantized as above by torch ops
that ``torch.compile`` fuses) in place of ``torch._scaled_mm``: on an H200 at 16-256 rows of Llama-3-8B's
projections it took 0.3-0.9x ``_scaled_mm``'s time (bench/results/2026-12-04-nvidia-h200-fp8-gemv-s21.json).
Longer steps (prompt chunks) keep ``_scaled_mm``, whose tiles are made for many rows. At one row the GEMV stays: a
compiled greedy step through the fp8 GEMM took 5.93 ms against bf16's 5.05 in the same run
(...-programs-s21-fp8c.json), and the GEMV's 4.61 (...-programs-s21-fp8c-gemv.json). The layer's path names all
three (:data:`GEMV_FP8_MATMUL`) or the GEMV and the de-quantized product (:data:`GEMV_DEQUANTIZE`). Without Triton
the layer's path is the one above alone, and says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treedec.models.linear import Linear, TensorSpec, check_loaded_value

__all__ = ["DEQUANTIZE", "FP8", "FP8_MAX", "GEMV_DEQUANTIZE", "GEMV_FP8_MATMUL", "SCALED_MM", "Fp8Linear",
           "dequantize", "quantize_rows", "scaled_mm"]

FP8 = torch.float8_e4m3fn
#: The largest e4m3 value.
FP8_MAX = float(torch.finfo(FP8).max)
#: Dtypes a checkpoint's scales may have (compressed-tensors writes them in the model dtype).
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALED_MM = "torch._scaled_mm (fp8 x fp8, dynamic per-token activation scales)"
_FP8_MATMUL = "the fp8 x fp8 Triton GEMM (dynamic per-token activation scales)"
DEQUANTIZE = "de-quantize + F.linear"
_GEMV = "the weight-only fp8 GEMV (Triton) for steps of at most 16 rows, "
GEMV_FP8_MATMUL = _GEMV + _FP8_MATMUL + " up to 256 rows, " + SCALED_MM + " above"
GEMV_DEQUANTIZE = _GEMV + DEQUANTIZE + " above"
_SOURCES = ("checkpoint", "quantize")
_STRATEGIES = ("tensor", "channel")
_ACTIVATIONS = ("dynamic", "none")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [m, k]`` (any float dtype) -> ``(q [m, k] float8_e4m3fn, scale [m, 1] float32)`` with
    ``q * scale ~= x``: each row scaled by its ``amax / 448`` (an all-zero row by 1)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight [out, in]`` fp8 and ``scale [out]`` float32 -> ``weight * scale[:, None]`` (in float32) as
    ``dtype``: the weight the fp8 layer stands for."""
    return (weight.float() * scale[:, None]).to(dtype)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """``x [..., in]`` bf16 times fp8 ``weight [out, in]`` (``scale [out]`` float32) on a CUDA device:
    ``x``'s rows quantized with dynamic per-row scales, ``torch._scaled_mm`` (row-wise scales), bf16
    ``[..., out]``, then ``+ bias``."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows(rows)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


@dataclass(frozen=True)
class Fp8Linear:
    """The fp8 e4m3 method of a :class:`~treedec.models.linear.Linear` (see the module docstring).

    Attributes
    ----------
    source : ``"checkpoint"`` (fp8 weights with their scales) or ``"quantize"`` (float weights, quantized
        per output row when loaded).
    weight_scales : how the checkpoint stores the scales: ``"tensor"`` (one per checkpoint tensor, shape
        ``()`` or ``(1,)``) or ``"channel"`` (``[rows, 1]``); ``"channel"`` for ``source="quantize"``.
    activations : ``"dynamic"`` (fp8 activations, per-token scales, where :data:`SCALED_MM` runs) or
        ``"none"`` (a weight-only scheme: activations stay in the model dtype; :data:`DEQUANTIZE`).
    input_scales : the checkpoint holds a static ``input_scale`` per tensor (read and checked, not used).
    """

    source: str = "quantize"
    weight_scales: str = "channel"
    activations: str = "dynamic"
    input_scales: bool = False
    quantized = True

    def __post_init__(self):
        for field, value, allowed in (("source", self.source, _SOURCES), ("weight_scales", self.weight_scales,
                                                                            _STRATEGIES),
                                      ("activations", self.activations, _ACTIVATIONS)):
            if value not in allowed:
                raise ValueError(f"Fp8Linear {field} must be one of {allowed}, got {value!r}")
        if self.source == "quantize" and (self.weight_scales != "channel" or self.input_scales):
            raise ValueError("Fp8Linear(source='quantize') computes per-channel weight scales and no input scales")

    @property
    def name(self) -> str:
        acts = "dynamic per-token fp8 activations" if self.activations == "dynamic" else "weight-only"
        return f"fp8 e4m3 (per-{self.weight_scales} weight scales, {acts})"

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=FP8),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(layer.out_features, dtype=torch.float32), requires_grad=False)

    def checkpoint_tensors(self, rows: int, cols: int) -> dict[str, TensorSpec]:
        if self.source == "quantize":
            return {"weight": TensorSpec(((rows, cols),), None, per_row=True)}
        scale = TensorSpec(((rows, 1),), SCALE_DTYPES, per_row=True) if self.weight_scales == "channel" else \
            TensorSpec(((), (1,)), SCALE_DTYPES, per_row=False)
        out = {"weight": TensorSpec(((rows, cols),), (FP8,), per_row=True), "weight_scale": scale}
        if self.input_scales:
            out["input_scale"] = TensorSpec(((), (1,)), SCALE_DTYPES, per_row=False)
        return out

    def load(self, layer: Linear, suffix: str, tensor: torch.Tensor, rows: slice, name: str, file: str) -> None:
        if self.source == "quantize":
            q, scale = quantize_rows(tensor)
            layer.weight[rows].copy_(q)
            layer.weight_scale[rows].copy_(scale.view(-1))
            return
        if suffix == "weight":
            layer.weight[rows].copy_(tensor)
            return
        scale = tensor.float().reshape(-1)
        check_loaded_value(bool(torch.isfinite(scale).all() and (scale > 0).all()), name, file,
                           f"must hold finite scales > 0, got {scale[:4].tolist()}{' ...' if len(scale) > 4 else ''}")
        if suffix == "weight_scale":
            layer.weight_scale[rows].copy_(scale.expand(layer.weight_scale[rows].shape))

    def finish(self, layer: Linear) -> None:
        weight = layer.weight
        fast = (weight.device.type == "cuda" and self.activations == "dynamic" and layer.dtype == torch.bfloat16
                and layer.in_features % 16 == 0 and layer.out_features % 16 == 0
                and torch.cuda.get_device_capability(weight.device) >= (8, 9))
        layer.path = SCALED_MM if fast else DEQUANTIZE
        if weight.device.type == "cuda" and layer.dtype in (torch.bfloat16, torch.float16) and \
                _triton_kernels_available():
            layer.path = GEMV_FP8_MATMUL if fast and layer.in_features >= 32 else GEMV_DEQUANTIZE

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        path = layer.path
        if path in (GEMV_FP8_MATMUL, GEMV_DEQUANTIZE):
            from treedec.kernels import fp8_gemv, fp8_matmul
            rows = x.numel() // x.shape[-1]
            if rows <= fp8_gemv.MAX_ROWS:
                return fp8_gemv.fp8_gemv(x, layer.weight, layer.weight_scale, bias)
            if path == GEMV_DEQUANTIZE:
                path = DEQUANTIZE
            elif rows <= fp8_matmul.MAX_ROWS:
                xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
                return fp8_matmul.fp8_matmul(xq, x_scale, layer.weight, layer.weight_scale, bias, x.dtype).view(
                    *x.shape[:-1], layer.out_features)
            else:
                path = SCALED_MM
        if path == SCALED_MM:
            return scaled_mm(x, layer.weight, layer.weight_scale, bias)
        return F.linear(x, dequantize(layer.weight, layer.weight_scale, x.dtype), bias)


def _triton_kernels_available() -> bool:
    """Whether the Triton fp8 kernels can be imported (Triton ships with CUDA builds of torch; a layer without it
    keeps the torch paths alone, which its :attr:`Linear.path` says)."""
    try:
        import treedec.kernels.fp8_gemv  # noqa: F401
        import treedec.kernels.fp8_matmul  # noqa: F401
    except ImportError:
        return False
    return True
