"""Acceptance of trained drafters on held-out prompts, measured with treedec's own speculative decoding.

:func:`evaluate_medusa` decodes every prompt twice on one engine, one request at a time (the way ``treedec
spec --check`` does): greedy speculative decoding with the heads' token tree
(:class:`~treedec.programs.speculative.medusa.MedusaDraft`, default Medusa's 64-token tree ``mc_sim_7b_63``), and
plain greedy decoding; it reports the tokens a verification step gives (1 + the draft tokens accepted), the
accepted length of every step, whether the tokens equal plain greedy decoding's, and both runs' times.
:func:`evaluate_eagle3` does the same with an EAGLE-3 drafter's dynamic trees.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Sequence

import numpy as np

from treedec.engine import Engine
from treedec.models.base import DecoderModel
from treedec.models.eagle_drafter import EagleDrafter
from treedec.models.medusa import MedusaHeads
from treedec.models.text import encode_prompt
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.acceptance import GreedyAcceptance
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.medusa import MEDUSA_64_CHOICES, MedusaDraft
from treedec.programs.speculative.program import speculative_generate
from treedec.runtime.requests import RequestSpec

__all__ = ["Acceptance", "choices_for", "evaluate_eagle3", "evaluate_medusa"]


@dataclass(frozen=True)
class Acceptance:
    """:func:`evaluate_medusa`'s measurements (``as_json()`` for the results file).

    Attributes
    ----------
    tokens_per_step : new tokens per verification step over all prompts (1 + mean accepted draft tokens).
    accepted_histogram : accepted draft tokens -> steps.
    equal_to_greedy : every prompt's tokens equal plain greedy decoding's.
    speedup : plain greedy decoding's seconds over speculative decoding's (decode loops, prefill included).
    per_prompt : per prompt: its id, new tokens, steps, tokens a step, every step's accepted length, equal.
    draft_tokens : draft tokens of the tree (63 for Medusa's 64-token tree).
    """

    tokens_per_step: float
    accepted_histogram: dict
    equal_to_greedy: bool
    speculative_seconds: float
    greedy_seconds: float
    speedup: float
    draft_tokens: int
    per_prompt: list = field(default_factory=list)

    def as_json(self) -> dict:
        return {"tokens_per_step": round(self.tokens_per_step, 4), "equal_to_greedy": self.equal_to_greedy,
                "accepted_histogram": self.accepted_histogram, "draft_tokens": self.draft_tokens,
                "speculative_seconds": round(self.speculative_seconds, 3),
                "greedy_seconds": round(self.greedy_seconds, 3), "speedup": round(self.speedup, 3),
                "prompts": self.per_prompt}


def choices_for(num_heads: int, choices: Sequence[Sequence[int]] = MEDUSA_64_CHOICES) -> list[list[int]]:
    """``choices``' paths that ``num_heads`` heads can draft (at most ``num_heads`` deep)."""
    return [list(p) for p in choices if len(p) <= num_heads]


def evaluate_medusa(model: DecoderModel, heads: MedusaHeads, requests: Sequence[RequestSpec], tokenizer,
                    max_tokens: int = 64, choices: Sequence[Sequence[int]] | None = None,
                    chat_template: bool = True, backend: str = "auto", progress: bool = True,
                    in_step: bool | None = None) -> Acceptance:
    """Greedy speculative decoding of each request with ``heads`` against plain greedy decoding (see the module
    docstring). ``choices`` default: :data:`MEDUSA_64_CHOICES` cut to the heads' depth. ``in_step``: the heads run
    inside the verification step at every verified token (:class:`MedusaDraft`'s default; the default here on a
    GPU), or after it at the last accepted token only (the default on the CPU, where the heads' four vocabulary
    projections at 64 rows cost more than the model's step): the same drafts, so the same acceptance."""
    paths = choices_for(heads.num_heads) if choices is None else [list(p) for p in choices]
    in_step = model.device.type == "cuda" if in_step is None else in_step
    return _evaluate(model, lambda: MedusaDraft(heads, paths, in_step=in_step), len(paths), requests, tokenizer,
                     max_tokens, chat_template, backend, progress, "medusa")


def evaluate_eagle3(model: DecoderModel, drafter: EagleDrafter, requests: Sequence[RequestSpec], tokenizer,
                    max_tokens: int = 64, depth: int = 5, top_k: int = 8, total_tokens: int = 63,
                    chat_template: bool = True, backend: str = "auto", progress: bool = True) -> Acceptance:
    """The same measurement with an EAGLE-3 drafter's dynamic trees (EAGLE-2's: ``depth``, ``top_k``,
    ``total_tokens`` draft tokens a step), on the drafter's own engine."""
    kv = max_tokens + total_tokens * 2 + 4096
    engine = Engine(drafter, kv_tokens=kv, backend=backend, cuda_graphs=model.device.type == "cuda")
    return _evaluate(model, lambda: EagleDraft(engine, depth=depth, top_k=top_k, total_tokens=total_tokens),
                     total_tokens, requests, tokenizer, max_tokens, chat_template, backend, progress, "eagle3",
                     drafter_engine=engine)


# ================================================================ private


def _evaluate(model: DecoderModel, make_draft, draft_tokens: int, requests: Sequence[RequestSpec], tokenizer,
              max_tokens: int, chat_template: bool, backend: str, progress: bool, name: str,
              drafter_engine: Engine | None = None) -> Acceptance:
    from tqdm import tqdm
    prompts = [list(r.prompt_ids) if r.prompt_ids is not None else
               encode_prompt(tokenizer, r.prompt if r.prompt is not None else list(r.messages), chat_template)
               for r in requests]
    engine = Engine(model, kv_tokens=max(len(p) for p in prompts) + max_tokens + 2 * draft_tokens + 256,
                    backend=backend, cuda_graphs=model.device.type == "cuda")
    if tokenizer is not None:
        engine.restrict_vocab(min(len(tokenizer), model.config.vocab_size))
    rows, accepted = [], []
    spec_s = plain_s = 0.0
    equal = True
    for spec, prompt in tqdm(list(zip(requests, prompts)), unit="prompt", desc=f"evaluate {name}",
                             disable=not progress or None):
        start = time.perf_counter()
        tokens, stats = speculative_generate(engine, prompt, make_draft(), max_tokens, GreedyAcceptance())
        spec_s += time.perf_counter() - start
        for e in (engine, drafter_engine):
            if e is not None:
                e.tree.prune_many(list(e.tree.roots))
        start = time.perf_counter()
        plain = greedy_generate(engine, prompt, max_tokens)
        plain_s += time.perf_counter() - start
        engine.tree.prune_many(list(engine.tree.roots))
        same = tokens == plain
        equal &= same
        accepted += stats.accepted
        rows.append({"id": spec.id, "new_tokens": len(tokens), "steps": stats.steps,
                     "tokens_per_step": round(1 + float(np.mean(stats.accepted)), 3) if stats.accepted else 1.0,
                     "accepted": list(stats.accepted), "equal_to_greedy": same})
    histogram = {str(k): v for k, v in sorted(Counter(accepted).items())}
    return Acceptance(1 + float(np.mean(accepted)) if accepted else 1.0, histogram, equal, spec_s, plain_s,
                      plain_s / spec_s if spec_s else 0.0, draft_tokens, rows)
