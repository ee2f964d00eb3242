"""Greedy speculative decoding of many requests at once: every request's draft tree in ONE step.

:func:`speculative_batch` is :func:`~treedec.search.batch.generate_batch` for speculative
decoding: requests wait in a queue and are admitted while their worst case fits the KV pool;
each iteration every live request's draft source proposes a token tree after its sequence,
all the trees are verified in one engine step (one plan over the forest, one forward), and
each request keeps its accepted path (its K/V moved onto the sequence, the rest freed) and the
bonus token, under its own stop rule (EOS ids, stop strings, ``max_new_tokens``: an EOS or a
stop string inside an accepted path cuts it there). Acceptance is greedy, so every request's
tokens are exactly those of plain greedy decoding of its prompt, whatever the draft (tested).

Drafts that read the target's hidden states (Medusa heads, draft models with features) are
not batched yet: :func:`~treedec.search.speculative.speculative_generate` runs them one request
at a time.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Sequence

import torch

from treedec.engine import Engine
from treedec.engine.text import IncrementalDetokenizer
from treedec.errors import PoolExhaustedError
from treedec.search.acceptance import greedy_path
from treedec.search.batch import BatchStats, _Output, _prepare, _Request, _results
from treedec.search.request import pages_in_use
from treedec.search.requests_file import RequestResult, RequestSpec
from treedec.search.speculative import DraftSource
from treedec.search.stops import StopChecker

__all__ = ["speculative_batch"]


def speculative_batch(engine: Engine, requests: Sequence[RequestSpec], draft: Callable[[RequestSpec], DraftSource],
                      tokenizer=None, chat_template: bool = False, max_draft_tokens: int = 64,
                      on_request_done: Callable[[list[RequestResult]], None] | None = None
                      ) -> tuple[list[RequestResult], BatchStats]:
    """Greedy speculative decoding of ``requests`` batched over ``engine``'s forest.

    Parameters
    ----------
    requests : :class:`RequestSpec` with ``temperature=0`` and ``n=1`` (greedy acceptance: one
        output, exactly greedy decoding's).
    draft : makes each request's draft source when it is admitted, e.g.
        ``lambda spec: PromptLookupDraft()``; a draft that ``needs_hidden`` or has a ``row_head``
        is refused.
    tokenizer, chat_template, on_request_done : as :func:`~treedec.search.batch.generate_batch`.
    max_draft_tokens : the largest tree a draft may propose (its root included): admission
        reserves its pages.

    Returns
    -------
    ``(results, stats)`` as :func:`~treedec.search.batch.generate_batch`; each result's ``stats``
    also holds ``accepted`` (draft tokens accepted at each of its steps).
    """
    if not callable(draft):
        raise TypeError(f"draft must be a function of a RequestSpec returning a draft source, got {draft!r:.60}")
    if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int) or max_draft_tokens < 1:
        raise ValueError(f"max_draft_tokens must be an int >= 1, got {max_draft_tokens!r}")
    queue = deque(_prepare(engine, requests, tokenizer, chat_template, None))
    for r in queue:
        if r.spec.temperature != 0 or r.spec.n != 1:
            raise ValueError(f"request {r.spec.id!r}: speculative_batch accepts greedily, one output a request: it "
                             f"needs temperature=0 and n=1, got temperature={r.spec.temperature}, n={r.spec.n}")
        pool = engine.pool
        # The sequence (prompt, new tokens, a path accepted past the budget) and one draft tree.
        r.worst_pages = (pool.pages_for(len(r.prompt_ids) + r.spec.max_new_tokens + max_draft_tokens)
                         + 1 + pool.pages_for(max_draft_tokens))
    budget = engine.pool.num_free_pages
    too_big = next((r for r in queue if r.worst_pages > budget), None)
    if too_big is not None:
        raise PoolExhaustedError(f"request {too_big.spec.id!r} may need {too_big.worst_pages} KV pages, the pool has "
                                 f"{budget} free; lower max_new_tokens or max_draft_tokens, or give the engine more "
                                 f"kv_tokens; nothing was run")
    stats = BatchStats()
    held_before = pages_in_use(engine.pool)
    results: dict[int, list[RequestResult]] = {}
    live: list[_Request] = []
    drafts: dict[int, DraftSource] = {}
    accepted: dict[int, list[int]] = {}
    start = time.perf_counter()

    def retire(request: _Request) -> None:
        live.remove(request)
        engine.tree.prune(request.root)
        done = _results(request, tokenizer)
        done[0].stats["accepted"] = accepted[request.order]
        results[request.order] = done
        if on_request_done is not None:
            on_request_done(done)

    try:
        while queue or live:
            committed = sum(r.worst_pages for r in live)
            admitted = False
            while queue and committed + queue[0].worst_pages <= budget:
                request = queue.popleft()
                committed += request.worst_pages
                drafts[request.order] = _draft_for(draft, request.spec)
                accepted[request.order] = []
                _admit_sequence(engine, request, tokenizer)
                live.append(request)
                admitted = True
                if request.outputs[0].checker.stopped:   # the first token ended it
                    retire(request)
            if queue and not admitted:
                stats.waits += 1
            if not live:
                continue
            trees = []
            for request in live:
                tokens_so_far = request.prompt_ids + request.outputs[0].checker.token_ids
                tree, tokens = drafts[request.order].propose(tokens_so_far)
                _check_proposal(request, tree, tokens, tokens_so_far[-1], max_draft_tokens)
                engine.tree.extend(request.root, tokens[:1])
                ids = engine.tree.add_token_tree(request.root, tokens[1:], tree.draft_parents()) if tree.size > 1 else []
                trees.append((request, tree, tokens, ids))
            nodes = [n for request, _, _, ids in trees for n in [request.root] + ids]
            logits = engine.step(logits_rows=engine.pending_rows(nodes))
            choice = logits.argmax(dim=-1).tolist()   # one transfer for every request's tree
            stats.steps += 1
            stats.queries_per_step.append(len(nodes))
            stats.requests_per_step.append(len(trees))
            stats.peak_pages = max(stats.peak_pages, pages_in_use(engine.pool) - held_before)
            offset = 0
            for request, tree, tokens, ids in trees:
                path, bonus = greedy_path(tree, tokens, choice[offset:offset + tree.size])
                offset += tree.size
                new = [tokens[i] for i in path] + [bonus]
                decision = request.outputs[0].checker.accept(new)
                keep = path[:min(decision.keep, len(path))]   # the bonus is not computed yet
                if ids:
                    engine.tree.accept(request.root, [ids[i - 1] for i in keep])
                accepted[request.order].append(len(keep))
                request.steps += 1
                if decision.reason is not None:
                    retire(request)
    except BaseException:
        tree = engine.tree
        if tree.layout().num_queries:
            tree.commit_step()
        for request in live:
            if request.root is not None and request.root in tree:
                tree.prune(request.root)
        raise
    stats.seconds = time.perf_counter() - start
    return [res for order in sorted(results) for res in results[order]], stats


# ================================================================ private


def _draft_for(draft: Callable[[RequestSpec], DraftSource], spec: RequestSpec) -> DraftSource:
    source = draft(spec)
    if not callable(getattr(source, "propose", None)):
        raise TypeError(f"draft(spec) must return a draft source (a propose method), got {type(source).__name__}")
    if getattr(source, "needs_hidden", False) or getattr(source, "row_head", None) is not None:
        raise ValueError(f"{type(source).__name__} reads the target's hidden states: speculative_batch does not batch "
                         f"such drafts yet; run its requests with speculative_generate")
    return source


def _admit_sequence(engine: Engine, request: _Request, tokenizer) -> None:
    """Prefill the prompt; its greedy next token is the output's first (the first tree's root)."""
    request.started = time.perf_counter()
    rule = request.spec.stop_rule(engine.model.eos_token_ids)
    detok = IncrementalDetokenizer(tokenizer, request.prompt_ids) if tokenizer is not None else None
    request.outputs.append(_Output(StopChecker(rule, detok)))
    request.root, logits = engine.prefill(request.prompt_ids)
    request.outputs[0].checker.accept(int(torch.argmax(logits)))


def _check_proposal(request: _Request, tree, tokens: list[int], last: int, max_draft_tokens: int) -> None:
    if not tokens or tokens[0] != last:
        raise ValueError(f"request {request.spec.id!r}: the draft's propose must return tokens[0] == the last "
                         f"sequence token {last}, got {tokens[:1]}")
    if len(tokens) != tree.size or tree.size > max_draft_tokens:
        raise ValueError(f"request {request.spec.id!r}: the draft proposed a {tree.size}-token tree with "
                         f"{len(tokens)} tokens; it must give one token per tree token and at most "
                         f"max_draft_tokens={max_draft_tokens}")
