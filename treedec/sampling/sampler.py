"""The batched sampler: every row of a step's logits drawn by one call, whatever each row's parameters.

:class:`SamplingRows` holds the sampling parameters of a batch's rows as device tensors (temperature, top-k,
top-p, min-p, the three penalties, seed and stream): built once when the batch's membership changes (an event),
read every step. :func:`sample_rows` draws one token per row from a step's logits in a fixed number of device
operations, with no host sync and no Python per row:

1. the penalties (:func:`penalize`), from each row's prompt mask and output counts kept on the device;
2. greedy rows (temperature 0) take the argmax of the penalized logits;
3. the other rows are warped (:func:`warp_rows`: temperature, then top-k, top-p, min-p: transformers' order,
   per row) and drawn by inverse CDF with a counter-based uniform number per row
   (:func:`~treedec.sampling.rng.counter_uniform` of the row's seed, stream and draw index): a seeded row's draws
   depend on nothing else in the batch.

Step 3 has two kernels (:func:`resolve_sampler_kernel`): ``torch`` (:func:`warp_rows`, a softmax and
:func:`~treedec.sampling.draw.inverse_cdf`: a sort of every row and some twenty passes over it; the reference,
and the CPU's) and ``triton`` (:func:`~treedec.kernels.sampling_kernel.fused_warp_draw`: one launch, no sort;
the same kept sets and draws up to the order of float additions and ties at the top-p boundary, which it keeps
whole). ``auto`` takes ``torch`` everywhere: on an H200 the fused kernel, one program per row, is latency-bound
(a 128k-token row read by one SM: 240 us a row for temperature alone, 1.6 ms for top-p at 1 to 64 rows, graphed)
and lost to the torch path at every size but ``top_k + top_p`` and every field at 64 rows
(``bench/results/2026-12-02-nvidia-h200-sampler-s19-fused.json``; a 64-request 8B step 7.94 ms against 7.06):
``triton`` is there to be asked for, and for the split-row kernel that is to replace it.

The semantics of every field are those of :class:`~treedec.sampling.params.SamplingParams` (its docstring).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from treedec.checks import FLOAT32_MAX
from treedec.sampling.draw import exact_prefix_sums, inverse_cdf
from treedec.sampling.rng import counter_uniform

__all__ = ["SAMPLER_KERNELS", "SamplingRows", "penalize", "resolve_sampler_kernel", "sample_rows", "warp",
           "warp_rows"]

#: the kernels of the warp and draw (:func:`resolve_sampler_kernel`)
SAMPLER_KERNELS = ("auto", "torch", "triton")
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SamplingRows:
    """The sampling parameters of ``L`` rows, as device tensors (one row per lane of a batch).

    Attributes
    ----------
    temperature : [L] float32; 0 for a greedy row.
    top_k : [L] int64; 0 for no top-k cut.
    top_p : [L] float32 in (0, 1]; 1 for no cut.
    min_p : [L] float32 in [0, 1]; 0 for no cut.
    repetition, presence, frequency : [L] float32, the penalties (1, 0, 0 for none).
    seed : [L] int64, each row's seed; stream : [L] int64, its output's index (``n`` outputs of a seeded
        request share the seed and differ by stream).
    greedy, sampled, top_k_cut, top_p_cut, min_p_cut, penalized : host flags: some row is greedy / sampled /
        has a top-k / top-p / min-p cut / a penalty (work the step skips when no row needs it).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    seed: torch.Tensor
    stream: torch.Tensor
    greedy: bool
    sampled: bool
    top_k_cut: bool
    top_p_cut: bool
    min_p_cut: bool
    penalized: bool

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(cls, params: Sequence, seeds: Sequence[int], streams: Sequence[int], device) -> "SamplingRows":
        """The rows of ``params`` (one :class:`~treedec.sampling.params.SamplingParams` per row; rows of one
        request repeat it), with each row's ``seeds`` and ``streams``: two host-to-device copies."""
        if not len(params) == len(seeds) == len(streams):
            raise ValueError(f"params, seeds and streams must have one entry per row, got {len(params)}, "
                             f"{len(seeds)}, {len(streams)}")
        floats = torch.tensor([[0.0 if p.greedy else p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                                p.presence_penalty, p.frequency_penalty] for p in params],
                              dtype=torch.float32).reshape(len(params), 6)
        ints = torch.tensor([[p.top_k or 0, seed, stream] for p, seed, stream in zip(params, seeds, streams)],
                            dtype=torch.int64).reshape(len(params), 3)
        greedy = [p.greedy for p in params]
        flags = dict(greedy=any(greedy), sampled=not all(greedy),
                     top_k_cut=any(p.top_k is not None and not p.greedy for p in params),
                     top_p_cut=any(p.top_p < 1 and not p.greedy for p in params),
                     min_p_cut=any(p.min_p > 0 and not p.greedy for p in params),
                     penalized=any(p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
                                   for p in params))
        floats, ints = floats.to(device), ints.to(device)
        temperature, top_p, min_p, repetition, presence, frequency = floats.unbind(1)
        top_k, seed, stream = ints.unbind(1)
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition=repetition,
                   presence=presence, frequency=frequency, seed=seed, stream=stream, **flags)

    def take(self, index: torch.Tensor) -> "SamplingRows":
        """The rows at ``index`` ([m] int64 on the rows' device), flags kept (they may then overstate)."""
        return SamplingRows(*(getattr(self, name)[index] for name in _TENSORS),
                            **{name: getattr(self, name) for name in _FLAGS})


_TENSORS = ("temperature", "top_k", "top_p", "min_p", "repetition", "presence", "frequency", "seed", "stream")
_FLAGS = ("greedy", "sampled", "top_k_cut", "top_p_cut", "min_p_cut", "penalized")


def _per_row(value):
    """A per-row parameter as a column ([L] tensor -> [L, 1]); a Python number as it is (no device tensor made)."""
    return value[:, None] if isinstance(value, torch.Tensor) else value


def penalize(scores: torch.Tensor, prompt_mask: torch.Tensor, counts: torch.Tensor, repetition, presence,
             frequency) -> torch.Tensor:
    """Per-row penalties, vLLM's rules (the one definition: :func:`~treedec.sampling.logits.apply_penalties` is this
    with one value for every row): a token of the prompt or the output gets ``logit / repetition`` if its logit is
    > 0, else ``logit * repetition``; then ``logit -= frequency * count + presence * (count > 0)``.

    ``scores`` [L, V] float; ``prompt_mask`` [L, V] or [1, V] bool; ``counts`` [L, V] int (output counts);
    the penalties [L] float32 tensors (each row its own) or Python numbers (every row's). Returns a new [L, V]
    float32 tensor: a finite logit a penalty takes past float32's largest saturates at 3.4e38 (never +inf, which
    would make the row's softmax NaN), one below its lowest is -inf; an infinite one (a masked token) stays."""
    given, scores = scores, scores.float()
    rep = _per_row(repetition)
    if isinstance(rep, torch.Tensor) or rep != 1:
        seen = prompt_mask | (counts > 0)
        if isinstance(rep, torch.Tensor):
            seen = seen & (rep != 1)
        penalized = torch.where(scores > 0, scores / rep, scores * rep).clamp_(max=FLOAT32_MAX)   # (logit / tiny)
        scores = torch.where(seen, penalized, scores)
    frequency, presence = _per_row(frequency), _per_row(presence)
    if isinstance(frequency, torch.Tensor) or frequency != 0:
        scores = scores - frequency * counts.float()
    if isinstance(presence, torch.Tensor) or presence != 0:
        scores = scores - presence * (counts > 0).float()
    return scores.clone() if scores is given else scores


def warp(scores: torch.Tensor, temperature, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The scores each row is drawn from (the one definition: :func:`~treedec.sampling.logits.warp_scores` is this
    with one value for every row): ``scores / temperature``, then top-k (ties with the k-th kept; 0: no cut), top-p
    (the smallest set of most likely tokens whose probability reaches top-p, their float32 probabilities summed
    exactly in fixed point: :func:`~treedec.sampling.draw.exact_prefix_sums`; the most likely always kept), min-p
    (tokens below min-p times the most likely's probability), each with that row's value;
    removed tokens get ``-inf`` (transformers' warpers, in their order).

    ``scores`` [L, V] float; each parameter an [L] tensor (``temperature`` and ``top_p``, ``min_p`` float32 >
    0, ``top_k`` int64) or a Python number for every row, None for no such cut. Returns [L, V] float32; a logit
    whose scaling passes float32's largest saturates at 3.4e38 (never +inf), one below its lowest is -inf."""
    scores = (scores.float() / _per_row(temperature)).clamp_(max=FLOAT32_MAX)
    vocab = scores.shape[-1]
    if top_k is not None or top_p is not None:
        ordered, order = scores.sort(dim=-1, descending=True)
        if top_k is not None:
            if isinstance(top_k, torch.Tensor):
                k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
                kth = ordered.gather(1, (k - 1)[:, None])
            else:
                kth = ordered[:, min(top_k, vocab) - 1:min(top_k, vocab)]
            ordered = ordered.masked_fill(ordered < kth, float("-inf"))
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if top_p is not None:
            exact = exact_prefix_sums(ordered.softmax(dim=-1))
            share = top_p.double().masked_fill(top_p >= 1, float("inf")) if isinstance(top_p, torch.Tensor) \
                else (float("inf") if top_p >= 1 else top_p)
            # a token is cut when the mass ranked above it (the sum through the one before) reaches top-p of the
            # row's: integers, exact, so the same cut alone or in any batch, on any device; a row of top-p 1 cuts
            # nothing (2**53 is past every sum), though the mass above its last tokens can be all of it
            need = (_per_row(share) * exact.total.double()[:, None]).nan_to_num_(nan=2.0 ** 53, posinf=2.0 ** 53)
            need = need.clamp_(max=2.0 ** 53).ceil_().long()
            cut = torch.zeros_like(ordered, dtype=torch.bool)
            cut[:, 1:] = exact.sums[:, :vocab - 1] >= need   # (the most likely token is always kept)
            drop = torch.zeros_like(cut).scatter(-1, order, cut)
            scores = scores.masked_fill(drop, float("-inf"))
    if min_p is not None:
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < _per_row(min_p) * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return scores


def warp_rows(scores: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """:func:`warp` with ``rows``' parameters (the cuts no row makes are skipped). ``scores`` [L, V] float of
    sampled rows (temperature > 0). Returns [L, V] float32."""
    return warp(scores, rows.temperature, rows.top_k if rows.top_k_cut else None,
                rows.top_p if rows.top_p_cut else None, rows.min_p if rows.min_p_cut else None)


def resolve_sampler_kernel(kernel: str, device) -> str:
    """The warp-and-draw kernel ``kernel`` (one of :data:`SAMPLER_KERNELS`) names on ``device``: ``auto`` is
    ``torch`` (the faster one on an H200 today: see the module docstring). Raises RuntimeError when the kernel
    cannot run there (``triton``: the package missing; on a CPU, ``TRITON_INTERPRET=1`` unset or a broken
    interpreter): no silent fallback."""
    if kernel not in SAMPLER_KERNELS:
        raise ValueError(f"kernel must be one of {SAMPLER_KERNELS}, got {kernel!r}")
    kernel = "torch" if kernel == "auto" else kernel
    problem = _KERNELS[kernel].problem(torch.device(device))
    if problem is not None:
        raise RuntimeError(problem)
    return kernel


@dataclass(frozen=True)
class _WarpDraw:
    """One warp-and-draw kernel of :func:`sample_rows`: whether it reads 16-bit logits as they are, why it cannot
    run on a device (None: it can), and the draw of the sampled rows."""

    reads_16bit: bool
    problem: Callable[[torch.device], str | None]
    draw: Callable[[torch.Tensor, SamplingRows, torch.Tensor], torch.Tensor]


def _torch_draw(scores: torch.Tensor, rows: SamplingRows, uniform: torch.Tensor) -> torch.Tensor:
    sampled = rows.temperature > 0
    safe = rows if not rows.greedy else _with_temperature(rows, torch.where(sampled, rows.temperature, 1.0))
    return inverse_cdf(warp_rows(scores, safe).softmax(dim=-1), uniform)


def _fused_draw(scores: torch.Tensor, rows: SamplingRows, uniform: torch.Tensor) -> torch.Tensor:
    from treedec.kernels.sampling_kernel import fused_warp_draw
    return fused_warp_draw(scores, rows.temperature, rows.top_k, rows.top_p, rows.min_p, uniform,
                           top_k_cut=rows.top_k_cut, top_p_cut=rows.top_p_cut, min_p_cut=rows.min_p_cut).tokens


def _fused_problem(device: torch.device) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return ("the triton sampler kernel needs the 'triton' package (pip install 'treedec[triton]'); "
                "pass kernel='torch' for the reference sampler")
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") != "1":
        return f"the triton sampler kernel needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got device {device}"
    from treedec.attention.backends.triton_backend import triton_interpreter_problem
    return triton_interpreter_problem()


_KERNELS = {"torch": _WarpDraw(reads_16bit=False, problem=lambda device: None, draw=_torch_draw),
            "triton": _WarpDraw(reads_16bit=True, problem=_fused_problem, draw=_fused_draw)}


def sample_rows(logits: torch.Tensor, rows: SamplingRows, draws: torch.Tensor,
                prompt_mask: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                kernel: str = "auto") -> torch.Tensor:
    """One token per row of ``logits``, each drawn under its row's parameters (see the module docstring).

    Parameters
    ----------
    logits : [L, V] any float dtype, the rows' raw logits (after user logits processors, if any).
    rows : the rows' :class:`SamplingRows`.
    draws : [L] int64, each row's draw index (tokens its output holds so far): the counter of its random number.
    prompt_mask, counts : [L, V] bool and int, each row's prompt tokens and output token counts; needed when
        ``rows.penalized``.
    kernel : the warp and draw's kernel (:func:`resolve_sampler_kernel`; ``auto``: ``torch``).

    Returns
    -------
    [L] int64 token ids in ``[0, V)``, on ``logits.device``; no host sync.
    """
    if logits.dim() != 2 or logits.shape[0] != rows.num_rows:
        raise ValueError(f"logits must be [L, V] with L = {rows.num_rows} rows, got {tuple(logits.shape)}")
    kernel = _KERNELS[resolve_sampler_kernel(kernel, logits.device)]
    # (the fused kernel reads 16-bit logits as they are: their float32 values are exact, so is their argmax)
    scores = logits if kernel.reads_16bit and logits.dtype in _FUSED_DTYPES else logits.float()
    if rows.penalized:
        if prompt_mask is None or counts is None:
            raise ValueError("rows with penalties need prompt_mask and counts")
        scores = penalize(scores, prompt_mask, counts, rows.repetition, rows.presence, rows.frequency)
    if not rows.sampled:
        return scores.argmax(dim=-1)
    sampled = rows.temperature > 0
    drawn = kernel.draw(scores, rows, counter_uniform(rows.seed, rows.stream, draws))
    return torch.where(sampled, drawn, scores.argmax(dim=-1)) if rows.greedy else drawn


def _with_temperature(rows: SamplingRows, temperature: torch.Tensor) -> SamplingRows:
    fields = {name: getattr(rows, name) for name in _TENSORS + _FLAGS}
    fields["temperature"] = temperature
    return SamplingRows(**fields)
