"""Speculative decoding by token-tree verification: draft sources, verification, the loop.

Each step a :class:`DraftSource` proposes a :class:`~treedec.tree.token_tree.TokenTree`
whose root is the sequence's last token; one engine step computes the root and every
draft token at once (tree attention: each token attends to its own path only). An
:class:`~treedec.search.acceptance.AcceptanceRule` picks the accepted path (greedy: the
longest path whose tokens equal the model's greedy choice at their parent); its K/V move
onto the sequence node (no recompute), the rest of the tree is pruned, and the token the
rule draws after the last accepted token (the *bonus* token) is the root of the next
step's tree. So every step emits ``accepted + 1`` tokens, and greedy speculative decoding
emits exactly the tokens of plain greedy decoding, whatever the draft. An EOS id on the
accepted path ends it there, as the bonus token: generation stops on it, and no K/V past
it is kept.

Draft sources: :class:`PromptLookupDraft`, :class:`TreeDraft` (here),
:class:`~treedec.search.medusa.MedusaDraft`, :class:`~treedec.search.draft_model.DraftModelDraft`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Protocol, Sequence

import numpy as np
import torch

from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.search.acceptance import AcceptanceRule, GreedyAcceptance
from treedec.search.request import MODEL_EOS, eos_token_ids
from treedec.transfer import HostCopy
from treedec.tree.token_tree import TokenTree
from treedec.tree.validate import int_list


class DraftSource(Protocol):
    """Proposes a token tree to verify after ``sequence_tokens`` (prompt + tokens so far).

    ``propose`` returns ``(tree, tokens)`` with ``len(tokens) == tree.size`` and
    ``tokens[0] == sequence_tokens[-1]`` (the root: the last token, not yet computed).

    Optional members, used by :func:`speculative_generate` when a draft has them (drafts
    that condition on the target model, e.g. Medusa heads):

    - ``start(engine)``: called once per request before the prefill; checks the draft
      fits the target (vocabulary, hidden size) and resets per-request state. Raises,
      changing nothing, when it does not fit.
    - ``needs_hidden`` (bool): the target's hidden states are wanted in :class:`TargetOutput`.
    - ``row_head``: a function of the target's final-norm hidden states ``[rows, hidden_size]``
      -> ``[rows, ...]`` that the target computes at every verified token inside the
      verification step (:meth:`Engine.add_row_head`, as ``"draft"``): e.g. Medusa heads' top-k
      candidates, so the next draft needs no step of its own. Its output at the last accepted
      token reaches ``observe`` as :attr:`TargetOutput.head`. The head stays on the engine after
      the request (removing it would drop the engine's captured graphs), for the next request
      with the same draft; ``engine.remove_row_head("draft")`` takes it off.
    - ``observe(output)``: called with a :class:`TargetOutput` after the prefill and after
      every verification step, before the next ``propose``.
    """

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]: ...


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
    """

    tokens: list[int]
    hidden: torch.Tensor | None
    head: torch.Tensor | None = None


# ================================================================ draft sources


@dataclass
class PromptLookupDraft:
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
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")

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


class TreeDraft:
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
        if not callable(tokens):
            self._check(list(tokens))

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]:
        draft = list(self.tokens(list(sequence_tokens)) if callable(self.tokens) else self.tokens)
        self._check(draft)
        return self.tree, [int(sequence_tokens[-1])] + draft

    def _check(self, draft: list[int]) -> None:
        if len(draft) != self.tree.size - 1:
            raise ValueError(f"TreeDraft needs {self.tree.size - 1} draft tokens (tree.size - 1), got {len(draft)}")


# ================================================================ verification


@dataclass
class SpeculativeStats:
    """Per-run counters of :func:`speculative_generate`.

    Attributes
    ----------
    steps : verification steps (engine steps after the prefill).
    accepted : draft tokens accepted at each step.
    draft_sizes : draft tokens verified at each step (the tree size less the root).
    draft_seconds, verify_seconds : wall time of each step's proposal and verification.
    prefill_seconds : wall time of the prefill and the first token.
    node : the request's sequence node (its tokens: prompt + every accepted token);
        prune it to free the request's pages.
    stop_reason : why generation stopped: "eos" (the last returned token is an EOS id)
        or "length" (``max_new_tokens`` reached), as :class:`~treedec.search.sampling.Sample`'s
        ``finish_reason``.
    """

    steps: int = 0
    accepted: list[int] = field(default_factory=list)
    draft_sizes: list[int] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0
    node: int | None = None
    stop_reason: str = ""

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification step: mean accepted length + 1 (the bonus token)."""
        return (sum(self.accepted) + self.steps) / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of :func:`verify_tree`.

    Attributes
    ----------
    accepted : the accepted draft tokens (now on the sequence node, K/V included).
    bonus : the token drawn after the last accepted one: the next root (not yet computed).
    hidden : [hidden_size] the target's final-norm hidden state at the last accepted token
        (the root when none was accepted); None unless asked for.
    head : the engine's row head ``head_name``'s output at that token, on the host; None
        unless asked for.
    """

    accepted: list[int]
    bonus: int
    hidden: torch.Tensor | None = None
    head: torch.Tensor | None = None


def verify_greedy(engine: Engine, node: int, tree: TokenTree, tokens: Sequence[int]) -> tuple[list[int], int]:
    """Verify a token tree under leaf ``node`` with :class:`GreedyAcceptance` (see :func:`verify_tree`).

    Returns
    -------
    (accepted draft tokens, bonus token): the model's choice after the last accepted token.
    """
    result = verify_tree(engine, node, tree, tokens)
    return result.accepted, result.bonus


def verify_tree(engine: Engine, node: int, tree: TokenTree, tokens: Sequence[int],
                acceptance: AcceptanceRule = GreedyAcceptance(), return_hidden: bool = False,
                stop_ids: Collection[int] = (), head_name: str | None = None) -> VerifyResult:
    """Verify a token tree under leaf ``node`` in one engine step; keep the accepted path.

    ``tokens[0]`` (the root) is appended to ``node`` and the draft tokens hang under it.
    After the step, ``acceptance`` picks the accepted path from the target's logits at
    every tree token; its K/V are copied onto ``node`` (no recompute), the rest is pruned
    (its pages freed). Checks its input first and changes nothing when it raises.

    Parameters
    ----------
    tokens : [tree.size] token ids, ``tokens[0]`` the root.
    return_hidden : also return the hidden state at the last accepted token (Medusa heads
        read it).
    stop_ids : token ids (EOS) that end the accepted path: the first path token among them
        is returned as the bonus (it was drawn after the tokens before it), so neither it
        nor anything after it is kept on ``node``.
    head_name : a row head of the engine (:meth:`Engine.add_row_head`) whose output at the
        last accepted token to return; its rows are copied to the host while the acceptance
        reads the logits (one wait for both).
    """
    t = engine.tree
    if head_name is not None and head_name not in engine.row_heads:
        raise ValueError(f"head_name {head_name!r} is not a row head of the engine {engine.row_heads}")
    tokens = int_list(tokens, "tokens", low=0)   # all checks before the root token is appended
    if len(tokens) != tree.size:
        raise ValueError(f"tokens must have one token per tree token ({tree.size}), got {len(tokens)}")
    vocab = engine.model.config.vocab_size
    bad = [x for x in tokens if not 0 <= x < vocab]
    if bad:
        raise ValueError(f"draft tokens must be token ids in [0, {vocab}), got {bad[:5]}")
    if t.children(node):
        raise ValueError(f"node {node} must be a leaf to verify a token tree under it, it has children "
                         f"{t.children(node)[:5]}")
    # The root may start a fresh page and the drafts take fresh pages of their own.
    need = 1 + engine.pool.pages_for(tree.size - 1)
    if need > engine.pool.num_free_pages:
        raise PoolExhaustedError(f"KV pool exhausted: verifying a {tree.size}-token tree may need {need} pages, "
                                 f"{engine.pool.num_free_pages} free; nothing was changed")
    t.extend(node, tokens[:1])
    ids = t.add_token_tree(node, tokens[1:], tree.draft_parents()) if tree.size > 1 else []
    out = engine.step(logits_rows=engine.pending_rows([node] + ids), return_hidden=return_hidden,
                      return_heads=head_name is not None)
    logits, *rest = out if isinstance(out, tuple) else (out,)
    hidden = rest.pop(0) if return_hidden else None
    heads = HostCopy(rest[0][head_name]) if head_name is not None else None
    path, bonus = acceptance.accept(tree, tokens, logits)
    assert all(tree.parents[c] == p for p, c in zip([0] + path, path)), f"not a root path: {path=}"
    stop = next((d for d, i in enumerate(path) if tokens[i] in stop_ids), None)
    if stop is not None:
        path, bonus = path[:stop], tokens[path[stop]]
    accepted = [tokens[i] for i in path]
    if ids:
        t.accept(node, [ids[i - 1] for i in path])   # their K/V move onto node; the rest is freed
    last = path[-1] if path else 0
    return VerifyResult(accepted, int(bonus), None if hidden is None else hidden[last],
                        None if heads is None else heads.tensor()[last])


def speculative_generate(engine: Engine, prompt_ids: Sequence[int], draft: DraftSource, max_new_tokens: int,
                         acceptance: AcceptanceRule | None = None,
                         on_step: Callable[[SpeculativeStats, int], None] | None = None,
                         eos_token_id: int | Sequence[int] | str | None = MODEL_EOS
                         ) -> tuple[list[int], SpeculativeStats]:
    """Speculative decoding of one request: prefill, then verification steps.

    Parameters
    ----------
    draft : the draft source; its optional ``start`` / ``needs_hidden`` / ``observe``
        members are used (see :class:`DraftSource`).
    max_new_tokens : int >= 1.
    acceptance : default :class:`GreedyAcceptance` (then the tokens are exactly those of
        plain greedy decoding); :class:`~treedec.search.acceptance.TypicalAcceptance` or
        :class:`~treedec.search.acceptance.RejectionSampling` for sampled decoding.
    on_step : called as ``on_step(stats, emitted)`` after every verification step
        (``emitted``: new tokens so far), e.g. to advance a progress bar.
    eos_token_id : ``"model"`` (default: ``engine.model.eos_token_ids``, the checkpoint's),
        an id, several ids, or None (no EOS stop).

    Returns ``(tokens, stats)``: the new tokens up to and including the first EOS id, at
    most ``max_new_tokens`` of them, and the run's :class:`SpeculativeStats`
    (``stats.stop_reason`` says which limit ended it). The request stays in
    ``engine.tree`` as node ``stats.node``: prompt and every accepted token, the last
    token not included (it is not computed), as plain greedy decoding leaves it; the last
    step may have accepted past ``max_new_tokens``, never past an EOS.
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    acceptance = GreedyAcceptance() if acceptance is None else acceptance
    if not isinstance(acceptance, AcceptanceRule):
        raise TypeError(f"acceptance must be an AcceptanceRule (first_token and accept methods), "
                        f"got {type(acceptance).__name__}")
    eos = frozenset(eos_token_ids(eos_token_id, engine.model))
    prompt = [int(x) for x in prompt_ids]
    needs_hidden = bool(getattr(draft, "needs_hidden", False))
    observe = getattr(draft, "observe", None)
    if hasattr(draft, "start"):
        draft.start(engine)
    head_name = _add_draft_head(engine, getattr(draft, "row_head", None))
    start = time.perf_counter()
    node, logits, *rest = engine.prefill(prompt, return_hidden=needs_hidden, return_heads=head_name is not None)
    hidden = rest.pop(0) if needs_hidden else None
    head = rest[0][head_name].cpu() if head_name is not None else None
    stats = SpeculativeStats(node=node)
    out = [acceptance.first_token(logits)]
    stats.prefill_seconds = time.perf_counter() - start
    sequence = prompt + out   # built once a step: O(sequence) for the draft's observe and propose
    if observe is not None:
        observe(TargetOutput(sequence, hidden, head))
    while len(out) < max_new_tokens and out[-1] not in eos:
        start = time.perf_counter()
        tree, tokens = draft.propose(sequence)
        if not tokens or tokens[0] != out[-1]:
            raise ValueError(f"{type(draft).__name__}.propose must return tokens[0] == the last sequence token "
                             f"{out[-1]}, got {tokens[:1]}")
        drafted = time.perf_counter()
        result = verify_tree(engine, node, tree, tokens, acceptance, return_hidden=needs_hidden, stop_ids=eos,
                             head_name=head_name)
        out += result.accepted + [result.bonus]
        sequence = prompt + out
        stats.steps += 1
        stats.accepted.append(len(result.accepted))
        stats.draft_sizes.append(tree.size - 1)
        stats.draft_seconds.append(drafted - start)
        stats.verify_seconds.append(time.perf_counter() - drafted)
        if observe is not None:
            observe(TargetOutput(sequence, result.hidden, result.head))
        if on_step is not None:
            on_step(stats, min(len(out), max_new_tokens))
    out = out[:max_new_tokens]
    stats.stop_reason = "eos" if out[-1] in eos else "length"
    return out, stats


def greedy_generate(engine: Engine, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | str | None = MODEL_EOS, pipeline: bool | None = None
                    ) -> list[int]:
    """Plain greedy decoding, one token per engine step: the reference that greedy
    speculative decoding must equal.

    Returns the new tokens up to and including the first EOS id (``eos_token_id`` as in
    :func:`speculative_generate`), at most ``max_new_tokens``. The request stays in
    ``engine.tree`` (its root node): the prompt and every new token but the last.

    ``pipeline`` (default: on for a CUDA engine, where the device runs asynchronously; off on the
    CPU, where nothing would overlap): each step is planned and launched before the previous
    step's token is read back (:meth:`Engine.step` reads it on the device), so the host's work
    runs while the device computes. After an EOS one step more has run; its token is dropped
    from the tree (:meth:`SequenceTree.truncate`), so the result and the tree are the same.
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    eos = frozenset(eos_token_ids(eos_token_id, engine.model))
    prompt = [int(x) for x in prompt_ids]
    pipeline = engine.device.type == "cuda" if pipeline is None else pipeline
    node, logits = engine.prefill(prompt)
    if not pipeline:
        out = [int(logits.argmax())]
        while len(out) < max_new_tokens and out[-1] not in eos:
            engine.tree.extend(node, out[-1:])
            out.append(int(engine.step()[0].argmax()))
        return out
    tree = engine.tree
    pending = logits.argmax().reshape(1)
    read = HostCopy(pending)
    out: list[int] = []
    while True:
        launched = None
        if len(out) + 1 < max_new_tokens:
            tree.extend(node, [0])    # a placeholder: the step reads `pending` on the device
            launched = engine.step(tokens=pending)[0].argmax().reshape(1)
            next_read = HostCopy(launched)
        token = read.result()[0]
        if launched is not None:
            tree.set_tokens(node, len(prompt) + len(out), [token])
        out.append(token)
        if token in eos or len(out) >= max_new_tokens:
            if launched is not None:
                tree.truncate(node, len(prompt) + len(out) - 1)
            return out
        pending, read = launched, next_read


# ================================================================ private


#: The row head name (:meth:`Engine.add_row_head`) of a draft source's ``row_head``.
DRAFT_HEAD = "draft"


def _add_draft_head(engine: Engine, row_head) -> str | None:
    """Put the draft's ``row_head`` on the engine as :data:`DRAFT_HEAD` (replacing another draft's);
    its name, or None for a draft without one."""
    if row_head is None:
        return None
    if DRAFT_HEAD in engine.row_heads:
        if engine.row_head(DRAFT_HEAD) == row_head:   # bound methods of one draft compare equal
            return DRAFT_HEAD
        engine.remove_row_head(DRAFT_HEAD)
    engine.add_row_head(DRAFT_HEAD, row_head)
    return DRAFT_HEAD


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
