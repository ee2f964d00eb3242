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

from treedec.attention.backends.base import Backend, SpanMasking, backend_names
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
        if self.keep.dim() != 1:
            object.__setattr__(self, "keep", self.keep.reshape(1))
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
    """The mask words some spans touch in a plan's ``entry_mask`` and, for every possible ``keep`` of each span,
    the bits each of its words keeps (all but those of its slots ``keep ..``). Applying it for all the spans is a
    handful of device operations (a gather of each word's row by its span's keep, an and, a scatter); where
    spans share words, their cleared bits (distinct slots: distinct bits) are summed per word first."""

    words: torch.Tensor    # [u] int64: flat word indices (entry * stride + word), distinct within a span
    at: torch.Tensor       # [u] int64: each word's row 0 in table (table[at + keep * width] its kept bits)
    width: torch.Tensor    # [u] int64: its span's word count (the stride of its rows in table)
    span: torch.Tensor     # [u] int64: its span's index
    table: torch.Tensor    # [sum over spans of (d + 1) * words] int32, span by span, row k by row k
    merged: tuple[torch.Tensor, torch.Tensor] | None   # words in two spans: (distinct words, each word's index)

    @classmethod
    def of(cls, plan: TreePlan, ranges: list[tuple[int, int]], stride: int, device: torch.device
           ) -> MaskPatch | None:
        """The patch of spans at ``ranges`` (each ``[start, stop)`` in ``plan``'s flattened KV,
        :meth:`DynamicSpan.kv_range`) for an ``entry_mask`` whose rows are ``stride`` words apart (a static plan's
        rows are its bounds' width); None when every span is empty."""
        lengths = np.array([b - a for a, b in ranges], dtype=np.int64)
        if not lengths.sum():
            return None
        starts = np.array([a for a, _ in ranges], dtype=np.int64)
        owner = np.repeat(np.arange(len(ranges)), lengths)                         # each span slot's span
        slot = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        position = starts[owner] + slot
        chunk = np.searchsorted(plan.chunk_kv_start, position, side="right") - 1
        offset = position - plan.chunk_kv_start[chunk]
        first, last = plan.chunk_entry_start[chunk], plan.chunk_entry_start[chunk + 1]
        count = last - first
        pair = np.repeat(np.arange(len(position)), count)                          # (entry, slot) pairs
        entry = np.repeat(first - np.cumsum(count) + count, count) + np.arange(count.sum())
        word = entry * stride + offset[pair] // MASK_BITS
        keys, inverse = np.unique(owner[pair] * (int(word.max()) + 1) + word, return_inverse=True)
        words, span = keys % (int(word.max()) + 1), keys // (int(word.max()) + 1)   # grouped by span, sorted
        u = np.bincount(span, minlength=len(ranges))                                # each span's words
        begin = np.cumsum(u) - u
        d1 = lengths + 1
        row0 = np.cumsum(u * d1) - u * d1                                           # each span's table start
        at = row0[span] + (np.arange(len(words)) - begin[span])
        # cleared[k] of a word: the bits of its span's slots >= k (distinct bits: their sum is their or), a suffix
        # sum over the slots of each slot's bits, at table[at + k * width]
        bits = np.left_shift(1, offset[pair] % MASK_BITS).astype(np.float64)
        s_pair = slot[pair]
        own = np.bincount(at[inverse] + s_pair * u[span[inverse]], weights=bits, minlength=int((u * d1).sum()))
        table = np.zeros(int((u * d1).sum()), dtype=np.int64)
        for k in range(len(ranges)):   # per span: the suffix sum over its rows
            if u[k]:
                rows = own[row0[k]:row0[k] + u[k] * d1[k]].reshape(d1[k], u[k])
                table[row0[k]:row0[k] + u[k] * d1[k]] = np.cumsum(rows[::-1], axis=0)[::-1].reshape(-1)
        table = (~table & 0xFFFFFFFF).astype(np.uint32).view(np.int32).astype(np.int64)
        distinct, where = np.unique(words, return_inverse=True)
        n, m = len(words), len(distinct) if len(distinct) < len(words) else 0
        on = to_device(np.concatenate([words, at, u[span], span, table, distinct[:m], where[:n if m else 0]]),
                       device)   # one copy
        end = 4 * n + len(table)
        merged = (on[end:end + m], on[end + m:]) if m else None
        return cls(on[:n], on[n:2 * n], on[2 * n:3 * n], on[3 * n:4 * n], on[4 * n:end].to(torch.int32), merged)

    def apply(self, entry_mask: torch.Tensor, keeps: list[torch.Tensor]) -> None:
        """Clear the bits of each span's slots ``keep ..`` (``keeps``: one one-element int64 tensor a span, in the
        ranges' order) in ``entry_mask`` (int32, rows ``stride`` apart), on its device, without waiting."""
        flat = entry_mask.view(-1)
        keep = keeps[0].reshape(1) if len(keeps) == 1 else torch.cat(keeps)   # (each [1]: DynamicSpan.keep)
        row = keep if len(keeps) == 1 else keep.index_select(0, self.span)
        kept = self.table.take(self.at + row * self.width)
        if self.merged is None:
            flat[self.words] = flat[self.words] & kept
            return
        words, where = self.merged   # the cleared bits of each word's spans, summed (or) as 32-bit values
        cleared = torch.zeros(len(words), dtype=torch.int64, device=flat.device).index_add_(
            0, where, (~kept).to(torch.int64) & 0xFFFFFFFF)
        cleared = torch.where(cleared >= 2 ** 31, cleared - 2 ** 32, cleared).to(torch.int32)
        flat[words] = flat[words] & ~cleared

    def apply_host(self, plan: TreePlan, keeps: list[int]) -> TreePlan:
        """``plan`` with the bits cleared in a copy of its (numpy) ``entry_mask``: for backends that read the host
        plan (:attr:`SpanMasking.HOST`); ``keeps`` must be on the host already."""
        mask = np.array(plan.entry_mask, copy=True)
        self.apply(torch.from_numpy(mask), [torch.tensor([k]) for k in keeps])
        return dataclasses.replace(plan, entry_mask=mask)


def located(plan: TreePlan, spans: tuple[DynamicSpan, ...], backend: Backend
            ) -> tuple[TreePlan, list[tuple[int, int] | None]]:
    """``plan`` with the ``spans``' ranges added to its ``dynamic_kv`` (as :meth:`DynamicSpan.locate` does), and
    each span's range (:meth:`DynamicSpan.kv_range`, found once: a scan of the flattened KV).

    ``backend``: the step's, by its :attr:`~Backend.span_masking`. One that reads the host plan
    (:attr:`SpanMasking.HOST`, ``torch``) gets it masked there too (reading ``keep``: a wait on a GPU); one that
    reads the device plan (:attr:`SpanMasking.DEVICE`) is masked by :func:`mask_on_device` after the copy. One
    that attends by the layout (:attr:`SpanMasking.UNSUPPORTED`, ``reference``): ValueError."""
    for span in spans:
        if not isinstance(span, DynamicSpan):
            raise TypeError(f"dynamic must be a DynamicSpan, got {type(span).__name__}")
    if spans and backend.span_masking is SpanMasking.UNSUPPORTED:
        able = backend_names(lambda b: b.span_masking is not SpanMasking.UNSUPPORTED)
        raise ValueError(f"the {backend.name} backend plans from the layout: a step with a dynamic span needs the "
                         f"{', '.join(able[:-1])} or {able[-1]} backend")
    ranges = [span.kv_range(plan) for span in spans]
    found = tuple(r for r in ranges if r is not None)
    if found:
        plan = dataclasses.replace(plan, dynamic_kv=tuple(sorted(plan.dynamic_kv + found)))
    if backend.span_masking is SpanMasking.HOST and found:
        placed = [(span, where) for span, where in zip(spans, ranges) if where is not None]
        patch = MaskPatch.of(plan, [w for _, w in placed], plan.mask_words, torch.device("cpu"))
        if patch is not None:
            plan = patch.apply_host(plan, [int(span.keep) for span, _ in placed])
    return plan, ranges


def mask_on_device(plan: TreePlan, entry_mask: torch.Tensor, spans: tuple[DynamicSpan, ...],
                   ranges: list[tuple[int, int] | None]) -> None:
    """Clear the unused slots' bits of the spans (at their ranges, as :func:`located` found them) in
    ``entry_mask``, the device copy of ``plan``'s (a static plan's rows are wider: its stride is used), with one
    :class:`MaskPatch` for all of them, stream-ordered after the plan's copy."""
    placed = [(span, where) for span, where in zip(spans, ranges) if where is not None]
    patch = MaskPatch.of(plan, [w for _, w in placed], entry_mask.stride(0), entry_mask.device) if placed else None
    if patch is not None:
        patch.apply(entry_mask, [span.keep for span, _ in placed])


def shift_positions(positions: torch.Tensor, spans: tuple[DynamicSpan, ...]) -> None:
    """Move the positions of the queries after each of ``spans`` back by its unused slots (``positions``: the step's,
    on the device): one copy of the rows and one add for all the spans, whatever their number."""
    moving = [span for span in spans if len(span.shift_rows)]
    if not moving:
        return
    if len(moving) == 1:
        span = moving[0]
        rows = span.rows_on(positions.device)
        by = (span.keep - len(span.slots)).to(positions.dtype)
        positions.index_add_(0, rows, by.expand(len(rows)))
        return
    counts = np.array([len(span.shift_rows) for span in moving], dtype=np.int64)
    host = np.concatenate([span.shift_rows for span in moving] + [np.repeat(np.arange(len(moving)), counts),
                                                                    [len(span.slots) for span in moving]])
    on = to_device(host.astype(np.int64), positions.device)   # one copy: the rows, each row's span, the lengths
    n = int(counts.sum())
    rows, owner, lengths = on[:n], on[n:2 * n], on[2 * n:]
    by = (torch.cat([span.keep for span in moving]) - lengths).to(positions.dtype)
    positions.index_add_(0, rows, by.take(owner))
