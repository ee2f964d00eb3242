"""The ``triton`` backend: prepare a plan's launch at plan time, then launch the Triton kernels.

:meth:`TritonBackend.prepare` derives from a :class:`DeviceTreePlan` everything the kernels
need (grids, constexprs, the partial-state workspace) once per step; :meth:`TritonBackend.run`
only launches (``treedec.kernels.triton_tree_attention``), for every layer. A plan in static
buffers (CUDA graphs) is prepared once at its capacity and replayed for any plan loaded into
them.

Triton is an optional extra: this module (and so the backend registry) imports without it; the
kernels module is imported when a backend is made or the custom op runs.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from treedec.attention.backends.base import Backend, OpArgs, OpSizes, SpanMasking, check_kv_caches
from treedec.attention.static_plan import PlanBounds
from treedec.attention.tree_plan import DeviceTreePlan, TreePlan
from treedec.attention.variant import AttentionVariant

if TYPE_CHECKING:
    from treedec.kernels.triton_tree_attention import LaunchConfig, TritonLaunch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# The plan arrays the kernels read, by name.
KERNEL_ARRAYS = ("kv_slots", "chunk_kv_start", "entry_query", "entry_mask", "entry_direct", "item_chunk",
                 "item_entry_start", "item_num_entries", "query_entry_start", "query_entries")


@dataclass(frozen=True)
class TritonOpSizes(OpSizes):
    """What a triton launch is made for (``kernels.plan_launch``), as the custom op carries it."""

    num_items: int
    num_queries: int
    num_entries: int
    query_tile: int
    fp32_workspace: bool  # the partial outputs are float32 (else q's dtype)


@dataclass(frozen=True)
class TritonPrepared:
    """A plan's launch on the triton kernels, made at plan time and reused by every layer."""

    launch: TritonLaunch
    arrays: dict              # the plan's int32 tensors the kernels read, by name
    o_ws: torch.Tensor        # [E, Hq, D] partial outputs (workspace dtype)
    lse_ws: torch.Tensor      # [E, Hq] float32 partial LSEs
    dtype: torch.dtype        # of q, K and V
    # what the launch was made for (a static plan's: its bounds'); None under a launch override (tuning),
    # which the custom op does not take
    op_sizes: TritonOpSizes | None

    def op_args(self) -> OpArgs:
        """The plan as ``torch.ops.treedec.tree_attention`` takes it: its tensors and sizes."""
        if self.op_sizes is None:
            raise ValueError("a plan prepared with a triton launch override (tuning) cannot run as the custom op")
        return OpArgs(TritonBackend.name, [self.arrays[name] for name in KERNEL_ARRAYS], self.op_sizes)


class TritonBackend(Backend):
    """Prepares and runs plans on the Triton kernels for one head configuration and dtype.

    ``workspace_dtype``: of the partial outputs; default fp16 for fp16 inputs (half the traffic
    of float32), float32 for bf16 (its 8-bit mantissa would round every partial) and fp32.
    ``launch``: overrides the stage-1 launch table (tuning: bench/triton_configs.py). ``variant``'s logit
    hooks are the kernels' constexprs (:meth:`AttentionVariant.kernel_key`); a prepared launch serves every
    variant (the engine's layer groups of one window share it).
    """

    name = "triton"
    prepares_launch = True
    static_plans = True
    custom_op = True
    span_masking = SpanMasking.DEVICE

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 variant: AttentionVariant, workspace_dtype: torch.dtype | None = None,
                 launch: LaunchConfig | None = None):
        from treedec.kernels import triton_tree_attention as kernels
        if dtype not in kernels.SUPPORTED_DTYPES:
            raise TypeError(f"the triton backend takes {kernels.SUPPORTED_DTYPES}, got {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        if workspace_dtype is None:
            workspace_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        if workspace_dtype not in kernels.SUPPORTED_DTYPES:
            raise TypeError(f"workspace_dtype must be one of {kernels.SUPPORTED_DTYPES}, got {workspace_dtype}")
        self.kernels = kernels
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.dtype, self.variant, self.workspace_dtype, self.launch_override = dtype, variant, workspace_dtype, launch
        self.logit_args = variant.logit_args(head_dim)

    @classmethod
    def why_unavailable(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the 'triton' package is not installed (pip install 'treedec[triton]')"
        if device.type != "cuda":
            if os.environ.get("TRITON_INTERPRET") != "1":
                return f"triton needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got device {device}"
            return triton_interpreter_problem()
        return None

    @classmethod
    def why_not_batch_invariant(cls) -> str | None:
        # The launch's tiles follow the head configuration and the query tile, never the plan's size; a row's
        # products, row max and sums are its own whatever the other rows of its program (the queries sharing its
        # chunk read every key of it, as its own copy would), and the merge reads its partials in order.
        return None

    @classmethod
    def create(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               variant: AttentionVariant, device: torch.device) -> TritonBackend:
        return cls(num_qo_heads, num_kv_heads, head_dim, dtype, variant)

    def prepare(self, plan: DeviceTreePlan) -> TritonPrepared:
        """The launch of ``plan`` (its sizes: a static plan's are its capacity's)."""
        host, device = plan.plan, plan.kv_slots.device
        if plan.kv_slots.dtype != torch.int32:
            raise ValueError(f"plan tensors must be int32, got {plan.kv_slots.dtype} (use TreePlan.to(device))")
        hq, d = self.num_qo_heads, self.head_dim
        launch = self.kernels.plan_launch(host.num_items, host.num_queries, host.num_entries, host.query_tile, hq,
                                          self.num_kv_heads, d, self.dtype, device.type == "cpu", self.launch_override)
        sizes = TritonOpSizes(host.num_items, host.num_queries, host.num_entries, host.query_tile,
                              self.workspace_dtype == torch.float32)
        return TritonPrepared(
            launch=launch, arrays={name: getattr(plan, name) for name in KERNEL_ARRAYS},
            o_ws=torch.empty(host.num_entries, hq, d, dtype=self.workspace_dtype, device=device),
            lse_ws=torch.empty(host.num_entries, hq, dtype=torch.float32, device=device), dtype=self.dtype,
            op_sizes=None if self.launch_override else sizes)

    # Static plans (CUDA graphs): the launch prepared at the bounds runs any padded plan, so the
    # backend writes nothing of its own per plan.

    def for_static_plans(self, tile_tokens: int | None) -> TritonBackend:
        if tile_tokens is not None:
            raise ValueError("tile_tokens is a cuda backend setting; the triton kernels tile by their launch table")
        return self

    def static_sections(self, bounds: PlanBounds) -> dict[str, int]:
        return {}

    def prepare_static(self, plan: DeviceTreePlan, bounds: PlanBounds, sections: dict[str, torch.Tensor]
                       ) -> TritonPrepared:
        return self.prepare(plan)

    def static_values(self, plan: TreePlan, prepared: TritonPrepared) -> dict[str, np.ndarray]:
        return {}

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
            kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch only, with ``plan.prepared``: ``out [Q, Hq, D]`` in q's dtype and ``lse [Q, Hq]``
        float32 (natural log)."""
        prepared: TritonPrepared = plan.prepared
        return _launch(self.kernels, q, k_cache, v_cache, prepared.arrays, prepared.o_ws, prepared.lse_ws,
                       prepared.launch, self.logit_args, kv_scale)

    @classmethod
    def run_op(cls, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tensors: list[torch.Tensor],
               sizes: list[int], variant: AttentionVariant, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The launch of :meth:`TritonPrepared.op_args`' plan, remade from its sizes (the op gets plain values;
        its workspace is allocated here, from a CUDA graph's private pool when captured)."""
        from treedec.kernels import triton_tree_attention as kernels
        s = TritonOpSizes.from_list(sizes)
        hq, d = q.shape[1], q.shape[2]
        launch = kernels.plan_launch(s.num_items, s.num_queries, s.num_entries, s.query_tile, hq, k_cache.shape[2], d,
                                     q.dtype, q.device.type == "cpu")
        o_ws = torch.empty(s.num_entries, hq, d, dtype=torch.float32 if s.fp32_workspace else q.dtype, device=q.device)
        lse_ws = torch.empty(s.num_entries, hq, dtype=torch.float32, device=q.device)
        return _launch(kernels, q, k_cache, v_cache, dict(zip(KERNEL_ARRAYS, tensors)), o_ws, lse_ws, launch,
                       variant.logit_args(d), kv_scale if variant.fp8_kv else None)[0]


def _launch(kernels, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, arrays: dict, o_ws: torch.Tensor,
            lse_ws: torch.Tensor, launch: TritonLaunch, logit_args, kv_scale: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernels (``kernels``: the triton kernels module) of a prepared plan (``arrays``, workspace,
    ``launch``) over the paged caches (fp8 ones with their ``kv_scale`` [2, Hkv]) with a variant's
    :class:`~treedec.attention.variant.LogitArgs`: ``out [Q, Hq, D]`` in q's dtype and ``lse [Q, Hq]`` float32
    (natural log)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    kernels.attend(q, k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d), out, lse, o_ws, lse_ws, arrays,
                   logit_args.scale_log2, logit_args.softcap_scale, launch, kv_scale)
    return out, lse


def run_plan_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
                    variant: AttentionVariant, workspace_dtype: torch.dtype | None = None, validate: bool = True,
                    launch: LaunchConfig | None = None, prepared: TritonPrepared | None = None,
                    kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepare (unless ``prepared`` is given) and run one plan: for tests and benchmarks.

    Parameters
    ----------
    q : [Q, Hq, D] fp16, bf16 or fp32, last dim contiguous
    k_cache, v_cache : [num_pages, page_size, Hkv, D], q's dtype and device (e4m3 for the variant's fp8
        ``kv_dtype``, with ``kv_scale`` [2, Hkv] float32)
    plan : DeviceTreePlan with int32 tensors on q's device
    variant : the layer's (scale and logit hooks, KV dtype; the plan holds its mask)
    workspace_dtype, launch : as :class:`TritonBackend`
    validate : check the inputs (TreeAttention.run has checked them and passes False)

    Returns ``out [Q, Hq, D]`` in q's dtype and ``lse [Q, Hq]`` float32, natural log.
    """
    if validate:
        check_inputs(q, k_cache, v_cache, plan, variant, kv_scale)
    backend = TritonBackend(q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, variant, workspace_dtype, launch)
    prepared = prepared or backend.prepare(plan)
    return backend.run(q, k_cache, v_cache, dataclasses.replace(plan, backend=backend.name, prepared=prepared),
                       kv_scale)


def check_inputs(q, k_cache, v_cache, plan: DeviceTreePlan, variant: AttentionVariant | None = None,
                 kv_scale: torch.Tensor | None = None) -> None:
    """Raise a clear error for inputs the kernels cannot take."""
    if not isinstance(plan, DeviceTreePlan):
        raise TypeError(f"plan must be a DeviceTreePlan (TreePlan.to(device)), got {type(plan).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape [num_queries, num_qo_heads, head_dim], got {tuple(q.shape)}")
    from treedec.kernels.triton_tree_attention import SUPPORTED_DTYPES
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    num_q, hq, d = q.shape
    if num_q != plan.plan.num_queries:
        raise ValueError(f"q has {num_q} rows but the plan has {plan.plan.num_queries} queries")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    if q.stride(2) != 1:
        raise ValueError(f"q must be contiguous in its last dim, got strides {q.stride()}")
    check_kv_caches(q, k_cache, v_cache, f"[num_pages, page_size, num_kv_heads, {d}]",
                    lambda cache: cache.shape[3] == d, _check_slot_view, variant, kv_scale)
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"q's {hq} heads must be a multiple of the caches' {hkv} KV heads")
    # TreePlan.to makes all the index tensors in one transfer: checking one checks them all.
    if plan.kv_slots.dtype != torch.int32 or plan.kv_slots.device != q.device:
        raise ValueError(f"plan tensors must be int32 on q's device {q.device}, got "
                         f"{plan.kv_slots.dtype} on {plan.kv_slots.device} (use TreePlan.to(q.device))")


def _check_slot_view(name: str, cache: torch.Tensor) -> None:
    """ValueError unless ``cache`` [num_pages, page_size, Hkv, D] views as [num_slots, Hkv, D] without a copy."""
    if cache.stride(3) == 1:
        try:
            cache.view(-1, cache.shape[2], cache.shape[3])
            return
        except RuntimeError:
            pass
    raise ValueError(f"{name} must be viewable as [num_slots, num_kv_heads, head_dim] with a contiguous "
                     f"last dim, got strides {cache.stride()}")


def triton_interpreter_problem() -> str | None:
    """None if the installed Triton interpreter runs the kernels on the CPU, else why not.

    Triton's interpreter before 3.7 turns a loaded loop bound into a Python int in a way
    numpy 2.4 rejects (triton-lang/triton#9171), so every kernel launch fails there. Compiled
    GPU kernels are not affected, which is why the ``triton`` extra carries no version bound
    (CUDA builds of torch pin their own triton).
    """
    import triton
    if _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4):
        return (f"the Triton {triton.__version__} interpreter fails with numpy {np.__version__} "
                f"(triton-lang/triton#9171): pip install 'triton>=3.7' or 'numpy<2.4' to run triton on the CPU")
    return None


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
