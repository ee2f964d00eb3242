"""A model's batch-invariant mode: every GEMM and norm computes a row with one reduction order whatever the other
rows are, so a request's logits are the same bits alone or in any batch (``Engine(..., batch_invariant=True)``).

:func:`make_batch_invariant` switches a :class:`~treedec.models.decoder.Decoder` over, in place:

- every unquantized :class:`~treedec.models.linear.Linear` (the projections, the MLP, the LM head, soft-capped or
  not) and a :class:`~treedec.models.tensor_parallel.VocabParallelHead` of one rank take
  :class:`BatchInvariantUnquantized`;
- the norms (RMSNorm, with its residual add) take :func:`batch_invariant_ops`.

What runs, by the weights' device (:class:`BatchInvariance` reports it):

- CUDA (``kernel="triton-kernels"``): the Triton matmul of :mod:`treedec.kernels.batch_invariant_matmul` (tiles
  chosen from N and K only, no split-K that follows M) and the Triton RMSNorm, alone or fused with the residual add
  before it, of :mod:`treedec.kernels.batch_invariant_rms_norm` (one program per row). torch's own GEMMs (cuBLAS
  picks kernels and split-K by M) and CUDA reductions (their block shape follows the number of rows) are not
  batch-invariant.
- CPU (``kernel="rows"``): the ops of :mod:`treedec.models.batch_invariant_rows` (``F.linear`` row by row, torch's
  row-wise RMSNorm), so a CPU step costs about rows x projections calls. The Triton kernels do not run on the CPU in
  this mode (the interpreter is a test tool); a test may ask for them, ``make_batch_invariant(model,
  "triton-kernels")`` under ``TRITON_INTERPRET=1``.

Every one of these GEMMs and norms is a torch custom op with a fake impl (``treedec::batch_invariant_matmul``,
``treedec::batch_invariant_rms_norm``, ``treedec::batch_invariant_add_rms_norm``; on the CPU
``treedec::linear_rows``, ``treedec::rms_norm_rows``, ``treedec::add_rms_norm_rows``): ``torch.compile``
(the engine's ``compile_model``, the model's ``compile_pointwise`` after the switch) keeps each whole and fuses
only the pointwise code between them (RoPE, the activation, the soft-cap), whose per-element math does not depend
on the row count. Outside a compile the functions launch their kernels directly.

Refused (ValueError naming the option): quantized projections (an fp8 GEMM picks its own kernel), a model split
over several ranks (the all-reduce after ``o_proj`` / ``down_proj`` sums in an order NCCL picks by message size),
pointwise ops fused before the switch (``compile_pointwise`` then compiled torch's norms, whose reduction kernels
Inductor tunes per shape). The switch is not undone: an engine made later over the same model computes
batch-invariantly too.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from treedec.errors import BackendUnavailableError
from treedec.models.decoder import Decoder
from treedec.models.layers import PointwiseOps
from treedec.models.batch_invariant_rows import add_rms_norm_rows, linear_rows, rms_norm_rows
from treedec.models.linear import Linear, Unquantized
from treedec.models.tensor_parallel import VocabParallelHead

__all__ = ["BATCH_INVARIANT_KERNELS", "BatchInvariance", "BatchInvariantUnquantized", "batch_invariant_ops",
           "make_batch_invariant"]

#: The batch-invariant compute paths: ``"triton-kernels"`` (CUDA, or the CPU under ``TRITON_INTERPRET=1`` in
#: tests) and ``"rows"`` (the CPU's: :mod:`~treedec.models.batch_invariant_rows`).
BATCH_INVARIANT_KERNELS = ("triton-kernels", "rows")


@dataclass(frozen=True)
class BatchInvariance:
    """What :func:`make_batch_invariant` switched: ``kernel`` (one of :data:`BATCH_INVARIANT_KERNELS`),
    ``linears`` (projections and heads switched), ``reason`` (why this kernel, in words)."""

    kernel: str
    linears: int
    reason: str

    @property
    def summary(self) -> str:
        """One line for logs and reports."""
        return f"{self.kernel} ({self.linears} projections; {self.reason})"


class BatchInvariantUnquantized(Unquantized):
    """:class:`~treedec.models.linear.Unquantized` weights whose product ``x @ W.T (+ b)`` gives each row the same
    bits whatever the number of rows: the Triton matmul (``kernel="triton-kernels"``) or one ``F.linear`` per row
    (``"rows"``). Loading is the unquantized method's."""

    quantized = False

    def __init__(self, kernel: str):
        if kernel not in BATCH_INVARIANT_KERNELS:
            raise ValueError(f"kernel must be one of {BATCH_INVARIANT_KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.name = f"unquantized, batch-invariant ({kernel})"
        if kernel == "triton-kernels":
            from treedec.kernels.batch_invariant_matmul import batch_invariant_matmul   # (triton is optional)
            self.matmul = batch_invariant_matmul
        else:
            self.matmul = linear_rows

    def finish(self, layer: Linear) -> None:
        layer.path = "batch-invariant matmul" if self.kernel == "triton-kernels" else "F.linear row by row"

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(x, layer.weight, bias)


def batch_invariant_ops(kernel: str) -> PointwiseOps:
    """The :class:`~treedec.models.layers.PointwiseOps` of the mode: the Triton RMSNorm (and its fused residual add)
    for ``"triton-kernels"``, the row-wise torch ones for ``"rows"``; RoPE and the activation are elementwise
    (invariant as they are)."""
    if kernel not in BATCH_INVARIANT_KERNELS:
        raise ValueError(f"kernel must be one of {BATCH_INVARIANT_KERNELS}, got {kernel!r}")
    if kernel == "rows":
        return PointwiseOps(rms_norm=rms_norm_rows, add_rms_norm=add_rms_norm_rows, batch_invariant=kernel)
    from treedec.kernels.batch_invariant_rms_norm import (   # (triton is optional)
        batch_invariant_add_rms_norm, batch_invariant_rms_norm)
    return PointwiseOps(rms_norm=batch_invariant_rms_norm, add_rms_norm=batch_invariant_add_rms_norm,
                        batch_invariant=kernel)


def make_batch_invariant(model, kernel: str | None = None) -> BatchInvariance:
    """Switch ``model`` (a :class:`~treedec.models.decoder.Decoder`) to batch-invariant GEMMs and norms, in place
    (see the module docstring). ``kernel`` None keeps the kernel of a model switched already, else chooses by the
    weights' device (CUDA: ``"triton-kernels"``, CPU: ``"rows"``). Raises ValueError naming what cannot be
    batch-invariant (nothing is switched then), NotImplementedError for another model class,
    BackendUnavailableError for CUDA without triton."""
    if not isinstance(model, Decoder):
        raise NotImplementedError(f"batch_invariant=True switches a Decoder's projections and norms; "
                                  f"{type(model).__name__} has no batch-invariant mode")
    if model.tensor_parallel is not None and model.tensor_parallel.size > 1:
        raise ValueError(f"batch_invariant=True cannot run a model split over {model.tensor_parallel.size} ranks "
                         f"(tensor_parallel): the all-reduce after o_proj and down_proj sums in an order NCCL picks "
                         f"by message size, which follows the batch; run the model in one process")
    quantized = sorted({m.method.name for m in model.modules() if isinstance(m, Linear) and m.method.quantized})
    if quantized:
        raise ValueError(f"batch_invariant=True needs unquantized projections, this model has {quantized} "
                         f"(quantization={model.quantization!r:.60}): load it without quantization")
    if model.ops.fused and model.ops.batch_invariant is None:
        raise ValueError("batch_invariant=True cannot keep compile_pointwise's fused ops: Inductor tunes their "
                         "reduction kernels per shape; call compile_pointwise after the switch (once an "
                         "Engine(batch_invariant=True) was made over the model), or use compile_model")
    device = model.device
    switched = {m.method.kernel for m in model.modules() if isinstance(m, Linear)
                and isinstance(m.method, BatchInvariantUnquantized)}
    if kernel is None and len(switched) == 1:
        kernel = switched.pop()
        reason = f"the model's projections were switched to {kernel!r} already"
    elif kernel is None:
        if device.type == "cuda":
            kernel, reason = "triton-kernels", f"the Triton matmul and RMSNorm on {device}"
        elif device.type == "cpu":
            kernel, reason = "rows", "on the CPU: F.linear row by row, torch's row-wise RMSNorm"
        else:
            raise ValueError(f"batch_invariant=True runs on CUDA or the CPU, the model is on {device}")
        if kernel == "triton-kernels" and importlib.util.find_spec("triton") is None:
            raise BackendUnavailableError("batch_invariant=True on CUDA runs Triton kernels: the 'triton' package "
                                          "is not installed (pip install 'treedec[triton]')")
    else:
        reason = f"kernel={kernel!r} asked for"
    if model.ops.fused and model.ops.batch_invariant != kernel:
        raise ValueError(f"compile_pointwise fused this model's {model.ops.batch_invariant!r} ops; "
                         f"kernel={kernel!r} cannot replace them: load the model again")
    method = BatchInvariantUnquantized(kernel)
    linears = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.method = method
            method.finish(module)
            linears += 1
        elif isinstance(module, VocabParallelHead):
            module.matmul = method.matmul
            linears += 1
    if model.ops.batch_invariant != kernel:   # (a second engine keeps the ops, compile_pointwise's too)
        model.ops = batch_invariant_ops(kernel)
    return BatchInvariance(kernel, linears, reason)
