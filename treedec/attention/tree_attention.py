"""TreeAttention: plan once per step on the CPU, run for every layer."""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from treedec.attention.backends import HYBRID_MIN_ROWS, resolve_backend
from treedec.attention.planners import PlanConfig, make_plan
from treedec.attention.reference import reference_tree_attention
from treedec.attention.torch_executor import run_plan_torch
from treedec.attention.tree_plan import DeviceTreePlan
from treedec.tree.layout import TreeLayout
from treedec.tree.sequence_tree import SequenceTree

logger = logging.getLogger("treedec")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


class TreeAttention:
    """Tree attention for a fixed head configuration.

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim:
        ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA of any ratio).
    backend:
        "auto", "reference", "torch", "triton" or "cuda". The choice made is in
        :attr:`backend` and :attr:`backend_reason` (and logged). ``auto`` may resolve to
        ``hybrid`` (H100/H200 with both kernel backends): each plan then names its kernel
        backend in ``plan.cache["backend"]`` (see :meth:`step_backend`).
    plan_config:
        Planner and chunking (:class:`PlanConfig`); its ``num_kv_heads`` and ``num_sms``
        are set from this object and the device.
    sm_scale:
        Softmax scale; default ``1 / sqrt(head_dim)``.
    device:
        Where ``run`` will get its tensors; default CUDA if available, else CPU.

    Examples
    --------
    >>> attn = TreeAttention(32, 8, 128)
    >>> plan = attn.plan(tree)                 # once per step
    >>> out = attn.run(q, k_cache, v_cache, plan)  # per layer
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, backend: str = "auto",
                 plan_config: PlanConfig = PlanConfig(), sm_scale: float | None = None,
                 device: torch.device | str | None = None):
        if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a positive multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            num_sms = plan_config.num_sms
        self.backend, self.backend_reason = resolve_backend(backend, self.device)
        self.plan_config = dataclasses.replace(plan_config, num_kv_heads=num_kv_heads, num_sms=num_sms)
        # Per kernel backend, the planner settings it runs best with (cuda: 128-row units).
        self._configs = {b: self._config_for(b) for b in self._kernel_backends()}
        if self.backend != "hybrid":
            self.plan_config = self._configs[self.backend]
        logger.info("TreeAttention backend: %s (%s)", self.backend, self.backend_reason)

    def plan(self, tree: SequenceTree | TreeLayout) -> DeviceTreePlan:
        """Plan one step on the CPU and copy the index arrays to :attr:`device`.

        The queries are the tree's pending tokens, in :meth:`SequenceTree.layout` order. The
        kernel backend that will run the plan is ``plan.cache["backend"]`` (with ``hybrid``,
        chosen here per step).
        """
        layout = tree.layout() if isinstance(tree, SequenceTree) else tree
        group = self.num_qo_heads // self.num_kv_heads
        backend = self.step_backend(layout.num_queries)
        device_plan = make_plan(layout, self._configs[backend], group).to(self.device)
        device_plan.cache["backend"] = backend
        return device_plan

    def step_backend(self, num_queries: int) -> str:
        """The backend a step of ``num_queries`` queries runs on (``hybrid`` picks by rows per KV head)."""
        if self.backend != "hybrid":
            return self.backend
        rows = num_queries * (self.num_qo_heads // self.num_kv_heads)
        return "cuda" if rows >= HYBRID_MIN_ROWS else "triton"

    def _kernel_backends(self) -> tuple[str, ...]:
        return ("triton", "cuda") if self.backend == "hybrid" else (self.backend,)

    def _config_for(self, backend: str) -> PlanConfig:
        config = self.plan_config
        if backend == "cuda":  # fill the cuda kernel's 128-row units; chunks sized for its persistent grid
            from treedec.kernels import cuda_tree_attention as ck
            config = ck.cuda_plan_config(config, self.device, self.head_dim, self.num_qo_heads // self.num_kv_heads)
        return config

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
            return_lse: bool = False):
        """Attention of every query over its root-to-itself path.

        Parameters
        ----------
        q : [Q, num_qo_heads, head_dim], fp16/bf16/fp32
        k_cache, v_cache : [num_pages, page_size, num_kv_heads, head_dim], same dtype as q
        plan : from :meth:`plan`

        Returns
        -------
        out : [Q, num_qo_heads, head_dim] in q's dtype; with ``return_lse`` also
        lse : [Q, num_qo_heads] float32, natural log.
        """
        self._check_inputs(q, k_cache, v_cache, plan)
        host_plan = plan.plan
        backend = self.backend
        if backend == "hybrid":
            backend = plan.cache.get("backend")
            if backend not in self._configs:
                raise ValueError("this plan was not made by this hybrid TreeAttention's plan(): "
                                 "it does not say which kernel backend runs it")
        if backend == "reference":
            out, lse = reference_tree_attention(q, k_cache, v_cache, host_plan.layout, self.sm_scale)
        elif backend == "torch":
            out, lse = run_plan_torch(q, k_cache, v_cache, host_plan, self.sm_scale)
        elif backend == "triton":
            from treedec.kernels.triton_tree_attention import run_plan_triton
            out, lse = run_plan_triton(q, k_cache, v_cache, plan, self.sm_scale, validate=False)
        elif backend == "cuda":
            from treedec.kernels import cuda_tree_attention as ck
            ck.check_dtype(q)  # shapes, devices and contiguity are checked above, row alignment by the extension
            out, lse = ck.run_plan_cuda(q, k_cache, v_cache, plan, self.sm_scale, validate=False)
        else:  # resolve_backend only lets runnable backends through
            raise AssertionError(f"backend {self.backend!r} has no runner")
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out

    def _check_inputs(self, q, k_cache, v_cache, plan: DeviceTreePlan) -> None:
        expected_q = (plan.plan.num_queries, self.num_qo_heads, self.head_dim)
        if q.dim() != 3 or tuple(q.shape) != expected_q:
            raise ValueError(f"q must have shape [num_queries, num_qo_heads, head_dim] = {expected_q}, "
                             f"got {tuple(q.shape)}")
        if q.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"q must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
        if q.stride(2) != 1:
            raise ValueError(f"q must be contiguous in its last dim, got strides {q.stride()}")
        if plan.kv_slots.device != q.device:
            raise ValueError(f"the plan is on {plan.kv_slots.device} but q is on {q.device}; "
                             f"plan with a TreeAttention made for device={q.device}")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.dim() != 4 or cache.shape[2:] != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"{name} must have shape [num_pages, page_size, {self.num_kv_heads}, "
                                 f"{self.head_dim}], got {tuple(cache.shape)}")
            if cache.dtype != q.dtype:
                raise TypeError(f"{name} dtype {cache.dtype} differs from q dtype {q.dtype}")
            if cache.device != q.device:
                raise ValueError(f"{name} is on {cache.device} but q is on {q.device}")
            if not cache.is_contiguous():
                raise ValueError(f"{name} must be contiguous (as PagedKVPool.layer gives), got strides {cache.stride()}")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
        capacity = k_cache.shape[0] * k_cache.shape[1]
        if plan.plan.max_slot >= capacity:
            raise ValueError(f"the plan reads slot {plan.plan.max_slot} but the cache holds {capacity} slots")
