"""Speculative decoding configured once for many requests (:class:`SpeculativeConfig`, vLLM's
``speculative_config``): which draft source, its weights and its shape; :meth:`SpeculativeConfig.build` loads what
it needs once (Medusa heads, an EAGLE drafter or a draft model and its engine) and returns each request's draft
source (:class:`Drafts`), the form :func:`~treedec.programs.speculative.batch.speculative_batch` takes."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Sequence

from treedec.checks import describe, nonnegative_int, positive_int
from treedec.engine import Engine
from treedec.models import DecoderModel, from_pretrained
from treedec.models.eagle_drafter import EagleDrafter, load_eagle
from treedec.models.medusa import MedusaHeads, load_medusa_heads
from treedec.runtime.requests import RequestSpec
from treedec.programs.speculative.draft_model import DraftModelDraft
from treedec.programs.speculative.drafts import DraftSource, PromptLookupDraft, TreeDraft
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.medusa import DEFAULT_MEDUSA_CHOICES, MedusaDraft

__all__ = ["METHODS", "Drafts", "SpeculativeConfig", "as_speculative_config"]

#: The draft sources by name (vLLM's method names where it has them).
METHODS = ("ngram", "medusa", "eagle", "eagle3", "draft_model", "tree")
#: ``model`` for the methods with weights: random (EAGLE) or untrained (Medusa) weights, for trying the machinery
#: (acceptance is then near zero, and the run says so).
RANDOM = "random"


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How every request of an :class:`~treedec.LLM` is drafted. Checked on construction.

    Attributes
    ----------
    method : one of :data:`METHODS`: ``"ngram"`` (prompt lookup, no weights), ``"medusa"`` (Medusa heads),
        ``"eagle"`` / ``"eagle3"`` (an EAGLE drafter), ``"draft_model"`` (a small model of the same vocabulary),
        ``"tree"`` (a fixed token tree with given tokens: ``tree``).
    model : the drafter's weights: a Medusa heads file or folder, an EAGLE checkpoint folder, a draft model (any
        name :func:`~treedec.models.from_pretrained` takes); ``"random"`` for random / untrained weights (the
        machinery only: acceptance near zero). Required by medusa, eagle, eagle3 and draft_model.
    num_speculative_tokens : the draft's depth: tokens per n-gram match, EAGLE / draft-model tree depth; (Medusa:
        its heads come from ``model``, its tree from ``medusa_choices``).
    prompt_lookup_max : ngram: the longest n-gram matched.
    prompt_lookup_matches : ngram: the continuations merged into one tree.
    top_k : eagle / draft_model: each drafted token's expansion width.
    total_tokens : eagle / draft_model: draft tokens a step verifies (the dynamic tree's size).
    medusa_choices : medusa: the tree's paths (default DEFAULT_MEDUSA_CHOICES: 10 draft tokens, depth 4; Medusa's tuned
        63-token tree is ``treedec.programs.speculative.medusa.MEDUSA_64_CHOICES``).
    tree : tree: the :class:`~treedec.programs.speculative.drafts.TreeDraft` every request uses.
    seed : random drafter weights and sampled drafts.
    """

    method: str
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_matches: int = 2
    top_k: int = 4
    total_tokens: int = 16
    medusa_choices: Sequence[Sequence[int]] = DEFAULT_MEDUSA_CHOICES
    tree: TreeDraft | None = None
    seed: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {describe(self.method)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_matches", "top_k", "total_tokens"):
            positive_int(name, getattr(self, name))
        nonnegative_int("seed", self.seed)
        weighted = self.method in ("medusa", "eagle", "eagle3", "draft_model")
        if weighted and not isinstance(self.model, str):
            raise ValueError(f"method {self.method!r} needs model: the drafter's weights (a path or a model name), or "
                             f"{RANDOM!r} for random weights (acceptance near zero); got {describe(self.model)}")
        if not weighted and self.model is not None:
            raise ValueError(f"method {self.method!r} has no weights: leave model None, got {self.model!r}")
        if (self.method == "tree") != (self.tree is not None):
            raise ValueError("method 'tree' needs tree=TreeDraft(...), and only it takes one")
        if self.tree is not None and not isinstance(self.tree, TreeDraft):
            raise ValueError(f"tree must be a TreeDraft, got {describe(self.tree)}")

    def build(self, engine: Engine) -> Drafts:
        """Load the drafter for ``engine``'s model (its dtype and device) once; the draft engines get ``engine``'s
        pool size, page size and backend."""
        target = engine.model
        if self.method == "ngram":
            base = PromptLookupDraft(max_ngram=self.prompt_lookup_max, num_draft_tokens=self.num_speculative_tokens,
                                     max_matches=self.prompt_lookup_matches)
            return Drafts(lambda spec: dataclasses.replace(base), f"prompt lookup {base}")
        if self.method == "tree":
            return Drafts(lambda spec: self.tree, f"a fixed tree of {self.tree.tree.size - 1} draft tokens")
        if self.method == "medusa":
            choices = [list(c) for c in self.medusa_choices]
            depth = max(len(c) for c in choices)
            heads = MedusaHeads.untrained(target, num_heads=depth, seed=self.seed) if self.model == RANDOM \
                else load_medusa_heads(self.model, target)
            note = "UNTRAINED Medusa heads" if self.model == RANDOM else f"Medusa heads from {self.model}"
            MedusaDraft(heads, choices)   # checks the tree against the heads before any request
            return Drafts(lambda spec: MedusaDraft(heads, choices), f"{note}, {len(choices)} draft tokens a step")
        shape = dict(depth=self.num_speculative_tokens, top_k=self.top_k, total_tokens=self.total_tokens)
        draft_engine = Engine(self._drafter(target), kv_tokens=engine.pool.num_pages * engine.pool.page_size,
                              page_size=engine.pool.page_size, backend=engine.attn.backend)
        note = f"{self.method} drafter {'with RANDOM weights' if self.model == RANDOM else 'from ' + self.model}"
        if self.method == "draft_model":
            return Drafts(lambda spec: DraftModelDraft(draft_engine, **shape, seed=_seed(spec, self.seed)), note)
        return Drafts(lambda spec: EagleDraft(draft_engine, **shape, seed=_seed(spec, self.seed)), note)

    def _drafter(self, target: DecoderModel):
        if self.method == "draft_model":
            if self.model == RANDOM:
                raise ValueError("method 'draft_model' needs a real draft model (random weights draft nothing "
                                 "useful); give model=<path or name>")
            return from_pretrained(self.model, dtype=target.dtype, device=target.device)
        if self.model == RANDOM:
            return EagleDrafter.random(target, self.method, seed=self.seed)
        return load_eagle(self.model, target, self.method)


@dataclass(frozen=True)
class Drafts:
    """What :meth:`SpeculativeConfig.build` made: ``source(spec)`` is a request's draft source (stateful ones new
    per request, sharing the loaded weights and draft engine); ``note`` says what it is."""

    source: Callable[[RequestSpec], DraftSource]
    note: str


def _seed(spec: RequestSpec, default: int) -> int:
    return default if spec.params.seed is None else spec.params.seed


def as_speculative_config(config) -> SpeculativeConfig | None:
    """``speculative_config`` as a :class:`SpeculativeConfig`: vLLM's dict (its keys checked) or one already."""
    if config is None or isinstance(config, SpeculativeConfig):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"speculative_config must be a dict of SpeculativeConfig's fields, a SpeculativeConfig or "
                        f"None, got {describe(config)}")
    fields = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    unknown = [key for key in config if key not in fields]
    if unknown:
        raise ValueError(f"speculative_config has key(s) {unknown} that treedec's SpeculativeConfig does not take "
                         f"(its fields: {', '.join(fields)})")
    return SpeculativeConfig(**config)
