"""Speculative decoding by token-tree verification: draft sources, greedy verification, the loop.

Each step a :class:`DraftSource` proposes a :class:`~treedec.tree.token_tree.TokenTree`
whose root is the sequence's last token; one engine step computes the root and every
draft token at once (tree attention: each token attends to its own path only). The
longest path whose tokens equal the model's greedy choice at their parent is accepted;
its K/V move onto the sequence node (no recompute), the rest of the tree is pruned, and
the model's choice after the last accepted token (the *bonus* token) is the root of the
next step's tree. So every step emits ``accepted + 1`` tokens, and greedy speculative
decoding emits exactly the tokens of plain greedy decoding, whatever the draft.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from treedec.engine import Engine, greedy
from treedec.errors import PoolExhaustedError
from treedec.tree.token_tree import TokenTree


class DraftSource(Protocol):
    """Proposes a token tree to verify after ``sequence_tokens`` (prompt + tokens so far).

    ``propose`` returns ``(tree, tokens)`` with ``len(tokens) == tree.size`` and
    ``tokens[0] == sequence_tokens[-1]`` (the root: the last token, not yet computed).
    """

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]: ...


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
    node : the request's sequence node (its tokens: prompt + every accepted token);
        prune it to free the request's pages.
    """

    steps: int = 0
    accepted: list[int] = field(default_factory=list)
    draft_sizes: list[int] = field(default_factory=list)
    node: int | None = None

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification step: mean accepted length + 1 (the bonus token)."""
        return (sum(self.accepted) + self.steps) / self.steps if self.steps else 0.0


def verify_greedy(engine: Engine, node: int, tree: TokenTree, tokens: Sequence[int]) -> tuple[list[int], int]:
    """Verify a token tree under leaf ``node`` in one engine step; keep the accepted path.

    ``tokens[0]`` (the root) is appended to ``node`` and the draft tokens hang under it.
    After the step, the longest root path whose every token equals the model's greedy
    choice at its parent is accepted: its K/V are copied onto ``node`` (no recompute), the
    rest is pruned. Checks its input first and changes nothing when it raises.

    Returns
    -------
    (accepted draft tokens, bonus token): the model's choice after the last accepted token.
    """
    t = engine.tree
    tokens = [int(x) for x in tokens]
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
    choice = greedy(engine.step(logits_rows=engine.pending_rows([node] + ids))).tolist()

    children: list[list[int]] = [[] for _ in range(tree.size)]
    for i, p in enumerate(tree.parents[1:], start=1):
        children[p].append(i)
    path, cur = [], 0
    while True:
        cur = next((c for c in children[cur] if tokens[c] == choice[cur]), None) if children[cur] else None
        if cur is None:
            break
        path.append(cur)
    bonus = choice[path[-1] if path else 0]
    accepted = [tokens[i] for i in path]
    if ids:
        saved = engine.pool.gather(np.concatenate([t.slots(ids[i - 1]) for i in path])) if path else None
        for child in t.children(node):
            t.prune(child)
        if path:
            engine.pool.scatter(t.extend(node, accepted), saved)
            t.commit_step()   # their K/V are in place: nothing to recompute
    return accepted, bonus


def speculative_generate(engine: Engine, prompt_ids: Sequence[int], draft: DraftSource,
                         max_new_tokens: int) -> tuple[list[int], SpeculativeStats]:
    """Greedy speculative decoding of one request: prefill, then verification steps.

    Returns ``(tokens, stats)``: the first ``max_new_tokens`` new tokens (exactly those of
    plain greedy decoding) and the run's :class:`SpeculativeStats`. The request stays in
    ``engine.tree`` as node ``stats.node`` (prompt and every accepted token; the last
    step may have accepted past ``max_new_tokens``).
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    prompt = [int(x) for x in prompt_ids]
    node, logits = engine.prefill(prompt)
    stats = SpeculativeStats(node=node)
    out = [int(greedy(logits))]
    while len(out) < max_new_tokens:
        tree, tokens = draft.propose(prompt + out)
        if not tokens or tokens[0] != out[-1]:
            raise ValueError(f"{type(draft).__name__}.propose must return tokens[0] == the last sequence token "
                             f"{out[-1]}, got {tokens[:1]}")
        accepted, bonus = verify_greedy(engine, node, tree, tokens)
        out += accepted + [bonus]
        stats.steps += 1
        stats.accepted.append(len(accepted))
        stats.draft_sizes.append(tree.size - 1)
    return out[:max_new_tokens], stats


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
