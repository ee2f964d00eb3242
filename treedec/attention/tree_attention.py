"""TreeAttention: plan (and prepare the launch) once per step on the CPU, run for every layer."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from treedec.attention.backends import Backend, OpArgs, backend_names, check_kv_caches, get_backend, resolve_backend
from treedec.attention.planner_choice import PlannerImpl, planner_impl
from treedec.attention.planners import PlanConfig, make_plan
from treedec.attention.static_plan import PlanBounds, StaticPlan
from treedec.attention.tree_plan import DeviceTreePlan, TreePlan
from treedec.attention.variant import AttentionVariant
from treedec.checks import int_in_range
from treedec.tree.layout import TreeLayout
from treedec.transfer import resolve_device
from treedec.tree import SequenceTree

logger = logging.getLogger("treedec")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def _resolve_device(device) -> torch.device:
    """The device ``run`` gets its tensors on (default: CUDA where available): a CPU or an existing CUDA device
    (:func:`~treedec.transfer.resolve_device`)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = resolve_device(device)
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {device!r}")
    return resolved


def _check_contiguous(name: str, cache: torch.Tensor) -> None:
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous (as PagedKVPool.layer gives), got strides {cache.stride()}")


class TreeAttention:
    """Tree attention for a fixed head configuration and dtype.

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim:
        ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA of any ratio).
    backend:
        "auto", "reference", "torch", "triton" or "cuda" (the registered backends,
        :mod:`treedec.attention.backends`). The choice made is in :attr:`backend` (its name),
        :attr:`backend_reason` (and logged) and :attr:`backend_impl` (the :class:`Backend` that
        prepares and runs, made once here); each plan names it in ``plan.backend``.
    plan_config:
        Planner and chunking (:class:`PlanConfig`); its ``num_kv_heads`` and ``num_sms``
        are set from this object and the device. A ``batch_invariant`` one takes only a backend that runs
        such plans (``auto`` chooses among those).
    variant:
        What the layers it runs compute (:class:`AttentionVariant`: softmax scale, default
        ``1 / sqrt(head_dim)``; logit soft-cap; sliding window): its mask fields go to the planner
        (:meth:`plan` clips each query's reads to its window), its logit fields to the kernels (the
        backend runs the kernel of :meth:`AttentionVariant.kernel_key`). A plan depends only on the
        mask fields (``plan.plan.window``): TreeAttentions of one window may run each other's plans.
    device:
        Where ``run`` will get its tensors; default CUDA if available, else CPU.
    dtype:
        Of q (fp16 by default, as FlashInfer's ``plan``), and of K and V unless the variant's ``kv_dtype`` is
        fp8 (then the caches hold e4m3 with the scales ``run`` takes): the kernel backends prepare their
        launches for it at plan time, and ``run`` checks q against it.

    Examples
    --------
    >>> attn = TreeAttention(32, 8, 128)
    >>> plan = attn.plan(tree)                 # once per step: plan and prepare the launch
    >>> out = attn.run(q, k_cache, v_cache, plan)  # per layer: launch only
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, backend: str = "auto",
                 plan_config: PlanConfig = PlanConfig(), variant: AttentionVariant = AttentionVariant(),
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float16):
        num_qo_heads = int_in_range("num_qo_heads", num_qo_heads, error=TypeError, numpy=True)
        num_kv_heads = int_in_range("num_kv_heads", num_kv_heads, error=TypeError, numpy=True)
        head_dim = int_in_range("head_dim", head_dim, error=TypeError, numpy=True)
        if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a positive multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        if not isinstance(plan_config, PlanConfig):
            raise TypeError(f"plan_config must be a PlanConfig, got {type(plan_config).__name__}")
        if not isinstance(variant, AttentionVariant):
            raise TypeError(f"variant must be an AttentionVariant, got {type(variant).__name__}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.variant = variant
        self.device = _resolve_device(device)
        if self.device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            num_sms = plan_config.num_sms
        self.backend, self.backend_reason = resolve_backend(backend, self.device, variant, head_dim, dtype,
                                                            plan_config.batch_invariant)
        self.backend_impl: Backend = get_backend(self.backend).create(num_qo_heads, num_kv_heads, head_dim, dtype,
                                                                      variant, self.device)
        if plan_config.batch_invariant:
            self.backend_impl = self.backend_impl.batch_invariant()
        # what the backend runs best with (cuda: chunks that fill its 128-row units and its persistent grid)
        self.plan_config = self.backend_impl.plan_config(
            dataclasses.replace(plan_config, num_kv_heads=num_kv_heads, num_sms=num_sms))
        planner = planner_impl()   # built or loaded here, not inside the first step
        logger.info("TreeAttention backend: %s (%s); planner: %s (%s)", self.backend, self.backend_reason,
                    planner.name, planner.reason)

    @property
    def planner(self) -> PlannerImpl:
        """The planner implementation :meth:`plan` runs (the compiled C++ planner or the numpy reference) and
        why (``TREEDEC_PLANNER``; :mod:`treedec.attention.planner_choice`)."""
        return planner_impl()

    def plan(self, tree: SequenceTree | TreeLayout, into: StaticPlan | None = None) -> DeviceTreePlan:
        """Plan one step on the CPU, copy the index arrays to :attr:`device` and prepare the launch.

        The queries are the tree's pending tokens, in :meth:`SequenceTree.layout` order. The
        kernel backend that runs the plan is ``plan.backend`` and what it launches with is
        ``plan.prepared``.

        ``into``: a :meth:`static_plan` to write the plan into instead (for CUDA graphs): the
        same prepared :class:`DeviceTreePlan` over its buffers is returned for every tree; a
        tree over its bounds raises PlanError and changes nothing.
        """
        if into is not None and not isinstance(into, StaticPlan):
            raise TypeError(f"into must be a StaticPlan from static_plan(), got {type(into).__name__}")
        host = self.plan_host(tree)
        if into is not None:
            return into.write(host)
        return self.prepare(host.to(self.device))

    def plan_host(self, tree: SequenceTree | TreeLayout) -> TreePlan:
        """The host half of :meth:`plan`: the step's :class:`TreePlan` with this object's planner settings
        (what a caller that picks the static plan from the plan's sizes writes itself, as the engine's
        CUDA graphs do). Every plan of a step is made here."""
        if isinstance(tree, SequenceTree):
            layout = tree.layout()
        elif isinstance(tree, TreeLayout):
            layout = tree
        else:
            raise TypeError(f"plan() takes a SequenceTree or its TreeLayout, got {type(tree).__name__}")
        return make_plan(layout, self.plan_config, self.num_qo_heads // self.num_kv_heads, self.variant)

    def static_plan(self, bounds: PlanBounds, tile_tokens: int | None = None,
                    extra: dict[str, tuple[int, ...]] | None = None) -> StaticPlan:
        """Device buffers of fixed address for plans within ``bounds``: see :mod:`treedec.attention.static_plan`.

        ``tile_tokens``: the cuda backend's KV tile for every plan (default: its rule, applied to
        the first plan). ``extra``: caller-owned int32 sections written with each plan
        (:meth:`StaticPlan.write`).
        """
        return StaticPlan(bounds, self.backend_impl.for_static_plans(tile_tokens), self.device, extra)

    def prepare(self, plan: DeviceTreePlan) -> DeviceTreePlan:
        """``plan`` (from :meth:`TreePlan.to`, e.g. a plan made with its own planner settings) with
        this object's backend's launch prepared."""
        return plan.with_launch(self.backend, self.backend_impl.prepare(plan))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
            return_lse: bool = False, kv_scale: torch.Tensor | None = None):
        """Attention of every query over its root-to-itself path; launches only.

        Parameters
        ----------
        q : [Q, num_qo_heads, head_dim], :attr:`dtype` (any float dtype on the torch and reference backends)
        k_cache, v_cache : [num_pages, page_size, num_kv_heads, head_dim], same dtype as q; with the variant's
            fp8 ``kv_dtype``, ``torch.float8_e4m3fn`` (:class:`~treedec.tree.PagedKVPool` of ``kv_dtype="fp8"``)
        plan : from :meth:`plan` (or :meth:`prepare`)
        kv_scale : [2, num_kv_heads] float32, fp8 caches' K and V scales (a stored value times its KV head's
            scale is the value: :meth:`PagedKVPool.layer_scale`); None for caches of q's dtype

        Returns
        -------
        out : [Q, num_qo_heads, head_dim] in q's dtype; with ``return_lse`` also
        lse : [Q, num_qo_heads] float32, natural log.
        """
        self._check_inputs(q, k_cache, v_cache, plan, kv_scale)
        if not return_lse:
            return self.backend_impl.run_out(q, k_cache, v_cache, plan, kv_scale).to(q.dtype)
        out, lse = self.backend_impl.run(q, k_cache, v_cache, plan, kv_scale)
        return out.to(q.dtype), lse

    def op_args(self, plan: DeviceTreePlan) -> OpArgs:
        """``plan`` (prepared for a backend with a custom op, :attr:`Backend.custom_op`) as
        ``torch.ops.treedec.tree_attention`` takes it; see :mod:`treedec.attention.custom_ops`."""
        if plan.prepared is None or plan.backend is None or not get_backend(plan.backend).custom_op:
            raise ValueError(f"the custom op runs plans prepared for the "
                             f"{' or '.join(backend_names(lambda b: b.custom_op))} kernels, this one is for "
                             f"{plan.backend!r}: make it with plan() on a TreeAttention of a kernel backend")
        return plan.prepared.op_args()

    def run_op(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`run` through ``torch.ops.treedec.tree_attention`` (what ``torch.compile`` traces):
        ``out [Q, num_qo_heads, head_dim]``. Outside a compiled region the inputs are checked as by
        :meth:`run`; inside one they are not (the checks read per-step values, which would become
        guards and recompile every step): the caller owns them, as the engine's static forward does."""
        if not torch.compiler.is_compiling():
            self._check_inputs(q, k_cache, v_cache, plan, kv_scale)
        return torch.ops.treedec.tree_attention(*self.op_args(plan).inputs(q, k_cache, v_cache, self.variant,
                                                                           kv_scale))

    def _check_inputs(self, q, k_cache, v_cache, plan: DeviceTreePlan, kv_scale=None) -> None:
        """Raise a clear error for inputs ``run`` cannot take: this object's checks, then the backend's own
        (:meth:`Backend.check_inputs`)."""
        for name, value in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(value, torch.Tensor):
                hint = " (torch.from_numpy converts a numpy array)" if isinstance(value, np.ndarray) else ""
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}{hint}")
        if not isinstance(plan, DeviceTreePlan):
            raise TypeError(f"plan must come from TreeAttention.plan(), got {type(plan).__name__}")
        if plan.plan.window != self.variant.window:
            raise ValueError(f"this plan was made for window={plan.plan.window}, not this TreeAttention's "
                             f"window={self.variant.window}: plan with a TreeAttention of this variant's mask fields")
        # torch and reference execute any plan; the kernel backends need their own launch prepared.
        prepares = self.backend_impl.prepares_launch
        if prepares and plan.backend != self.backend:
            raise ValueError(f"this plan is prepared for backend {plan.backend!r}, not this TreeAttention's "
                             f"{self.backend!r}: make it with this object's plan() or prepare()")
        expected_q = (plan.plan.num_queries, self.num_qo_heads, self.head_dim)
        if q.dim() != 3 or tuple(q.shape) != expected_q:
            raise ValueError(f"q must have shape [num_queries, num_qo_heads, head_dim] = {expected_q}, "
                             f"got {tuple(q.shape)}")
        if q.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"q must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
        if prepares and plan.prepared is None:
            raise ValueError(f"this plan has no {self.backend} launch prepared: make it with plan() or prepare()")
        if prepares and q.dtype != plan.prepared.dtype:
            raise TypeError(f"q is {q.dtype} but the plan was prepared for {plan.prepared.dtype}: "
                            f"make the TreeAttention with dtype={q.dtype}")
        if q.stride(2) != 1:
            raise ValueError(f"q must be contiguous in its last dim, got strides {q.stride()}")
        if plan.kv_slots.device != q.device:
            raise ValueError(f"the plan is on {plan.kv_slots.device} but q is on {q.device}; "
                             f"plan with a TreeAttention made for device={q.device}")
        check_kv_caches(q, k_cache, v_cache, f"[num_pages, page_size, {self.num_kv_heads}, {self.head_dim}]",
                        lambda cache: cache.shape[2:] == (self.num_kv_heads, self.head_dim), _check_contiguous,
                        self.variant, kv_scale)
        capacity = k_cache.shape[0] * k_cache.shape[1]
        max_slot = (plan.plan if plan.static is None else plan.static.current).max_slot
        if max_slot >= capacity:
            raise ValueError(f"the plan reads slot {max_slot} but the cache holds {capacity} slots")
        self.backend_impl.check_inputs(q, k_cache, v_cache)
