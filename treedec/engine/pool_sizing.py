"""How many KV pages an :class:`~treedec.engine.Engine`'s pool gets, and whether that fits in memory.

- :func:`kv_pool_pages` (the engine's): ``kv_tokens`` when given (refused when it is more than the device's
  memory holds: :func:`check_kv_pool`), else on a GPU what fits in free memory after the weights.
- :func:`cpu_pool_tokens`: the size the front door and the commands give a CPU pool when none is asked for
  (there is no free-memory query worth trusting there, and a pool is allocated zeroed, so its size is
  start-up time and memory): what the known requests need at most, else one request of the model's context
  (``max_model_len``), at most :data:`CPU_POOL_TOKENS` either way and never more than the memory available.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from treedec.checks import positive_int
from treedec.models.base import DecoderModel
from treedec.errors import PoolExhaustedError
from treedec.tree.kv_cache_dtype import kv_storage_dtype

__all__ = ["CPU_POOL_TOKENS", "PoolSize", "activation_reserve", "available_memory", "check_kv_pool",
           "cpu_pool_tokens", "kv_bytes_per_token", "kv_pool_pages"]

_GIB = 1 << 30

#: The most tokens a CPU pool gets by default (more requests than it holds wait for pages), unless one request
#: alone needs more.
CPU_POOL_TOKENS = 32768


@dataclass(frozen=True)
class PoolSize:
    """A KV pool's size in tokens (whole pages) and why it is that size (for the line that says so)."""

    tokens: int
    reason: str


def kv_bytes_per_token(model: DecoderModel, kv_cache_dtype: str = "auto") -> int:
    """Bytes of KV pool one token takes in ``model``'s engine (K and V of every layer) for ``kv_cache_dtype``
    (``"auto"``: the model's dtype; ``"fp8"``: one byte a value, half of bf16's)."""
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_storage_dtype(kv_cache_dtype, model.dtype).itemsize


def kv_pool_pages(model: DecoderModel, kv_tokens: int | None, page_size: int, memory_fraction: float,
                  prefill_chunk: int, kv_cache_dtype: str = "auto") -> tuple[int, str]:
    """``(pages, reason)``: ``kv_tokens // page_size`` when given (:func:`check_kv_pool` first); else, on CUDA,
    ``memory_fraction`` of the free memory after the weights, less :func:`activation_reserve`. A tensor-parallel
    model's ranks all take the smallest rank's count (the programs' page decisions must agree on every rank)."""
    positive_int("page_size", page_size)
    bytes_per_token = kv_bytes_per_token(model, kv_cache_dtype)
    if kv_tokens is not None:
        if not isinstance(kv_tokens, int) or kv_tokens < page_size:
            raise ValueError(f"kv_tokens must be an int >= page_size ({page_size}), got {kv_tokens!r}")
        check_kv_pool(model, kv_tokens, page_size, kv_cache_dtype=kv_cache_dtype)
        pages, reason = kv_tokens // page_size, f"kv_tokens={kv_tokens} requested"
    else:
        if model.device.type != "cuda":
            raise ValueError(f"kv_tokens is required on {model.device} (only a CUDA pool is sized from free memory)")
        free, _ = torch.cuda.mem_get_info(model.device)
        reserve = activation_reserve(model, prefill_chunk)
        pages = (int(free * memory_fraction) - reserve) // (bytes_per_token * page_size)
        if pages < 1:
            raise PoolExhaustedError(f"no GPU memory left for a KV pool: {free / _GIB:.2f} GiB free after the "
                                     f"weights, {reserve / _GIB:.2f} GiB kept for activations")
        reason = (f"sized from free GPU memory after the weights: {memory_fraction:.0%} of "
                  f"{free / _GIB:.1f} GiB free, less {reserve / _GIB:.1f} GiB for activations, "
                  f"{pages * page_size * bytes_per_token / _GIB:.1f} GiB at {bytes_per_token} B/token")
    tp = model.tensor_parallel
    if tp is not None:
        pages = min(tp.gather_objects(pages))
    return pages, reason


def check_kv_pool(model: DecoderModel, kv_tokens: int, page_size: int, name: str = "kv_tokens",
                  dtype_name: str = "dtype", kv_cache_dtype: str = "auto") -> str:
    """Raise MemoryError if a pool of ``kv_tokens`` tokens (the argument ``name``; ``dtype_name`` the argument that
    sets the model's dtype) stored as ``kv_cache_dtype`` is larger than the memory available on ``model``'s device
    (:func:`available_memory`), before anything is allocated; else return the words that describe the pool (for an
    out-of-memory message if its allocation fails anyway)."""
    per_token = kv_bytes_per_token(model, kv_cache_dtype)
    asked = (kv_tokens // page_size) * page_size * per_token
    what = f"{name} {kv_tokens} asks for a KV pool of {_size(asked)} ({asked} bytes at {per_token} B/token)"
    free = available_memory(model.device)
    if free is not None and asked > free:
        raise MemoryError(f"out of memory: {what}, but {_size(free)} is available on {model.device}; lower {name} "
                          f"(about {free // per_token} tokens fit), or use a smaller {dtype_name}")
    return what


def cpu_pool_tokens(model: DecoderModel, page_size: int, max_model_len: int, requests: Sequence[int] | None = None,
                    memory_fraction: float = 0.9, kv_cache_dtype: str = "auto") -> PoolSize:
    """The default size of a CPU engine's KV pool (on a GPU the engine sizes it from free memory).

    Parameters
    ----------
    model : the model (its bytes per token, its device's memory).
    page_size : tokens per page; the size is whole pages.
    max_model_len : the most positions one request may reach (the model's context, or less when asked).
    requests : when the requests are known, the most KV tokens each may take (its prompt plus its outputs'
        new tokens): the pool holds them all at once, at most :data:`CPU_POOL_TOKENS` (then they wait for
        pages), and always the largest alone. Default: one request of ``max_model_len`` tokens, at most
        :data:`CPU_POOL_TOKENS`.
    memory_fraction : the share of the available memory (:func:`available_memory`) the pool may take.
    kv_cache_dtype : what the pool stores (its bytes per token).

    Raises
    ------
    MemoryError : the memory available does not hold the largest request (or one page).
    """
    positive_int("page_size", page_size)
    positive_int("max_model_len", max_model_len)
    if requests:
        pages = [-(-positive_int("requests[i]", t) // page_size) for t in requests]
        need, largest = sum(pages) * page_size, max(pages) * page_size
        cap = max(CPU_POOL_TOKENS, largest)
        tokens = min(need, cap)
        what = "the request's" if len(pages) == 1 else f"the {len(pages)} requests'"
        reason = f"{what} worst case" + ("" if tokens == need else f" ({need} tokens), at most " + (
            f"{CPU_POOL_TOKENS}" if cap == CPU_POOL_TOKENS else "the largest request's"))
    else:   # (a page more: a prompt's last page and its output's first are not shared)
        largest = tokens = (-(-min(max_model_len, CPU_POOL_TOKENS) // page_size) + 1) * page_size
        reason = (f"one request of max_model_len {max_model_len}" if max_model_len <= CPU_POOL_TOKENS else
                  f"at most {CPU_POOL_TOKENS} of max_model_len {max_model_len}")
    per_token = kv_bytes_per_token(model, kv_cache_dtype)
    free = available_memory(model.device)
    if free is not None and tokens * per_token > free * memory_fraction:
        fit = int(free * memory_fraction) // (per_token * page_size) * page_size
        if fit < largest:
            raise MemoryError(f"out of memory: a KV pool of {largest} tokens ({_size(largest * per_token)}) does not "
                              f"fit in {memory_fraction:.0%} of the {_size(free)} available on {model.device}; "
                              f"shorten the request (or max_model_len), or use a smaller dtype")
        tokens, reason = fit, f"{reason}, cut to {memory_fraction:.0%} of the {_size(free)} available"
    return PoolSize(tokens, f"{reason}: {_size(tokens * per_token)} at {per_token} B/token")


def activation_reserve(model: DecoderModel, prefill_chunk: int) -> int:
    """Bytes kept free for a step's activations: a prefill chunk's largest tensors, its attention
    workspace (up to 8 partials per query), the logits, and 1 GiB for the allocator and graphs."""
    c, size = model.config, model.dtype.itemsize
    per_row = size * (8 * c.hidden_size + 2 * c.qkv_size + 3 * c.intermediate_size) + 8 * c.hidden_size
    workspace = 8 * prefill_chunk * c.num_heads * (c.head_dim * size + 4)
    return 2 * prefill_chunk * per_row + workspace + 256 * c.vocab_size * size + _GIB


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
