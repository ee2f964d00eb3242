"""The batched sampler's warp and draw fused in one Triton kernel: temperature, top-k, top-p, min-p and an
inverse-CDF draw, one program per row, no sort and no [L, V] intermediate.

Every cut of the reference (:func:`treedec.sampling.sampler.warp`, transformers' order) keeps the tokens whose
scaled logit ``s = x / T`` is at least some threshold, so a row's kept set is ``s >= t`` (top-k then top-p) and
``exp(s - max) >= min_p`` (min-p: ``p >= min_p * p_max``):

1. one pass: the row's max, min and whether it holds a NaN; when a row cuts by top-k or top-p, one more: the
   count and mass ``sum exp(s' - max)`` of the elements at or above 16 fixed distances below the max (the
   lowest: the row's min, so the row's mass ``Z``), the first search's starting bracket;
2. top-k: ``t_k`` = the k-th largest ``s`` (ties kept, as the reference), by an exact search over the
   order-preserving int32 pattern of ``s``: each pass counts the elements at or above 16 candidate patterns at
   once (a 16-ary search: at most 8 passes for 32 bits);
3. top-p: ``t_p`` = the largest ``s`` whose mass ``sum exp(s' - max) over s' >= s`` reaches ``top_p`` times the
   mass of the top-k survivors (the reference renormalizes over them), by the same search on masses;
4. once a search's bracket holds at most ``CAP`` elements, one pass copies them into a per-row workspace and
   the search's later passes read those instead of the row;
5. the draw: the first kept token in vocabulary order whose running kept mass passes ``u * kept`` (``u`` the
   row's uniform number), as :func:`~treedec.sampling.draw.inverse_cdf`; ``kept`` is the search's mass at its
   threshold, or one more pass's when min-p cuts or no search ran.

Semantics are the reference's except (a) the order of float additions (float32 running sums here, in an order
fixed by the row's length alone; exact fixed-point sums in the reference's top-p and draw) and (b) ties at the
top-p boundary: every token whose ``s`` equals ``t_p`` is kept (the reference keeps a tied group only as far as its
sort order reaches the mass), and with a tiny top-p every token tied with the max is kept (the reference keeps
one). A token of zero weight or outside the kept set is never drawn; a row with a NaN, or with every logit
``-inf``, draws ``V - 1`` (the reference's NaN draw).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["CAP", "FusedDraw", "fused_warp_draw"]

#: elements a search's bracket may hold to be copied into the workspace (a row's [CAP] float32 there)
CAP = 4096
#: elements a program reads per loop iteration (fewer for a shorter row)
BLOCK = 1024
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FusedDraw:
    """What :func:`fused_warp_draw` gives, one entry per row.

    Attributes
    ----------
    tokens : [L] int64, the drawn ids in ``[0, V)`` (0 for a row of temperature 0: the caller's argmax).
    threshold : [L] float32, the cut on the scaled logits: a token is kept iff ``s >= threshold`` and
        ``exp(s - row_max) >= min_p`` (``-inf`` or the row's min when no top-k / top-p cut).
    row_max : [L] float32, the row's largest ``s`` (NaN for a row with a NaN).
    """

    tokens: torch.Tensor
    threshold: torch.Tensor
    row_max: torch.Tensor


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
def _row_stats(ptr, n, temperature, BLOCK: tl.constexpr):
    """The row's max and min of ``s`` and whether it holds a NaN."""
    hi = tl.full([BLOCK], float("-inf"), tl.float32)
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        s = _scores(ptr, offs, mask, temperature)
        nan = nan | (s != s).to(tl.int32)
        hi = tl.maximum(hi, tl.where(s != s, float("-inf"), s))
        lo = tl.minimum(lo, tl.where(mask & (s == s), s, float("inf")))
    return tl.max(hi, axis=0), tl.min(lo, axis=0), tl.max(nan, axis=0)


@triton.jit
def _count(ptr, n, temperature, row_max, cand, BLOCK: tl.constexpr):
    """Count and mass of the elements whose key is at least each of the 16 candidate keys ``cand``."""
    cnt = tl.zeros([16], tl.int32)
    mass = tl.zeros([16], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        s = _scores(ptr, offs, mask, temperature)
        w = tl.exp(s - row_max)
        ge = (_key(s)[:, None] >= cand[None, :]) & mask[:, None]
        cnt += tl.sum(ge.to(tl.int32), axis=0)
        mass += tl.sum(tl.where(ge, w[:, None], 0.0), axis=0)
    return cnt, mass


@triton.jit
def _compact(ptr, n, temperature, lo, hi, buf_ptr, BLOCK: tl.constexpr):
    """Copy the row's ``s`` whose key lies in ``[lo, hi]`` into ``buf_ptr`` (vocabulary order); their number."""
    total = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        s = _scores(ptr, offs, mask, temperature)
        key = _key(s)
        inside = (mask & (key >= lo) & (key <= hi)).to(tl.int32)
        tl.store(buf_ptr + total + tl.cumsum(inside, axis=0) - 1, s, mask=inside != 0)
        total += tl.sum(inside, axis=0)
    return total


@triton.jit
def _pick(values, index):
    """``values[index]`` of a [16] vector (0 where ``index`` is out of range)."""
    return tl.sum(tl.where(tl.arange(0, 16) == index, values, 0), axis=0)


@triton.jit
def _narrow(lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi, cand, valid, cnt, mass, ok):
    """The bracket ``[lo, hi]`` narrowed by increasing candidate keys ``cand`` (``valid`` ones within it), their
    counts and masses, and which pass the test (``ok``: a prefix, the test being monotone)."""
    taken = tl.sum(ok.to(tl.int32), axis=0)
    if taken > 0:
        lo = _pick(cand, taken - 1)
        cnt_lo = _pick(cnt, taken - 1)
        mass_lo = _pick(mass, taken - 1)
    if (taken < 16) & (_pick(valid.to(tl.int32), taken) != 0):
        hi = _pick(cand, taken) - 1
        cnt_hi = _pick(cnt, taken)
        mass_hi = _pick(mass, taken)
    return lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi


@triton.jit
def _search(ptr, n, temperature, row_max, buf_ptr, lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi, need_cnt, need_mass,
            BY_MASS: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key ``t`` in ``[lo, hi]`` whose count (``BY_MASS`` False) or mass (True) of elements with
    key ``>= t`` reaches ``need_cnt`` / ``need_mass`` (true at ``lo``: ``cnt_lo``, ``mass_lo``; ``cnt_hi``,
    ``mass_hi``: the count and mass above ``hi``). Returns ``t`` and its count and mass."""
    in_buf = tl.full([], -1, tl.int32)   # elements in the workspace (-1: not copied yet)
    cnt_base = tl.zeros([], tl.int32)   # count and mass above the copied bracket
    mass_base = tl.zeros([], tl.float32)
    while lo < hi:
        if (in_buf < 0) & (cnt_lo - cnt_hi <= CAP):
            in_buf = _compact(ptr, n, temperature, lo, hi, buf_ptr, BLOCK)
            cnt_base = cnt_hi
            mass_base = mass_hi
        step = (hi - lo) // 16 + 1
        cand = lo + (tl.arange(0, 16) + 1).to(tl.int64) * step
        valid = cand <= hi
        keys = tl.where(valid, cand, hi).to(tl.int32)
        if in_buf >= 0:
            cnt, mass = _count(buf_ptr, in_buf, 1.0, row_max, keys, BLOCK)
            cnt += cnt_base
            mass += mass_base
        else:
            cnt, mass = _count(ptr, n, temperature, row_max, keys, BLOCK)
        if BY_MASS:
            ok = valid & (mass >= need_mass)
        else:
            ok = valid & (cnt >= need_cnt)
        lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi = _narrow(lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi, cand, valid,
                                                           cnt, mass, ok)
    return lo, cnt_lo, mass_lo


@triton.jit
def _fused_warp_draw_kernel(x_ptr, stride_x, n, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, uniform_ptr,
                            stride_temperature, stride_top_k, stride_top_p, stride_min_p, stride_uniform,
                            buf_ptr, token_ptr, threshold_ptr, max_ptr, HAS_TOP_K: tl.constexpr,
                            HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, CAP: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ptr = x_ptr + row.to(tl.int64) * stride_x
    buf = buf_ptr + row.to(tl.int64) * CAP
    temperature = tl.load(temperature_ptr + row * stride_temperature)
    # (every value an if-block may redefine starts as a typed scalar: compiled Triton merges blocks by type)
    token = tl.full([], 0, tl.int32)
    threshold = tl.full([], float("-inf"), tl.float32)
    row_max = tl.full([], float("nan"), tl.float32)
    zero_i = tl.zeros([], tl.int32)
    zero_f = tl.zeros([], tl.float32)
    if temperature > 0:
        token = token + n - 1
        row_max, row_min, nan = _row_stats(ptr, n, temperature, BLOCK)
        if nan != 0:
            row_max = tl.full([], float("nan"), tl.float32)
        elif row_max > float("-inf"):
            lo = _key(row_min).to(tl.int64)
            hi = _key(row_max).to(tl.int64)
            k = zero_i + n
            if HAS_TOP_K:
                k = tl.minimum(tl.load(top_k_ptr + row * stride_top_k), n).to(tl.int32)   # (a top_k past int32: no cut)
            top_p = 1.0
            if HAS_TOP_P:
                top_p = tl.load(top_p_ptr + row * stride_top_p)
            cut_k = (k > 0) & (k < n)
            cnt_lo = zero_i + n
            mass_lo = zero_f
            if cut_k | (top_p < 1):
                # a first pass at fixed distances below the max (finer near it) for the first search's bracket;
                # its lowest candidate is the row's min, whose mass is the row's
                j = tl.arange(0, 16)
                grid = _key(row_max - 0.15 * ((16 - j) * (16 - j)).to(tl.float32)).to(tl.int64)
                cand = tl.where(j == 0, lo, tl.maximum(grid, lo))
                cnt, mass = _count(ptr, n, temperature, row_max, cand.to(tl.int32), BLOCK)
                mass_lo = _pick(mass, 0)
                valid = j >= 0
                if cut_k:
                    t_lo, t_hi, t_cnt_lo, t_mass_lo, cnt_hi, mass_hi = _narrow(
                        lo, hi, cnt_lo, mass_lo, zero_i, zero_f, cand, valid, cnt, mass, valid & (cnt >= k))
                    lo, cnt_lo, mass_lo = _search(ptr, n, temperature, row_max, buf, t_lo, t_hi, t_cnt_lo, t_mass_lo,
                                                  cnt_hi, mass_hi, k, zero_f, False, CAP, BLOCK)
                if top_p < 1:
                    need = top_p * mass_lo
                    t_lo = lo
                    t_hi = hi
                    t_cnt_lo = cnt_lo
                    t_mass_lo = mass_lo
                    cnt_hi = zero_i
                    mass_hi = zero_f
                    if cut_k == 0:
                        t_lo, t_hi, t_cnt_lo, t_mass_lo, cnt_hi, mass_hi = _narrow(
                            lo, hi, cnt_lo, mass_lo, zero_i, zero_f, cand, valid, cnt, mass, valid & (mass >= need))
                    lo, cnt_lo, mass_lo = _search(ptr, n, temperature, row_max, buf, t_lo, t_hi, t_cnt_lo, t_mass_lo,
                                                  cnt_hi, mass_hi, zero_i, need, True, CAP, BLOCK)
            threshold = _value(lo.to(tl.int32))
            cut = lo.to(tl.int32)
            min_p = 0.0
            if HAS_MIN_P:
                min_p = tl.load(min_p_ptr + row * stride_min_p)
            kept = zero_f - 1.0   # the kept mass: a search's when no min-p cut follows it, else a pass of its own
            if (cut_k | (top_p < 1)) & (min_p == 0):
                kept = mass_lo
            uniform = tl.load(uniform_ptr + row * stride_uniform)
            token = _draw(ptr, n, temperature, row_max, cut, min_p, kept, uniform, BLOCK)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(threshold_ptr + row, threshold)
    tl.store(max_ptr + row, row_max)


@triton.jit
def _draw(ptr, n, temperature, row_max, cut, min_p, kept, uniform, BLOCK: tl.constexpr):
    """The first kept token (key ``>= cut``, weight ``>= min_p``, weight > 0) whose running kept weight
    passes ``uniform`` times the kept total (``kept``; a pass sums it when negative); the last kept token if
    rounding leaves none past it."""
    if kept < 0:
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            s = _scores(ptr, offs, mask, temperature)
            w = tl.exp(s - row_max)
            acc += tl.where(mask & (_key(s) >= cut) & (w >= min_p), w, 0.0)
        kept = tl.sum(acc, axis=0)
    target = (uniform * kept.to(tl.float64)).to(tl.float32)
    running = tl.zeros([], tl.float32)
    found = tl.zeros([], tl.int32) + n
    last = tl.full([], -1, tl.int32)
    start = tl.zeros([], tl.int32)
    while (start < n) & (found == n):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        s = _scores(ptr, offs, mask, temperature)
        w = tl.exp(s - row_max)
        keep = mask & (_key(s) >= cut) & (w >= min_p) & (w > 0)
        weight = tl.where(keep, w, 0.0)
        passed = keep & (running + tl.cumsum(weight, axis=0) > target)
        found = tl.minimum(found, tl.min(tl.where(passed, offs, n), axis=0))
        last = tl.maximum(last, tl.max(tl.where(keep, offs, -1), axis=0))
        running += tl.sum(weight, axis=0)
        start += BLOCK
    return tl.where(found < n, found, tl.where(last >= 0, last, n - 1))


def fused_warp_draw(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniform: torch.Tensor, *, top_k_cut: bool, top_p_cut: bool,
                    min_p_cut: bool) -> FusedDraw:
    """Warp each row of ``scores`` and draw one token from it (the module docstring), on the GPU or under the
    Triton interpreter; one launch, no host sync (CUDA-graph capturable: a fixed grid of ``L`` programs).

    Parameters
    ----------
    scores : [L, V] float32, bfloat16 or float16, unit stride along V: the rows' (penalized) logits.
    temperature : [L] float32; a row of temperature <= 0 is skipped (token 0: its caller takes the argmax).
    top_k : [L] int64 (0 or >= V: no cut); top_p : [L] float32 (1: no cut); min_p : [L] float32 (0: no cut).
    uniform : [L] float64 in [0, 1), each row's number for the draw.
    top_k_cut, top_p_cut, min_p_cut : whether any row makes that cut (a field whose flag is off is not read,
        as :func:`~treedec.sampling.sampler.warp_rows` skips it).
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
    tokens = torch.empty(rows, dtype=torch.int64, device=scores.device)
    threshold = torch.empty(rows, dtype=torch.float32, device=scores.device)
    row_max = torch.empty(rows, dtype=torch.float32, device=scores.device)
    if rows == 0:
        return FusedDraw(tokens, threshold, row_max)
    workspace = torch.empty(rows if top_k_cut or top_p_cut else 1, CAP, dtype=torch.float32, device=scores.device)
    _fused_warp_draw_kernel[(rows,)](
        # (the parameters by their strides: SamplingRows' columns are views of one [L, 6] tensor, not copied)
        scores, scores.stride(0), vocab, temperature, top_k, top_p, min_p, uniform, temperature.stride(0),
        top_k.stride(0), top_p.stride(0), min_p.stride(0), uniform.stride(0), workspace, tokens, threshold, row_max,
        HAS_TOP_K=top_k_cut, HAS_TOP_P=top_p_cut, HAS_MIN_P=min_p_cut, CAP=CAP,
        BLOCK=min(BLOCK, triton.next_power_of_2(max(vocab, 16))), num_warps=8)
    return FusedDraw(tokens, threshold, row_max)
