"""A request as a program of the scheduler (:mod:`treedec.runtime.scheduler`): what a program is, what it
yields and what it is resumed with.

A program is a Python generator made by :meth:`Program.run`: it edits the engine's tree, then yields a
:class:`StepRequest` (the nodes whose outputs it reads after the next engine step), a :class:`Read` (device
values it needs on the host) or a :class:`Wait` (KV pages it needs first), and is resumed with a
:class:`StepRows`, the values, or nothing (or, for a long-running request, a
:class:`~treedec.runtime.decode.Decode` or a :class:`~treedec.runtime.bulk.Bulk` request). :class:`ProgramContext`
is what it sees of the run: the engine, its prompt (a shared prefix included) and page helpers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Hashable, Mapping, Sequence

import numpy as np
import torch

from treedec.attention.dynamic_span import DynamicSpans
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.runtime.prefix_cache import CachedPrefix, PrefixCache
from treedec.runtime.prefixes import SharedPrefix
from treedec.runtime.request import Positions, check_positions

__all__ = ["Program", "ProgramContext", "Read", "StepRequest", "StepRows", "Wait", "set_aside_bad_tokens"]


@dataclass(frozen=True)
class StepRequest:
    """What a program yields after adding its pending tokens to the tree.

    Attributes
    ----------
    nodes : node ids; the program gets one output row per node, at the node's last pending
        token (a node may appear more than once). May be empty (then only ``read`` is done).
    hidden : also return those rows' final-norm hidden states.
    aux : also return those rows' inner-layer states (:meth:`Engine.capture_hidden_layers`).
    all_rows : the hidden states and ``aux`` at EVERY pending token of ``nodes`` (node by node, in
        token order) instead of the last (e.g. a whole prompt chunk's, for an EAGLE drafter).
    heads : also return the engine's row heads at those rows.
    argmax : also return the rows' argmax (computed once for the whole step).
    tokens : int64 device tensor, optional: the ids of the last pending tokens of the nodes in
        ``placed`` (default ``nodes``), which the tree holds as placeholders (read on the device;
        pipelining).
    placed : the nodes whose placeholders ``tokens`` fills, when not ``nodes`` (e.g. a node whose
        token is computed but whose output row is not wanted).
    read : a device tensor to read back; its values come in the next :class:`StepRows`'s
        ``read``, after the step is launched.
    prompt : the nodes are prompt chunks (:meth:`ProgramContext.prompt`; counted in
        :attr:`SchedulerStats.prompt_steps`).
    dynamic : :class:`~treedec.attention.dynamic_span.DynamicSpans` of the program's nodes (pipelined
        speculative decoding: one span, or a batched verify group's, one a request, as arrays); the scheduler
        gives them the rows of ``nodes`` as the queries after them, split evenly among them in order.
    """

    nodes: Sequence[int]
    hidden: bool = False
    aux: bool = False
    all_rows: bool = False
    heads: bool = False
    argmax: bool = False
    tokens: torch.Tensor | None = None
    placed: Sequence[int] | None = None
    read: torch.Tensor | None = None
    prompt: bool = False
    dynamic: DynamicSpans | None = None


@dataclass(frozen=True)
class Read:
    """Yielded by a program for an integer device tensor's values: it is resumed with them as (nested)
    lists of ints. The reads of all the programs resumed together go back in one copy (one wait)."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class Wait:
    """Yielded by a program that needs ``pages`` free KV pages before it can go on (it changed nothing);
    ``reason`` says for what (the error's words when nothing can free them)."""

    pages: int
    reason: str | None = None


@dataclass
class StepRows:
    """A program's rows of a step (``None`` for what it did not ask for).

    Attributes
    ----------
    logits : [len(nodes), vocab] in the model dtype.
    hidden : [len(nodes), hidden_size] (with ``all_rows``: [the nodes' pending tokens, hidden_size]) or None.
    aux : [as hidden, len(engine.hidden_layers), hidden_size] or None.
    heads : {name: [len(nodes), ...]} or None.
    argmax : [len(nodes)] int64 device tensor or None.
    read : the values of the request's ``read`` tensor as (nested) Python numbers, or None.
    """

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    heads: dict[str, torch.Tensor] | None = None
    argmax: torch.Tensor | None = None
    read: list | None = None


class Program:
    """A request as a resumable program; subclasses define :meth:`run`.

    Attributes
    ----------
    prompt_ids : the prompt's token ids when the program starts from a prompt (requests with a
        common prefix then share its K/V, unless ``shares_prompt`` is False), else None.
    shares_prompt : whether its prompt may start with a prefix computed for several requests.
    name : how errors name it (e.g. ``"request 'b' (line 3)"``); None: by its index in the run.
    """

    prompt_ids: list[int] | None = None
    shares_prompt: bool = True
    name: str | None = None

    def run(self, ctx: "ProgramContext") -> Generator[StepRequest | Wait, StepRows | None, Any]:
        """The program: edits ``ctx.engine.tree``, yields requests, returns its result. It frees its
        own nodes before it returns, and in a ``finally`` (it may be closed at any yield)."""
        raise NotImplementedError(f"{type(self).__name__} must define run(ctx)")

    def positions(self) -> Positions | None:
        """The most positions one of its sequences may reach (its prompt and token budget), when known
        before it runs; None when not (then only the tokens it adds are checked, as it adds them).
        :func:`~treedec.runtime.scheduler.run_programs` refuses, before anything runs, a program whose
        count exceeds the model's (:func:`~treedec.runtime.request.position_limit`)."""
        return None

    def start_pages(self, pool, shared: int = 0) -> int:
        """KV pages its start takes (the prompt past the first ``shared`` tokens, a shared prefix's, which
        is whole pages): admission waits for them."""
        return pool.pages_for(len(self.prompt_ids) - shared) if self.prompt_ids else 0

    def step_pages(self, pool) -> int:
        """Pages one of its steps may add, at most (headroom kept for it while it runs)."""
        return 1


class ProgramContext:
    """What a running program sees: the engine, its prompt and page helpers, ``step_queries``
    (the tokens it added for its last step) and ``name`` (how errors name the program)."""

    def __init__(self, engine: Engine, prefix: SharedPrefix | CachedPrefix | None = None, name: str = "the program",
                 cache: PrefixCache | None = None):
        self.engine = engine
        self.prefix = prefix   # the shared or cached prefix its prompt starts with (its node made by the scheduler)
        self.cache = cache     # the prefix cache across requests, if the scheduler keeps one
        self.step_queries = 0  # the tokens the program added for its last step (its share of the step)
        self.cached_tokens = 0  # its prompt's tokens read from the prefix cache across requests (none computed)
        self.offer_after_step: int | None = None   # a prompt node the scheduler offers once the step is launched
        # an abort's kept outputs (output index -> tokens a frontend's stop string kept), set before it is closed
        self.kept: Mapping[int, int] | None = None
        self.name = name

    def reserve(self, pages: int, reason: str | None = None) -> Generator[Wait, Any, None]:
        """Wait until ``pages`` KV pages are free (``yield from ctx.reserve(n)`` before growing);
        ``reason``: what needs them, for the error when nothing can free them."""
        pool = self.engine.pool
        if pages > pool.num_pages:
            raise PoolExhaustedError(f"KV pool exhausted: a step needs {pages} pages of {pool.page_size} tokens, the "
                                     f"pool has {pool.num_pages} in all; give the engine more kv_tokens")
        while pool.num_free_pages < pages:
            yield Wait(pages, reason)

    def together(self) -> Generator[Read, Any, None]:
        """Yield once, to be resumed after every other program resumed in the same scheduler pass has yielded
        (``yield from ctx.together()``): what they queued before it is queued when this program goes on (e.g.
        every request's EAGLE proposal, drafted for all at the first collect). An empty :class:`Read`: the
        pass's reads go back in one copy, then its programs are resumed."""
        yield Read(torch.zeros(0, dtype=torch.int64, device=self.engine.device))

    def free(self, node: int | None) -> None:
        """Prune ``node``'s subtree if it is still in the tree (a program's ``finally``). After an error
        that left tokens of that subtree pending (the run ends with it) the step's tokens are marked
        computed first: nothing reads them, and the scheduler closes every program."""
        tree = self.engine.tree
        if node is None or node not in tree:
            return
        # (its own nodes' pending tokens: not a walk from every pending token of the forest, when many end together)
        if tree.num_pending and any(tree.computed_length(n) < tree.sequence_length(n) for n in tree.subtree(node)):
            tree.commit_step()
        tree.prune(node)

    def prompt(self, ids: Sequence[int], parent: int | None = None, hidden: bool = False, heads: bool = False,
               aux: bool = False, all_rows: bool = False
               ) -> Generator[StepRequest | Wait, Any, tuple[int, StepRows]]:
        """Add a prompt (a new tree, or a child of ``parent``) and compute it in steps of at most
        ``engine.prefill_chunk`` tokens (the chunks of :meth:`Engine.chunk_prompt`, as :meth:`Engine.prefill`
        runs them, each stepped with the other programs' tokens); returns ``(node, output at its last
        token)``. With
        ``all_rows`` the output's ``hidden`` / ``aux`` hold every prompt token's (the chunks' joined).

        A root prompt that starts with the context's shared or cached prefix becomes a child of the
        prefix's node, holding the rest of the prompt (never empty: see
        :func:`~treedec.runtime.prefixes.share_prefixes`, :meth:`~treedec.runtime.prefix_cache.PrefixCache.match`).
        A root prompt is offered to the prefix cache (:meth:`offer`) as soon as the step computing its last chunk
        is launched (:attr:`offer_after_step`: a request admitted at the next iteration reads it).
        """
        engine, ids, root = self.engine, [int(t) for t in ids], parent is None
        if parent is None and self.prefix is not None:
            assert ids[:len(self.prefix.tokens)] == self.prefix.tokens, "the prompt does not start with its prefix"
            parent, ids = self.prefix.node, ids[len(self.prefix.tokens):]
        prompt = engine.chunk_prompt(ids, parent)
        first, count = prompt.first_position, prompt.num_tokens
        check_positions(engine.model, Positions(first + count, f"{first} tokens before a {count}-token prompt"
                                                if first else f"a {count}-token prompt"), self.name)
        yield from self.reserve(prompt.pages)
        node = prompt.add(engine.tree, 0)
        request = StepRequest([node], hidden=hidden, heads=heads, aux=aux, all_rows=all_rows, prompt=True)
        states: list[StepRows] = []
        last = len(prompt.pieces) - 1
        try:
            self.offer_after_step = node if root and last == 0 else None
            out = yield request
            states.append(out)
            for i in range(1, len(prompt.pieces)):
                prompt.add(engine.tree, i, node)
                self.offer_after_step = node if root and i == last else None
                out = yield request
                states.append(out)
        except BaseException:   # closed or failed before the caller has the node: free it here
            self.free(node)
            raise
        if all_rows and len(states) > 1:
            out.hidden = torch.cat([o.hidden for o in states]) if hidden else None
            out.aux = torch.cat([o.aux for o in states]) if aux else None
        return node, out

    def offer(self, node: int, length: int | None = None) -> None:
        """Offer the first ``length`` (default: all computed) tokens of ``node``'s sequence to the prefix cache
        across requests, if the scheduler keeps one (:meth:`~treedec.runtime.prefix_cache.PrefixCache.offer`). The
        tokens' ids must be the real ones (not a pipelined step's placeholders)."""
        if self.cache is not None:
            self.cache.offer(node, length)


def kept_length(tree, node: int, before: int, known: Sequence[int], kept: int) -> int:
    """How much of ``node``'s sequence an output ending at its ``kept``-th token offers the prefix cache: the
    ``before`` tokens ahead of the output's first, then its first ``kept - 1`` tokens (the last one's K/V is not
    kept, as at any end) as far as the node holds them with the output's ids ``known`` (a run again may be behind;
    a pipelined step's placeholder differs); 0 when none of the output's tokens would be offered."""
    placed = tree.sequence(node)[before:before + max(0, kept - 1)]
    same = next((k for k, (a, b) in enumerate(zip(placed, known)) if a != b), min(len(placed), len(known)))
    return before + same if same else 0


def set_aside_bad_tokens(engine: Engine, requests: Sequence[tuple[Hashable, StepRequest, str]]
                         ) -> dict[Hashable, Exception]:
    """After the engine refused a step (its host check of the pending token ids): the programs whose pending ids
    are outside the model's vocabulary, each with its error, so that they fail alone. ``requests``: ``(key, the
    program's StepRequest, its name)`` for every program in the step; a pending token belongs to the program
    whose ``nodes`` / ``placed`` hold its node (or a descendant of it). Their bad ids are replaced by 0 in the
    tree: the step can then run for the others (nothing reads those programs' K/V: they fail after it). Empty,
    changing nothing, when a bad id belongs to none of them, or there is none: the step's error stands."""
    tree, vocab = engine.tree, engine.model.config.vocab_size
    tokens = tree.pending_tokens()
    layout = tree.layout()
    owner = {n: key for key, r, _ in requests for n in (*r.nodes, *(r.placed or ()))}
    found: dict[Hashable, list[tuple[int, int, int]]] = {}
    for q in np.flatnonzero((tokens < 0) | (tokens >= vocab)).tolist():
        node = int(layout.node_ids[layout.query_node[q]])
        key = owner.get(node)
        if key is None:
            key = next((k for k, r, _ in requests for n in r.nodes if node in tree.path(n)), None)
        if key is None:
            return {}
        found.setdefault(key, []).append((node, int(layout.query_offset[q]), int(tokens[q])))
    for edits in found.values():
        for node, at, _ in edits:
            tree.set_tokens(node, at, [0])
    names = {key: name for key, _, name in requests}
    return {key: ValueError(f"{names[key]}: its token ids must be in [0, {vocab}) (the model's vocabulary), got "
                            f"{[t for _, _, t in edits][:5]}; it alone failed, the step ran for the others")
            for key, edits in found.items()}


def program_name(program: Program, index: int) -> str:
    """How errors name a program of a run (its ``name``, else its index and class)."""
    return program.name if program.name is not None else f"programs[{index}] ({type(program).__name__})"
