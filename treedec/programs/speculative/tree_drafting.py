"""Token trees drafted by a network on an engine of its own, layer by layer (EAGLE-2's dynamic trees).

:class:`EngineTreeDraft` is what :class:`~treedec.programs.speculative.draft_model.DraftModelDraft` and
:class:`~treedec.programs.speculative.eagle.EagleDraft` share: each proposal first brings the drafter up to
the sequence (the root's logits), then grows the tree ``depth`` layers deep, one drafter step
per layer over the layer's frontier, and keeps the best ``total_tokens`` nodes by cumulative
log-prob. Greedy (top-k) drafts do it with every other request on their drafter engine
(:class:`~treedec.programs.speculative.drafter_batch.DrafterGroup`: one sync step, then the frontier in ``top_k``
chains of scratch KV slots, one :class:`~treedec.engine.step_chain.StepChain` for all requests;
:meth:`~EngineTreeDraft.sync_inputs` gives a request's new queries; the group reads and writes a draft's state
through its public methods only). With ``sample``, a proposal draws each expanded
node's children without replacement, alone (``_sync``, ``_frontier_logits``), and reports the
distributions drawn from (:attr:`draft_probs`). A drafter whose vocabulary differs from the
target's maps its ids (:meth:`~EngineTreeDraft.to_target`, ``_target_probs``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.sampling.params import SamplingParams, sampling_probs
from treedec.programs.speculative.drafter_batch import DrafterGroup
from treedec.programs.speculative.drafts import DraftSource
from treedec.tree.token_tree import TokenTree


class EngineTreeDraft(DraftSource):
    """The tree growth of drafts that run on their own :class:`~treedec.engine.Engine`; subclasses
    define :meth:`sync_inputs` (greedy drafts), ``_sync`` and ``_frontier_logits`` (sampled drafts; see the module
    docstring). Parameters as
    :class:`~treedec.programs.speculative.draft_model.DraftModelDraft`'s; ``what`` names the engine in errors."""

    def __init__(self, engine: Engine, what: str, depth: int, top_k: int, total_tokens: int,
                 sample: SamplingParams | None, seed: int):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be {what} Engine, got {type(engine).__name__}")
        for name, value in [("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)]:
            positive_int(name, value)
        vocab = self._draft_vocab_size(engine)
        if top_k > vocab:
            raise ValueError(f"top_k ({top_k}) must be <= the draft vocabulary ({vocab})")
        if sample is not None and (not isinstance(sample, SamplingParams) or sample.temperature == 0):
            raise ValueError(f"sample must be SamplingParams with a temperature > 0 (or None: top-k drafts), "
                             f"got {sample!r}")
        self.engine, self.depth, self.top_k, self.total_tokens = engine, depth, top_k, total_tokens
        self.sample, self.seed = sample, seed
        self.draft_probs: torch.Tensor | None = None     # with sample: [tree.size, vocab] of the last proposal
        self._generator: torch.Generator | None = None
        self._node: int | None = None                    # the drafter's sequence node
        self._computed: dict[tuple[int, ...], int] = {}  # sampled: token path after the root -> drafter node
        self._outputs: dict[tuple[int, ...], torch.Tensor] = {}   # EAGLE: token path -> the drafter's output feature
        self._scratch: np.ndarray | None = None          # [top_k, depth - 1] the chains' KV slots (scratch_slots)
        self._scratch_pages: np.ndarray | None = None

    @property
    def max_depth(self) -> int:
        """The deepest draft token of a proposal: ``depth``."""
        return self.depth

    @property
    def node(self) -> int | None:
        """The draft engine's sequence node of the current request (None before the first proposal)."""
        return self._node

    def reset(self) -> None:
        """Free the draft's request: its KV pages (its sequence, its chains' scratch slots) and anything it
        queued in its drafter engine's group."""
        if self._node is not None:
            self.engine.tree.prune(self._node)
        if self._scratch_pages is not None:
            self.engine.pool.decref(self._scratch_pages)
        DrafterGroup.of(self.engine).drop(self)
        self._node, self._computed, self._outputs = None, {}, {}
        self._scratch = self._scratch_pages = None

    @property
    def drafts_together(self) -> bool:
        """Greedy (top-k) drafts draft together with the other requests on their drafter engine (its
        :class:`~treedec.programs.speculative.drafter_batch.DrafterGroup`); sampled ones propose alone."""
        return self.sample is None

    def submit(self, sequence_tokens: Sequence[int]) -> None:
        """Queue this request's proposal in its drafter engine's group (see :attr:`drafts_together`)."""
        if not self.drafts_together:
            raise ValueError(f"a sampled {type(self).__name__} proposes alone: call propose()")
        # (not a copy of the whole sequence: the sync reads its length and its new tail only)
        DrafterGroup.of(self.engine).submit(self, sequence_tokens)

    def collect(self) -> tuple[TokenTree, list[int]]:
        """The tree of the submitted sequence: drafted together with every request submitted since."""
        return DrafterGroup.of(self.engine).collect(self)

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]:
        if self.sample is None:
            self.submit(sequence_tokens)
            return self.collect()
        seq = [int(x) for x in sequence_tokens]
        if not seq:
            raise ValueError("sequence_tokens must hold at least the root token, got none")
        root_logits = self._sync(seq)
        self._computed = {}
        return self._sampled_tree(seq[-1], root_logits)

    # ================================================================ what its drafter group reads and writes

    def sync_inputs(self, seq: Sequence[int]) -> tuple[list[int], torch.Tensor | None]:
        """The drafter's new queries for ``seq`` (its last token the root; greedy drafts, in their group's sync):
        their tokens and, for a drafter that reads them, the target's states at them (else None). Subclasses
        define it."""
        raise NotImplementedError(f"{type(self).__name__} must define sync_inputs")

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's ids (the same ids unless a subclass maps them)."""
        return draft_ids

    def extend_sequence(self, tokens: Sequence[int]) -> int:
        """Add ``tokens`` (pending) to the drafter's sequence, which they start when it has none (a sync step
        computes them); the sequence's node (:attr:`node`)."""
        if self._node is None:
            self._node = self.engine.tree.add_prompt(tokens)
        else:
            self.engine.tree.extend(self._node, tokens)
        return self._node

    @property
    def root_output(self) -> torch.Tensor | None:
        """EAGLE: the drafter's output feature ``[feature]`` at the root of the current proposal (the sync step's),
        None before a sync or for a drafter that has none. Setting it (None: clearing it) forgets the features of
        the last proposal's tree."""
        return self._outputs.get(())

    @root_output.setter
    def root_output(self, feature: torch.Tensor | None) -> None:
        self._outputs = {} if feature is None else {(): feature}

    def scratch_slots(self) -> np.ndarray:
        """The chains' KV slots ``[top_k, depth - 1]`` (their drafter group's chains write their K/V there): pages
        of the drafter's pool reserved at the first call, held until :meth:`reset`."""
        if self._scratch is None:
            e, k, n = self.engine, self.top_k, self.depth - 1
            pages = e.pool.pages_for(k * n)
            if pages > e.pool.num_free_pages:
                raise PoolExhaustedError(f"drafter KV pool exhausted: {k} chains of {n} tokens need {pages} "
                                         f"pages, {e.pool.num_free_pages} free")
            self._scratch_pages = e.pool.allocate(pages)
            slots = (self._scratch_pages[:, None] * e.pool.page_size + np.arange(e.pool.page_size)).reshape(-1)
            self._scratch = slots[:k * n].reshape(k, n)
        return self._scratch

    # ================================================================ hooks

    def _sync(self, seq: list[int]) -> torch.Tensor:
        """Bring the drafter to ``seq`` alone (sampled drafts; its last token the root); the logits [draft vocab]
        of the root's children."""
        raise NotImplementedError(f"{type(self).__name__} must define _sync")

    def _frontier_logits(self, paths: list[tuple[int, ...]]) -> torch.Tensor:
        """One drafter step over a layer's frontier (token paths after the root, target ids; each
        path's parent computed): their logits ``[len(paths), draft vocab]``."""
        raise NotImplementedError(f"{type(self).__name__} must define _frontier_logits")

    def _target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """Distributions over the draft vocabulary ``[..., draft vocab]`` -> over the target's."""
        return probs

    @staticmethod
    def _draft_vocab_size(engine: Engine) -> int:
        return getattr(engine.model, "draft_vocab_size", engine.model.config.vocab_size)

    # ================================================================ private

    def _sampled_tree(self, root: int, root_logits: torch.Tensor) -> tuple[TokenTree, list[int]]:
        """Layer by layer: the ``top_k`` frontier nodes with the best cumulative log-prob (which nodes
        grow may depend on values) each draw ``top_k`` children without replacement from their
        processed distribution, all kept in draw order; the last draws past ``total_tokens`` are
        dropped. Sets :attr:`draft_probs`."""
        if self._generator is None or self._generator.device != root_logits.device:
            self._generator = torch.Generator(device=root_logits.device).manual_seed(self.seed)
        paths: list[tuple[int, ...]] = [()]                      # node i's token path (root: ())
        parents, scores = [-1], [0.0]
        probs = {(): self._target_probs(sampling_probs(root_logits, self.sample))}   # path -> children's distribution
        frontier = [0]
        for d in range(self.depth):
            new = []
            for i in frontier:
                q = probs[paths[i]]
                k = min(self.top_k, int((q > 0).sum()), self.total_tokens + 1 - len(paths))
                if k <= 0:
                    break
                drawn = torch.multinomial(q, k, replacement=False, generator=self._generator)
                for token, lp in zip(drawn.tolist(), torch.log(q[drawn]).tolist()):
                    paths.append(paths[i] + (token,))
                    parents.append(i)
                    scores.append(scores[i] + lp)
                    new.append(len(paths) - 1)
            frontier = sorted(new, key=lambda j: -scores[j])[:self.top_k]
            if d + 1 == self.depth or not frontier:
                break
            logits = self._frontier_logits([paths[j] for j in frontier])
            probs.update(zip((paths[j] for j in frontier), self._target_probs(sampling_probs(logits, self.sample))))
        vocab = next(iter(probs.values())).shape[-1]
        self.draft_probs = torch.stack([probs.get(p, torch.zeros(vocab, device=root_logits.device)) for p in paths])
        return TokenTree(tuple(parents)), [root] + [p[-1] for p in paths[1:]]

    def _add_frontier(self, paths: list[tuple[int, ...]]) -> list[int]:
        """Hang the frontier nodes under their (computed) parents, pending, in one tree operation; their
        ids in ``paths`` order."""
        e = self.engine
        need = e.pool.pages_for(len(paths))
        if need > e.pool.num_free_pages:
            raise PoolExhaustedError(f"draft KV pool exhausted: a tree layer needs {need} pages, "
                                     f"{e.pool.num_free_pages} free")
        parents = [self._node if len(p) == 1 else self._computed[p[:-1]] for p in paths]
        ids = e.tree.add_children(parents, [p[-1] for p in paths])
        self._computed.update(zip(paths, ids))
        return ids
