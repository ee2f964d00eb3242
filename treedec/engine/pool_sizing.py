"""How many KV pages an :class:`~treedec.engine.Engine`'s pool gets: asked for, or what fits in free GPU memory."""
from __future__ import annotations

import torch

from treedec.checks import positive_int
from treedec.models.base import DecoderModel
from treedec.errors import PoolExhaustedError

_GIB = 1 << 30


def kv_pool_pages(model: DecoderModel, kv_tokens: int | None, page_size: int, memory_fraction: float,
                  prefill_chunk: int) -> tuple[int, str]:
    """``(pages, reason)``: ``kv_tokens // page_size`` when given; else, on CUDA, ``memory_fraction`` of the
    free memory after the weights, less :func:`activation_reserve`. A tensor-parallel model's ranks all
    take the smallest rank's count (the programs' page decisions must agree on every rank)."""
    c = model.config
    positive_int("page_size", page_size)
    bytes_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize
    if kv_tokens is not None:
        if not isinstance(kv_tokens, int) or kv_tokens < page_size:
            raise ValueError(f"kv_tokens must be an int >= page_size ({page_size}), got {kv_tokens!r}")
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


def activation_reserve(model: DecoderModel, prefill_chunk: int) -> int:
    """Bytes kept free for a step's activations: a prefill chunk's largest tensors, its attention
    workspace (up to 8 partials per query), the logits, and 1 GiB for the allocator and graphs."""
    c, size = model.config, model.dtype.itemsize
    per_row = size * (8 * c.hidden_size + 2 * c.qkv_size + 3 * c.intermediate_size) + 8 * c.hidden_size
    workspace = 8 * prefill_chunk * c.num_heads * (c.head_dim * size + 4)
    return 2 * prefill_chunk * per_row + workspace + 256 * c.vocab_size * size + _GIB
