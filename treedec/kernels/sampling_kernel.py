"""The batched sampler's warp and draw without a sort: temperature, top-k, top-p, min-p and an inverse-CDF draw
in a fixed sequence of Triton launches, each row split over several programs, no [L, V] intermediate, no host
sync.

Every cut of the reference (:func:`treedec.sampling.sampler.warp`, transformers' order) keeps the tokens whose
scaled logit ``s = x / T`` is at least some threshold, so a row's kept set is ``s >= t`` (top-k then top-p) and
``exp(s - max) >= min_p`` (min-p: ``p >= min_p * p_max``):

1. the row's max, min and whether it holds a NaN; when a row cuts by top-k or top-p, the count and mass
   ``sum exp(s' - max)`` of the elements at or above 16 fixed distances below the max (the lowest: the row's
   min, so the row's mass ``Z``), the first search's starting bracket;
2. top-k: ``t_k`` = the k-th largest ``s`` (ties kept, as the reference), by an exact search over the
   order-preserving int32 pattern of ``s``: each pass counts the elements at or above 16 candidate patterns at
   once (a 16-ary search: at most 8 passes for 32 bits);
3. top-p: ``t_p`` = the largest ``s`` whose mass ``sum exp(s' - max) over s' >= s`` reaches ``top_p`` times the
   mass of the top-k survivors (the reference renormalizes over them), by the same search on masses;
4. the draw: the first kept token in vocabulary order whose running kept mass passes ``u * kept`` (``u`` the
   row's uniform number), as :func:`~treedec.sampling.draw.inverse_cdf`.

A row is cut into ``S`` splits of :data:`SPLIT` elements, ``S`` a function of ``V`` alone (:func:`split_layout`),
so a row's result does not depend on the rows beside it. Each pass over the rows is one launch of an ``(L, S)``
grid whose programs write their split's partials (max and min; counts and masses at the 16 candidates; kept
mass) into a workspace; the next launch's programs each reduce their row's ``S`` partials in one fixed order
(deterministic, no atomics), so all of a row's programs narrow its bracket alike (its split 0 writes the row's
state). The launch sequence is fixed by the host flags (which cuts some row makes), never by the data
(:func:`search_passes`): a first search narrows its bracket by the fixed distances, then at most 8 times (to a
16th of it each time: 16 ** 8 = 2 ** 32 patterns), top-p starts in the launch where top-k resolves and narrows at
most 8 times, and a row whose search has resolved does no work in the passes left: a call is CUDA-graph capturable.
The draw is one program per row: the first split whose running kept mass (the splits' partials summed in order)
passes ``u * kept``, then the first kept token in it whose running mass does.

Semantics are the reference's except (a) the order of float additions (float32 sums within a split, then over
the splits in a fixed order; a search's mass at a candidate is the mass above its bracket plus the bracket's
partials; float64 in the reference's draw) and (b) ties at the top-p boundary: every token whose ``s`` equals
``t_p`` is kept (the reference keeps a tied group only as far as its sort order reaches the mass), and with a
tiny top-p every token tied with the max is kept (the reference keeps one). A token of zero weight or outside
the kept set is never drawn (when rounding leaves no token past ``u * kept``: the last kept one of the split
found, or of the row); a row with a NaN, or with every logit ``-inf``, draws ``V - 1`` (the reference's NaN draw).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["MAX_SPLITS", "SEARCH_PASSES", "SPLIT", "FusedDraw", "SplitLayout", "fused_warp_draw", "search_passes",
           "split_layout"]

#: elements of a row one program reads (a row of more than MAX_SPLITS * SPLIT: longer splits)
SPLIT = 4096
#: the most programs a row is split over
MAX_SPLITS = 64
#: the passes a 16-ary search over 32-bit patterns needs to resolve any bracket (16 ** 8 = 2 ** 32)
SEARCH_PASSES = 8
#: elements a program reads per loop iteration (fewer for a shorter split)
BLOCK = 1024
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
# a row's phase: greedy (token 0, the caller's argmax), broken (a NaN or no finite logit: token V - 1), searching
# for t_k or t_p, done (its threshold found); a row draws when its phase is at least _TOP_K
_GREEDY = tl.constexpr(0)
_BROKEN = tl.constexpr(1)
_TOP_K = tl.constexpr(2)
_TOP_P = tl.constexpr(3)
_DONE = tl.constexpr(4)
# a row's state: int32 phase, bracket [lo, hi] (keys), counts at lo and above hi; float32 masses at lo and above
# hi, the top-p search's target mass, the row's max
_INTS = tl.constexpr(5)
_FLOATS = tl.constexpr(4)


@dataclass(frozen=True)
class FusedDraw:
    """What :func:`fused_warp_draw` gives, one entry per row.

    Attributes
    ----------
    tokens : [L] int64, the drawn ids in ``[0, V)`` (0 for a row of temperature 0: the caller's argmax).
    threshold : [L] float32, the cut on the scaled logits: a token is kept iff ``s >= threshold`` and
        ``exp(s - row_max) >= min_p`` (``-inf`` or the row's min when no top-k / top-p cut).
    row_max : [L] float32, the row's largest ``s`` (NaN for a row with a NaN or of temperature 0).
    """

    tokens: torch.Tensor
    threshold: torch.Tensor
    row_max: torch.Tensor


@dataclass(frozen=True)
class SplitLayout:
    """How a row of ``V`` elements is cut: ``splits`` programs of ``length`` elements (the last one shorter),
    each read ``block`` elements at a time; ``padded`` is ``splits`` rounded up to a power of two (the width of
    the vector a program reduces the partials in)."""

    splits: int
    length: int
    block: int
    padded: int


def split_layout(vocab: int, split: int = SPLIT) -> SplitLayout:
    """The split of a row of ``vocab`` elements into programs of ``split`` elements (at most :data:`MAX_SPLITS`
    of them, longer for a longer row; one for a row no longer than ``split``). A function of ``vocab`` and
    ``split`` alone: never of the number of rows (batch invariance)."""
    if vocab < 1 or split < 1:
        raise ValueError(f"vocab and split must be >= 1, got vocab={vocab}, split={split}")
    length = max(split, -(-vocab // MAX_SPLITS))
    splits = -(-vocab // length)
    block = min(BLOCK, triton.next_power_of_2(max(min(length, vocab), 16)))
    return SplitLayout(splits=splits, length=length, block=block, padded=triton.next_power_of_2(splits))


def search_passes(top_k_cut: bool, top_p_cut: bool) -> int:
    """The launches of :func:`fused_warp_draw`'s pass kernel, whatever the data: the first (the rows' states;
    when a search is asked for, the counts at the fixed distances), then when one is, the fixed distances'
    narrowing and :data:`SEARCH_PASSES` more for each search asked (top-k, top-p): 1, 10 or 18. The last one
    narrows for the last time and sums the kept masses."""
    searches = int(top_k_cut) + int(top_p_cut)
    return 1 + (1 + SEARCH_PASSES * searches if searches else 0)


@triton.jit
def _scores(ptr, offs, mask, temperature):
    """The reference's scaled logits: ``x / T`` in float32, correctly rounded, saturated at float32's largest
    (a NaN stays NaN); masked lanes are -inf."""
    x = tl.load(ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, temperature)
    return tl.where(s > _FLOAT32_MAX, _FLOAT32_MAX, s)


@triton.jit
def _key(s):
    """The order-preserving int32 pattern of float32 ``s`` (-0 taken as +0, so keys compare as the floats do)."""
    bits = tl.where(s == 0, 0.0, s).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _value(key):
    """The float32 of an order-preserving pattern (:func:`_key`'s inverse)."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _stats_kernel(x_ptr, stride_x, n, split_len, num_splits, temperature_ptr, stride_temperature, stats_ptr,
                  BLOCK: tl.constexpr):
    """Each split's max and min of ``s`` (its max NaN when it holds a NaN): ``stats[row, split, 0:2]``."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row * stride_temperature)
    top = tl.full([], float("-inf"), tl.float32)
    bottom = tl.full([], float("inf"), tl.float32)
    if temperature > 0:
        ptr = x_ptr + row * stride_x
        end = tl.minimum(split * split_len + split_len, n)
        hi = tl.full([BLOCK], float("-inf"), tl.float32)
        lo = tl.full([BLOCK], float("inf"), tl.float32)
        nan = tl.zeros([BLOCK], tl.int32)
        for start in range(split * split_len, end, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < end
            s = _scores(ptr, offs, mask, temperature)
            nan = nan | (s != s).to(tl.int32)
            hi = tl.maximum(hi, tl.where(s != s, float("-inf"), s))
            lo = tl.minimum(lo, tl.where(mask & (s == s), s, float("inf")))
        top = tl.max(hi, axis=0)
        bottom = tl.min(lo, axis=0)
        if tl.max(nan, axis=0) != 0:
            top = tl.full([], float("nan"), tl.float32)
    slot = stats_ptr + (row * num_splits + split) * 2
    tl.store(slot, top)
    tl.store(slot + 1, bottom)


@triton.jit
def _start(stats_ptr, row, num_splits, n, temperature, k, top_p, SPLITS: tl.constexpr):
    """A row's phase, bracket ``[key(min), key(max)]`` and max from its splits' stats."""
    phase = tl.full([], _GREEDY, tl.int32)
    lo = tl.zeros([], tl.int64)
    hi = tl.zeros([], tl.int64)
    row_max = tl.full([], float("nan"), tl.float32)
    if temperature > 0:
        j = tl.arange(0, SPLITS)
        slot = stats_ptr + (row * num_splits + j) * 2
        tops = tl.load(slot, mask=j < num_splits, other=float("-inf"))
        bottoms = tl.load(slot + 1, mask=j < num_splits, other=float("inf"))
        phase = tl.full([], _BROKEN, tl.int32)
        if tl.max((tops != tops).to(tl.int32), axis=0) == 0:
            row_max = tl.max(tops, axis=0)
            if row_max > float("-inf"):
                lo = _key(tl.min(bottoms, axis=0)).to(tl.int64)
                hi = _key(row_max).to(tl.int64)
                phase = tl.where((k > 0) & (k < n), _TOP_K, tl.where(top_p < 1, _TOP_P, _DONE)).to(tl.int32)
    return phase, lo, hi, row_max


@triton.jit
def _candidates(lo, hi, row_max, grid):
    """The 16 increasing candidate keys a pass counts in ``[lo, hi]`` and which are in it: fixed distances below
    the max (finer near it; the lowest the row's min, ``lo``) on the first pass (``grid``), else ``lo`` plus
    multiples of a 16th of the bracket."""
    j = tl.arange(0, 16)
    fixed = _key(row_max - 0.15 * ((16 - j) * (16 - j)).to(tl.float32)).to(tl.int64)
    fixed = tl.where(j == 0, lo, tl.maximum(fixed, lo))
    spread = lo + (j + 1).to(tl.int64) * ((hi - lo) // 16 + 1)
    cand = tl.where(grid, fixed, spread)
    return cand, grid | (cand <= hi)


@triton.jit
def _count(ptr, begin, end, temperature, row_max, keys, lo, hi, BLOCK: tl.constexpr):
    """Count and mass of the split's elements with key in ``[keys[j], hi]`` (``keys`` within ``[lo, hi]``); a
    block with no element in the bracket costs its load only."""
    cnt = tl.zeros([16], tl.int32)
    mass = tl.zeros([16], tl.float32)
    for start in range(begin, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < end
        s = _scores(ptr, offs, mask, temperature)
        key = _key(s)
        inside = mask & (key >= lo) & (key <= hi)
        if tl.max(inside.to(tl.int32), axis=0) != 0:
            w = tl.exp(s - row_max)
            ge = (key[:, None] >= keys[None, :]) & inside[:, None]
            cnt += tl.sum(ge.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(ge, w[:, None], 0.0), axis=0)
    return cnt, mass


@triton.jit
def _narrow(lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi, cand, valid, cnt, mass, ok):
    """The bracket ``[lo, hi]`` narrowed by increasing candidate keys ``cand`` (``valid`` ones within it), their
    counts and masses, and which pass the test (``ok``: a prefix, the test being monotone)."""
    taken = tl.sum(ok.to(tl.int32), axis=0)
    last_ok = tl.arange(0, 16) == taken - 1   # (one-hot selections: a vector has no scalar indexing)
    first_failed = tl.arange(0, 16) == taken
    if taken > 0:
        lo = tl.sum(tl.where(last_ok, cand, 0), axis=0)
        cnt_lo = tl.sum(tl.where(last_ok, cnt, 0), axis=0)
        mass_lo = tl.sum(tl.where(last_ok, mass, 0.0), axis=0)
    if tl.max((first_failed & valid).to(tl.int32), axis=0) != 0:
        hi = tl.sum(tl.where(first_failed, cand, 0), axis=0) - 1
        cnt_hi = tl.sum(tl.where(first_failed, cnt, 0), axis=0)
        mass_hi = tl.sum(tl.where(first_failed, mass, 0.0), axis=0)
    return lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi


@triton.jit
def _row_partials(count_ptr, mass_ptr, base, num_splits, SPLITS: tl.constexpr):
    """A row's counts and masses at the 16 candidates, summed over its splits' partials (``[S, 16]`` from
    ``base``) in one fixed order."""
    j = tl.arange(0, SPLITS)
    offs = base + j[:, None] * 16 + tl.arange(0, 16)[None, :]
    mask = (j < num_splits)[:, None]
    cnt = tl.sum(tl.load(count_ptr + offs, mask=mask, other=0), axis=0)
    mass = tl.sum(tl.load(mass_ptr + offs, mask=mask, other=0.0), axis=0)
    return cnt, mass


@triton.jit(do_not_specialize=["step"])
def _pass_kernel(x_ptr, stride_x, n, split_len, num_splits, step, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                 stride_temperature, stride_top_k, stride_top_p, stride_min_p, stats_ptr, ints_ptr, floats_ptr,
                 count_ptr, mass_ptr, kept_ptr, threshold_ptr, max_ptr, HAS_TOP_K: tl.constexpr,
                 HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, FIRST: tl.constexpr, FINAL: tl.constexpr,
                 SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Pass ``step`` of a row's split: its state from the stats (``FIRST``) or from the last pass's state and
    partials (narrowed, top-p started where top-k resolves), then its partials at the next candidates, or
    (``FINAL``) its kept mass. State and partials alternate between two slots by the pass's parity."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    ptr = x_ptr + row * stride_x
    begin = split * split_len
    end = tl.minimum(begin + split_len, n)
    temperature = tl.load(temperature_ptr + row * stride_temperature)
    k = tl.zeros([], tl.int32) + n
    if HAS_TOP_K:
        k = tl.minimum(tl.load(top_k_ptr + row * stride_top_k), n).to(tl.int32)   # (a top_k past int32: no cut)
    top_p = tl.full([], 1.0, tl.float32)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row * stride_top_p)
    here = step % 2
    ints = ints_ptr + (row * 2 + here) * _INTS
    floats = floats_ptr + (row * 2 + here) * _FLOATS
    if FIRST:
        phase, lo, hi, row_max = _start(stats_ptr, row, num_splits, n, temperature, k, top_p, SPLITS)
        cnt_lo = tl.zeros([], tl.int32) + n
        cnt_hi = tl.zeros([], tl.int32)
        mass_lo = tl.zeros([], tl.float32)
        mass_hi = tl.zeros([], tl.float32)
        need = tl.zeros([], tl.float32)
    else:
        last_ints = ints_ptr + (row * 2 + 1 - here) * _INTS
        last_floats = floats_ptr + (row * 2 + 1 - here) * _FLOATS
        phase = tl.load(last_ints)
        lo = tl.load(last_ints + 1).to(tl.int64)
        hi = tl.load(last_ints + 2).to(tl.int64)
        cnt_lo = tl.load(last_ints + 3)
        cnt_hi = tl.load(last_ints + 4)
        mass_lo = tl.load(last_floats)
        mass_hi = tl.load(last_floats + 1)
        need = tl.load(last_floats + 2)
        row_max = tl.load(last_floats + 3)
        if (phase == _TOP_K) | (phase == _TOP_P):
            cnt, mass = _row_partials(count_ptr, mass_ptr, ((row * 2 + 1 - here) * num_splits) * 16, num_splits,
                                      SPLITS)
            cnt += cnt_hi
            mass += mass_hi
            grid = step == 1
            cand, valid = _candidates(lo, hi, row_max, grid)
            if grid:   # the fixed distances' lowest is the row's min: its mass is the row's
                mass_lo = tl.sum(tl.where(tl.arange(0, 16) == 0, mass, 0.0), axis=0)
                if phase == _TOP_P:
                    need = top_p * mass_lo
            ok = valid & tl.where(phase == _TOP_K, cnt >= k, mass >= need)
            lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi = _narrow(lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi, cand,
                                                               valid, cnt, mass, ok)
            if lo >= hi:
                if (phase == _TOP_K) & (top_p < 1):   # top-p over the top-k survivors: [t_k, key(max)]
                    need = top_p * mass_lo
                    hi = _key(row_max).to(tl.int64)
                    cnt_hi = tl.zeros([], tl.int32)
                    mass_hi = tl.zeros([], tl.float32)
                    phase = tl.where(lo < hi, _TOP_P, _DONE).to(tl.int32)
                else:
                    phase = tl.full([], _DONE, tl.int32)
    first = split == 0
    tl.store(ints, phase, mask=first)
    tl.store(ints + 1, lo.to(tl.int32), mask=first)
    tl.store(ints + 2, hi.to(tl.int32), mask=first)
    tl.store(ints + 3, cnt_lo, mask=first)
    tl.store(ints + 4, cnt_hi, mask=first)
    tl.store(floats, mass_lo, mask=first)
    tl.store(floats + 1, mass_hi, mask=first)
    tl.store(floats + 2, need, mask=first)
    tl.store(floats + 3, row_max, mask=first)
    draws = phase >= _TOP_K
    if FINAL:   # (by the pass count every search has resolved: lo is the threshold)
        tl.store(threshold_ptr + row, tl.where(draws, _value(lo.to(tl.int32)), float("-inf")), mask=first)
        tl.store(max_ptr + row, row_max, mask=first)
        kept = tl.zeros([], tl.float32)
        if draws:
            min_p = 0.0
            if HAS_MIN_P:
                min_p = tl.load(min_p_ptr + row * stride_min_p)
            kept = _kept_mass(ptr, begin, end, temperature, row_max, lo.to(tl.int32), min_p, BLOCK)
        tl.store(kept_ptr + row * num_splits + split, kept)
    else:
        if (phase == _TOP_K) | (phase == _TOP_P):
            cand, valid = _candidates(lo, hi, row_max, step == 0)
            keys = tl.where(valid, cand, hi).to(tl.int32)
            cnt, mass = _count(ptr, begin, end, temperature, row_max, keys, lo.to(tl.int32), hi.to(tl.int32),
                               BLOCK)
            offs = ((row * 2 + here) * num_splits + split) * 16 + tl.arange(0, 16)
            tl.store(count_ptr + offs, cnt)
            tl.store(mass_ptr + offs, mass)


@triton.jit
def _kept_mass(ptr, begin, end, temperature, row_max, cut, min_p, BLOCK: tl.constexpr):
    """The split's kept mass: the sum of ``exp(s - max)`` over key ``>= cut`` and weight ``>= min_p``."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(begin, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < end
        s = _scores(ptr, offs, mask, temperature)
        w = tl.exp(s - row_max)
        acc += tl.where(mask & (_key(s) >= cut) & (w >= min_p), w, 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _draw_kernel(x_ptr, stride_x, n, split_len, num_splits, parity, temperature_ptr, min_p_ptr, uniform_ptr,
                 stride_temperature, stride_min_p, stride_uniform, ints_ptr, floats_ptr, kept_ptr, token_ptr,
                 HAS_MIN_P: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """A row's token: the first split whose running kept mass passes ``u * kept``, then the first kept token
    in it whose running kept mass does (the last kept one of that split if rounding leaves none)."""
    row = tl.program_id(0).to(tl.int64)
    phase = tl.load(ints_ptr + (row * 2 + parity) * _INTS)
    token = tl.full([], 0, tl.int32)
    if phase == _BROKEN:
        token = token + n - 1
    elif phase >= _TOP_K:
        cut = tl.load(ints_ptr + (row * 2 + parity) * _INTS + 1)
        row_max = tl.load(floats_ptr + (row * 2 + parity) * _FLOATS + 3)
        j = tl.arange(0, SPLITS)
        part = tl.load(kept_ptr + row * num_splits + j, mask=j < num_splits, other=0.0)
        running = tl.cumsum(part, axis=0)
        kept = tl.max(running, axis=0)
        target = (tl.load(uniform_ptr + row * stride_uniform) * kept.to(tl.float64)).to(tl.float32)
        # (a split of no kept mass is never the one, whatever the scan's rounding)
        chosen = tl.min(tl.where((running > target) & (part > 0), j, SPLITS), axis=0)
        if chosen == SPLITS:
            chosen = tl.max(tl.where(part > 0, j, -1), axis=0)
        token = token + n - 1
        if chosen >= 0:
            before = tl.sum(tl.where(j == chosen - 1, running, 0.0), axis=0)
            min_p = 0.0
            if HAS_MIN_P:
                min_p = tl.load(min_p_ptr + row * stride_min_p)
            temperature = tl.load(temperature_ptr + row * stride_temperature)
            begin = chosen * split_len
            token = _draw_in_split(x_ptr + row * stride_x, begin, tl.minimum(begin + split_len, n), temperature,
                                   row_max, cut, min_p, before, target, BLOCK)
    tl.store(token_ptr + row, token.to(tl.int64))


@triton.jit
def _draw_in_split(ptr, begin, end, temperature, row_max, cut, min_p, before, target, BLOCK: tl.constexpr):
    """The first kept token (key ``>= cut``, weight ``>= min_p``, weight > 0) of ``[begin, end)`` whose running
    kept weight, from ``before``, passes ``target``; the last kept token if none does (the split holds one)."""
    running = before
    found = end
    last = tl.full([], -1, tl.int32)
    start = begin
    while (start < end) & (found == end):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < end
        s = _scores(ptr, offs, mask, temperature)
        w = tl.exp(s - row_max)
        keep = mask & (_key(s) >= cut) & (w >= min_p) & (w > 0)
        weight = tl.where(keep, w, 0.0)
        passed = keep & (running + tl.cumsum(weight, axis=0) > target)
        found = tl.minimum(found, tl.min(tl.where(passed, offs, end), axis=0))
        last = tl.maximum(last, tl.max(tl.where(keep, offs, -1), axis=0))
        running += tl.sum(weight, axis=0)
        start += BLOCK
    return tl.where(found < end, found, last)


def _pieces(rows: int, sizes: list[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One allocation cut into ``[rows * size]`` pieces, each starting 16 bytes aligned whatever ``rows`` (Triton
    specializes a kernel on its pointers' alignment, which may change its reductions' order: a row's bits would
    then depend on the batch's size)."""
    padded = [rows * (-(-size // 4) * 4) for size in sizes]
    flat = torch.empty(sum(padded), dtype=dtype, device=device)
    return [piece[:rows * size] for piece, size in zip(flat.split(padded), sizes)]


def fused_warp_draw(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniform: torch.Tensor, *, top_k_cut: bool, top_p_cut: bool,
                    min_p_cut: bool, split: int = SPLIT) -> FusedDraw:
    """Warp each row of ``scores`` and draw one token from it (the module docstring), on the GPU or under the
    Triton interpreter: ``search_passes(top_k_cut, top_p_cut) + 2`` launches whatever the data (3, 12 or 20),
    no host sync (CUDA-graph capturable; the workspace is taken from torch's caching allocator).

    Parameters
    ----------
    scores : [L, V] float32, bfloat16 or float16, unit stride along V: the rows' (penalized) logits.
    temperature : [L] float32; a row of temperature <= 0 is skipped (token 0: its caller takes the argmax).
    top_k : [L] int64 (0 or >= V: no cut); top_p : [L] float32 (1: no cut); min_p : [L] float32 (0: no cut).
    uniform : [L] float64 in [0, 1), each row's number for the draw.
    top_k_cut, top_p_cut, min_p_cut : whether any row makes that cut (a field whose flag is off is not read,
        as :func:`~treedec.sampling.sampler.warp_rows` skips it).
    split : elements of a row a program reads (:func:`split_layout`); results differ between splits only by
        the order of float additions.

    The workspace, taken in the call: per row two slots of ``[S, 16]`` int32 counts and float32 masses, ``2 S``
    float32 split stats, two slots of the row's state (5 int32, 4 float32), ``S`` float32 kept masses: about
    ``268 S + 80`` bytes (8.6 kB for Llama 3's 32 splits).
    """
    if scores.dim() != 2 or scores.dtype not in _SUPPORTED or scores.stride(1) != 1:
        raise ValueError(f"scores must be [L, V] {_SUPPORTED} with unit stride along V, got {tuple(scores.shape)} "
                         f"{scores.dtype} strides {scores.stride()}")
    rows, vocab = scores.shape
    for name, tensor, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                                ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                                ("uniform", uniform, torch.float64)):
        if tensor.shape != (rows,) or tensor.dtype != dtype or tensor.device != scores.device:
            raise ValueError(f"{name} must be [{rows}] {dtype} on {scores.device}, got {tuple(tensor.shape)} "
                             f"{tensor.dtype} on {tensor.device}")
    device = scores.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    threshold = torch.empty(rows, dtype=torch.float32, device=device)
    row_max = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0:
        return FusedDraw(tokens, threshold, row_max)
    layout = split_layout(vocab, split)
    s = layout.splits
    counts, ints = _pieces(rows, [2 * s * 16, 2 * _INTS.value], torch.int32, device)
    masses, stats, floats, kept = _pieces(rows, [2 * s * 16, 2 * s, 2 * _FLOATS.value, s], torch.float32, device)
    # (the parameters by their strides: SamplingRows' columns are views of one [L, 6] tensor, not copied)
    row_args = (scores, scores.stride(0), vocab, layout.length, s)
    _stats_kernel[(rows, s)](*row_args, temperature, temperature.stride(0), stats, BLOCK=layout.block, num_warps=4)
    passes = search_passes(top_k_cut, top_p_cut)
    for step in range(passes):
        _pass_kernel[(rows, s)](
            *row_args, step, temperature, top_k, top_p, min_p, temperature.stride(0), top_k.stride(0),
            top_p.stride(0), min_p.stride(0), stats, ints, floats, counts, masses, kept, threshold, row_max,
            HAS_TOP_K=top_k_cut, HAS_TOP_P=top_p_cut, HAS_MIN_P=min_p_cut, FIRST=step == 0,
            FINAL=step == passes - 1, SPLITS=layout.padded, BLOCK=layout.block, num_warps=8)
    _draw_kernel[(rows,)](*row_args, (passes - 1) % 2, temperature, min_p, uniform, temperature.stride(0),
                          min_p.stride(0), uniform.stride(0), ints, floats, kept, tokens, HAS_MIN_P=min_p_cut,
                          SPLITS=layout.padded, BLOCK=layout.block, num_warps=4)
    return FusedDraw(tokens, threshold, row_max)
