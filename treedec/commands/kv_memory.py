"""A command's KV pool against the machine's memory: checked before it is allocated, and an
allocation that fails anyway reported as one "out of memory" line.

A pool of ``--kv-tokens`` tokens takes ``2 x layers x KV heads x head dim x dtype size`` bytes a
token (K and V), allocated zeroed when the engine is made. :func:`build_engine` refuses a pool
larger than the memory available on its device (on the CPU: the system's available memory and
free swap, within the process's cgroup limit; on a GPU: its free memory) before allocating it,
and turns an allocation that fails anyway (torch's OutOfMemoryError, the CPU allocator's
RuntimeError "can't allocate memory", MemoryError) into a MemoryError with one line saying the
tokens and bytes asked for and what to do; ``treedec`` reports it and exits 2.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from treedec.engine import Engine

__all__ = ["available_memory", "build_engine", "check_kv_pool", "kv_bytes_per_token", "out_of_memory_as_error"]

_GIB = 1 << 30


def kv_bytes_per_token(model) -> int:
    """Bytes of KV pool one token takes in ``model``'s engine (K and V of every layer)."""
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize


def build_engine(model, kv_tokens: int | None, page_size: int, flag: str = "--kv-tokens", **options) -> Engine:
    """``Engine(model, kv_tokens=kv_tokens, page_size=page_size, **options)``, its pool checked first
    (:func:`check_kv_pool`).

    Raises
    ------
    MemoryError
        The pool does not fit (nothing is allocated then), or allocating it failed; the message
        names ``flag``, the tokens and bytes asked for, and what to do.
    """
    what = check_kv_pool(model, kv_tokens, page_size, flag)
    with out_of_memory_as_error(what, f"lower {flag}, or use a smaller --dtype"):
        return Engine(model, kv_tokens=kv_tokens, page_size=page_size, **options)


def check_kv_pool(model, kv_tokens: int | None, page_size: int, flag: str = "--kv-tokens") -> str:
    """Raise MemoryError if a pool of ``kv_tokens`` tokens (``flag``'s value; None: sized by the engine from
    free memory) is larger than the memory available on ``model``'s device, ValueError if it is smaller
    than one page; else return the words that describe the pool in an out-of-memory message."""
    per_token = kv_bytes_per_token(model)
    if kv_tokens is None:
        return f"the KV pool sized from free memory at {per_token} B/token"
    if kv_tokens < page_size:
        raise ValueError(f"the KV pool of {kv_tokens} tokens ({flag}, or its default) is smaller than one page of "
                         f"--page-size {page_size}; give a larger {flag} or a smaller --page-size")
    asked = (kv_tokens // page_size) * page_size * per_token
    what = f"{flag} {kv_tokens} asks for a KV pool of {_size(asked)} ({asked} bytes at {per_token} B/token)"
    free = available_memory(model.device)
    if free is not None and asked > free:
        raise MemoryError(f"out of memory: {what}, but {_size(free)} is available on {model.device}; lower {flag} "
                          f"(about {free // per_token} tokens fit), or use a smaller --dtype")
    return what


@contextlib.contextmanager
def out_of_memory_as_error(what: str, advice: str):
    """Inside, an allocation failure (torch.OutOfMemoryError, MemoryError, the CPU allocator's
    RuntimeError) becomes ``MemoryError("out of memory: <what>; <advice>")``, one line."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise MemoryError(f"out of memory: {what}; {advice}") from e
    except RuntimeError as e:
        text = str(e)
        if "can't allocate memory" in text or "out of memory" in text.lower() or "bad_alloc" in text:
            raise MemoryError(f"out of memory: {what}; {advice}") from e
        raise


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``; None where it cannot be told.

    CUDA: the device's free memory. CPU (Linux): ``MemAvailable`` plus ``SwapFree`` of
    ``/proc/meminfo``, at most what the process's cgroup (v2) limit leaves.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        free = (int(info["MemAvailable"].split()[0]) + int(info.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            # the group's use less its file cache, which the kernel reclaims before failing an allocation
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            used = int((cgroup / "memory.current").read_text()) - int(stat.get("file", 0))
            free = min(free, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass   # no cgroup v2 limit to read: the system's figure stands
    return free


def _size(nbytes: int) -> str:
    return f"{nbytes / _GIB:.1f} GiB" if nbytes >= _GIB else f"{nbytes / (1 << 20):.1f} MiB"
