"""The ``torch`` and ``reference`` backends: PyTorch ops on any device, nothing to prepare."""
from __future__ import annotations

import torch

from treedec.attention.reference import reference_tree_attention
from treedec.attention.torch_executor import run_plan_torch
from treedec.attention.tree_plan import DeviceTreePlan


class TorchBackend:
    """Executes any plan chunk by chunk with PyTorch ops (fp32 math): the CPU default."""

    name = "torch"

    def __init__(self, sm_scale: float):
        self.sm_scale = sm_scale

    def prepare(self, plan: DeviceTreePlan) -> None:
        return None

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan
            ) -> tuple[torch.Tensor, torch.Tensor]:
        return run_plan_torch(q, k_cache, v_cache, plan.plan, self.sm_scale)


class ReferenceBackend(TorchBackend):
    """Dense fp32 masked attention over the plan's layout: the ground truth of every test."""

    name = "reference"

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan
            ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_tree_attention(q, k_cache, v_cache, plan.plan.layout, self.sm_scale)
