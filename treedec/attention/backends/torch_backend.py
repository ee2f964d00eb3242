"""The ``torch`` and ``reference`` backends: PyTorch ops on any device, nothing to prepare."""
from __future__ import annotations

import torch

from treedec.attention.backends.base import Backend, SpanMasking
from treedec.attention.reference import reference_tree_attention
from treedec.attention.torch_executor import run_plan_torch
from treedec.attention.tree_plan import DeviceTreePlan


class TorchBackend(Backend):
    """Executes any plan chunk by chunk with PyTorch ops (fp32 math): the CPU default.

    It indexes with the host plan (``plan.plan``), so it runs any :class:`DeviceTreePlan` and a
    dynamic span is masked in that host plan.
    """

    name = "torch"
    prepares_launch = False
    static_plans = False
    custom_op = False
    span_masking = SpanMasking.HOST

    def __init__(self, sm_scale: float):
        self.sm_scale = sm_scale

    @classmethod
    def why_unavailable(cls, device: torch.device) -> str | None:
        return None

    @classmethod
    def create(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, sm_scale: float,
               device: torch.device) -> TorchBackend:
        return cls(sm_scale)

    def prepare(self, plan: DeviceTreePlan) -> None:
        return None

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan
            ) -> tuple[torch.Tensor, torch.Tensor]:
        return run_plan_torch(q, k_cache, v_cache, plan.plan, self.sm_scale)


class ReferenceBackend(TorchBackend):
    """Dense fp32 masked attention over the plan's layout: the ground truth of every test.

    It attends by the tree's layout, not the plan's masks, so it takes no dynamic span.
    """

    name = "reference"
    span_masking = SpanMasking.UNSUPPORTED

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan
            ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_tree_attention(q, k_cache, v_cache, plan.plan.layout, self.sm_scale)
