"""The attention backend protocol and the registry the backends register into.

A :class:`Backend` runs :class:`~treedec.attention.tree_plan.DeviceTreePlan` s for one head
configuration and dtype: :meth:`Backend.prepare` at plan time (once per step: launch parameters,
work schedule, workspace), :meth:`Backend.run` launch-only (every layer). What callers decide by
backend (static plans and CUDA graphs, the custom op, where a dynamic span is masked, whether a
plan must be prepared by the backend that runs it) is a capability of its class, never a test of
its name::

    impl = get_backend("triton").create(32, 8, 128, torch.float16, AttentionVariant(), device)
    if impl.static_plans: ...

The four backends (``reference``, ``torch``, ``triton``, ``cuda``) register when
:mod:`treedec.attention.backends` is imported; a name is registered once (the registry is the
one module-level table of the package: which backends exist).
"""
from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol

import torch

from treedec.attention.variant import AttentionVariant

if TYPE_CHECKING:
    from treedec.attention.planners import PlanConfig
    from treedec.attention.static_plan import StaticBackend
    from treedec.attention.tree_plan import DeviceTreePlan

__all__ = ["CAPABILITIES", "Backend", "OpArgs", "OpSizes", "PreparedLaunch", "SpanMasking", "backend_names",
           "check_kv_caches", "get_backend", "register_backend"]


class SpanMasking(enum.Enum):
    """Where a backend's runs see the unused slots of a :class:`~treedec.attention.dynamic_span.DynamicSpans`
    masked (pipelined speculative decoding, whose accepted length the device decides)."""

    UNSUPPORTED = "unsupported"  # it attends by the tree's layout, not the plan's masks: no dynamic span
    HOST = "host"                # it reads the host plan: masked there, reading the span's keep (a wait on a GPU)
    DEVICE = "device"            # its kernels read the device plan: masked there, stream-ordered, without waiting


@dataclasses.dataclass(frozen=True)
class OpSizes:
    """A backend's launch sizes as ``torch.ops.treedec.tree_attention`` carries them.

    Subclasses are frozen dataclasses of int (and bool) fields; the op takes them as ``list[int]``
    in field order (what a ``torch.library`` schema holds) and the backend reads them back by name
    (:meth:`from_list`).
    """

    def to_list(self) -> list[int]:
        """The fields' values, in order, as ints."""
        return [int(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_list(cls, values: list[int]):
        """The sizes of :meth:`to_list`'s ``values``; ValueError unless there is one value per field."""
        names = [f.name for f in dataclasses.fields(cls)]
        if len(values) != len(names):
            raise ValueError(f"{cls.__name__} takes {len(names)} sizes {names}, got {len(values)}: {list(values)}")
        return cls(*(bool(v) if f.type in ("bool", bool) else int(v) for f, v in zip(dataclasses.fields(cls), values)))


@dataclasses.dataclass(frozen=True)
class OpArgs:
    """A prepared plan as ``torch.ops.treedec.tree_attention`` takes it (:meth:`TreeAttention.op_args`).

    ``backend``: the registered name of the backend whose :meth:`Backend.run_op` launches it;
    ``tensors``: the plan's int32 tensors (and the backend's own, e.g. its schedule), in the order
    that backend reads them; ``sizes``: what its launch was prepared for.
    """

    backend: str
    tensors: list[torch.Tensor]
    sizes: OpSizes

    def inputs(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, variant: AttentionVariant,
               kv_scale: torch.Tensor | None = None) -> tuple:
        """The op's arguments for these q, caches (with an fp8 cache's ``kv_scale``) and the layer's variant, in its
        schema's order."""
        return q, k_cache, v_cache, self.tensors, self.sizes.to_list(), self.backend, variant.op_values(), kv_scale


class PreparedLaunch(Protocol):
    """What a backend that prepares its launch (:attr:`Backend.prepares_launch`) keeps in ``plan.prepared``."""

    dtype: torch.dtype  # of the q, K and V it was prepared for

    def op_args(self) -> OpArgs:
        """The plan as the custom op takes it; ValueError where this launch cannot run as the op."""


class Backend(ABC):
    """Runs plans for one head configuration and dtype; made by :meth:`create`.

    Capabilities (class attributes, what callers decide by):

    ``name``: the registered name (``TreeAttention(backend=name)``).
    ``prepares_launch``: :meth:`run` needs the plan prepared by this backend (``plan.prepared``, a
    :class:`PreparedLaunch`, for q's dtype); False: it executes any plan, nothing prepared.
    ``static_plans``: it runs plans written into a :class:`~treedec.attention.static_plan.StaticPlan`
    (CUDA graphs): its launch reads the plan from device memory only (:meth:`for_static_plans`).
    ``custom_op``: it runs through ``torch.ops.treedec.tree_attention`` (:meth:`run_op`), what
    ``torch.compile`` traces.
    ``span_masking``: where a dynamic span's unused slots are masked (:class:`SpanMasking`).
    """

    name: ClassVar[str]
    prepares_launch: ClassVar[bool]
    static_plans: ClassVar[bool]
    custom_op: ClassVar[bool]
    span_masking: ClassVar[SpanMasking]

    @classmethod
    @abstractmethod
    def why_unavailable(cls, device: torch.device) -> str | None:
        """None if this backend can run on ``device``, else the reason it cannot (a sentence). Builds nothing."""

    @classmethod
    def why_not_variant(cls, variant: AttentionVariant, head_dim: int | None = None) -> str | None:
        """None if this backend's kernels compute ``variant`` (its hooks and KV dtype) at ``head_dim`` (None: some
        head dim), else why not (a sentence). Default: every variant."""
        return None

    @classmethod
    def why_not_dtype(cls, dtype: torch.dtype) -> str | None:
        """None if this backend's kernels take q, K and V of ``dtype``, else why not (a sentence). Default: every
        dtype tree attention supports."""
        return None

    @classmethod
    def why_not_batch_invariant(cls) -> str | None:
        """None if :meth:`batch_invariant`'s backend computes each query of a ``batch_invariant`` plan
        (:class:`~treedec.attention.planners.PlanConfig`) in an order its own chunks alone set, whatever the other
        queries, else why not (a sentence). Default: not (a backend says so once it is checked)."""
        return f"the {cls.name} backend is not checked to compute a query alike whatever the other queries"

    def batch_invariant(self) -> Backend:
        """This backend as it runs ``batch_invariant`` plans (called only where :meth:`why_not_batch_invariant` is
        None). Default: itself."""
        return self

    @classmethod
    @abstractmethod
    def create(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               variant: AttentionVariant, device: torch.device) -> Backend:
        """This backend for a head configuration (``num_qo_heads`` a multiple of ``num_kv_heads``), the dtype
        of q, K and V, the layer's variant (its scale and logit hooks: a kernel backend builds the kernel of its
        :meth:`~AttentionVariant.kernel_key`; its mask fields are the planner's) and the device the tensors live
        on; raises for what it cannot run."""

    def plan_config(self, config: PlanConfig) -> PlanConfig:
        """``config`` with what this backend runs best with filled in (default: unchanged)."""
        return config

    @abstractmethod
    def prepare(self, plan: DeviceTreePlan) -> PreparedLaunch | None:
        """At plan time: what :meth:`run` launches ``plan`` with (None where it needs nothing)."""

    @abstractmethod
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
            kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch only: ``out [Q, Hq, D]`` and ``lse [Q, Hq]`` float32 (natural log), for inputs that
        ``TreeAttention`` and :meth:`check_inputs` have checked. ``kv_scale``: ``[2, Hkv]`` float32, the K and V
        scales of fp8 caches (the variant's ``kv_dtype``), else None."""

    def run_out(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DeviceTreePlan,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`run` for a caller that reads ``out [Q, Hq, D]`` only (a model's layer; ``TreeAttention.run``
        without ``return_lse``). Default: :meth:`run`'s ``out``; a backend that saves work without the LSE
        overrides it."""
        return self.run(q, k_cache, v_cache, plan, kv_scale)[0]

    def check_inputs(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Raise a clear error for inputs this backend cannot take beyond what ``TreeAttention`` checks
        (its head configuration, dtypes, devices, the plan's backend); default: none."""

    def for_static_plans(self, tile_tokens: int | None) -> StaticBackend:
        """What a :class:`~treedec.attention.static_plan.StaticPlan` prepares and writes with
        (``tile_tokens``: the cuda kernels' KV tile of every plan). ValueError where static plans
        do not run (:attr:`static_plans` False) or ``tile_tokens`` is not this backend's setting."""
        raise ValueError(f"static plans (CUDA graphs) run on the {' or '.join(backend_names(_static))} kernels, "
                         f"whose launch reads the plan from device memory only; the {self.name} backend reads it "
                         f"on the host")

    @classmethod
    def run_op(cls, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tensors: list[torch.Tensor],
               sizes: list[int], variant: AttentionVariant, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The body of ``torch.ops.treedec.tree_attention`` for this backend (:attr:`custom_op`): launch the
        plan of :class:`OpArgs` ``tensors`` and ``sizes`` with ``variant``'s kernel (and an fp8 cache's
        ``kv_scale``), ``out [Q, Hq, D]`` in q's dtype."""
        raise ValueError(f"treedec::tree_attention runs the {' or '.join(backend_names(_op))} kernels, "
                         f"not the {cls.name} backend")


def _static(backend: type[Backend]) -> bool:
    return backend.static_plans


def _op(backend: type[Backend]) -> bool:
    return backend.custom_op


# What every registered backend sets (class attributes of Backend).
CAPABILITIES = ("name", "prepares_launch", "static_plans", "custom_op", "span_masking")
_REGISTRY: dict[str, type[Backend]] = {}


def register_backend(backend: type[Backend]) -> type[Backend]:
    """Register ``backend`` (a :class:`Backend` subclass) under its ``name``; usable as a class decorator.
    ValueError for a name already registered."""
    if not (isinstance(backend, type) and issubclass(backend, Backend)):
        raise TypeError(f"register_backend takes a Backend subclass, got {backend!r}")
    missing = [c for c in CAPABILITIES if not hasattr(backend, c)]
    if missing:
        raise TypeError(f"{backend.__name__} must set the Backend capabilities {missing}")
    name = backend.name
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"{backend.__name__}.name must be a non-empty string other than 'auto', got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"an attention backend named {name!r} is registered already ({_REGISTRY[name].__name__})")
    _REGISTRY[name] = backend
    return backend


def get_backend(name: str) -> type[Backend]:
    """The backend class registered as ``name``; ValueError naming the registered ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend {name!r}: the backends are {backend_names()}") from None


def backend_names(where: Callable[[type[Backend]], bool] | None = None) -> tuple[str, ...]:
    """The registered backends' names, in registration order (those ``where`` accepts, if given)."""
    return tuple(name for name, backend in _REGISTRY.items() if where is None or where(backend))


def check_kv_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, shape: str,
                    shape_ok, layout_ok=None, variant: AttentionVariant | None = None,
                    kv_scale: torch.Tensor | None = None) -> None:
    """Raise a clear error unless ``k_cache`` and ``v_cache`` are 4-D caches of one shape, of the dtype
    ``variant`` says (q's, or e4m3 for its fp8 ``kv_dtype``, then with ``kv_scale`` ``[2, Hkv]`` float32) and q's
    device.

    ``shape_ok(cache)`` says whether a cache's shape is what the caller takes, ``shape`` words it
    (e.g. ``"[num_pages, page_size, 8, 128]"``); ``layout_ok(name, cache)``, if given, raises for
    a memory layout the caller cannot take.
    """
    fp8 = variant is not None and variant.fp8_kv
    expected = torch.float8_e4m3fn if fp8 else q.dtype
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or not shape_ok(cache):
            raise ValueError(f"{name} must have shape {shape}, got {tuple(cache.shape)}")
        if cache.dtype != expected:
            what = "the variant's kv_dtype 'fp8_e4m3'" if fp8 else f"q dtype {q.dtype}"
            hint = "" if fp8 or cache.dtype != torch.float8_e4m3fn else \
                " (an fp8 cache needs a TreeAttention whose variant has kv_dtype='fp8_e4m3')"
            raise TypeError(f"{name} dtype {cache.dtype} differs from {what}{hint}")
        if cache.device != q.device:
            raise ValueError(f"{name} is on {cache.device} but q is on {q.device}")
        if layout_ok is not None:
            layout_ok(name, cache)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if not fp8:
        if kv_scale is not None:
            raise ValueError(f"kv_scale is for fp8 K/V caches; these are {k_cache.dtype}: pass None")
        return
    expected_scale = (2, k_cache.shape[2])
    if not isinstance(kv_scale, torch.Tensor):
        raise TypeError(f"an fp8 KV cache needs kv_scale, the layer's K and V scales [2, num_kv_heads] = "
                        f"{list(expected_scale)} float32 (PagedKVPool.layer_scale), got {type(kv_scale).__name__}")
    if tuple(kv_scale.shape) != expected_scale or kv_scale.dtype != torch.float32 or kv_scale.device != q.device \
            or not kv_scale.is_contiguous():
        raise ValueError(f"kv_scale must be a contiguous float32 tensor of shape {list(expected_scale)} on {q.device}, "
                         f"got {kv_scale.dtype} {list(kv_scale.shape)} on {kv_scale.device}")
