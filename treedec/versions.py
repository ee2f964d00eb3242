"""The versions of treedec's dependencies as installed here (``treedec env``).

CI prints them before the tests so that a release drift (a new triton, numpy or
transformers resolved on a fresh machine) is visible in the log next to any failure.
"""
from __future__ import annotations

import importlib.metadata
import platform

# Distribution names, in the order printed: the core install, then the extras.
PACKAGES = ("torch", "numpy", "transformers", "tokenizers", "safetensors", "tqdm", "matplotlib",
            "triton", "nvidia-cutlass", "ninja", "pytest", "hypothesis")


def installed_versions() -> dict[str, str | None]:
    """``{"python": ..., package: version or None if not installed, "cuda": ...}``."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:
        import torch
        versions["torch CUDA"] = torch.version.cuda
        versions["GPU"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return versions


def format_versions(versions: dict[str, str | None] | None = None) -> str:
    """One ``name version`` line per entry; ``-`` for what is not installed."""
    versions = installed_versions() if versions is None else versions
    width = max(map(len, versions))
    return "\n".join(f"{name:<{width}}  {value or '-'}" for name, value in versions.items())
