"""Attention backends: the :class:`Backend` protocol, the registry of the four, and how ``auto`` chooses.

``reference`` (dense fp32, the ground truth), ``torch`` (any plan: one masked attention for one request, chunk
by chunk for a forest), ``triton`` and ``cuda`` (the kernels) register here, in that order; :func:`get_backend`
finds one by name and :func:`resolve_backend` maps a request (or ``auto``) to one that runs on a device.
"""
from __future__ import annotations

import torch

from treedec.attention.backends.base import (CAPABILITIES, Backend, OpArgs, OpSizes, PreparedLaunch, SpanMasking,
                                             backend_names, check_kv_caches, get_backend, register_backend)
from treedec.attention.backends.cuda_backend import CudaBackend
from treedec.attention.backends.torch_backend import ReferenceBackend, TorchBackend
from treedec.attention.backends.triton_backend import TritonBackend
from treedec.attention.variant import AttentionVariant
from treedec.errors import BackendUnavailableError

__all__ = ["AUTO", "CAPABILITIES", "Backend", "CudaBackend", "OpArgs", "OpSizes", "PreparedLaunch", "ReferenceBackend",
           "SpanMasking", "TorchBackend", "TritonBackend", "backend_names", "check_kv_caches", "get_backend",
           "register_backend", "resolve_backend"]

for _backend in (ReferenceBackend, TorchBackend, TritonBackend, CudaBackend):
    register_backend(_backend)
del _backend

AUTO = "auto"  # the request that lets resolve_backend choose
AUTO_ORDER = ("triton", "cuda")  # elsewhere: triton first (the cuda kernels off sm_90a are untimed on such GPUs)


def resolve_backend(name: str, device: torch.device, variant: AttentionVariant | None = None,
                    head_dim: int | None = None, dtype: torch.dtype | None = None,
                    batch_invariant: bool = False) -> tuple[str, str]:
    """Map a requested backend (or ``auto``) to a registered one that runs on ``device`` (and ``variant`` at
    ``head_dim`` and q/K/V of ``dtype``, where given: a backend whose kernels lack one of the variant's hooks or
    its KV dtype, :meth:`Backend.why_not_variant`, or that does not take ``dtype``,
    :meth:`Backend.why_not_dtype` — the cuda kernels and fp32 — is not chosen, and the reason says why).

    Returns ``(backend, reason)``. On an H100/H200 (sm_90) where the wgmma (sm_90a) cuda kernels
    build, ``auto`` is ``cuda``: it was faster than triton on every step measured, eagerly and in
    CUDA graphs: the eight suite trees (H200, 2026-11-22, bench/results/2026-11-22-nvidia-h200-
    suite-final.json; H100, 2026-11-24, ...-suite-part{1,2}.json), every unshared-decode and
    long-sequence step of a GQA-4 model (H100, ...-families-split-kv.json) and, on 2026-11-25, one
    query of a model of 16 or 32 KV heads for 32 query heads, 1-2 rows per KV head
    (...-kv-heads-{16,32}.json: 16.6 vs 20.3 us graphed at 2k tokens, 183.0 vs 200.0 at 32k, no
    GQA). Elsewhere ``auto`` prefers triton > cuda > torch. An explicit choice that cannot run
    raises BackendUnavailableError naming why. ``batch_invariant``: only backends that run batch-invariant plans
    (:meth:`Backend.why_not_batch_invariant`; on an H100/H200 ``auto`` is then triton, the reason says why).
    """
    if name != AUTO and name not in backend_names():
        raise BackendUnavailableError(f"backend must be {AUTO!r} or one of {backend_names()}, got {name!r}")
    statuses = {b: get_backend(b).why_unavailable(device) or
                (None if variant is None else get_backend(b).why_not_variant(variant, head_dim)) or
                (None if dtype is None else get_backend(b).why_not_dtype(dtype)) or
                (get_backend(b).why_not_batch_invariant() if batch_invariant else None)
                for b in backend_names()}
    if name == AUTO:
        if device.type == "cuda":
            if statuses["cuda"] is None and torch.cuda.get_device_capability(device) == (9, 0):
                return "cuda", (f"auto: cuda (wgmma) on {device}, faster than triton on every tree, unshared "
                                f"batch and long sequence measured on an H100/H200")
            for candidate in AUTO_ORDER:
                if statuses[candidate] is None:
                    passed = "; ".join(f"{b}: {statuses[b]}" for b in AUTO_ORDER if b != candidate and statuses[b])
                    return candidate, (f"auto: {candidate} is the fastest backend available on {device}"
                                       + (f" (passed over: {passed})" if passed else ""))
        skipped = "; ".join(f"{b}: {statuses[b]}" for b in AUTO_ORDER if statuses[b])
        return "torch", f"auto: torch plan executor on {device} ({skipped})"
    if statuses[name] is not None:
        raise BackendUnavailableError(f"backend {name!r} cannot run: {statuses[name]}")
    return name, f"requested {name!r}"
