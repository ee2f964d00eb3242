"""Building the compiled planner: a C++ extension (no CUDA), JIT on first use, cached on disk.

:func:`load_planner` compiles ``treedec/kernels/planner/binding.cpp`` (one translation unit; the
headers beside it hold the planner) with ``torch.utils.cpp_extension.load`` (ninja) into
treedec's cache folder (:func:`treedec.cache.cache_dir`, default ``~/.cache/treedec``)/planner-<python>-<numpy
ABI>-<a digest of the sources and headers>: two checkouts (or versions) of treedec sharing a cache folder never load
each other's build; torch rebuilds only when the flags change (ninja tracks the headers). The module takes and returns
numpy arrays through the CPython and numpy C APIs (no torch or pybind11 headers: a build of a
few seconds). :func:`build_problem` says, without building, why it cannot be built here (no sources,
no C++ compiler, no ninja, no Python headers).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

from treedec.cache import cache_dir
from treedec.errors import BackendUnavailableError

SOURCE_DIR = Path(__file__).parent / "planner"
BINDING_SOURCE = "binding.cpp"
MODULE_NAME = "treedec_planner"
CXX_FLAGS = ("-O3",)


def build_dir() -> Path:
    """Where the extension is built and cached: one build per Python and numpy ABI (the module links
    against both; torch's rebuild check does not see their versions) and per content of the planner's sources
    and headers (torch's check hashes the listed source only, and processes of two checkouts would load each
    other's builds)."""
    abi = f"py{sys.version_info[0]}{sys.version_info[1]}-np{np.__version__.split('.')[0]}"
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*")) if SOURCE_DIR.is_dir() else ():
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return cache_dir() / f"planner-{abi}-{digest.hexdigest()[:12]}"


def build_problem() -> str | None:
    """None if the compiled planner can be built here, else why not (nothing is built)."""
    from torch.utils.cpp_extension import is_ninja_available
    if not (SOURCE_DIR / BINDING_SOURCE).is_file():
        return f"its C++ sources are not installed ({SOURCE_DIR / BINDING_SOURCE} is missing)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++ or clang, or set CXX)"
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return f"the Python headers are missing ({headers}; install python3-dev)"
    return None


@functools.lru_cache(maxsize=None)
def load_planner():
    """Build (or load the cached build of) the compiled planner; returns the module.

    Raises BackendUnavailableError naming the build directory when the build fails.
    """
    from torch.utils.cpp_extension import load
    directory = build_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return load(name=MODULE_NAME, sources=[str(SOURCE_DIR / BINDING_SOURCE)], extra_cflags=list(CXX_FLAGS),
                    extra_include_paths=[str(SOURCE_DIR), np.get_include()], build_directory=str(directory),
                    verbose=os.environ.get("TREEDEC_VERBOSE_BUILD") == "1")
    except (OSError, RuntimeError, subprocess.CalledProcessError, ImportError) as err:
        raise BackendUnavailableError(f"building the compiled planner in {directory} failed "
                                      f"(TREEDEC_VERBOSE_BUILD=1 shows the compiler output): {err}") from err
