"""The ``torch`` and ``reference`` backends: PyTorch ops on any device."""
from __future__ import annotations

from collections import Counter

import torch

from treedec.attention.backends.base import Backend, SpanMasking
from treedec.attention.reference import reference_tree_attention
from treedec.attention.torch_executor import TORCH_FORMS, TorchLaunch, prepare_torch, run_torch
from treedec.attention.tree_plan import DeviceTreePlan
from treedec.attention.variant import AttentionVariant


class TorchBackend(Backend):
    """Executes any plan with PyTorch ops (fp32 math): the CPU default. fp8 K/V caches are de-quantized (to fp32)
    as they are read.

    :meth:`prepare` makes the step's :class:`~treedec.attention.torch_executor.TorchLaunch` from the host plan
    (``plan.plan``; a dynamic span is masked there) once, in the form ``form`` says: ``auto`` (the default) runs
    one dense masked attention over all the plan's KV tokens where that wastes little (one request decoding), else
    chunk by chunk as the kernels do, ``rows`` one entry at a time within each chunk (see
    :mod:`treedec.attention.torch_executor`). :attr:`forms` counts the
    forms prepared. :meth:`run` also takes a plan prepared by nothing (or another backend): it prepares it itself.
    """

    name = "torch"
    prepares_launch = False
    static_plans = False
    custom_op = False
    span_masking = SpanMasking.HOST

    def __init__(self, variant: AttentionVariant, form: str = "auto"):
        if form not in TORCH_FORMS:
            raise ValueError(f"form must be one of {TORCH_FORMS}, got {form!r}")
        self.variant = variant
        self.form = form
        self.forms: Counter = Counter()

    @classmethod
    def why_unavailable(cls, device: torch.device) -> str | None:
        return None

    @classmethod
    def create(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               variant: AttentionVariant, device: torch.device) -> TorchBackend:
        return cls(variant)

    @classmethod
    def why_not_batch_invariant(cls) -> str | None:
        return None   # (its rows form: one small attention per entry over its chunk, of that query only)

    def batch_invariant(self) -> TorchBackend:
        """The rows form always: the dense form attends every query in one product, whose shape follows the
        step's queries (and ``auto`` picks it for one request alone, chunks for a batch), and the chunks form
        attends a chunk's queries in one GEMM, whose sums a CPU GEMM orders by its row count (a chunk of a
        batch-invariant plan is read by every query of its window, however many the forest has)."""
        return TorchBackend(self.variant, "rows")

    def prepare(self, plan: DeviceTreePlan) -> TorchLaunch:
        launch = prepare_torch(plan.plan, plan.kv_slots.device, self.form)
        self.forms[launch.form] += 1
        return launch

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
            kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(run_torch(q, k_cache, v_cache, self._launch(plan), self.variant, kv_scale=kv_scale))

    def run_out(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        return run_torch(q, k_cache, v_cache, self._launch(plan), self.variant, return_lse=False,
                         kv_scale=kv_scale).out

    def _launch(self, plan: DeviceTreePlan) -> TorchLaunch:
        return plan.prepared if isinstance(plan.prepared, TorchLaunch) else self.prepare(plan)


class ReferenceBackend(TorchBackend):
    """Dense fp32 masked attention over the plan's layout: the ground truth of every test.

    It attends by the tree's layout, not the plan's masks, so it takes no dynamic span and prepares nothing.
    """

    name = "reference"
    span_masking = SpanMasking.UNSUPPORTED

    @classmethod
    def why_not_batch_invariant(cls) -> str | None:
        return "the reference backend attends every query in one dense product over all of the step's tokens"

    def prepare(self, plan: DeviceTreePlan) -> None:
        return None

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
            kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_tree_attention(q, k_cache, v_cache, plan.plan.layout, self.variant, kv_scale)

    def run_out(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(q, k_cache, v_cache, plan, kv_scale)[0]
