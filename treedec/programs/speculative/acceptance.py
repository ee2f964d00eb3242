"""Acceptance rules of token-tree verification: greedy, Medusa typical, lossless rejection sampling.

One engine step computes the target model's logits at every token of a draft
:class:`~treedec.tree.token_tree.TokenTree` (token 0 the root: the sequence's last token).
A rule then picks the accepted path, a root path of draft tokens each a child of the one
before, and the next token (the *bonus*: the root of the next step's tree), drawn from the
target's logits at the last accepted token. Every rule also draws the first token after
the prefill (:meth:`AcceptanceRule.first_token`).

- :class:`GreedyAcceptance`: the longest path whose every token is the target's argmax
  at its parent. Greedy speculative decoding emits exactly plain greedy decoding's tokens.
- :class:`TypicalAcceptance` (Medusa): a token is accepted when its target probability
  exceeds ``min(posterior_threshold, posterior_alpha * exp(-entropy))`` of the target's
  distribution at its parent; the deepest accepted node wins. Not lossless: it trades the
  exact sampling distribution for longer accepted paths.
- :class:`RejectionSampling` (SpecInfer / EAGLE recursive rule): samples exactly from the
  target distribution (at a temperature), whatever the draft (:func:`recursive_rejection`).

Randomness of the host walks (:meth:`AcceptanceRule.accept`) comes from a ``torch.Generator`` the rule object
owns (seeded by ``seed``, on the logits' device): one rule object is one random stream; make a new object with
the same seed to reproduce a run. :class:`RejectionSampling`'s device decisions (its first token and
:meth:`RejectionSampling.outcome`, what the speculative programs use) draw counter-based numbers of its seed and
the verification step instead, the same whatever else runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from treedec.checks import FLOAT32_MAX, float32_number, nonnegative_int
from treedec.sampling.logits import SAMPLING_EPS, warp_scores
from treedec.programs.speculative.device_acceptance import greedy_outcomes, rejection_outcomes
from treedec.sampling.params import GREEDY, SamplingParams, sample_tokens, sampling_probs, seed_word
from treedec.sampling.rng import counter_uniform
from treedec.transfer import to_device
from treedec.tree.token_tree import TokenTree
from treedec.tree.validate import int_value


@runtime_checkable
class AcceptanceRule(Protocol):
    """Picks the accepted path of a verified token tree and the next token."""

    def first_token(self, logits: torch.Tensor) -> int:
        """The first new token after the prefill, from the prompt's last logits ``[vocab]``."""
        ...

    def accept(self, tree: TokenTree, tokens: Sequence[int], logits: torch.Tensor,
               draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
        """``(path, bonus)`` for a verified tree.

        ``tokens [tree.size]`` are the tree's tokens, ``logits [tree.size, vocab]`` the
        target's logits at each (row i: the distribution of the token after token i).
        ``path`` lists the accepted draft tokens' tree indices, root child first, each a
        child of the one before; ``bonus`` is drawn from the row of ``path[-1]`` (the root's
        row when ``path`` is empty). ``draft_probs [tree.size, vocab]`` (optional): the
        distributions a sampling draft drew each node's children from (see
        :meth:`RejectionSampling.accept`); rules for deterministic drafts ignore it.
        """
        ...


# ================================================================ greedy


@dataclass(frozen=True)
class GreedyAcceptance:
    """Accept the longest path whose tokens equal the target's argmax at their parent.

    Among siblings that equal the argmax (a draft may repeat a token), the first wins.
    """

    #: Rules of equal keys decide many requests' trees in one :meth:`outcomes` call (batched verification).
    batch_key = ("greedy",)
    #: The seed of its random streams: none are drawn.
    seed = 0

    def first_token(self, logits: torch.Tensor) -> int:
        return int(sample_tokens(logits, GREEDY))

    def first_sample(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`first_token` left on the device (``[1]`` int64, no wait)."""
        return sample_tokens(logits, GREEDY).reshape(1)

    def accept(self, tree: TokenTree, tokens: Sequence[int], logits: torch.Tensor,
               draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
        return greedy_path(tree, tokens, sample_tokens(logits, GREEDY).tolist())

    def outcomes(self, tree: TokenTree, tokens: torch.Tensor, logits: torch.Tensor, seeds: torch.Tensor,
                 steps: torch.Tensor) -> torch.Tensor:
        """The decisions on ``R`` trees of one shape on the device: ``tokens [R, N]``, ``logits [R, N, vocab]``
        (``seeds``, ``steps``: unused) -> ``[R, 2 + depth]`` outcomes
        (:func:`~treedec.programs.speculative.device_acceptance.greedy_outcomes`)."""
        argmax = sample_tokens(logits.reshape(-1, logits.shape[-1]), GREEDY).reshape(tokens.shape)
        return greedy_outcomes(tree, tokens, argmax)


def greedy_path(tree: TokenTree, tokens: Sequence[int], choice: Sequence[int]) -> tuple[list[int], int]:
    """:class:`GreedyAcceptance`'s ``(path, bonus)`` from the target's argmax at each tree token
    (``choice [tree.size]``, on the host: a batch reads every request's in one transfer)."""
    children = _children(tree)
    path, cur = [], 0
    while True:
        cur = next((c for c in children[cur] if tokens[c] == choice[cur]), None)
        if cur is None:
            return path, int(choice[path[-1] if path else 0])
        path.append(cur)


# ================================================================ random streams


def seed_bits(seed: int) -> int:
    """A rule's ``seed`` (an int64, as :attr:`~treedec.sampling.params.SamplingParams.seed`, or the unsigned 64-bit
    word of one, :func:`~treedec.sampling.params.seed_word`'s) as the int64 holding its 64 bits: what the
    counter-based generator's int64 seed tensors take (-1 and 2**64 - 1 draw the same numbers)."""
    word = seed_word(seed)
    return word - 2**64 if word >= 2**63 else word


def check_seed(seed) -> int:
    """``seed`` checked: an int in ``[-2**63, 2**64)`` (an int64 or its unsigned word), else TypeError / ValueError
    naming it."""
    return int_value(seed, "seed", low=-2**63, high=2**64 - 1)


class _SeededStream:
    """A rule's random stream (see the module docstring): its ``seed`` and a ``_generator`` field, made on
    first use on the logits' device (seeded with the seed's unsigned word)."""

    seed: int
    _generator: torch.Generator | None

    def _stream(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(seed_word(self.seed))
        return self._generator


# ================================================================ Medusa typical acceptance


@dataclass
class TypicalAcceptance(_SeededStream):
    """Medusa's typical acceptance (Cai et al. 2024, section 2.3.1).

    With ``p = softmax(logits / temperature)`` at a token's parent, the token is accepted
    when ``p[token] > min(posterior_threshold, posterior_alpha * exp(-H(p)))`` (``H`` the
    entropy, computed as Medusa does with ``log(p + 1e-5)``) and its parent is accepted.
    The deepest accepted node wins; among equally deep ones the one with the highest sum
    of log-probabilities along its path, then the first. The first token after the
    prefill and every bonus token are sampled, as Medusa does, from ``p`` with the tokens
    below that threshold removed (the argmax is always kept).

    ``posterior_threshold -> 0`` accepts every draft token whose probability is not zero:
    the deepest path of the tree is accepted (ties: the likeliest). A threshold of 1 or
    more with ``posterior_alpha >= 1`` accepts nothing. A flat distribution (high entropy,
    e.g. random weights) lowers the threshold so far that almost every draft token passes.
    Medusa's defaults:
    ``posterior_threshold=0.09``, ``posterior_alpha=0.3`` (about its square root).
    Temperature 0 is greedy decoding: use :class:`GreedyAcceptance`.
    """

    temperature: float = 0.7
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        _check_temperature(self.temperature, "TypicalAcceptance")
        for name in ("posterior_threshold", "posterior_alpha"):
            float32_number(name, getattr(self, name), 0.0, note=" (finite in float32)")
        check_seed(self.seed)

    def first_token(self, logits: torch.Tensor) -> int:
        return self._typical_sample(logits)

    def accept(self, tree: TokenTree, tokens: Sequence[int], logits: torch.Tensor,
               draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
        probs = warp_scores(logits, self.temperature).softmax(dim=-1)                       # [N, V]
        threshold = self._thresholds(probs)                                                  # [N]
        parents = torch.as_tensor(tree.parents[1:], dtype=torch.long, device=probs.device)
        drafts = torch.as_tensor(list(tokens[1:]), dtype=torch.long, device=probs.device)
        p_token = probs[parents, drafts]                                                     # [N - 1]
        ok = (p_token > threshold[parents]).tolist()
        logp = torch.log(p_token).tolist()
        # (depth, path log-prob) of every accepted node; the root is accepted
        accepted: dict[int, tuple[int, float]] = {0: (0, 0.0)}
        for i, p in enumerate(tree.parents[1:], start=1):
            if ok[i - 1] and p in accepted:
                accepted[i] = (accepted[p][0] + 1, accepted[p][1] + logp[i - 1])
        best = max(accepted, key=lambda i: (accepted[i][0], accepted[i][1], -i))
        path = []
        while best:
            path.append(best)
            best = tree.parents[best]
        path.reverse()
        return path, self._typical_sample(logits[path[-1] if path else 0])

    def _thresholds(self, probs: torch.Tensor) -> torch.Tensor:
        entropy = -(probs * torch.log(probs + 1e-5)).sum(dim=-1)
        return torch.clamp(self.posterior_alpha * torch.exp(-entropy), max=self.posterior_threshold)

    def _typical_sample(self, logits: torch.Tensor) -> int:
        """Medusa's ``get_typical_one_token``: sample from ``p`` without the tokens below the threshold."""
        probs = warp_scores(logits, self.temperature).softmax(dim=-1)
        keep = probs >= self._thresholds(probs)
        keep[probs.argmax()] = True
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        return int(torch.multinomial(probs, 1, generator=self._stream(probs.device)))


# ================================================================ rejection sampling


@dataclass
class RejectionSampling(_SeededStream):
    """Lossless speculative sampling over a token tree: EAGLE's / SpecInfer's recursive rule.

    From the root down: at a node, with ``p`` the target's distribution there (its logits
    at ``temperature``, cut to ``top_k`` / ``top_p`` / ``min_p`` as :func:`~treedec.sampling.params.sampling_probs`
    does), :func:`recursive_rejection` tries the node's children in order; an accepted child
    becomes the next node, and if none is accepted the bonus token is drawn from the
    residual of ``p`` (a leaf: from ``p``). Every emitted token is an exact sample of the
    target's processed distribution (tested by chi-square on fixed tables).

    Drafts: a deterministic draft (n-gram lookup, fixed trees, Medusa top-k, draft-model
    top-k) makes each child a point mass, ``q`` one-hot at its token (as in EAGLE's code):
    child ``x`` is accepted with probability ``p(x)`` and a rejected ``x`` is removed from
    ``p`` before the next sibling. A draft that *samples* a node's children without
    replacement from a distribution ``q`` (processed with the same temperature, top-k and
    top-p) passes those rows as ``draft_probs``: sibling i was drawn from ``q`` with the
    siblings before it removed, which is the ``q_i`` it is tested against (recursive
    rejection sampling without replacement, Jeon et al. 2024).
    """

    temperature: float = 1.0
    seed: int = 0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False, compare=False)
    _calls: int = field(default=0, init=False, repr=False, compare=False)   # outcome() calls without a step

    def __post_init__(self):
        _check_temperature(self.temperature, "RejectionSampling")
        check_seed(self.seed)
        # (checks top_k, top_p)
        self._params = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                      min_p=self.min_p)   # (checks min_p too)

    @property
    def batch_key(self) -> tuple:
        """Rules of equal keys (the same temperature, top-k, top-p and min-p) decide many requests' trees in one
        :meth:`outcomes` call, each with its own seed."""
        return ("rejection", self.temperature, self.top_k, self.top_p, self.min_p)

    def first_token(self, logits: torch.Tensor) -> int:
        return int(self.first_sample(logits)[0])

    def first_sample(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`first_token` left on the device (``[1]`` int64, no wait): drawn with the counter-based number of
        the rule's seed, stream 0 (:func:`~treedec.sampling.rng.counter_uniform`; a verification step's are its
        streams 1, 2, ...)."""
        seed, zero = to_device(np.array([seed_bits(self.seed), 0], dtype=np.int64), logits.device).split(1)
        uniform = counter_uniform(seed, zero, zero)
        return sample_tokens(logits.reshape(1, -1), self._params, uniform=uniform).reshape(1)

    def accept(self, tree: TokenTree, tokens: Sequence[int], logits: torch.Tensor,
               draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
        """As :meth:`AcceptanceRule.accept`; ``draft_probs [tree.size, vocab]``, optional: row j is the
        distribution node j's children were sampled from, without replacement, in child order.

        This walk reads a probability and a random number for every child it tries (on a GPU, a wait
        each): the reference of :meth:`outcome`, which the speculative programs use."""
        _check_draft_probs(tree, logits, draft_probs)
        generator = self._stream(logits.device)
        children = _children(tree)
        path, cur = [], 0
        while True:
            kids = children[cur]
            probs = sampling_probs(logits[cur], self._params)   # only the rows on the path
            draft = [tokens[c] for c in kids]
            q = None if draft_probs is None or not kids else without_replacement(draft_probs[cur], draft)
            index, token = recursive_rejection(probs, draft, q, generator)
            if index is None:
                return path, token
            cur = kids[index]
            path.append(cur)

    def outcome(self, tree: TokenTree, tokens: Sequence[int] | torch.Tensor, logits: torch.Tensor,
                draft_probs: torch.Tensor | None = None, step: int | None = None) -> torch.Tensor:
        """The same decision made on the device, launched without waiting: ``[2 + depth]`` int64
        (:func:`~treedec.programs.speculative.device_acceptance.rejection_outcomes` of one tree; read it back and
        :func:`~treedec.programs.speculative.device_acceptance.decode_outcome` gives :meth:`accept`'s ``(path, bonus)``).
        ``step``: the verification step's index in its request (its random numbers; a request's step draws the
        same ones alone, batched or pipelined); None: the count of this rule's earlier calls with None. Its tokens
        follow :meth:`accept`'s distribution exactly; single draws differ from :meth:`accept`'s."""
        _check_draft_probs(tree, logits, draft_probs)
        if len(tokens) != tree.size or logits.shape[0] != tree.size:
            raise ValueError(f"tokens and logits must have one row per tree token ({tree.size}), got "
                             f"{len(tokens)} and {logits.shape[0]}")
        if step is None:
            step, self._calls = self._calls, self._calls + 1
        else:
            nonnegative_int("step", step)
        device = logits.device
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=device).reshape(1, -1)
        seed, at = to_device(np.array([seed_bits(self.seed), step], dtype=np.int64), device).split(1)   # (no wait)
        return rejection_outcomes(tree, tokens, logits[None], self._params, seed, at,
                                  None if draft_probs is None else draft_probs[None])[0]

    def outcomes(self, tree: TokenTree, tokens: torch.Tensor, logits: torch.Tensor, seeds: torch.Tensor,
                 steps: torch.Tensor) -> torch.Tensor:
        """:meth:`outcome` of ``R`` trees of one shape (``tokens [R, N]``, ``logits [R, N, vocab]``), each request
        with its seed and step (``[R]`` int64 each): ``[R, 2 + depth]``
        (:func:`~treedec.programs.speculative.device_acceptance.rejection_outcomes`)."""
        return rejection_outcomes(tree, tokens, logits, self._params, seeds, steps)


def without_replacement(q: torch.Tensor, drawn: Sequence[int]) -> torch.Tensor:
    """``[len(drawn), vocab]``: the distribution each of ``drawn`` was sampled from when they were drawn
    one after another from ``q [vocab]`` without replacement (row i: ``q`` without ``drawn[:i]``,
    renormalised)."""
    rows = q.float().unsqueeze(0).repeat(len(drawn), 1)
    for i, x in enumerate(drawn[:-1]):
        rows[i + 1:, x] = 0.0
    return rows / rows.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def recursive_rejection(p: torch.Tensor, draft_tokens: Sequence[int], q: torch.Tensor | None,
                        generator: torch.Generator | None = None) -> tuple[int | None, int]:
    """One node of recursive rejection sampling (SpecInfer's multi-round speculative sampling).

    For each draft token ``x_i`` in order: accept it with probability
    ``min(1, p(x_i) / q_i(x_i))``; else ``p <- normalise(max(p - q_i, 0))`` and try the
    next. If none is accepted, sample from the final ``p`` (the residual). The result is
    an exact sample of the input ``p`` provided each ``x_i`` is an independent draw from
    ``q_i`` (a deterministic draft: ``q_i`` one-hot at ``x_i``).

    Parameters
    ----------
    p : [vocab] float, the target distribution (sums to 1).
    draft_tokens : the k draft tokens (a node's children), k >= 0.
    q : [k, vocab] float, the distribution each draft token was drawn from; None: one-hot
        at each token (``q_i(x_i) = 1``; a rejected token is removed from ``p``).
    generator : the random stream (on ``p``'s device).

    Returns
    -------
    (i, token): draft ``i`` accepted (``token == draft_tokens[i]``), or ``(None, token)``
    with ``token`` sampled from the residual.
    """
    if q is not None and q.shape != (len(draft_tokens), p.shape[-1]):
        raise ValueError(f"q must have shape [len(draft_tokens), vocab] = {[len(draft_tokens), p.shape[-1]]}, "
                         f"got {list(q.shape)}")
    p = p.float().clone()
    for i, x in enumerate(draft_tokens):
        q_x = 1.0 if q is None else float(q[i, x])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_x < float(p[x]):          # u < p(x) / q(x), without dividing by a zero q(x)
            return i, int(x)
        if q is None:
            p[x] = 0.0
        else:
            p = torch.clamp(p - q[i].float(), min=0.0)
        total = float(p.sum())
        if total <= 0.0:
            # p <= q everywhere means p == q: the acceptance probability was 1 (a rounding miss)
            return i, int(x)
        p /= total
    return None, int(torch.multinomial(p, 1, generator=generator))


# ================================================================ private


def _children(tree: TokenTree) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in range(tree.size)]
    for i, p in enumerate(tree.parents[1:], start=1):
        children[p].append(i)
    return children


def _check_draft_probs(tree: TokenTree, logits: torch.Tensor, draft_probs: torch.Tensor | None) -> None:
    if draft_probs is not None and tuple(draft_probs.shape) != (tree.size, logits.shape[-1]):
        raise ValueError(f"draft_probs must have shape [tree.size, vocab] = {[tree.size, logits.shape[-1]]}, "
                         f"got {list(draft_probs.shape)}")


def _check_temperature(value, rule: str) -> None:
    """A sampling rule's temperature: in float32's range and at least :data:`~treedec.sampling.logits.SAMPLING_EPS`
    (below it a request is greedy, as :class:`~treedec.sampling.params.SamplingParams` makes it)."""
    float32_number(f"{rule} temperature", value, SAMPLING_EPS, FLOAT32_MAX,
                   note=" (below 1e-5 decoding is greedy: use GreedyAcceptance)")
