"""Attention backends: which exist, which can run here, and how ``auto`` chooses."""
from __future__ import annotations

import importlib.util
import os

import torch

from treedec.errors import BackendUnavailableError

BACKENDS = ("reference", "torch", "triton", "cuda")
AUTO_ORDER = ("triton", "cuda")  # on a CUDA device without the hybrid, fastest first (measured)
HYBRID_MIN_ROWS = 4  # query rows (queries x GQA group) per KV head from which hybrid takes cuda


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

    Returns ``(backend, reason)``. On a CUDA device ``auto`` is ``hybrid`` where both triton
    and the wgmma (sm_90a) cuda kernels run: each step takes cuda when it has at least
    :data:`HYBRID_MIN_ROWS` query rows per KV head and triton below. On the H200 suite of
    2026-11-22 (bench/results/2026-11-22-nvidia-h200-small-triton-vs-cuda.json and
    ...-suite-final.json) cuda is faster on all eight workloads, eagerly and in CUDA graphs; on
    an H100 on 2026-11-24 (...-families.json, ...-small-rows.json) it is also faster on every
    unshared-decode and long-sequence step down to one query of a GQA-4 model (4 rows: 16.2 vs
    18.6 us at 2k tokens, 66.8 vs 73.1 at 32k) and a graphed greedy decode step with cuda took
    6.65 / 7.94 ms at 4000 / 32000 tokens against 6.78 / 8.43 with triton for it
    (...-programs-backend-{cuda,auto}.json). Steps below 4 rows (a query or three of a model
    without GQA) were not measured and keep triton. Otherwise ``auto`` prefers triton > cuda > torch. An explicit choice that cannot run raises
    BackendUnavailableError naming why.
    """
    statuses = {"reference": None, "torch": None,
                "triton": triton_status(device), "cuda": cuda_status(device)}
    if name == "auto":
        if device.type == "cuda":
            if statuses["triton"] is None and statuses["cuda"] is None \
                    and torch.cuda.get_device_capability(device) == (9, 0):
                return "hybrid", (f"auto: hybrid on {device}: per step, cuda (wgmma) for steps with >= "
                                  f"{HYBRID_MIN_ROWS} query rows per KV head, triton below (measured crossover)")
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
