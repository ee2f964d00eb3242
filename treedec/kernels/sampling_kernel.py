"""The batched sampler's warp and draw fused in one Triton kernel: temperature, top-k, top-p, min-p and an
inverse-CDF draw, one program per row, no sort and no [L, V] intermediate.

Every cut of the reference (:func:`treedec.sampling.sampler.warp`, transformers' order) keeps the tokens whose
scaled logit ``s = x / T`` is at least some threshold, so a row's kept set is ``s >= t`` (top-k then top-p) and
``exp(s - max) >= min_p`` (min-p: ``p >= min_p * p_max``):

1. one pass: the row's max, min and whether it holds a NaN; when top-p cuts, one more: ``Z = sum exp(s - max)``;
2. top-k: ``t_k`` = the k-th largest ``s`` (ties kept, as the reference), by an exact search over the
   order-preserving int32 pattern of ``s``: each pass counts the elements at or above 16 candidate patterns at
   once (a 16-ary search: at most 8 passes for 32 bits);
3. top-p: ``t_p`` = the largest ``s`` whose mass ``sum exp(s' - max) over s' >= s`` reaches ``top_p`` times the
   mass of the top-k survivors (the reference renormalizes over them), by the same search on masses;
4. once a search's bracket holds at most ``CAP`` elements, one pass copies them into a per-row workspace and
   the search's later passes read those instead of the row;
5. two passes: the kept mass, then the first kept token in vocabulary order whose running kept mass passes
   ``u * kept`` (``u`` the row's uniform number), as :func:`~treedec.sampling.draw.inverse_cdf`.

Semantics are the reference's except (a) the order of float additions (float32 running sums here, float64
in the reference's draw) and (b) ties at the top-p boundary: every token whose ``s`` equals ``t_p`` is kept
(the reference keeps a tied group only as far as its sort order reaches the mass), and with a tiny top-p every
token tied with the max is kept (the reference keeps one). A token of zero weight or outside the kept set is
never drawn; a row with a NaN, or with every logit ``-inf``, draws ``V - 1`` (the reference's NaN draw).
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
_FLOAT32_MAX: tl.constexpr = 3.4028234663852886e38
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
    bits = (s + 0.0).to(tl.int32, bitcast=True)
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
def _mass(ptr, n, temperature, row_max, BLOCK: tl.constexpr):
    """``sum exp(s - row_max)`` over the row."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        s = _scores(ptr, offs, offs < n, temperature)
        acc += tl.exp(s - row_max)
    return tl.sum(acc, axis=0)


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
    total = 0
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
def _search(ptr, n, temperature, row_max, buf_ptr, lo, hi, cnt_lo, mass_lo, need_cnt, need_mass,
            BY_MASS: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key ``t`` in ``[lo, hi]`` whose count (``BY_MASS`` False) or mass (True) of elements with
    key ``>= t`` reaches ``need_cnt`` / ``need_mass`` (true at ``lo``: ``cnt_lo``, ``mass_lo``; no element lies
    above ``hi``). Returns ``t`` and its count and mass."""
    cnt_hi = 0       # count and mass of the elements above hi
    mass_hi = 0.0
    in_buf = -1      # elements in the workspace (-1: not copied yet)
    cnt_base = 0     # count and mass above the copied bracket
    mass_base = 0.0
    while lo < hi:
        if (in_buf < 0) & (cnt_lo - cnt_hi <= CAP):
            in_buf = _compact(ptr, n, temperature, lo, hi, buf_ptr, BLOCK)
            cnt_base = cnt_hi
            mass_base = mass_hi
        step = (hi - lo) // 16 + 1
        cand64 = lo + (tl.arange(0, 16) + 1).to(tl.int64) * step
        valid = cand64 <= hi
        cand = tl.where(valid, cand64, hi).to(tl.int32)
        if in_buf >= 0:
            cnt, mass = _count(buf_ptr, in_buf, 1.0, row_max, cand, BLOCK)
            cnt += cnt_base
            mass += mass_base
        else:
            cnt, mass = _count(ptr, n, temperature, row_max, cand, BLOCK)
        if BY_MASS:
            ok = valid & (mass >= need_mass)
        else:
            ok = valid & (cnt >= need_cnt)
        taken = tl.sum(ok.to(tl.int32), axis=0)   # candidates 1..taken pass (the test is monotone)
        if taken > 0:
            cnt_lo = _pick(cnt, taken - 1)
            mass_lo = _pick(mass, taken - 1)
        if (taken < 16) & (lo + (taken + 1) * step <= hi):
            cnt_hi = _pick(cnt, taken)
            mass_hi = _pick(mass, taken)
        hi = tl.minimum(hi, lo + (taken + 1) * step - 1)
        lo = lo + taken * step
    return lo, cnt_lo, mass_lo


@triton.jit
def _fused_warp_draw_kernel(x_ptr, stride_x, n, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, uniform_ptr,
                            buf_ptr, token_ptr, threshold_ptr, max_ptr, HAS_TOP_K: tl.constexpr,
                            HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, CAP: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ptr = x_ptr + row.to(tl.int64) * stride_x
    buf = buf_ptr + row.to(tl.int64) * CAP
    temperature = tl.load(temperature_ptr + row)
    token = n - 1
    threshold = float("-inf")
    row_max = float("nan")
    if temperature > 0:
        row_max, row_min, nan = _row_stats(ptr, n, temperature, BLOCK)
        if nan != 0:
            row_max = float("nan")
        elif row_max > float("-inf"):
            lo = _key(row_min).to(tl.int64)
            hi = _key(row_max).to(tl.int64)
            cnt_lo = n
            mass_lo = 1.0
            top_p = 1.0
            if HAS_TOP_P:
                top_p = tl.load(top_p_ptr + row)
                if top_p < 1:
                    mass_lo = _mass(ptr, n, temperature, row_max, BLOCK)
            if HAS_TOP_K:
                k = tl.load(top_k_ptr + row)
                if (k > 0) & (k < n):
                    lo, cnt_lo, mass_lo = _search(ptr, n, temperature, row_max, buf, lo, hi, cnt_lo, mass_lo,
                                                  k.to(tl.int32), 0.0, False, CAP, BLOCK)
            if HAS_TOP_P:
                if top_p < 1:
                    lo, cnt_lo, mass_lo = _search(ptr, n, temperature, row_max, buf, lo, hi, cnt_lo, mass_lo,
                                                  0, top_p * mass_lo, True, CAP, BLOCK)
            threshold = _value(lo.to(tl.int32))
            cut = lo.to(tl.int32)
            min_p = 0.0
            if HAS_MIN_P:
                min_p = tl.load(min_p_ptr + row)
            token = _draw(ptr, n, temperature, row_max, cut, min_p, tl.load(uniform_ptr + row), BLOCK)
    else:
        token = 0
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(threshold_ptr + row, threshold)
    tl.store(max_ptr + row, row_max)


@triton.jit
def _draw(ptr, n, temperature, row_max, cut, min_p, uniform, BLOCK: tl.constexpr):
    """The first kept token (key ``>= cut``, weight ``>= min_p``, weight > 0) whose running kept weight
    passes ``uniform`` times the kept total; the last kept token if rounding leaves none past it."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        s = _scores(ptr, offs, mask, temperature)
        w = tl.exp(s - row_max)
        acc += tl.where(mask & (_key(s) >= cut) & (w >= min_p), w, 0.0)
    target = (uniform * tl.sum(acc, axis=0).to(tl.float64)).to(tl.float32)
    running = 0.0
    found = n
    last = -1
    start = 0
    while (start < n) & (found == n):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        s = _scores(ptr, offs, mask, temperature)
        w = tl.exp(s - row_max)
        kept = mask & (_key(s) >= cut) & (w >= min_p) & (w > 0)
        weight = tl.where(kept, w, 0.0)
        passed = kept & (running + tl.cumsum(weight, axis=0) > target)
        found = tl.minimum(found, tl.min(tl.where(passed, offs, n), axis=0))
        last = tl.maximum(last, tl.max(tl.where(kept, offs, -1), axis=0))
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
        scores, scores.stride(0), vocab, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(),
        min_p.contiguous(), uniform.contiguous(), workspace, tokens, threshold, row_max, HAS_TOP_K=top_k_cut,
        HAS_TOP_P=top_p_cut, HAS_MIN_P=min_p_cut, CAP=CAP, BLOCK=min(BLOCK, triton.next_power_of_2(max(vocab, 16))),
        num_warps=8)
    return FusedDraw(tokens, threshold, row_max)
