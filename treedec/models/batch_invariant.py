"""A model's batch-invariant mode: every GEMM and norm computes a row with one reduction order whatever the other
rows are, so a request's logits are the same bits alone or in any batch (``Engine(..., batch_invariant=True)``).

:func:`make_batch_invariant` switches a :class:`~treedec.models.decoder.Decoder` over, in place:

- every unquantized :class:`~treedec.models.linear.Linear` (the projections, the MLP, the LM head, soft-capped or
  not) and a :class:`~treedec.models.tensor_parallel.VocabParallelHead` of one rank take
  :class:`BatchInvariantUnquantized`;
- the norms (RMSNorm, with its residual add) take :func:`batch_invariant_ops`.

What runs, by the weights' device (:class:`BatchInvariance` reports it):

- CUDA (``kernel="triton-kernels"``): the Triton matmul of :mod:`treedec.kernels.batch_invariant_matmul` (tiles
  chosen from N and K only, no split-K) and the Triton RMSNorm of :mod:`treedec.kernels.batch_invariant_rms_norm`
  (one program per row). torch's own GEMMs (cuBLAS picks kernels and split-K by M) and CUDA reductions (their
  block shape follows the number of rows) are not batch-invariant.
- CPU (``kernel="rows"``): each row is its own ``F.linear`` (a matrix-vector product, the same call whatever the
  batch: a CPU GEMM takes another code path for one row than for many), one call per row, so a CPU step costs
  about rows x projections calls; the norms are torch's, whose CPU reduction sums each row on its own in one
  order (for rows of fewer than 32768 values, every model's hidden size). The Triton kernels do not run on the
  CPU in this mode (the interpreter is a test tool); a test may ask for them,
  ``make_batch_invariant(model, "triton-kernels")`` under ``TRITON_INTERPRET=1``.

Refused (ValueError naming the option): quantized projections (an fp8 GEMM picks its own kernel), a model split
over several ranks (the all-reduce after ``o_proj`` / ``down_proj`` sums in an order NCCL picks by message size),
fused pointwise ops (``compile_pointwise``: Inductor's reduction kernels are tuned per shape). The switch is not
undone: an engine made later over the same model computes batch-invariantly too.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treedec.errors import BackendUnavailableError
from treedec.models.decoder import Decoder
from treedec.models.layers import PointwiseOps
from treedec.models.linear import Linear, Unquantized
from treedec.models.tensor_parallel import VocabParallelHead

__all__ = ["BATCH_INVARIANT_KERNELS", "BatchInvariance", "BatchInvariantUnquantized", "batch_invariant_ops",
           "make_batch_invariant"]

#: The batch-invariant compute paths: ``"triton-kernels"`` (CUDA, or the CPU under ``TRITON_INTERPRET=1`` in
#: tests) and ``"rows"`` (the CPU's: one ``F.linear`` per row).
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
            self.matmul = _row_by_row_linear

    def finish(self, layer: Linear) -> None:
        layer.path = "batch-invariant matmul" if self.kernel == "triton-kernels" else "F.linear row by row"

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(x, layer.weight, bias)


def batch_invariant_ops(kernel: str) -> PointwiseOps:
    """The :class:`~treedec.models.layers.PointwiseOps` of the mode: the Triton RMSNorm for ``"triton-kernels"``,
    torch's (row by row on the CPU already) for ``"rows"``; RoPE and the activation are elementwise (invariant as they
    are)."""
    if kernel not in BATCH_INVARIANT_KERNELS:
        raise ValueError(f"kernel must be one of {BATCH_INVARIANT_KERNELS}, got {kernel!r}")
    if kernel == "rows":
        return PointwiseOps()
    from treedec.kernels.batch_invariant_rms_norm import batch_invariant_rms_norm   # (triton is optional)

    def add_norm(x, y, weight, eps, offset=0.0):
        s = x + y
        return s, batch_invariant_rms_norm(s, weight, eps, offset)

    return PointwiseOps(rms_norm=batch_invariant_rms_norm, add_rms_norm=add_norm)


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
    if model.ops != PointwiseOps() and not _is_batch_invariant_ops(model.ops):
        raise ValueError("batch_invariant=True cannot keep compile_pointwise's fused ops: Inductor tunes their "
                         "reduction kernels per shape; use a model whose compile_pointwise was not called")
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
    model.ops = batch_invariant_ops(kernel)
    return BatchInvariance(kernel, linears, reason)


def _is_batch_invariant_ops(ops: PointwiseOps) -> bool:
    """Whether ``ops`` are a batch-invariant set already (a second engine over a switched model)."""
    return ops.rms_norm.__name__ == "batch_invariant_rms_norm"


def _row_by_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed one row at a time (``x [..., K]`` -> ``[..., N]``)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.stack([F.linear(row, weight, bias) for row in rows.unbind(0)]).reshape(*x.shape[:-1],
                                                                                           weight.shape[0])

