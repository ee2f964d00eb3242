"""A counter-based random number generator: each draw's number is a hash of (seed, stream, counter).

A lane of the batched sampler draws its ``t``-th token with ``counter_uniform(seed, stream, t)``: the number
depends on nothing but the request's seed, the output's index (``stream``) and the draw's index, so a seeded
request's tokens do not depend on which other requests share its steps, on when they were admitted, or on the
batch's order (vLLM keeps a ``torch.Generator`` per seeded request for this; a hash needs no state and works on
every row of a batch in one call). The hash is SplitMix64's finalizer (Steele, Lea, Flood 2014: the
``java.util.SplittableRandom`` mixer) applied twice, in int64 tensor arithmetic (two's-complement wrap-around,
logical shifts emulated by masks), so it runs on the CPU and the GPU alike and gives the same bits on both.
"""
from __future__ import annotations

import torch

__all__ = ["counter_uniform", "mix64"]

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 it is in two's complement."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_STREAM = _signed(0xD1B54A32D192ED03)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic on negative values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer of int64 ``x`` (any shape), elementwise: a bijection of the 64-bit words whose
    output bits each depend on every input bit."""
    x = x ^ _shift_right(x, 30)
    x = x * _M1
    x = x ^ _shift_right(x, 27)
    x = x * _M2
    return x ^ _shift_right(x, 31)


def counter_uniform(seed: torch.Tensor, stream: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in ``[0, 1)``, one per element: a hash of ``(seed, stream, counter)``.

    Parameters
    ----------
    seed, stream, counter : int64 tensors of one shape (or broadcastable), on one device: a request's seed in
        ``[0, 2**63)``, its output's index, and the draw's index within that output.

    Returns
    -------
    float64 tensor of the broadcast shape, in ``[0, 1)`` (53 random bits each).
    """
    key = mix64(seed * _GOLDEN + stream * _STREAM)
    x = mix64(key + (counter + 1) * _GOLDEN)
    return _shift_right(x, 11).to(torch.float64) * (2.0 ** -53)
