"""A span of KV whose visibility the device decides after the step is planned (pipelined speculative decoding).

A pipelined speculative loop plans and launches step n+1 before step n's accepted length reaches the host.
Step n's accepted K/V are moved on the device into ``d`` slots reserved at the end of the sequence; only the
first ``keep`` of them (the accepted length, a device value) may be read. The host plans the step as if all
``d`` were read, then :class:`DynamicSpan` patches the plan on the device: the mask bits of the span's slots
``keep ..`` are cleared in every entry of the chunks that hold them (the span's range among the plan's
``dynamic_kv`` keeps the cuda schedule from skipping the mask words of those tiles), and the queries after the
span move back by ``d - keep`` positions. Nothing waits for the device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from treedec.attention.tree_plan import MASK_BITS, TreePlan
from treedec.transfer import to_device

__all__ = ["DynamicSpan", "MaskPatch", "located", "mask_on_device", "shift_positions"]


@dataclass(frozen=True)
class DynamicSpan:
    """What a step's caller knows of a span before its length is known on the host.

    Attributes
    ----------
    slots : [d] int64 (host): pool slots of ``d`` computed tokens at the end of one node, in order.
    keep : int64 tensor of one element on the engine's device: how many of them (a prefix) hold real tokens.
    shift_rows : [r] int64 (host): the step's query rows after the span (their positions move by ``keep - d``).
    """

    slots: np.ndarray
    keep: torch.Tensor
    shift_rows: np.ndarray

    def __post_init__(self):
        slots = np.asarray(self.slots, dtype=np.int64).reshape(-1)
        rows = np.asarray(self.shift_rows, dtype=np.int64).reshape(-1)
        if not isinstance(self.keep, torch.Tensor) or self.keep.numel() != 1:
            raise TypeError(f"DynamicSpan.keep must be a one-element tensor, got {self.keep!r}")
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "shift_rows", rows)

    def rows_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`shift_rows` on ``device``, copied once (a span read by several steps: a chain's)."""
        have = self.__dict__.get("_rows_on")
        if have is None or have.device != torch.device(device):
            have = to_device(self.shift_rows, device)
            object.__setattr__(self, "_rows_on", have)
        return have

    def kv_range(self, plan: TreePlan) -> tuple[int, int] | None:
        """``(start, stop)``: where the span lies in ``plan``'s flattened KV (None when it is empty or no query
        reads it). Raises ValueError when the slots are not one run of the flattened order."""
        d = len(self.slots)
        if d == 0:
            return None
        hits = np.flatnonzero(plan.kv_slots == self.slots[0])
        if len(hits) == 0:
            return None
        start = int(hits[0])
        if not np.array_equal(plan.kv_slots[start:start + d], self.slots):
            raise ValueError(f"a dynamic span's {d} slots must be one run of the plan's flattened KV (the end of "
                             f"one node), got slots {self.slots[:8].tolist()}")
        return start, start + d

    def locate(self, plan: TreePlan) -> TreePlan:
        """``plan`` with the span's :meth:`kv_range` added to its ``dynamic_kv`` ranges, kept sorted (unchanged
        when no query reads it). Raises ValueError when the slots are not one run of the flattened order."""
        where = self.kv_range(plan)
        if where is None:
            return plan
        return dataclasses.replace(plan, dynamic_kv=tuple(sorted(plan.dynamic_kv + (where,))))


@dataclass(frozen=True)
class MaskPatch:
    """The mask words a span touches in a plan's ``entry_mask`` and, for every possible ``keep``, the bits each of
    them keeps (all but those of the span's slots ``keep ..``): applying it is a gather, an and and a scatter on
    the device, and patches of several spans compose (each only clears bits)."""

    words: torch.Tensor    # [u] int64: distinct flat word indices (entry * stride + word)
    table: torch.Tensor    # [d + 1, u] int32: row k, each word's bits kept when the span's first k slots are real

    @classmethod
    def of(cls, plan: TreePlan, start: int, stop: int, stride: int, device: torch.device) -> MaskPatch | None:
        """The patch of a span at ``[start, stop)`` in ``plan``'s flattened KV (:meth:`DynamicSpan.kv_range`) for
        an ``entry_mask`` whose rows are ``stride`` words apart (a static plan's rows are its bounds' width); None
        when the span is empty."""
        if start == stop:
            return None
        d = stop - start
        position = np.arange(start, stop, dtype=np.int64)
        chunk = np.searchsorted(plan.chunk_kv_start, position, side="right") - 1
        offset = position - plan.chunk_kv_start[chunk]
        first, last = plan.chunk_entry_start[chunk], plan.chunk_entry_start[chunk + 1]
        count = last - first
        pair_slot = np.repeat(np.arange(d), count)
        entry = np.repeat(first - np.cumsum(count) + count, count) + np.arange(count.sum())
        words, inverse = np.unique(entry * stride + offset[pair_slot] // MASK_BITS, return_inverse=True)
        bits = np.left_shift(1, offset[pair_slot] % MASK_BITS).astype(np.int64)
        # clear[k, w]: the bits in word w of the span's slots >= k (distinct bits: their sum is their or, exact in
        # float64), a suffix sum over the slots of each slot's bits
        u = len(words)
        own = np.bincount(pair_slot * u + inverse, weights=bits, minlength=d * u).astype(np.int64).reshape(d, u)
        clear = np.zeros((d + 1, u), dtype=np.int64)
        clear[:d] = np.cumsum(own[::-1], axis=0)[::-1]
        table = (~clear & 0xFFFFFFFF).astype(np.uint32).view(np.int32).astype(np.int64)
        on = to_device(np.concatenate([words, table.reshape(-1)]), device)   # one copy
        return cls(on[:len(words)], on[len(words):].reshape(d + 1, len(words)).to(torch.int32))

    def apply(self, entry_mask: torch.Tensor, keep: torch.Tensor) -> None:
        """Clear the bits of the span's slots ``keep ..`` in ``entry_mask`` (int32, rows ``stride`` apart), on its
        device, without waiting."""
        flat = entry_mask.view(-1)
        flat[self.words] = flat[self.words] & self.table.index_select(0, keep.reshape(1).to(torch.int64))[0]

    def apply_host(self, plan: TreePlan, keep: int) -> TreePlan:
        """``plan`` with the bits cleared in a copy of its (numpy) ``entry_mask``: for backends that read the host
        plan (``torch``); ``keep`` must be on the host already."""
        mask = np.array(plan.entry_mask, copy=True)
        self.apply(torch.from_numpy(mask), torch.tensor(keep))
        return dataclasses.replace(plan, entry_mask=mask)


def located(plan: TreePlan, spans: tuple[DynamicSpan, ...], backend: str
            ) -> tuple[TreePlan, list[tuple[int, int] | None]]:
    """``plan`` with the ``spans``' ranges added to its ``dynamic_kv`` (as :meth:`DynamicSpan.locate` does), and
    each span's range (:meth:`DynamicSpan.kv_range`, found once: a scan of the flattened KV); for the ``torch``
    backend, which reads the host plan, also masked there (reading ``keep``: a wait on a GPU). The ``reference``
    backend plans from the layout: ValueError."""
    for span in spans:
        if not isinstance(span, DynamicSpan):
            raise TypeError(f"dynamic must be a DynamicSpan, got {type(span).__name__}")
    if spans and backend == "reference":
        raise ValueError("the reference backend plans from the layout: a step with a dynamic span needs the torch, "
                         "triton or cuda backend")
    ranges = [span.kv_range(plan) for span in spans]
    found = tuple(r for r in ranges if r is not None)
    if found:
        plan = dataclasses.replace(plan, dynamic_kv=tuple(sorted(plan.dynamic_kv + found)))
    for span, where in zip(spans, ranges) if backend == "torch" else ():
        patch = None if where is None else MaskPatch.of(plan, *where, plan.mask_words, torch.device("cpu"))
        if patch is not None:
            plan = patch.apply_host(plan, int(span.keep))
    return plan, ranges


def mask_on_device(plan: TreePlan, entry_mask: torch.Tensor, spans: tuple[DynamicSpan, ...],
                   ranges: list[tuple[int, int] | None]) -> None:
    """Clear the unused slots' bits of each span (at its range, as :func:`located` found it) in ``entry_mask``, the
    device copy of ``plan``'s (a static plan's rows are wider: its stride is used), stream-ordered after the
    plan's copy."""
    for span, where in zip(spans, ranges):
        patch = None if where is None else MaskPatch.of(plan, *where, entry_mask.stride(0), entry_mask.device)
        if patch is not None:
            patch.apply(entry_mask, span.keep)


def shift_positions(positions: torch.Tensor, span: DynamicSpan) -> None:
    """Move the positions of the queries after ``span`` back by its unused slots (``positions``: the step's, on the
    device)."""
    if len(span.shift_rows):
        rows = span.rows_on(positions.device)
        by = (span.keep.reshape(1) - len(span.slots)).to(positions.dtype)
        positions.index_add_(0, rows, by.expand(len(rows)))
