"""A span of KV whose visibility the device decides after the step is planned (pipelined speculative decoding).

A pipelined speculative loop plans and launches step n+1 before step n's accepted length reaches the host.
Step n's accepted K/V are moved on the device into ``d`` slots reserved at the end of the sequence; only the
first ``keep`` of them (the accepted length, a device value) may be read. The host plans the step as if all
``d`` were read, then :class:`DynamicSpans` (every request's span of the step, as arrays) patches the plan on
the device: the mask bits of the span's slots
``keep ..`` are cleared in every entry of the chunks that hold them, wherever the plan holds them (a
batch-invariant plan holds a slot once per copy of a window that reads it, and a window border may cut a span:
:class:`SpanPlaces`); the span's positions among the plan's ``dynamic_kv`` keep the cuda schedule from skipping the
mask words of those tiles, and the queries after the span move back by ``d - keep`` positions. Nothing waits for
the device, and the host work is a fixed number of array operations whatever the number of spans.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from treedec.attention.backends.base import Backend, SpanMasking, backend_names
from treedec.attention.planner_choice import planner_impl
from treedec.attention.tree_plan import MASK_BITS, TreePlan
from treedec.transfer import to_device

__all__ = ["DynamicSpans", "MaskPatch", "SpanPlaces", "located", "mask_on_device", "shift_positions"]


@dataclass(frozen=True)
class SpanPlaces:
    """Where a step's spans sit in a plan's flattened KV (:meth:`DynamicSpans.places`): every position holding a
    span's slot, ascending, ``position [n]``, with that slot's span ``span [n]`` and its index in the span ``slot
    [n]`` (all int64 numpy). A plan may hold a slot several times (a batch-invariant plan's copies of a window: one
    per query that reads only a prefix of it) or not at all (a span no query reads)."""

    position: np.ndarray
    span: np.ndarray
    slot: np.ndarray


@dataclass(frozen=True)
class DynamicSpans:
    """The spans of one step whose lengths only the device knows, as arrays (one span a request of a verify group:
    built, moved and patched with a fixed number of array operations whatever their number).

    Attributes
    ----------
    slots : [n] int64 (host): every span's pool slots, span by span; span ``i``'s ``lengths[i]`` slots are computed
        tokens at the end of one node, in order.
    lengths : [S] int64 (host): each span's slot count ``d`` (0: an empty span, nothing masked).
    keep : [S] int64 tensor on the engine's device: how many of each span's slots (a prefix) hold real tokens.
    shift_rows : [r] int64 (host): the step's query rows after a span (their positions move by ``keep - d``).
    shift_span : [r] int64 (host): the span of each of ``shift_rows``.
    """

    slots: np.ndarray
    lengths: np.ndarray
    keep: torch.Tensor
    shift_rows: np.ndarray
    shift_span: np.ndarray

    def __post_init__(self):
        if not isinstance(self.keep, torch.Tensor) or self.keep.dim() != 1 or len(self.keep) != len(self.lengths):
            raise TypeError(f"DynamicSpans.keep must be a [{len(self.lengths)}] tensor (one a span), got {self.keep!r}")
        if int(self.lengths.sum()) != len(self.slots) or len(self.shift_rows) != len(self.shift_span):
            raise ValueError(f"DynamicSpans: {len(self.slots)} slots for lengths summing to {int(self.lengths.sum())}, "
                             f"{len(self.shift_rows)} shift rows for {len(self.shift_span)} owners")

    @classmethod
    def unchecked(cls, slots: np.ndarray, lengths: np.ndarray, keep: torch.Tensor, shift_rows: np.ndarray,
                  shift_span: np.ndarray) -> DynamicSpans:
        """The spans of arrays their caller made consistent (the verify group's, and :meth:`with_rows`' of checked
        spans: every step), without the constructor's checks (a dozen Python calls a step)."""
        spans = object.__new__(cls)
        spans.__dict__.update(slots=slots, lengths=lengths, keep=keep, shift_rows=shift_rows, shift_span=shift_span)
        return spans

    @classmethod
    def one(cls, slots, keep: torch.Tensor, shift_rows) -> DynamicSpans:
        """One span: ``slots [d]``, ``keep`` a one-element tensor, ``shift_rows [r]``."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        rows = np.asarray(shift_rows, dtype=np.int64).reshape(-1)
        if not isinstance(keep, torch.Tensor) or keep.numel() != 1:
            raise TypeError(f"a span's keep must be a one-element tensor, got {keep!r}")
        return cls(slots, np.array([len(slots)], dtype=np.int64), keep.reshape(1), rows, np.zeros(len(rows), np.int64))

    @classmethod
    def of_rows(cls, slots: np.ndarray, keep: torch.Tensor) -> DynamicSpans:
        """``S`` spans of ``d`` slots each: ``slots [S, d]`` (host), ``keep [S]``; no shift rows yet
        (:meth:`with_rows`)."""
        slots = np.asarray(slots, dtype=np.int64)
        empty = np.zeros(0, dtype=np.int64)
        return cls(slots.reshape(-1), np.full(slots.shape[0], slots.shape[1], dtype=np.int64), keep.reshape(-1),
                   empty, empty)

    @classmethod
    def concat(cls, parts: Sequence[DynamicSpans]) -> DynamicSpans:
        """The spans of ``parts``, in order (one concatenation per column: a few parts a step, one a group)."""
        if len(parts) == 1:
            return parts[0]
        counts = np.array([p.num_spans for p in parts], dtype=np.int64)
        base = counts.cumsum() - counts
        return cls(np.concatenate([p.slots for p in parts]), np.concatenate([p.lengths for p in parts]),
                   torch.cat([p.keep for p in parts]), np.concatenate([p.shift_rows for p in parts]),
                   np.concatenate([p.shift_span + b for p, b in zip(parts, base.tolist())]))

    @classmethod
    def of(cls, dynamic) -> DynamicSpans | None:
        """``dynamic`` (None, DynamicSpans or a sequence of them) as one :class:`DynamicSpans` (None: none)."""
        if dynamic is None:
            return None
        if isinstance(dynamic, DynamicSpans):   # (every step's: the scheduler joined the requests' spans already)
            return dynamic if len(dynamic.lengths) else None
        parts = list(dynamic)
        for part in parts:
            if not isinstance(part, DynamicSpans):
                raise TypeError(f"dynamic must be DynamicSpans (or a sequence of them), got {type(part).__name__}")
        parts = [p for p in parts if p.num_spans]
        return cls.concat(parts) if parts else None

    @property
    def num_spans(self) -> int:
        return len(self.lengths)

    def with_rows(self, rows: np.ndarray) -> DynamicSpans:
        """These spans with the query rows ``rows [r]`` after them, split evenly among them in order (span ``i``
        before the ``i``-th ``r / S``)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n, r = len(self.lengths), len(rows)
        per = r // max(n, 1)
        if per * n != r:
            raise ValueError(f"{r} query rows do not split evenly among {n} spans")
        return DynamicSpans.unchecked(self.slots, self.lengths, self.keep, rows, np.arange(n).repeat(per))

    def rows_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(shift_rows, shift_span, lengths)`` on ``device``, copied once (spans read by several steps: a
        chain's)."""
        have = self.__dict__.get("_rows_on")
        if have is None or have[0].device != torch.device(device):
            n, r = self.num_spans, len(self.shift_rows)
            on = to_device(np.concatenate([self.shift_rows, self.shift_span, self.lengths]), device)   # one copy
            have = (on[:r], on[r:2 * r], on[2 * r:2 * r + n])
            object.__setattr__(self, "_rows_on", have)
        return have

    def places(self, plan: TreePlan) -> SpanPlaces:
        """The :class:`SpanPlaces` of these spans in ``plan``: every position of its flattened KV holding one of their
        slots. Raises ValueError when a span's slots are not one run of the tree's flattened order (the end of one
        node, in order: its ``keep`` then names a prefix of its tokens). Array operations over the layout's and the
        plan's KV and the spans, whatever their number (the compiled planner's ``span_places`` where it runs: one
        call)."""
        module = planner_impl().module
        if module is not None:
            return self.compiled_places(module, plan)[0]
        has = (self.lengths > 0).nonzero()[0]
        none = np.zeros(0, dtype=np.int64)
        if not len(has) or not plan.num_tokens:
            return SpanPlaces(none, none, none)
        self._check_runs(plan.layout.kv_slots, has)
        offsets = self.lengths.cumsum() - self.lengths
        owner = np.arange(self.num_spans).repeat(self.lengths)                     # each span slot's span
        which = np.full(int(max(plan.max_slot, self.slots.max())) + 1, -1, dtype=np.int64)
        which[self.slots] = np.arange(len(self.slots))                              # slot -> its index in slots
        found = which[plan.kv_slots]
        position = (found >= 0).nonzero()[0]
        index = found[position]
        span = owner[index]
        return SpanPlaces(position, span, index - offsets[span])

    def _check_runs(self, tokens: np.ndarray, has: np.ndarray) -> None:
        """ValueError unless each span of ``has`` (the non-empty ones) is one run of ``tokens`` (the layout's slots,
        each token once) where its first slot is, or absent from it (no such node: the plan holds none of it)."""
        offsets = self.lengths.cumsum() - self.lengths
        first = self.slots[offsets[has]]
        where = np.full(int(max(tokens.max(initial=0), first.max())) + 1, -1, dtype=np.int64)   # slot -> position
        where[tokens] = np.arange(len(tokens))
        at = where[first]
        found = at >= 0
        has, at = has[found], at[found]
        d = self.lengths[has]
        local = np.arange(int(d.sum())) - (d.cumsum() - d).repeat(d)
        position = at.repeat(d) + local
        inside = position < len(tokens)
        same = np.zeros(len(position), dtype=bool)
        same[inside] = tokens[position[inside]] == self.slots[offsets[has].repeat(d) + local][inside]
        if not same.all():
            raise self._not_a_run(int(has[np.arange(len(has)).repeat(d)[~same][0]]))

    def _not_a_run(self, bad: int) -> ValueError:
        """The error of span ``bad``, whose slots are not one run of the tree's flattened KV."""
        at = int(self.lengths[:bad].sum())
        got = self.slots[at:at + self.lengths[bad]]
        return ValueError(f"a dynamic span's {int(self.lengths[bad])} slots must be one run of the tree's "
                          f"flattened KV (the end of one node), got slots {got[:8].tolist()}")

    def compiled_places(self, module, plan: TreePlan) -> tuple[SpanPlaces, np.ndarray]:
        """:meth:`places` and the ``[P, 2]`` runs :meth:`locate` makes of them, from the compiled planner's
        ``module`` (:func:`~treedec.attention.planner_choice.planner_impl`): one call, where it runs."""
        position, span, slot, ranges, bad = module.span_places(plan.layout.kv_slots, plan.kv_slots, self.slots,
                                                               self.lengths)
        if bad >= 0:
            raise self._not_a_run(bad)
        return SpanPlaces(position, span, slot), ranges

    def locate(self, plan: TreePlan, places: SpanPlaces | None = None) -> TreePlan:
        """``plan`` with the spans' positions (:meth:`places`, or ``places`` found already) added to its ``dynamic_kv``
        ranges, as runs of consecutive positions, kept sorted (unchanged when no query reads any)."""
        places = self.places(plan) if places is None else places
        position = places.position
        if not len(position):
            return plan
        breaks = (position[1:] != position[:-1] + 1).nonzero()[0]
        ranges = np.empty((len(breaks) + 1, 2), dtype=np.int64)   # (start, stop) rows
        ranges[0, 0], ranges[1:, 0] = position[0], position[breaks + 1]
        ranges[:-1, 1], ranges[-1, 1] = position[breaks] + 1, position[-1] + 1
        return _with_ranges(plan, ranges)


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
    def of(cls, plan: TreePlan, spans: DynamicSpans, places: SpanPlaces, stride: int, device: torch.device
           ) -> MaskPatch | None:
        """The patch of ``spans`` at their ``places`` in ``plan``'s flattened KV (:meth:`DynamicSpans.places`) for an
        ``entry_mask`` whose rows are ``stride`` words apart (a static plan's rows are its bounds' width); None when
        the plan holds none of their slots. Array operations whatever the number of spans (the compiled planner's
        ``mask_patch`` where it runs: one call). A chunk holds a slot once, so each (mask word, slot) pair below is
        one bit of one place."""
        if not len(places.position):
            return None
        module = planner_impl().module
        if module is not None:
            flat, n, size, m = module.mask_patch(plan.chunk_kv_start, plan.chunk_entry_start, places.position,
                                                 places.span, places.slot, spans.lengths, stride)
            on = to_device(flat, device)   # one copy
            end = 4 * n + size
            merged = (on[end:end + m], on[end + m:]) if m else None
            return cls(on[:n], on[n:2 * n], on[2 * n:3 * n], on[3 * n:4 * n], on[4 * n:end].to(torch.int32), merged)
        ids, owner = _unique_inverse(places.span)                       # the placed spans, each place's among them
        lengths = spans.lengths[ids]
        count_spans = len(ids)
        slot, position = places.slot, places.position
        chunk = plan.chunk_kv_start.searchsorted(position, side="right") - 1
        offset = position - plan.chunk_kv_start[chunk]
        first, last = plan.chunk_entry_start[chunk], plan.chunk_entry_start[chunk + 1]
        count = last - first
        pair = np.arange(len(position)).repeat(count)                          # (entry, slot) pairs
        count_ends = count.cumsum()
        entry = (first - count_ends + count).repeat(count) + np.arange(count_ends[-1])
        word = entry * stride + offset[pair] // MASK_BITS
        base = int(word.max()) + 1
        keys, inverse = _unique_inverse(owner[pair] * base + word)
        words, span = keys % base, keys // base                                     # grouped by span, sorted
        u = np.bincount(span, minlength=count_spans)                                # each span's words
        begin = u.cumsum() - u
        d1 = lengths + 1
        rows_of = u * d1                                                            # each span's table rows
        table_ends = rows_of.cumsum()
        row0 = table_ends - rows_of                                                 # each span's table start
        at = row0[span] + (np.arange(len(words)) - begin[span])
        # cleared[k] of a word: the bits of its span's slots >= k (distinct bits: their sum is their or), a suffix
        # sum over the slots of each slot's bits, at table[at + k * width]
        bits = np.left_shift(1, offset[pair] % MASK_BITS).astype(np.int64)
        s_pair = slot[pair]
        size = int(table_ends[-1])
        own = np.bincount(at[inverse] + s_pair * u[span[inverse]], weights=bits, minlength=size)
        own = np.rint(own).astype(np.int64)   # (sums of distinct bits below 2**32: exact in float64)
        # The suffix sums of every word's column (its span's d1 rows) at once: the columns one after another, each
        # row by row, summed from the end of its column.
        column_rows = d1[span]                                                      # [words]: rows of each column
        col = np.arange(len(words)).repeat(column_rows)
        column_ends = column_rows.cumsum()
        r = np.arange(column_ends[-1]) - (column_ends - column_rows).repeat(column_rows)
        flat = at[col] + r * u[span[col]]
        values = own[flat]
        total = values.cumsum()
        column_end = column_ends - 1
        table = np.zeros(size, dtype=np.int64)
        table[flat] = total[column_end][col] - (total - values)
        table = (~table & 0xFFFFFFFF).astype(np.uint32).view(np.int32).astype(np.int64)
        width = u[span]   # (its span's word count: u is by placed span)
        span = ids[span]   # (each word's span among all of them: apply takes every span's keep)
        distinct, where = _unique_inverse(words)
        n, m = len(words), len(distinct) if len(distinct) < len(words) else 0
        on = to_device(np.concatenate([words, at, width, span, table, distinct[:m], where[:n if m else 0]]),
                       device)   # one copy
        end = 4 * n + len(table)
        merged = (on[end:end + m], on[end + m:]) if m else None
        return cls(on[:n], on[n:2 * n], on[2 * n:3 * n], on[3 * n:4 * n], on[4 * n:end].to(torch.int32), merged)

    def apply(self, entry_mask: torch.Tensor, keep: torch.Tensor) -> None:
        """Clear the bits of each span's slots ``keep ..`` (``keep``: every span's, ``[S]`` int64, as
        :attr:`DynamicSpans.keep`) in ``entry_mask`` (int32, rows ``stride`` apart), on its device, without
        waiting."""
        flat = entry_mask.view(-1)
        row = keep.index_select(0, self.span)
        kept = self.table.take(self.at + row * self.width)
        if self.merged is None:
            flat[self.words] = flat[self.words] & kept
            return
        words, where = self.merged   # the cleared bits of each word's spans, summed (or) as 32-bit values
        cleared = torch.zeros(len(words), dtype=torch.int64, device=flat.device).index_add_(
            0, where, (~kept).to(torch.int64) & 0xFFFFFFFF)
        cleared = torch.where(cleared >= 2 ** 31, cleared - 2 ** 32, cleared).to(torch.int32)
        flat[words] = flat[words] & ~cleared

    def apply_host(self, plan: TreePlan, keep: torch.Tensor) -> TreePlan:
        """``plan`` with the bits cleared in a copy of its (numpy) ``entry_mask``: for backends that read the host
        plan (:attr:`SpanMasking.HOST`); ``keep`` is read on the host (a wait on a GPU)."""
        mask = np.array(plan.entry_mask, copy=True)
        self.apply(torch.from_numpy(mask), keep.cpu())
        return dataclasses.replace(plan, entry_mask=mask)


def _unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of a 1-D int64 array, in a few array operations (np.unique's
    own Python costs about as much as the rest of a patch)."""
    order = values.argsort(kind="stable")
    ordered = values[order]
    new = np.empty(len(ordered), dtype=bool)
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    inverse = np.empty(len(values), dtype=np.int64)
    inverse[order] = new.cumsum() - 1
    return ordered[new], inverse


def _with_ranges(plan: TreePlan, ranges: np.ndarray) -> TreePlan:
    """``plan`` with the ``[P, 2]`` (start, stop) ``ranges`` added to its ``dynamic_kv`` ranges, sorted by start
    (stable: ties keep the plan's first)."""
    if len(plan.dynamic_kv):
        ranges = np.concatenate([np.asarray(plan.dynamic_kv, dtype=np.int64).reshape(-1, 2), ranges])
    return plan.with_dynamic_kv(ranges[ranges[:, 0].argsort(kind="stable")])


def located(plan: TreePlan, spans: DynamicSpans | None, backend: Backend) -> tuple[TreePlan, SpanPlaces | None]:
    """``plan`` with the ``spans``' positions added to its ``dynamic_kv`` (as :meth:`DynamicSpans.locate` does), and
    their places (:meth:`DynamicSpans.places`, found once); ``(plan, None)`` without spans.

    ``backend``: the step's, by its :attr:`~Backend.span_masking`. One that reads the host plan
    (:attr:`SpanMasking.HOST`, ``torch``) gets it masked there too (reading ``keep``: a wait on a GPU); one that
    reads the device plan (:attr:`SpanMasking.DEVICE`) is masked by :func:`mask_on_device` after the copy. One
    that attends by the layout (:attr:`SpanMasking.UNSUPPORTED`, ``reference``): ValueError."""
    if spans is None:
        return plan, None
    if not isinstance(spans, DynamicSpans):
        raise TypeError(f"dynamic must be DynamicSpans, got {type(spans).__name__}")
    if backend.span_masking is SpanMasking.UNSUPPORTED:
        able = backend_names(lambda b: b.span_masking is not SpanMasking.UNSUPPORTED)
        raise ValueError(f"the {backend.name} backend plans from the layout: a step with a dynamic span needs the "
                         f"{', '.join(able[:-1])} or {able[-1]} backend")
    module = planner_impl().module
    if module is not None:   # (the places and their runs in one call)
        places, ranges = spans.compiled_places(module, plan)
        if len(ranges):
            plan = plan.with_dynamic_kv(ranges) if not len(plan.dynamic_kv) else _with_ranges(plan, ranges)
    else:
        places = spans.places(plan)
        plan = spans.locate(plan, places)
    if backend.span_masking is SpanMasking.HOST:
        patch = MaskPatch.of(plan, spans, places, plan.mask_words, torch.device("cpu"))
        if patch is not None:
            plan = patch.apply_host(plan, spans.keep)
    return plan, places


def mask_on_device(plan: TreePlan, entry_mask: torch.Tensor, spans: DynamicSpans | None,
                   places: SpanPlaces | None) -> None:
    """Clear the unused slots' bits of the spans (at their ``places``, as :func:`located` found them) in
    ``entry_mask``, the device copy of ``plan``'s (a static plan's rows are wider: its stride is used), with one
    :class:`MaskPatch` for all of them, stream-ordered after the plan's copy."""
    if spans is None:
        return
    patch = MaskPatch.of(plan, spans, places, entry_mask.stride(0), entry_mask.device)
    if patch is not None:
        patch.apply(entry_mask, spans.keep)


def shift_positions(positions: torch.Tensor, spans: DynamicSpans | None) -> None:
    """Move the positions of the queries after each of ``spans`` back by its unused slots (``positions``: the step's,
    on the device): one copy of the rows (once per spans) and one add for all the spans, whatever their number."""
    if spans is None or not len(spans.shift_rows):
        return
    rows, owner, lengths = spans.rows_on(positions.device)
    by = (spans.keep - lengths).to(positions.dtype)
    positions.index_add_(0, rows, by.index_select(0, owner))
