"""Host <-> device copies that do not make the host wait for the device's queued work.

A copy from ordinary (pageable) host memory to a CUDA device first waits for every kernel
already queued on the stream (CUDA's rule for pageable transfers), and a copy to the host
followed by ``.tolist()`` waits for the whole stream. Between engine steps both would make
the host wait for the step it just launched, so the host's work for the next step could not
overlap the device's work for this one. These helpers go through pinned memory:

- :func:`to_device`: a host array's copy, queued in stream order; returns at once.
- :class:`HostCopy`: a device tensor's copy to the host, started at once; :meth:`HostCopy.result`
  waits for that copy only, not for work queued after it.
- :class:`PinnedStaging`: the same two copies for what runs every step (a decode step's inputs, its draws read
  back), through pinned buffers made once and reused in turn, never pinned anew per copy.

On the CPU both are plain conversions. :func:`resolve_device` checks a device argument before anything is put
on it.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.errors import BackendUnavailableError


def resolve_device(device, name: str = "device") -> torch.device:
    """``device`` (a ``torch.device`` or a string such as ``"cpu"``, ``"cuda:1"``) as a ``torch.device``, a CUDA one
    only where it exists: a CUDA device on a CPU build of torch or with no GPU visible raises
    :class:`~treedec.errors.BackendUnavailableError`, one past the visible GPUs or a malformed one ValueError, both
    naming the argument ``name`` (instead of torch's "Torch not compiled with CUDA enabled" at the first use)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0', "
                         f"got {device!r}: {error}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU build of torch" if torch.version.cuda is None else "no visible CUDA GPU"
            raise BackendUnavailableError(f"{name} {device!r} asked for, but this machine has {build} "
                                          f"(torch {torch.__version__}): use {name}='cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return resolved


def to_device(array: np.ndarray | list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``array`` as a tensor on ``device``; on a CUDA device copied from pinned memory without waiting.

    PyTorch's pinned-memory cache keeps the pinned block until the copy has read it.
    """
    host = torch.as_tensor(np.ascontiguousarray(array), dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def take_rows(tensor: torch.Tensor, rows: np.ndarray | None, device: torch.device, copy: bool = False) -> torch.Tensor:
    """Rows ``rows`` (host indices, sent with :func:`to_device`) of a device ``tensor``; all of them for None
    (``copy``: never a view of ``tensor``, e.g. of a CUDA graph's output buffer)."""
    if rows is None:
        return tensor.clone() if copy else tensor
    return tensor[to_device(rows, device)]


class HostCopy:
    """A device tensor's copy to the host, started without waiting: :meth:`result` waits for that copy
    only, not for the work queued after it (e.g. the next step, launched meanwhile)."""

    def __init__(self, value: torch.Tensor, into: torch.Tensor | None = None, event=None):
        self.source = value   # the device tensor, for work queued before the copy is read
        if value.device.type == "cuda":
            # (``into``, ``event``: a pinned buffer of :class:`PinnedStaging` and the event of its turn)
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True) if into is None else into
            self._host.copy_(value, non_blocking=True)
            self._done = torch.cuda.Event() if event is None else event
            self._done.record()
        else:
            self._host, self._done = value, None

    def tensor(self) -> torch.Tensor:
        """The copy on the host, once it has arrived."""
        if self._done is not None:
            self._done.synchronize()
        return self._host

    def result(self) -> list:
        """The copy as (nested) Python numbers."""
        return self.tensor().tolist()


class PinnedStaging:
    """Host <-> device copies of one kind of step work through pinned host buffers made once and used in turn.

    Each copy (:meth:`to_device`, :meth:`to_host`) takes the next of ``turns`` buffers (grown by doubling when a
    copy needs more), so a buffer is written again only ``turns`` copies later, once its last copy has read it (an
    event each; with two turns and a host that reads every step's results back, that copy is long done: no wait).
    On the CPU both are plain conversions (no buffer). One thread uses it (the engine's).

    Parameters
    ----------
    device : where the device side lives.
    dtype : the buffers' element type (int64: token ids, rows, flags).
    turns : buffers used in turn.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64, turns: int = 2):
        self.device, self.dtype = torch.device(device), dtype
        self.pinned = self.device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * turns
        self._events: list = [None] * turns
        self._turn = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` (any shape, cast to the staging's dtype) as a new device tensor, copied from this turn's
        pinned buffer in stream order, without waiting for the device."""
        if not self.pinned:
            return torch.as_tensor(array, dtype=self.dtype)
        host, event = self._take(array.size)
        host = host.view(array.shape)
        host.numpy()[...] = array
        out = host.to(self.device, non_blocking=True)
        event.record()
        return out

    def to_host(self, value: torch.Tensor) -> "HostCopy":
        """A :class:`HostCopy` of device tensor ``value`` into this turn's pinned buffer (started at once)."""
        if not self.pinned:   # (a copy: the device work queued after it may write ``value``, as on a GPU)
            return HostCopy(value.clone())
        host, event = self._take(value.numel())
        return HostCopy(value, into=host.view(value.shape), event=event)

    def _take(self, numel: int):
        """This turn's buffer (its first ``numel`` elements, once its last copy is done) and event; the turn
        advances. The caller records the event after its copy."""
        turn = self._turn
        self._turn = (turn + 1) % len(self._buffers)
        buffer, event = self._buffers[turn], self._events[turn]
        if event is None:
            event = self._events[turn] = torch.cuda.Event()
        else:
            event.synchronize()   # its last copy has read (or written) it
        if buffer is None or buffer.numel() < numel:
            # (a buffer outgrown goes back to torch's pinned cache, which keeps it until its copies are done)
            size = max(numel, 2 * (0 if buffer is None else buffer.numel()), 64)
            buffer = self._buffers[turn] = torch.empty(size, dtype=self.dtype, pin_memory=True)
        return buffer[:numel], event
