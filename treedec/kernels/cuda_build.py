"""Building the ``cuda`` backend: JIT on first use, cached on disk, for the GPU's own arch.

:func:`load_extension` compiles ``treedec/kernels/cuda/*`` with
``torch.utils.cpp_extension.load`` (ninja, parallel per translation unit) into treedec's cache
folder (:func:`treedec.cache.cache_dir`, default ``~/.cache/treedec``)/cuda-sm<arch>; torch rebuilds only when the
sources or flags change (``TREEDEC_CUDA_FLAGS`` adds nvcc flags, e.g. the tile knobs
``-DTREEDEC_WS_STAGES=5``; its ``-D`` defines reach the C++ binding too, so both halves of a build
agree: ``-DTREEDEC_WS_TRACE=1`` is the bench-only trace build of ``bench/stage1_trace.py``). The
kernels use CuTe's MMA/ldmatrix/cp.async atoms from the CUTLASS headers the ``nvidia-cutlass``
package ships (``cutlass_library/source/include``);
both come with the ``cuda`` extra: ``pip install 'treedec[cuda]'``.

:func:`compile_sources` compiles the torch-free kernel sources with nvcc alone (no GPU
needed): the CPU test that keeps the CUDA code building in CI.

Logit variants (FlashInfer's JIT idea): an extension holds the kernels of one *variant key*, the names of the
logit hooks they apply (``AttentionVariant.kernel_key``; ``cuda/variants.cuh``). The plain key ``()`` builds
what it always built, under its old name; each other key is its own extension (``..._softcap``), built the
first time a layer of that variant runs.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import torch

from treedec.cache import cache_dir
from treedec.errors import BackendUnavailableError

SOURCE_DIR = Path(__file__).parent / "cuda"
KERNEL_SOURCES = ("partial_fp16.cu", "partial_bf16.cu", "dispatch.cu")  # torch-free
BINDING_SOURCE = "binding.cpp"
NVCC_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "--expt-relaxed-constexpr")
MIN_CAPABILITY = (8, 0)
# The defines of each hook a variant key may name: the logit hooks (cuda/variants.cuh) and the KV dtype
# (FlashInfer's dtype_kv: e4m3 K/V, the sm_90a kernels').
LOGIT_HOOKS = {"softcap": "-DTREEDEC_LOGITS_SOFTCAP=1", "kv_fp8": "-DTREEDEC_KV_FP8=1"}


def variant_flags(kernel_key: tuple[str, ...]) -> list[str]:
    """The nvcc (and C++) defines of a variant key's hooks; ValueError for a hook no kernel has."""
    unknown = [hook for hook in kernel_key if hook not in LOGIT_HOOKS]
    if unknown or len(set(kernel_key)) != len(kernel_key):
        raise ValueError(f"a variant key names distinct hooks of {sorted(LOGIT_HOOKS)}, got {kernel_key!r}")
    return [LOGIT_HOOKS[hook] for hook in sorted(kernel_key)]


def cutlass_include_dir() -> Path:
    """The CUTLASS/CuTe headers of the ``nvidia-cutlass`` package, or BackendUnavailableError."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        raise BackendUnavailableError("the cuda backend needs the CUTLASS headers of nvidia-cutlass: "
                                      "pip install 'treedec[cuda]'")
    include = Path(spec.origin).parent / "source" / "include"
    if not (include / "cute" / "arch" / "mma_sm80.hpp").is_file():
        raise BackendUnavailableError(f"nvidia-cutlass is installed but its headers are missing under {include}")
    return include


def nvcc_path() -> str:
    """The nvcc that torch's extension builder will use, or BackendUnavailableError."""
    from torch.utils.cpp_extension import CUDA_HOME
    candidates = [Path(CUDA_HOME) / "bin" / "nvcc"] if CUDA_HOME else []
    found = shutil.which("nvcc")
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise BackendUnavailableError("the cuda backend is built on first use and needs nvcc "
                                  "(install the CUDA toolkit or set CUDA_HOME)")


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc flags for a compute capability: sm_90 builds sm_90a with the wgmma kernels (-DTREEDEC_SM90A)."""
    if capability < MIN_CAPABILITY:
        raise BackendUnavailableError(f"the cuda backend needs compute capability >= 8.0 (mma.sync, cp.async), "
                                      f"got {capability[0]}.{capability[1]}")
    major, minor = capability
    if (major, minor) == (9, 0):
        return ["-gencode=arch=compute_90a,code=sm_90a", "-DTREEDEC_SM90A"]
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


def build_problem(device: torch.device) -> str | None:
    """None if the extension can be built and run on ``device``, else why not (nothing is built)."""
    if device.type != "cuda":
        return f"the cuda backend needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return "torch reports no CUDA device"
    try:
        arch_flags(torch.cuda.get_device_capability(device))
        cutlass_include_dir()
        nvcc_path()
    except BackendUnavailableError as err:
        return str(err)
    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
        return "the cuda backend is built with ninja: pip install 'treedec[cuda]'"
    return None


@functools.lru_cache(maxsize=None)
def load_extension(capability: tuple[int, int], kernel_key: tuple[str, ...] = ()):
    """Build (or load the cached build of) the extension for ``capability`` and the logit variant key
    ``kernel_key`` (see the module docstring); returns the module."""
    knobs = os.environ.get("TREEDEC_CUDA_FLAGS", "").split()   # tuning knobs, diagnostic builds
    variant = variant_flags(kernel_key)
    flags = arch_flags(capability) + variant + knobs
    defines = variant + [f for f in knobs if f.startswith("-D")]
    include = cutlass_include_dir()
    nvcc_path()
    from torch.utils.cpp_extension import load
    name = f"treedec_cuda_sm{capability[0]}{capability[1]}" + "".join(f"_{hook}" for hook in sorted(kernel_key))
    build_dir = cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(max(1, min(4, os.cpu_count() or 1))))
    sources = [str(SOURCE_DIR / s) for s in (BINDING_SOURCE, *KERNEL_SOURCES)]
    try:
        return load(name=name, sources=sources, extra_include_paths=[str(include), str(SOURCE_DIR)],
                    extra_cuda_cflags=[*NVCC_FLAGS, *flags], extra_cflags=["-O3", "-std=c++17", *defines],
                    build_directory=str(build_dir), verbose=os.environ.get("TREEDEC_VERBOSE_BUILD") == "1")
    except (RuntimeError, subprocess.CalledProcessError) as err:
        raise BackendUnavailableError(f"building the cuda backend in {build_dir} failed "
                                      f"(TREEDEC_VERBOSE_BUILD=1 shows the compiler output): {err}") from err


def compile_sources(arch: str = "sm_90a", out_dir: Path | None = None, flags: tuple[str, ...] = (),
                    sources: tuple[str, ...] = KERNEL_SOURCES, kernel_key: tuple[str, ...] = ()) -> list[Path]:
    """Compile the torch-free kernel ``sources`` (of :data:`KERNEL_SOURCES`) with nvcc for ``arch`` (object
    files, no GPU needed), the kernels of the logit variant key ``kernel_key``; ``flags`` are added as
    ``TREEDEC_CUDA_FLAGS`` adds them (e.g. ``("-DTREEDEC_WS_TRACE=1",)``: the bench-only trace build).

    Returns the object files; raises BackendUnavailableError without nvcc or CUTLASS, and
    RuntimeError with nvcc's output when a source does not compile.
    """
    unknown = [s for s in sources if s not in KERNEL_SOURCES]
    if unknown:
        raise ValueError(f"sources must be among {KERNEL_SOURCES}, got {unknown}")
    include = cutlass_include_dir()
    nvcc = nvcc_path()
    compute = arch.replace("sm_", "compute_")
    defines = (["-DTREEDEC_SM90A"] if arch == "sm_90a" else []) + variant_flags(kernel_key)
    out_dir = Path(out_dir) if out_dir is not None else Path.cwd()
    objects = []
    for source in sources:
        obj = out_dir / (Path(source).stem + "".join(f".{hook}" for hook in sorted(kernel_key)) + f".{arch}.o")
        cmd = [nvcc, *NVCC_FLAGS, f"-gencode=arch={compute},code={arch}", *defines, *flags, "-I", str(include),
               "-I", str(SOURCE_DIR), "-c", str(SOURCE_DIR / source), "-o", str(obj)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source} for {arch}:\n{result.stderr[-4000:]}")
        objects.append(obj)
    return objects
