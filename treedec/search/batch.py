"""Many generation requests at once: one forest, one engine step per iteration for all of them.

:func:`generate_batch` is the offline batch API (vLLM's ``LLM.generate`` over a list of
requests): each :class:`~treedec.search.requests_file.RequestSpec` is a prompt and its ``n``
outputs, sampled (or greedy at temperature 0) under its own stop rule. The requests wait in
a queue; every iteration the scheduler

1. admits the next requests while their worst cases fit the KV pool (the prompt's pages plus
   ``n`` outputs of ``max_new_tokens`` tokens each, summed over the live requests), prefills
   them (each prompt a new tree of the engine's forest; its ``n`` outputs become children of
   the prompt's node, so the prompt's K/V is stored once),
2. draws the next token of every live output from its row of the last step, applies the
   output's stop rule (EOS ids, stop strings, ``max_new_tokens``:
   :class:`~treedec.search.stops.StopChecker`), and grows the outputs that go on,
3. runs ONE engine step over the pending tokens of every live request (one plan, one forward),
4. retires the requests whose outputs all ended, pruning their trees (pages freed for the
   next admissions).

Shared prompt prefixes: requests whose prompts start with the same tokens (a system prompt,
few-shot examples; at least ``min_shared_prefix`` tokens) read one copy of that prefix's K/V.
Before the run the prompts are matched against each other (sorted, neighbours' longest
common prefix); each group's common prefix is prefilled once, as a root node, when its first
request is admitted, and every member's own rest of the prompt is prefilled under it. The
prefix node is pruned when its last member retires.

Admission never over-commits: a request waits until its worst case fits (no preemption), so
the pool cannot run out mid-run; a request whose worst case exceeds the whole pool raises
before anything runs.

Randomness: a request with a ``seed`` draws from its own generator, one uniform number per
output per draw (:func:`~treedec.search.sampling.sample_tokens` by inverse CDF), so its outputs
do not depend on which other requests share its steps: batched == alone (tested). Requests
without a seed draw from the batch's ``generator`` in admission order.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from treedec.engine import Engine
from treedec.engine.text import IncrementalDetokenizer, encode_prompt
from treedec.errors import PoolExhaustedError
from treedec.search.request import pages_in_use
from treedec.search.requests_file import RequestResult, RequestSpec
from treedec.search.sampling import SamplingParams, sample_tokens
from treedec.search.stops import StopChecker
from treedec.transfer import HostCopy, to_device

__all__ = ["BatchStats", "generate_batch"]


@dataclass
class BatchStats:
    """Counters of one :func:`generate_batch` run.

    Attributes
    ----------
    steps : engine steps after the prefills (each computes every live request's new tokens).
    queries_per_step : tokens computed by each step.
    requests_per_step : requests with tokens in each step.
    waits : iterations in which the next queued request waited for pages.
    shared_prefix_tokens : prompt tokens whose K/V was not stored again because another request
        of the batch shares them (a prefix of ``t`` tokens shared by ``m`` requests counts
        ``t * (m - 1)``).
    peak_pages : the most KV pages the batch held at once.
    seconds : wall time of the run.
    """

    steps: int = 0
    queries_per_step: list[int] = field(default_factory=list)
    requests_per_step: list[int] = field(default_factory=list)
    waits: int = 0
    shared_prefix_tokens: int = 0
    peak_pages: int = 0
    seconds: float = 0.0


@dataclass
class _Output:
    checker: StopChecker
    node: int | None = None      # a child of the prompt's node, from the output's first token on


@dataclass
class _Prefix:
    tokens: list[int]
    members: int                  # requests of the batch that read it and have not retired
    pages: int
    node: int | None = None       # its root node, from its first member's admission on
    logits: torch.Tensor | None = None   # [vocab] at its last token: a member whose whole prompt it is


@dataclass
class _Request:
    spec: RequestSpec
    order: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    worst_pages: int              # its own: the prompt past a shared prefix, and the outputs
    prefix: _Prefix | None = None
    outputs: list[_Output] = field(default_factory=list)
    root: int | None = None       # the node the outputs hang under
    own: int | None = None        # the request's own prompt node (None: its prompt is the shared prefix)
    logits: torch.Tensor | None = None     # [live outputs, vocab]: the rows of the last step
    greedy: torch.Tensor | None = None     # their argmax, when the step drew it for every greedy request
    rows: list[int] = field(default_factory=list)   # the outputs those rows belong to
    steps: int = 0
    started: float = 0.0

    @property
    def live(self) -> list[int]:
        return [i for i, o in enumerate(self.outputs) if not o.checker.stopped]


def generate_batch(engine: Engine, requests: Sequence[RequestSpec], tokenizer=None, chat_template: bool = False,
                   generator: torch.Generator | None = None,
                   on_request_done: Callable[[list[RequestResult]], None] | None = None,
                   min_shared_prefix: int | None = None, pipeline: bool | None = None
                   ) -> tuple[list[RequestResult], BatchStats]:
    """Run ``requests`` batched over ``engine``'s forest (see the module docstring).

    Parameters
    ----------
    engine : the engine; its other trees are left alone (their pages are not the batch's).
    requests : the :class:`RequestSpec` of each request (``prompt`` and ``messages`` need a
        ``tokenizer``; ``prompt_ids`` are used as they are).
    tokenizer : the checkpoint's tokenizer (:func:`~treedec.engine.text.load_tokenizer`): prompts
        are encoded with it, outputs detokenized (``RequestResult.text``), stop strings matched.
    chat_template : encode ``prompt`` / ``messages`` through the tokenizer's chat template.
    generator : draws of the requests without a ``seed`` (on the engine's device).
    on_request_done : called with a request's results when it retires (e.g. a progress bar).
    min_shared_prefix : the fewest common prompt tokens that requests share as one prefix node
        (default: the pool's page size; 0 turns sharing off).
    pipeline : default on for a CUDA engine (off on the CPU, where nothing would overlap): each
        step is launched before the tokens drawn for it are read back (the step reads them on the
        device); an output that those tokens end computed one token more, which is pruned with it.
        The outputs are the same either way (tested); ``stats`` may count steps differently.

    Returns
    -------
    ``(results, stats)``: every output's :class:`RequestResult`, in request order then output
    index, and the run's :class:`BatchStats`. Each result's ``stats`` holds the request's
    ``steps``, ``prompt_tokens`` and ``seconds`` (admission to retirement).

    Raises
    ------
    ValueError, TypeError : a bad request or argument, before the engine is touched.
    PoolExhaustedError : a request's worst case does not fit the pool's free pages, before
        anything runs.
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
    if pipeline is not None and not isinstance(pipeline, bool):
        raise ValueError(f"pipeline must be a bool or None (on for a CUDA engine), got {pipeline!r}")
    pipeline = engine.device.type == "cuda" if pipeline is None else pipeline
    min_shared = engine.pool.page_size if min_shared_prefix is None else min_shared_prefix
    if isinstance(min_shared, bool) or not isinstance(min_shared, int) or min_shared < 0:
        raise ValueError(f"min_shared_prefix must be an int >= 0 (0: no sharing) or None, got {min_shared_prefix!r}")
    queue = deque(_prepare(engine, requests, tokenizer, chat_template, generator))
    prefixes = _share_prefixes(engine, list(queue), min_shared) if min_shared else []
    budget = engine.pool.num_free_pages
    too_big = next((r for r in queue if r.worst_pages + (r.prefix.pages if r.prefix else 0) > budget), None)
    if too_big is not None:
        raise PoolExhaustedError(
            f"request {too_big.spec.id!r} may need {too_big.worst_pages} KV pages (prompt {len(too_big.prompt_ids)} "
            f"tokens + {too_big.spec.n} x {too_big.spec.max_new_tokens} new tokens), the pool has {budget} free; "
            f"lower max_new_tokens or n, or give the engine more kv_tokens; nothing was run")
    stats = BatchStats(shared_prefix_tokens=sum(len(p.tokens) * (p.members - 1) for p in prefixes))
    held_before = pages_in_use(engine.pool)
    results: dict[int, list[RequestResult]] = {}
    live: list[_Request] = []
    start = time.perf_counter()
    try:
        while queue or live:
            committed = sum(r.worst_pages for r in live) + sum(p.pages for p in prefixes if p.node is not None)
            admitted = False
            while queue and committed + _admission_pages(queue[0]) <= budget:
                request = queue.popleft()
                committed += _admission_pages(request)
                _admit(engine, request, tokenizer)
                live.append(request)
                admitted = True
            if queue and not admitted:
                stats.waits += 1
            drawing = [r for r in live if r.logits is not None]
            if drawing:
                read_rows = [list(r.rows) for r in drawing]
                drawn = [_draw(r) for r in drawing]
                everything = torch.cat(drawn)
                copy = HostCopy(everything)   # one transfer for every request's tokens
                if pipeline:   # the next step runs while the host reads and checks these tokens
                    _launch_unread(engine, drawing, read_rows, everything, stats)
                flat = copy.result()
                grow: dict[int, list[int]] = {}
                for request, rows in zip(drawing, read_rows):
                    _take(engine, request, rows, flat[:len(rows)], grow, pipeline)
                    flat = flat[len(rows):]
                if grow:
                    engine.tree.extend_many(grow)
            stats.peak_pages = max(stats.peak_pages, pages_in_use(engine.pool) - held_before)
            stepping = [(r, r.live) for r in live if r.live]
            if not pipeline and stepping:
                _step(engine, stepping, stats)
            for request in [r for r in live if not r.live]:
                live.remove(request)
                _retire(engine, request)
                done = _results(request, tokenizer)
                results[request.order] = done
                if on_request_done is not None:
                    on_request_done(done)
    except BaseException:
        for request in live:
            _discard(engine, request)
        for prefix in prefixes:
            if prefix.node is not None and prefix.node in engine.tree:
                engine.tree.prune(prefix.node)
        raise
    stats.seconds = time.perf_counter() - start
    return [res for order in sorted(results) for res in results[order]], stats


# ================================================================ private


def _prepare(engine: Engine, requests, tokenizer, chat_template: bool, generator) -> list[_Request]:
    """Check and encode every request before the engine is touched."""
    if isinstance(requests, RequestSpec) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of RequestSpec, got {type(requests).__name__}")
    if not isinstance(chat_template, bool):
        raise TypeError(f"chat_template must be a bool, got {chat_template!r}")
    vocab = engine.model.config.vocab_size
    out, ids = [], set()
    for k, spec in enumerate(requests):
        if not isinstance(spec, RequestSpec):
            raise TypeError(f"requests[{k}] must be a RequestSpec, got {type(spec).__name__}")
        if spec.id in ids:
            raise ValueError(f"requests[{k}]: request id {spec.id!r} is used twice")
        ids.add(spec.id)
        if spec.prompt_ids is not None:
            prompt_ids = list(spec.prompt_ids)
        elif tokenizer is None:
            raise ValueError(f"request {spec.id!r} gives its prompt as text: it needs the checkpoint's tokenizer "
                             f"(or give prompt_ids)")
        else:
            prompt_ids = encode_prompt(tokenizer, spec.prompt if spec.prompt is not None else list(spec.messages),
                                       chat_template or spec.messages is not None)
        bad = [t for t in prompt_ids + list(spec.stop_token_ids) if t >= vocab]
        if bad:
            raise ValueError(f"request {spec.id!r}: token ids must be in [0, {vocab}), got {bad[:5]}")
        if spec.stop and tokenizer is None:
            raise ValueError(f"request {spec.id!r} has stop strings {list(spec.stop)!r:.60}: they are matched on the "
                             f"output text and need the checkpoint's tokenizer")
        pool = engine.pool
        worst = pool.pages_for(len(prompt_ids)) + spec.n * pool.pages_for(spec.max_new_tokens)
        own = None
        if spec.seed is not None and spec.temperature > 0:
            own = torch.Generator(engine.device).manual_seed(spec.seed)
        params = SamplingParams(spec.temperature, spec.top_k, spec.top_p)
        out.append(_Request(spec, k, prompt_ids, params, own if spec.seed is not None else generator, worst))
    return out


def _share_prefixes(engine: Engine, requests: list[_Request], min_tokens: int) -> list[_Prefix]:
    """Group requests whose prompts share at least ``min_tokens`` leading tokens: prompts sorted,
    runs of neighbours whose common prefix is that long form a group, its prefix the run's
    shortest common one. Each member's ``prefix`` and own ``worst_pages`` are set."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].prompt_ids)
    groups, run, shared = [], [order[0]] if order else [], None
    for a, b in zip(order, order[1:]):
        common = _common_prefix(requests[a].prompt_ids, requests[b].prompt_ids)
        if common >= min_tokens:
            run.append(b)
            shared = common if shared is None else min(shared, common)
        else:
            if len(run) > 1:
                groups.append((run, shared))
            run, shared = [b], None
    if len(run) > 1:
        groups.append((run, shared))
    pool, prefixes = engine.pool, []
    for members, length in groups:
        prefix = _Prefix(requests[members[0]].prompt_ids[:length], len(members), pool.pages_for(length))
        prefixes.append(prefix)
        for i in members:
            r = requests[i]
            r.prefix = prefix
            r.worst_pages = pool.pages_for(len(r.prompt_ids) - length) + r.spec.n * pool.pages_for(r.spec.max_new_tokens)
    return prefixes


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def _admission_pages(request: _Request) -> int:
    """Pages admitting ``request`` commits: its worst case, and its shared prefix if not prefilled yet."""
    prefix = request.prefix
    return request.worst_pages + (prefix.pages if prefix is not None and prefix.node is None else 0)


def _admit(engine: Engine, request: _Request, tokenizer) -> None:
    """Prefill the request's prompt (past its shared prefix, which is prefilled first if it is
    not yet); the prompt's last logits serve all ``n`` outputs."""
    spec = request.spec
    request.started = time.perf_counter()
    rule = spec.stop_rule(engine.model.eos_token_ids)
    for _ in range(spec.n):
        detok = IncrementalDetokenizer(tokenizer, request.prompt_ids) if tokenizer is not None else None
        request.outputs.append(_Output(StopChecker(rule, detok)))
    prefix = request.prefix
    if prefix is None:
        request.root, first = engine.prefill(request.prompt_ids)
        request.own = request.root
    else:
        if prefix.node is None:
            prefix.node, prefix.logits = engine.prefill(prefix.tokens)
        rest = request.prompt_ids[len(prefix.tokens):]
        if rest:
            request.own, first = engine.prefill(rest, parent=prefix.node)
            request.root = request.own
        else:
            request.root, first = prefix.node, prefix.logits
    request.rows = list(range(spec.n))
    request.logits = first[None].expand(spec.n, -1)


def _draw(request: _Request) -> torch.Tensor:
    """The next token (on the device) of each output with a row in the last step."""
    if request.greedy is not None:
        tokens, request.greedy, request.logits = request.greedy, None, None
        return tokens
    uniform = None
    if request.params.temperature > 0:
        # One number per output per draw, whichever outputs are live: a request's stream does
        # not depend on when its outputs end, nor on the other requests.
        numbers = torch.rand(request.spec.n, generator=request.generator, device=request.logits.device)
        uniform = numbers[to_device(request.rows, numbers.device)]
    tokens = sample_tokens(request.logits, request.params, uniform=uniform)
    request.logits = None
    return tokens


def _step(engine: Engine, entries: list[tuple[_Request, list[int]]], stats: BatchStats,
          tokens: torch.Tensor | None = None) -> None:
    """One engine step over the pending tokens of ``entries`` (each request with its outputs that have
    one); each request keeps its rows' logits (and, greedy, their argmax: one for the whole step)."""
    nodes = [r.outputs[i].node for r, outputs in entries for i in outputs]
    logits = engine.step(logits_rows=engine.pending_rows(nodes), tokens=tokens)
    greedy = logits.argmax(dim=-1) if any(r.params.temperature == 0 for r, _ in entries) else None
    stats.steps += 1
    stats.queries_per_step.append(len(nodes))
    stats.requests_per_step.append(len(entries))
    offset = 0
    for r, outputs in entries:
        r.rows = list(outputs)
        r.logits = logits[offset:offset + len(outputs)]
        if r.params.temperature == 0:
            r.greedy = greedy[offset:offset + len(outputs)]
        offset += len(outputs)
        r.steps += 1


def _launch_unread(engine: Engine, drawing: list[_Request], read_rows: list[list[int]], drawn: torch.Tensor,
                   stats: BatchStats) -> None:
    """Pipelined: append a placeholder for each drawn token that may be computed (its output has not
    ended and the token is not its last allowed one) and run the step on the drawn tokens on the
    device. An output the token ends is pruned when it is read, the token computed meanwhile with it."""
    tree = engine.tree
    entries, grow, source = [], {}, {}
    offset = 0
    for request, rows in zip(drawing, read_rows):
        outputs, fresh = [], []
        for k, i in enumerate(rows):
            output = request.outputs[i]
            if output.checker.stopped or len(output.checker.token_ids) + 1 >= request.spec.max_new_tokens:
                continue
            outputs.append(i)
            if output.node is None:
                fresh.append((i, offset + k))
            else:
                grow[output.node] = [0]
                source[output.node] = offset + k
        if fresh:
            for (i, at), node in zip(fresh, tree.branch(request.root, [[0]] * len(fresh))):
                request.outputs[i].node = node
                source[node] = at
        if outputs:
            entries.append((request, outputs))
        offset += len(rows)
    if grow:
        tree.extend_many(grow)
    if entries:
        order = to_device([source[n] for n in engine.pending_nodes().tolist()], drawn.device)
        _step(engine, entries, stats, drawn[order])


def _take(engine: Engine, request: _Request, rows: list[int], tokens: list[int], grow: dict[int, list[int]],
          pipelined: bool) -> None:
    """Give each drawn token to its output's stop rule and prune the outputs that ended. Pipelined, the
    others' placeholders get the real ids; else the new outputs start and ``node: [token]`` goes into
    ``grow`` for the others (the caller extends them all at once)."""
    tree = engine.tree
    fresh: dict[int, int] = {}
    for i, token in zip(rows, tokens):
        output = request.outputs[i]
        if output.checker.stopped:      # ended at an earlier draw; this row ran in flight (pipelined)
            continue
        decision = output.checker.accept(token)
        if decision.reason is not None:
            if output.node is not None:
                tree.prune(output.node)
                output.node = None
        elif pipelined:
            tree.set_tokens(output.node, len(output.checker.token_ids) - 1, [token])   # the node holds its tokens
        elif output.node is None:
            fresh[i] = token
        else:
            grow[output.node] = [token]
    if fresh:
        for i, node in zip(fresh, tree.branch(request.root, [[t] for t in fresh.values()])):
            request.outputs[i].node = node


def _results(request: _Request, tokenizer) -> list[RequestResult]:
    spec = request.spec
    prompt = spec.prompt if spec.prompt is not None else (list(spec.messages) if spec.messages is not None else None)
    seconds = time.perf_counter() - request.started
    return [RequestResult(spec.id, i, prompt, list(request.prompt_ids), o.checker.token_ids, o.checker.text,
                          o.checker.stop_reason, {"steps": request.steps, "prompt_tokens": len(request.prompt_ids),
                                                  "seconds": seconds})
            for i, o in enumerate(request.outputs)]


def _retire(engine: Engine, request: _Request) -> None:
    """Prune the request's own nodes, and its shared prefix after its last member."""
    if request.own is not None:
        engine.tree.prune(request.own)
    prefix = request.prefix
    if prefix is not None:
        prefix.members -= 1
        if prefix.members == 0:
            engine.tree.prune(prefix.node)
            prefix.node = prefix.logits = None


def _discard(engine: Engine, request: _Request) -> None:
    """Free a live request's own nodes after a failed iteration (pending tokens included); its
    shared prefix is the caller's to prune."""
    tree = engine.tree
    if tree.layout().num_queries:
        tree.commit_step()
    if request.own is not None and request.own in tree:
        tree.prune(request.own)
    for output in request.outputs:   # outputs of a request whose prompt is its shared prefix
        if output.node is not None and output.node in tree:
            tree.prune(output.node)
