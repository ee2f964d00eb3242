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
import sys
from typing import Sequence

import torch

from treedec.engine import Engine
from treedec.engine.pool_sizing import check_kv_pool as pool_check, cpu_pool_tokens, kv_bytes_per_token
from treedec.runtime.request import position_limit

__all__ = ["build_engine", "check_kv_pool", "command_engine", "out_of_memory_as_error"]


def build_engine(model, kv_tokens: int | None, page_size: int, flag: str = "--kv-tokens", kv_cache_dtype: str = "auto",
                 **options) -> Engine:
    """``Engine(model, kv_tokens=kv_tokens, page_size=page_size, kv_cache_dtype=kv_cache_dtype, **options)``, its pool
    checked first (:func:`check_kv_pool`). An engine in the batch-invariant mode says so, and what it runs, in one
    line on stderr.

    Raises
    ------
    MemoryError
        The pool does not fit (nothing is allocated then), or allocating it failed; the message
        names ``flag``, the tokens and bytes asked for, and what to do.
    """
    what = check_kv_pool(model, kv_tokens, page_size, flag, kv_cache_dtype)
    with out_of_memory_as_error(what, f"lower {flag}, or use a smaller --dtype or --kv-cache-dtype fp8"):
        engine = Engine(model, kv_tokens=kv_tokens, page_size=page_size, kv_cache_dtype=kv_cache_dtype, **options)
    if engine.batch_invariance is not None:
        config = engine.attn.plan_config
        print(f"batch-invariant mode: GEMMs and norms {engine.batch_invariance.summary}; attention: the "
              f"{config.planner} planner, {config.chunk_size}-token chunks, {engine.attn.backend} backend",
              file=sys.stderr)
    return engine


def command_engine(model, kv_tokens: int | None, page_size: int, requests: Sequence[int] | None = None,
                   flag: str = "--kv-tokens", kv_cache_dtype: str = "auto", **options) -> Engine:
    """The engine of a command's model: :func:`build_engine` with ``kv_tokens`` (``flag``'s value) when given;
    else on the CPU a pool of :func:`~treedec.engine.pool_sizing.cpu_pool_tokens` (``requests``: the most KV
    tokens each of the command's requests may take; None: one request of the model's context), on a GPU what
    free memory holds: then one line on stderr says the size chosen and why."""
    if kv_tokens is not None:
        return build_engine(model, kv_tokens, page_size, flag, kv_cache_dtype, **options)
    reason, limit = None, position_limit(model)
    if page_size > limit:
        raise ValueError(f"--page-size {page_size} is more tokens than the model's {limit} positions (each branch of "
                         f"a tree takes pages of its own); give a smaller --page-size (default 16)")
    if torch.device(model.device).type != "cuda":
        size = cpu_pool_tokens(model, page_size, limit, requests, kv_cache_dtype=kv_cache_dtype)
        kv_tokens, reason = size.tokens, size.reason
    engine = build_engine(model, kv_tokens, page_size, flag, kv_cache_dtype, **options)
    scales = "" if engine.kv_scale_source is None else f", scales {engine.kv_scale_source}"
    print(f"KV pool: {engine.kv_capacity_tokens} tokens of {engine.kv_cache_dtype}{scales} "
          f"({reason or engine.kv_pool_reason}; {flag} N sets it)", file=sys.stderr)
    return engine


def check_kv_pool(model, kv_tokens: int | None, page_size: int, flag: str = "--kv-tokens",
                  kv_cache_dtype: str = "auto") -> str:
    """Raise MemoryError if a pool of ``kv_tokens`` tokens (``flag``'s value; None: sized by the engine from
    free memory) is larger than the memory available on ``model``'s device
    (:func:`~treedec.engine.pool_sizing.check_kv_pool`), ValueError if it is smaller than one page; else return
    the words that describe the pool in an out-of-memory message."""
    if kv_tokens is None:
        return f"the KV pool sized from free memory at {kv_bytes_per_token(model, kv_cache_dtype)} B/token"
    if kv_tokens < page_size:
        raise ValueError(f"the KV pool of {kv_tokens} tokens ({flag}, or its default) is smaller than one page of "
                         f"--page-size {page_size}; give a larger {flag} or a smaller --page-size")
    return pool_check(model, kv_tokens, page_size, flag, "--dtype or --kv-cache-dtype fp8", kv_cache_dtype)


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
