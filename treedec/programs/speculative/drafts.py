"""Draft sources for speculative decoding: what proposes the token tree a step verifies.

A :class:`DraftSource` proposes a :class:`~treedec.tree.token_tree.TokenTree` whose root is
the sequence's last token (see :mod:`treedec.programs.speculative.program` for the verification).
Here: the base class, :class:`TargetOutput` (what a draft that reads the target sees),
:class:`PromptLookupDraft` (n-grams of the sequence) and :class:`TreeDraft` (a fixed shape
with given tokens); :class:`~treedec.programs.speculative.medusa.MedusaDraft` and
:class:`~treedec.programs.speculative.draft_model.DraftModelDraft` live in their own modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.transfer import to_device
from treedec.tree.token_tree import TokenTree
from treedec.tree.validate import int_list

__all__ = ["DeviceStep", "DraftSource", "PromptLookupDraft", "TargetOutput", "TreeDraft", "check_draft_tree",
           "target_states_at"]


class DraftSource:
    """Proposes a token tree to verify after ``sequence_tokens`` (prompt + tokens so far): the base
    class of every draft source.

    A subclass defines :meth:`propose`; the other members have defaults that fit a draft that does
    not read the target model (n-gram lookup, fixed trees), and drafts that condition on the target
    (Medusa heads, EAGLE, a draft model) override those they need. :func:`speculative_generate`
    and :func:`speculative_batch` use every member.
    """

    needs_hidden: bool = False
    """The target's final-norm hidden state at the token before each root is wanted, in
    :attr:`TargetOutput.hidden`."""

    row_head: Callable[[torch.Tensor], torch.Tensor] | None = None
    """A function of the target's final-norm hidden states ``[rows, hidden_size]`` -> ``[rows, ...]``
    that the target computes at every verified token inside the verification step
    (:meth:`Engine.add_row_head`, as ``"draft"``): e.g. Medusa heads' top-k candidates, so the next
    draft needs no step of its own. Its output at the last accepted token reaches :meth:`observe` as
    :attr:`TargetOutput.head`. The head stays on the engine after the request (removing it would
    drop the engine's captured graphs), for the next request with the same draft;
    ``engine.remove_row_head("draft")`` takes it off. None: no row head."""

    target_states: str | tuple[int, ...] | None = None
    """``"hidden"`` (the target's final-norm hidden states) or a tuple of layer indices (the residual
    stream entering them: :meth:`Engine.capture_hidden_layers`): the draft reads them at *every*
    token the target computes, in :attr:`TargetOutput.states` (EAGLE drafters). Its requests then
    compute their whole prompt themselves (no shared prefix: a shared prefix's states are not
    computed for each request). None: no states."""

    max_depth: int | None = None
    """The depth (the root's 0) of the deepest token of any tree it proposes: a request's prompt +
    ``max_new_tokens`` + ``max_depth - 1`` positions are checked against the model's before it runs.
    None: unknown (the request's own tokens are checked, and each tree as it comes)."""

    draft_probs: torch.Tensor | None = None
    """For a draft that samples its tokens, after each :meth:`propose` the ``[tree.size, vocab]``
    distributions it drew each node's children from (without replacement, in child order),
    processed with the acceptance rule's temperature, top-k and top-p
    (:func:`~treedec.sampling.params.sampling_probs`); the acceptance rule gets them
    (:class:`~treedec.programs.speculative.acceptance.RejectionSampling` is then lossless for such drafts).
    None: the draft's tokens are not sampled."""

    drafts_together: bool = False
    """True for drafts that draft for many requests at once (EAGLE and draft-model drafts on a shared drafter engine): a
    speculative program then calls :meth:`submit`, lets every other program of the scheduler pass submit
    too (:meth:`~treedec.runtime.program.ProgramContext.together`), and :meth:`collect` s its tree;
    :meth:`propose` is both, alone. Pipelined, with a :attr:`fixed_tree`: :meth:`submit_step` and
    :meth:`collect_step`, :meth:`device_drafts` both alone."""

    fixed_tree: TokenTree | None = None
    """The tree every proposal has, for a draft whose tokens are computed on the device from what the step
    before left there (:meth:`device_drafts`: its :attr:`row_head`'s output at the last accepted token, the
    target's states, or nothing for fixed tokens): its speculative loop can run pipelined
    (:mod:`~treedec.programs.speculative.verify_table`). None: not such a draft."""

    @property
    def batch_key(self):
        """For a draft with a :attr:`fixed_tree` and a :attr:`row_head`: drafts of equal keys make the draft tokens
        of many requests in one :meth:`row_head_drafts` call (of any of them) in batched verification
        (:mod:`~treedec.programs.speculative.verify_table`); None: each request's its own."""
        return None

    def row_head_drafts(self, heads: torch.Tensor) -> torch.Tensor:
        """The draft tokens of :attr:`fixed_tree` for ``R`` requests at once from their :attr:`row_head` outputs at
        their last accepted tokens (``heads [R, ...]`` on the device): ``[R, tree.size - 1]`` int64, without
        waiting (drafts with a fixed tree and a row head only)."""
        raise NotImplementedError(f"{type(self).__name__} has no row head drafting a fixed tree on the device")

    def device_drafts(self, step: DeviceStep) -> torch.Tensor:
        """The draft tokens of :attr:`fixed_tree` (``[tree.size - 1]`` int64 on ``step.device``, the root
        excluded) from what the step before left on the device, without waiting (drafts with a
        :attr:`fixed_tree` only)."""
        raise NotImplementedError(f"{type(self).__name__} has no fixed tree drafted on the device (fixed_tree is "
                                  f"None)")

    def submit_step(self, step: DeviceStep) -> None:
        """Queue :meth:`device_drafts` of ``step`` with the other requests' (drafts with a :attr:`fixed_tree` and
        :attr:`drafts_together` only: a pipelined loop then calls it, lets every other program of the scheduler
        pass submit too, and :meth:`collect_step` s the tokens)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft on the device together: call device_drafts()")

    def collect_step(self) -> torch.Tensor:
        """The submitted step's draft tokens, as :meth:`device_drafts` returns them."""
        raise NotImplementedError(f"{type(self).__name__} does not draft on the device together: call device_drafts()")

    def submit(self, sequence_tokens: Sequence[int]) -> None:
        """Queue the proposal after ``sequence_tokens`` (drafts with :attr:`drafts_together` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft together (drafts_together is False): "
                                  f"call propose()")

    def collect(self) -> tuple[TokenTree, list[int]]:
        """The submitted proposal's ``(tree, tokens)``, as :meth:`propose` returns them (drafts with
        :attr:`drafts_together` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft together (drafts_together is False): "
                                  f"call propose()")

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]:
        """The token tree to verify after ``sequence_tokens``.

        Returns
        -------
        (tree, tokens) : a :class:`~treedec.tree.token_tree.TokenTree` and its ``tree.size`` token
            ids, ``tokens[0] == sequence_tokens[-1]`` (the root: the last token, not yet computed).
        """
        raise NotImplementedError(f"{type(self).__name__} must define propose(sequence_tokens)")

    def start(self, engine: Engine) -> None:
        """Called once per request before its prefill, with the target's engine: check the draft fits the
        target (vocabulary, hidden size) and reset per-request state; raise, changing nothing, when it does
        not fit. Default: nothing to check."""

    def observe(self, output: TargetOutput) -> None:
        """Called with a :class:`TargetOutput` after the prefill and after every verification step that
        does not end the request, before the next :meth:`propose`. Default: ignored."""

    def reset(self) -> None:
        """Called when a request ends without keeping its node (and after a failure): free the draft's
        per-request state (a drafter's KV pages: its engine may serve other requests). Default: nothing
        to free."""


@dataclass(frozen=True)
class DeviceStep:
    """What a pipelined step's draft gets from the target's step before it (:meth:`DraftSource.device_drafts`):
    device values, none of them read back.

    Attributes
    ----------
    device : the target's device.
    head : the draft's :attr:`~DraftSource.row_head` output at the last accepted token (None: no row head).
    states : ``[n, ...]`` the target's :attr:`~DraftSource.target_states` at the tokens it computed since the
        last proposal (after the prefill, the prompt's; then the last root and the ``n - 1`` path slots of its
        tree, of which the first ``count - 1`` were accepted); None when the draft reads no states.
    tokens : ``[n]`` int64: the token that follows each of them (the last real one: the new root); None with
        ``states``.
    count : one-element int64 tensor: how many of the ``n`` are real (a prefix); None: all ``n``.
    unused : how many of the previous :class:`DeviceStep`'s ``n`` were not real: known on the host by now (a
        drafter drops what it computed for them).
    """

    device: torch.device
    head: torch.Tensor | None = None
    states: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    count: torch.Tensor | None = None
    unused: int = 0


def target_states_at(engine: Engine, states, out, rows: list[int] | None = None) -> torch.Tensor | None:
    """The target states a draft reads (its :attr:`~DraftSource.target_states`: None, ``"hidden"`` or layer
    indices) from a step's output ``out`` (its ``hidden`` / ``aux``), at ``rows`` of it (None: all)."""
    if states is None:
        return None
    if states == "hidden":
        return out.hidden if rows is None else out.hidden[rows]
    which = [engine.hidden_layers.index(i) for i in states]
    if which == list(range(which[0], which[0] + len(which))):   # (as captured: a view, no index to send)
        aux = out.aux[:, which[0]:which[0] + len(which)]
    else:   # (a list index would be a pageable copy: a wait for the device)
        aux = out.aux.index_select(1, to_device(np.asarray(which, dtype=np.int64), out.aux.device))
    return aux if rows is None else aux[rows]


@dataclass(frozen=True)
class TargetOutput:
    """What the target model computed up to the newest root, for drafts that read it.

    Attributes
    ----------
    tokens : the sequence: prompt + every emitted token; ``tokens[-1]`` is the next root.
    hidden : [hidden_size] the target's final-norm hidden state at ``tokens[-2]`` (the last
        accepted token, or the prompt's last token after the prefill: the state the root
        was drawn from); None unless the draft ``needs_hidden``.
    head : the draft's ``row_head`` output at that same token, on the host; None unless the
        draft has a ``row_head``.
    states : the target states the draft reads at every token (its ``target_states``), at the
        tokens computed since the last observation, ``tokens[-1 - n:-1]`` for ``n = len(states)``:
        the whole prompt after the prefill, the root and the accepted tokens after a step. Final-norm
        hidden states ``[n, hidden_size]``, or the inputs of the draft's layers ``[n, k, hidden_size]``;
        None unless the draft has ``target_states``.
    """

    tokens: list[int]
    hidden: torch.Tensor | None
    head: torch.Tensor | None = None
    states: torch.Tensor | None = None


@dataclass
class PromptLookupDraft(DraftSource):
    """Prompt-lookup (n-gram) drafts: continue the sequence as it continued after an earlier
    occurrence of its last n-gram.

    The longest n in ``[min_ngram, max_ngram]`` with a match wins; matches are taken most
    recent first, up to ``max_matches`` distinct continuations of up to
    ``num_draft_tokens`` tokens each, merged into one tree (shared prefixes once).
    No match: the tree is the root alone (the step is a plain decoding step).
    """

    max_ngram: int = 3
    min_ngram: int = 1
    num_draft_tokens: int = 8
    max_matches: int = 1

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram", "num_draft_tokens", "max_matches"):
            positive_int(name, getattr(self, name))
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")

    @property
    def max_depth(self) -> int:
        """The deepest draft token: a continuation's last."""
        return self.num_draft_tokens

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]:
        seq = np.asarray(sequence_tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)   # n-grams that have a next token
            starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))[::-1]
            continuations: list[list[int]] = []
            for s in starts.tolist():
                cont = seq[s + n: s + n + self.num_draft_tokens].tolist()
                if cont not in continuations:
                    continuations.append(cont)
                if len(continuations) == self.max_matches:
                    break
            if continuations:
                return _trie(int(seq[-1]), continuations)
        return TokenTree.chain(0), [int(seq[-1])]


class TreeDraft(DraftSource):
    """A fixed tree shape with caller-given draft tokens (a replayed or scripted draft).

    Parameters
    ----------
    tree : the shape, e.g. ``TokenTree.from_medusa_choices(...)``.
    tokens : the ``tree.size - 1`` draft tokens (token 1 onwards), or a function of the
        sequence so far that returns them each step.
    """

    def __init__(self, tree: TokenTree, tokens: Sequence[int] | Callable[[list[int]], Sequence[int]]):
        self.tree = tree
        self.tokens = tokens
        self._on_device: torch.Tensor | None = None
        if not callable(tokens):
            self._check(list(tokens))

    @property
    def fixed_tree(self) -> TokenTree | None:
        """The tree, when the draft tokens are fixed (not a function of the sequence): then every proposal is
        known ahead and the loop can run pipelined."""
        return None if callable(self.tokens) else self.tree

    def start(self, engine: Engine) -> None:
        """Check fixed draft tokens against the target's vocabulary (a pipelined loop reads them on the device,
        where an id out of range would not be caught)."""
        vocab = engine.model.config.vocab_size
        bad = [] if callable(self.tokens) else [t for t in self.tokens if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"TreeDraft tokens must be token ids in [0, {vocab}), got {bad[:5]}")

    def device_drafts(self, step: DeviceStep) -> torch.Tensor:
        """The fixed draft tokens on ``step.device`` (copied once)."""
        if callable(self.tokens):
            return super().device_drafts(step)
        if self._on_device is None or self._on_device.device != torch.device(step.device):
            self._on_device = to_device(np.array([int(t) for t in self.tokens], dtype=np.int64), step.device)
        return self._on_device

    @property
    def max_depth(self) -> int:
        """The depth of the tree's deepest token."""
        return max(self.tree.depth)

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]:
        draft = list(self.tokens(list(sequence_tokens)) if callable(self.tokens) else self.tokens)
        self._check(draft)
        return self.tree, [int(sequence_tokens[-1])] + draft

    def _check(self, draft: list[int]) -> None:
        if len(draft) != self.tree.size - 1:
            raise ValueError(f"TreeDraft needs {self.tree.size - 1} draft tokens (tree.size - 1), got {len(draft)}")


def check_draft_source(value, what: str) -> None:
    """Raise a TypeError naming ``what`` and the type of ``value`` unless it is a :class:`DraftSource`."""
    if not isinstance(value, DraftSource):
        raise TypeError(f"{what} must be a draft source, got {type(value).__name__}: subclass "
                        f"treedec.programs.speculative.drafts.DraftSource (it declares every member a draft may define)")


# ================================================================ private


def _trie(root: int, continuations: list[list[int]]) -> tuple[TokenTree, list[int]]:
    """The token tree of ``continuations`` after ``root``, shared prefixes merged."""
    index: dict[tuple[int, ...], int] = {(): 0}
    parents, tokens = [-1], [root]
    for cont in continuations:
        for d in range(1, len(cont) + 1):
            key = tuple(cont[:d])
            if key not in index:
                parents.append(index[key[:-1]])
                tokens.append(cont[d - 1])
                index[key] = len(index)
    return TokenTree(tuple(parents)), tokens


def check_draft_tree(engine: Engine, node: int, tree: TokenTree, tokens, last: int | None = None,
                     max_tokens: int | None = None) -> list[int]:
    """The checks of a verification step before it changes anything: a draft's ``tokens`` (``[tree.size]``
    ids, ``tokens[0]`` the root) as ints, checked against ``tree``, the vocabulary and the leaf ``node`` that
    the tree will hang under; ``last``: the sequence's last token, which must be the root; ``max_tokens``: the
    largest tree allowed.

    Raises ``TypeError`` (tokens that are not integers), ``ValueError`` (a wrong count, an id out of the
    vocabulary, a wrong root, a tree too large, a ``node`` with children) or
    :class:`~treedec.errors.TreeError` (an unknown ``node``).
    """
    tokens = int_list(tokens, "tokens", low=0)   # all checks before the root token is appended
    if len(tokens) != tree.size:
        raise ValueError(f"tokens must have one token per tree token ({tree.size}), got {len(tokens)}")
    if last is not None and tokens[0] != last:
        raise ValueError(f"the draft's propose must return tokens[0] == the last sequence token {last}, "
                         f"got {tokens[:1]}")
    if max_tokens is not None and tree.size > max_tokens:
        raise ValueError(f"the draft proposed a {tree.size}-token tree; at most max_draft_tokens={max_tokens}")
    vocab = engine.model.config.vocab_size
    bad = [x for x in tokens if not 0 <= x < vocab]
    if bad:
        raise ValueError(f"draft tokens must be token ids in [0, {vocab}), got {bad[:5]}")
    t = engine.tree
    if t.children(node):
        raise ValueError(f"node {node} must be a leaf to verify a token tree under it, it has children "
                         f"{t.children(node)[:5]}")
    return tokens
