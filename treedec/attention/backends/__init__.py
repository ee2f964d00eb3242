"""Attention backends: which exist, which can run here, and how ``auto`` chooses."""
from __future__ import annotations

import importlib.util
import os

import torch

from treedec.errors import BackendUnavailableError

BACKENDS = ("reference", "torch", "triton", "cuda")
AUTO_ORDER = ("triton", "cuda")  # elsewhere: triton first (the cuda kernels off sm_90a are untimed on such GPUs)


def check_kv_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, shape: str,
                    shape_ok, layout_ok=None) -> None:
    """Raise a clear error unless ``k_cache`` and ``v_cache`` are 4-D caches of one shape, q's dtype and device.

    ``shape_ok(cache)`` says whether a cache's shape is what the caller takes, ``shape`` words it
    (e.g. ``"[num_pages, page_size, 8, 128]"``); ``layout_ok(name, cache)``, if given, raises for
    a memory layout the caller cannot take.
    """
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or not shape_ok(cache):
            raise ValueError(f"{name} must have shape {shape}, got {tuple(cache.shape)}")
        if cache.dtype != q.dtype:
            raise TypeError(f"{name} dtype {cache.dtype} differs from q dtype {q.dtype}")
        if cache.device != q.device:
            raise ValueError(f"{name} is on {cache.device} but q is on {q.device}")
        if layout_ok is not None:
            layout_ok(name, cache)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")


def triton_status(device: torch.device) -> str | None:
    """None if the triton backend can run on ``device``, else the reason it cannot."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed (pip install 'treedec[triton]')"
    if device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return f"triton needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got device {device}"
        return triton_interpreter_problem()
    return None


def triton_interpreter_problem() -> str | None:
    """None if the installed Triton interpreter runs the kernels on the CPU, else why not.

    Triton's interpreter before 3.7 turns a loaded loop bound into a Python int in a way
    numpy 2.4 rejects (triton-lang/triton#9171), so every kernel launch fails there. Compiled
    GPU kernels are not affected, which is why the ``triton`` extra carries no version bound
    (CUDA builds of torch pin their own triton).
    """
    import numpy as np
    import triton
    if _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4):
        return (f"the Triton {triton.__version__} interpreter fails with numpy {np.__version__} "
                f"(triton-lang/triton#9171): pip install 'triton>=3.7' or 'numpy<2.4' to run triton on the CPU")
    return None


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def cuda_status(device: torch.device) -> str | None:
    """None if the cuda backend can be built and run on ``device``, else the reason it cannot.

    Nothing is compiled here: the extension is built (or loaded from its disk cache) on
    first use, and a build failure raises BackendUnavailableError then.
    """
    from treedec.kernels.cuda_build import build_problem
    return build_problem(device)


def resolve_backend(name: str, device: torch.device) -> tuple[str, str]:
    """Map a requested backend (or ``auto``) to one that runs on ``device``.

    Returns ``(backend, reason)``. On an H100/H200 (sm_90) where the wgmma (sm_90a) cuda kernels
    build, ``auto`` is ``cuda``: it was faster than triton on every step measured, eagerly and in
    CUDA graphs: the eight suite trees (H200, 2026-11-22, bench/results/2026-11-22-nvidia-h200-
    suite-final.json; H100, 2026-11-24, ...-suite-part{1,2}.json), every unshared-decode and
    long-sequence step of a GQA-4 model (H100, ...-families-split-kv.json) and, on 2026-11-25, one
    query of a model of 16 or 32 KV heads for 32 query heads, 1-2 rows per KV head
    (...-kv-heads-{16,32}.json: 16.6 vs 20.3 us graphed at 2k tokens, 183.0 vs 200.0 at 32k, no
    GQA). Elsewhere ``auto`` prefers triton > cuda > torch. An explicit choice that cannot run
    raises BackendUnavailableError naming why.
    """
    statuses = {"reference": None, "torch": None,
                "triton": triton_status(device), "cuda": cuda_status(device)}
    if name == "auto":
        if device.type == "cuda":
            if statuses["cuda"] is None and torch.cuda.get_device_capability(device) == (9, 0):
                return "cuda", (f"auto: cuda (wgmma) on {device}, faster than triton on every tree, unshared "
                                f"batch and long sequence measured on an H100/H200")
            for candidate in AUTO_ORDER:
                if statuses[candidate] is None:
                    return candidate, f"auto: {candidate} is the fastest backend available on {device}"
        skipped = "; ".join(f"{b}: {statuses[b]}" for b in AUTO_ORDER if statuses[b])
        return "torch", f"auto: torch plan executor on {device} ({skipped})"
    if name not in statuses:
        raise BackendUnavailableError(f"backend must be 'auto' or one of {BACKENDS}, got {name!r}")
    if statuses[name] is not None:
        raise BackendUnavailableError(f"backend {name!r} cannot run: {statuses[name]}")
    return name, f"requested {name!r}"
