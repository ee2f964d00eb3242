"""TokenTree: the shape of a speculative token tree (Medusa choices, EAGLE-2 expansion).

Token 0 is the *root*: the last token of the sequence so far (the model's own choice,
whose K/V the verification step computes). Every other token is a draft candidate for
the position after its parent. Parents come before their children.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from treedec.checks import describe, is_int, positive_int
from treedec.tree.validate import int_array, int_value


@dataclass(frozen=True)
class TokenTree:
    """The topology of a token tree.

    Attributes
    ----------
    parents : tuple of int, length N
        ``parents[0] == -1`` (the root); ``parents[i]`` in ``[0, i)`` for every other token.
        Given as any 1-D collection of integers (list, tuple, numpy or torch integer array);
        stored as a tuple of Python ints.

    Raises
    ------
    TypeError : ``parents`` is not a 1-D collection of integers (strings, floats, bools, None, ...).
    ValueError : ``parents`` do not describe a tree of that shape.
    """

    parents: tuple[int, ...]

    def __post_init__(self):
        parents = int_array(self.parents, "parents", low=-1)
        if len(parents) == 0 or parents[0] != -1:
            raise ValueError(f"parents must start with -1 (the root token), got {parents[:8].tolist()}")
        bad = np.flatnonzero((parents[1:] < 0) | (parents[1:] >= np.arange(1, len(parents)))) + 1
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"parents[{i}] must be an int index in [0, {i}) (parents come first), "
                             f"got {int(parents[i])}")
        object.__setattr__(self, "parents", tuple(parents.tolist()))

    # ================================================================ constructors

    @classmethod
    def chain(cls, num_draft: int) -> TokenTree:
        """The root and ``num_draft`` tokens in a line (a single draft continuation)."""
        return cls(tuple(range(-1, int_value(num_draft, "num_draft", low=0))))

    @classmethod
    def from_medusa_choices(cls, choices: Sequence[Sequence[int]]) -> TokenTree:
        """Build from Medusa ``choices``: one index path per draft token.

        Path ``[a, b]`` is the b-th candidate (of the second head) after the a-th candidate
        (of the first head). Paths are sorted by ``(len, path)``, as Medusa does, so token
        ``i + 1`` is the i-th path in that order; every proper prefix of a path must be a
        path too.

        Raises ValueError (only, whatever ``choices`` holds: callers turn it into their own
        format errors) naming the offending path.
        """
        if isinstance(choices, (str, bytes, bytearray)) or not isinstance(choices, Sequence):
            raise ValueError(f"choices must be a list of index paths (lists of ints), got {describe(choices)}")
        paths = []
        for i, p in enumerate(choices):
            if (isinstance(p, (str, bytes, bytearray)) or not isinstance(p, Sequence) or not p
                    or not all(is_int(x) and x >= 0 for x in p)):
                raise ValueError(f"choices[{i}] must be a non-empty list of non-negative ints, got {describe(p)}")
            paths.append(tuple(int(x) for x in p))
        paths.sort(key=lambda p: (len(p), p))
        index: dict[tuple[int, ...], int] = {(): 0}
        parents = [-1]
        for p in paths:
            if p in index:
                raise ValueError(f"choices list path {list(p)} twice")
            if p[:-1] not in index:
                raise ValueError(f"choices path {list(p)} has no parent path {list(p[:-1])}")
            parents.append(index[p[:-1]])
            index[p] = len(index)
        return cls(tuple(parents))

    # ================================================================ queries

    @property
    def size(self) -> int:
        """Tokens in the tree, the root included."""
        return len(self.parents)

    @property
    def depth(self) -> tuple[int, ...]:
        """Depth of every token (the root 0)."""
        out = [0] * self.size
        for i, p in enumerate(self.parents[1:], start=1):
            out[i] = out[p] + 1
        return tuple(out)

    @property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Every token's index path: its ordinal among its siblings at each level (the root ``()``)."""
        out: list[tuple[int, ...]] = [()]
        seen = [0] * self.size
        for p in self.parents[1:]:
            out.append(out[p] + (seen[p],))
            seen[p] += 1
        return tuple(out)

    def children(self, i: int) -> list[int]:
        """Token indices whose parent is token ``i``, in order."""
        return [j for j, p in enumerate(self.parents) if p == i]

    def draft_parents(self) -> list[int]:
        """Parents of tokens ``1..N-1`` re-indexed without the root (-1 for a root child).

        The ``parents`` argument of ``SequenceTree.add_token_tree`` for the draft tokens
        hung under the node whose last token is the root.
        """
        return [p - 1 for p in self.parents[1:]]


Candidates = Callable[[tuple[int, ...]], tuple[Sequence[int], Sequence[float]]]
LayerCandidates = Callable[[list[tuple[int, ...]]], Sequence[tuple[Sequence[int], Sequence[float]]]]


def expand_by_logprob(root_token: int, candidates: Candidates | LayerCandidates, depth: int, top_k: int,
                      total_tokens: int, batched: bool = False) -> tuple[TokenTree, list[int]]:
    """EAGLE-2 dynamic expansion: grow a tree by cumulative log-prob, keep the best nodes.

    Layer by layer (``depth`` layers), the ``top_k`` nodes of the last layer with the
    highest cumulative log-prob are expanded, each with the candidates
    ``candidates(token_path)`` returns (the draft's top-k next tokens and their log-probs
    after the token path, root excluded). Of all nodes made, the ``total_tokens`` with the
    highest cumulative log-prob are kept (ties: shallower, then earlier first). Log-probs
    are <= 0, so a kept node's ancestors are kept too.

    Parameters
    ----------
    root_token : the sequence's last token (token 0 of the result), an int >= 0.
    candidates : token path -> (tokens [k] ints >= 0, log-probs [k]); a pure function of its input.
    depth, top_k, total_tokens : ints >= 1; ``total_tokens`` counts draft tokens (not the root).
    batched : if True, ``candidates`` takes one layer's token paths at once (the nodes to
        expand, best first) and returns one ``(tokens, log-probs)`` per path, e.g. from one
        draft-model step over the whole frontier. It is called ``depth`` times, first with ``[()]``.

    Returns
    -------
    (tree, tokens) with ``tokens[0] == root_token``; nodes sorted by depth, then score.

    Raises
    ------
    TypeError : ``root_token`` or a candidate token is not an integer.
    ValueError : any other bad argument or candidate.
    """
    for name, value in [("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)]:
        positive_int(name, value)
    root_token = int_value(root_token, "root_token", low=0)
    # node: (score, depth, creation order, token path)
    made: list[tuple[float, int, int, tuple[int, ...]]] = []
    frontier: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    for d in range(1, depth + 1):
        layer = []
        paths = [path for _, path in frontier]
        results = list(candidates(paths)) if batched else [candidates(path) for path in paths]
        if len(results) != len(paths):
            raise ValueError(f"candidates gave {len(results)} results for a layer of {len(paths)} token paths")
        for (score, path), (tokens, logprobs) in zip(frontier, results):
            tokens = int_array(tokens, f"candidates({list(path)}) tokens", low=0).tolist()
            logprobs = [float(x) for x in logprobs]
            if len(tokens) != len(logprobs):
                raise ValueError(f"candidates({list(path)}) gave {len(tokens)} tokens but {len(logprobs)} log-probs")
            if len(set(tokens)) != len(tokens):
                raise ValueError(f"candidates({list(path)}) gave a token twice: {tokens}")
            for t, lp in zip(tokens, logprobs):
                if math.isnan(lp) or lp > 0:
                    raise ValueError(f"candidates({list(path)}) gave log-prob {lp} for token {t}, expected <= 0")
                layer.append((score + lp, d, len(made) + len(layer), path + (t,)))
        made += layer
        best = sorted(layer, key=lambda n: (-n[0], n[2]))[:top_k]
        frontier = [(n[0], n[3]) for n in best]
    kept = sorted(made, key=lambda n: (-n[0], n[1], n[2]))[:total_tokens]
    kept.sort(key=lambda n: (n[1], -n[0], n[2]))
    index: dict[tuple[int, ...], int] = {(): 0}
    parents, tokens = [-1], [root_token]
    for _, _, _, path in kept:
        assert path[:-1] in index, f"kept node {path} without its parent"
        parents.append(index[path[:-1]])
        tokens.append(path[-1])
        index[path] = len(index)
    return TokenTree(tuple(parents)), tokens
