"""A CPU stand-in for the order in which torch's CUDA ``cumsum`` adds along the last dimension, so that CPU tests
can see what the GPU's order does to the sampler (issue #53: seeded sampling batched != alone on an H200).

ATen's ``scan_dim`` (``aten/src/ATen/native/cuda/ScanUtils.cuh``, ``ScanKernels.cpp``) sends a tensor whose numel is
its last dimension (one row) to cub's device scan, and every other last-dimension scan to
``tensor_kernel_scan_innermost_dim``: threads ``(2**x, 512 / 2**x)`` with
``x = clamp((9 + ceil_log2(row_size) - ceil_log2(num_rows)) // 2, 4, 9)``, each row cut into tiles of ``2 * 2**x``
values, the running total of the tiles before added to a tile's first value, then a Sklansky scan of the tile.
The tile, so the order of a row's additions, follows the number of rows: a row's prefix sums round otherwise in a
batch of 16 than alone. :func:`cuda_order_cumsum` adds in that order (one row: a Sklansky scan of 1024-value tiles,
standing for cub's own order, which is another again).
"""
from __future__ import annotations

import torch


def _log_threads_x(num_rows: int, row_size: int) -> int:
    """ATen's ``get_log_num_threads_x_inner_scan``."""
    log_x = (row_size - 1).bit_length()
    log_y = (num_rows - 1).bit_length()
    return min(max(4, (9 + log_x - log_y) // 2), 9)


def _sklansky(buf: torch.Tensor, threads: int) -> None:
    """The Sklansky scan of ``buf``'s tiles ([R, 2 * threads]) in place, as ATen's kernel steps it."""
    t = torch.arange(threads)
    s = 1
    while s <= threads:
        a = (t // s) * (2 * s) + s
        buf[:, a + t % s] += buf[:, a - 1]
        s *= 2


def cuda_order_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(-1)`` ([..., n], any float or int dtype), its additions in the order torch's CUDA kernels use."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    log_x = 9 if rows.shape[0] == 1 else _log_threads_x(rows.shape[0], n)
    threads = 1 << log_x
    tile = 2 * threads
    out = torch.empty_like(rows)
    total = torch.zeros_like(rows[:, 0])
    for start in range(0, n, tile):
        buf = torch.zeros(rows.shape[0], tile, dtype=rows.dtype)
        width = min(tile, n - start)
        buf[:, :width] = rows[:, start:start + width]
        buf[:, 0] = buf[:, 0] + total
        _sklansky(buf, threads)
        out[:, start:start + width] = buf[:, :width]
        total = buf[:, -1].clone()
    return out.reshape(x.shape)


def patch_cumsum(monkeypatch) -> None:
    """Make ``Tensor.cumsum`` along the last dimension add in the CUDA order (:func:`cuda_order_cumsum`)."""
    original = torch.Tensor.cumsum

    def cumsum(self, dim, *args, **kwargs):
        if dim in (-1, self.dim() - 1) and not args and not kwargs and self.dim() > 0:
            return cuda_order_cumsum(self)
        return original(self, dim, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cumsum", cumsum)


def gpu_order_device(monkeypatch) -> torch.device:
    """Where a test of the sampler's invariance runs: the GPU if there is one (its own order), else the CPU with
    :func:`patch_cumsum`."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    patch_cumsum(monkeypatch)
    return torch.device("cpu")
