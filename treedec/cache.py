"""treedec's cache folder: the compiled planner and CUDA builds, and the checkpoints converted from GGUF files.

``$TREEDEC_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/treedec``, else ``~/.cache/treedec`` (as Hugging Face
places its own cache). Everything in it can be deleted: it is rebuilt or re-fetched on next use.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder (it may not exist yet; whoever writes into it makes it)."""
    explicit = os.environ.get("TREEDEC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "treedec"
