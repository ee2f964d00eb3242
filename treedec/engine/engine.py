"""Engine: a model (a :class:`~treedec.models.base.DecoderModel` of any family) on a paged KV pool and a forest of
decoding trees.

    engine = Engine(from_pretrained("/models/Llama-3.1-8B"))   # KV pool from free GPU memory
    root = engine.prefill(prompt_ids)                           # a new tree of the forest
    firsts = root.logits.topk(4).indices.tolist()
    leaves = engine.tree.branch(root.node, [[t] for t in firsts])   # any tree edit ...
    logits = engine.step().logits                               # ... then one forward: [4, vocab]

A step's queries are the tree's pending tokens (whatever :class:`~treedec.tree.SequenceTree`
operations added since the last step: one token per live leaf, a speculative token tree, a
prompt continuation under a node), in ``tree.layout()`` order; :meth:`Engine.pending_nodes`
says which node each belongs to. The attention plan is made once per step and reused by
every layer; the step commits the tokens (their K/V are in the pool) when it returns.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Sequence

import numpy as np
import torch

from treedec.attention import DeviceTreePlan, PlanConfig, SpanMasking, StaticPlan
from treedec.attention.dynamic_span import DynamicSpans, mask_on_device, shift_positions
from treedec.checks import int_in_range, positive_int
from treedec.engine.attention_groups import LayerAttention, StepAttend
from treedec.engine.batch_invariance import engine_plan_config, refuse_switched_model, switch_model
from treedec.engine.cuda_graphs import (CudaGraphConfig, GraphRunner, build_graph_runner, fill_tokens,
                                        token_sources)
from treedec.engine.row_heads import RowHeads
from treedec.engine.kv_cache import calibrate_kv_scales, initial_kv_scales, kv_cache_name, variant_kv_dtype
from treedec.models.base import DecoderModel
from treedec.engine.pool_sizing import kv_pool_pages
from treedec.engine.step_checks import (check_device_tokens, check_features, check_rows, check_token_ids,
                                        check_window)
from treedec.engine.query_rows import QueryRows
from treedec.engine.prompt import PromptChunks, prefill_steps
from treedec.engine.step_output import PrefillOutput, StepOutput
from treedec.engine.step_tail import StepTail
from treedec.errors import TreeError
from treedec.transfer import PinnedStaging, take_rows
from treedec.tree import PagedKVPool, SequenceTree
from treedec.tree.thread_guard import ThreadGuard
from treedec.tree.validate import int_list

logger = logging.getLogger("treedec")

class Engine(RowHeads):
    """Runs tree steps of ``model`` over its own :class:`PagedKVPool`, :class:`SequenceTree` and :class:`TreeAttention`.

    Parameters
    ----------
    model : DecoderModel
        From :func:`~treedec.models.from_pretrained`, :func:`~treedec.models.from_hf_model`
        or :func:`~treedec.models.from_config` (or an EAGLE drafter); the pool takes its dtype and device.
    kv_tokens : int, optional
        KV pool capacity in tokens (rounded down to whole pages). Default on CUDA: what fits in
        ``memory_fraction`` of the free GPU memory after the weights, less an activation
        reserve; required on the CPU. The result is :attr:`kv_capacity_tokens`.
    page_size : int
        Tokens per KV page.
    backend, plan_config :
        Of the :class:`TreeAttention` (``auto``: cuda on an H100/H200, else triton on a GPU; torch on the CPU;
        ``plan_config`` None: ``PlanConfig()``, or the batch-invariant mode's); one per variant of the model's
        layers (``model.attention_variants()``), a plan a step per group of layers sharing a window
        (:mod:`treedec.engine.attention_groups`). Keys past a window are never read, and their pages go back to the
        pool when every layer has one; a config's window the variants do not implement caps the positions.
    prefill_chunk : int
        :meth:`prefill` runs a long prompt as steps of at most this many tokens.
    cuda_graphs : bool or CudaGraphConfig
        Replay captured CUDA graphs for steps of up to ``max_queries`` queries (needs CUDA and a
        kernel backend: triton or cuda); see :mod:`treedec.engine.cuda_graphs`.
    compile_model : bool or dict
        With ``cuda_graphs``: compile the whole forward of the graphed steps with ``torch.compile``
        (``fullgraph=True``; a dict gives more ``torch.compile`` arguments), attention and the K/V
        store running as the custom ops of :mod:`treedec.attention.custom_ops`, so Inductor fuses
        everything between the GEMMs; the compiled forward is then captured. One compile per
        graph bucket, at its first step. Eager steps (past the graphs' bounds) stay uncompiled.
    kv_cache_dtype : str
        vLLM's: ``"auto"`` stores K/V in the model's dtype; ``"fp8"`` / ``"fp8_e4m3"`` as e4m3, half the bytes of
        bf16 (twice the tokens in the same memory, half the K/V a step reads), with the checkpoint's scales or 1.0
        (:mod:`treedec.engine.kv_cache`; :meth:`calibrate_kv_scales`). The kernels read fp8 K/V (the triton
        backend; the torch backend de-quantizes them, the CPU's). :attr:`kv_cache_dtype` says what the pool
        stores, :attr:`kv_scale_source` where its scales came from.
    batch_invariant : bool
        A request's logits are the same bits alone or in any batch (:mod:`treedec.engine.batch_invariance`; it
        switches the model, refuses what cannot be invariant); :attr:`batch_invariance` reports it (None: off).

    One thread drives an engine: a second thread entering :meth:`step`, :meth:`prefill` or a
    scheduler run (``with engine.guard``) while the first is inside raises
    :class:`~treedec.errors.ConcurrentUseError` instead of corrupting the tree's refcounts.

    Attributes
    ----------
    attention : LayerAttention
        The layers' TreeAttentions and groups (:mod:`treedec.engine.attention_groups`); ``attn`` is layer 0's
        TreeAttention (its backend and planner are every layer's).
    guard : ThreadGuard
        Held by the thread inside the engine (re-entrant); see :mod:`treedec.tree.thread_guard`.
    vocab_limit : int or None
        Token ids at or past it are never produced: their logits are -inf in every step's output
        (:meth:`restrict_vocab`; e.g. a checkpoint whose embedding is padded past its tokenizer).
    stats : Counter
        ``steps``, ``queries``, ``plan_seconds`` (host time from a step's layout to its plan
        prepared, or written into its graph's static plan) and ``kv_tokens_read`` (per KV
        head, by every layer's attention: each chunk once per work item).
    """

    def __init__(self, model: DecoderModel, kv_tokens: int | None = None, page_size: int = 16, backend: str = "auto",
                 plan_config: PlanConfig | None = None, prefill_chunk: int = 2048, memory_fraction: float = 0.9,
                 cuda_graphs: bool | CudaGraphConfig = False, compile_model: bool | dict = False,
                 kv_cache_dtype: str = "auto", batch_invariant: bool = False):
        c = model.config
        positive_int("prefill_chunk", prefill_chunk)
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        plan_config = engine_plan_config(plan_config, batch_invariant)
        self.model = model
        self.device = model.device
        self.prefill_chunk = prefill_chunk
        variants = model.attention_variants()
        kv_dtype = variant_kv_dtype(kv_cache_dtype, model.dtype)
        self.attention = LayerAttention.build(variants, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, backend,
                                              plan_config, self.device, model.dtype, kv_dtype)
        self.attn = self.attention.planners[0]   # layer 0's; the one of every layer in a one-variant model
        self.batch_invariance = switch_model(model, self.attn) if batch_invariant else refuse_switched_model(model)
        self._window_cap = None if any(v.window is not None for v in variants) else c.sliding_window
        self._release_window = self.attention.release_window   # None: some layer reads every key
        num_pages, self.kv_pool_reason = kv_pool_pages(model, kv_tokens, page_size, memory_fraction, prefill_chunk,
                                                       kv_cache_dtype)
        # One scratch page: where the padded rows of a CUDA-graph step write their K/V.
        self.pool = PagedKVPool(num_pages, page_size, c.num_layers, c.num_kv_heads, c.head_dim,
                                dtype=model.dtype, device=self.device, scratch_pages=1, kv_dtype=kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_name(self.pool)
        self.kv_scale_source = initial_kv_scales(self.pool, model)
        self.tree = SequenceTree(self.pool)
        self.stats: Counter = Counter()
        self.guard = ThreadGuard("this Engine")
        self.vocab_limit: int | None = None
        self._row_heads: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._hidden_layers: tuple[int, ...] = ()
        self._feature_size: int | None = model.feature_size   # read every step
        logger.info("KV pool: %d tokens of %s (%s)%s", self.kv_capacity_tokens, self.kv_cache_dtype,
                    self.kv_pool_reason, "" if self.kv_scale_source is None else f"; scales: {self.kv_scale_source}")
        self._graphs = build_graph_runner(self, self._static_forward, cuda_graphs, compile_model)
        self._query_rows = QueryRows()   # pending_rows' lookup (one sort of a layout's node ids)
        self._staging = PinnedStaging(self.device, turns=4)   # the eager steps' inputs (a chain's steps: several)

    # ================================================================ public API

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds."""
        return self.pool.num_slots

    def restrict_vocab(self, size: int) -> None:
        """Never produce token ids ``>= size``: every step's logits there are -inf from now on, so greedy
        picks, sampling and speculative acceptance all skip them. For a model whose vocabulary (the
        embedding, often padded to a multiple of 64 or 128) is larger than its tokenizer's
        (``len(tokenizer)``): an id past the tokenizer cannot be decoded. The batch functions call it
        when they are given a tokenizer. A later, larger ``size`` does not widen an earlier limit."""
        vocab = self.model.config.vocab_size
        size = int_in_range("size", size, 1, vocab, numpy=True, note=" (the model's vocab_size)")
        if size < vocab and (self.vocab_limit is None or size < self.vocab_limit):
            self.vocab_limit = size
            logger.info("token ids >= %d are never produced (the model's vocabulary has %d)", size, vocab)

    def prefill(self, prompt_ids: Sequence[int], parent: int | None = None, return_hidden: bool = False,
                return_heads: bool = False) -> PrefillOutput:
        """Add a prompt and run it; returns a :class:`PrefillOutput`: the prompt's node and its last
        token's ``logits [vocab]``; with ``return_hidden`` also its ``hidden [hidden_size]`` (the
        final-norm hidden state), with ``return_heads`` the row heads' outputs ``{name: output}`` at
        that token (see :meth:`step`). The fields not asked for are None.

        ``parent=None`` starts a new tree of the forest; else the prompt is a new child of node
        ``parent`` (a continuation, e.g. an evaluation prompt under a thought). A prompt longer
        than ``prefill_chunk`` runs as several steps, the chunks of :meth:`chunk_prompt` (which a
        scheduler program steps with other requests' tokens). The tree must have no pending tokens
        (run :meth:`step` first); a pool too small for the prompt raises PoolExhaustedError
        before anything changes.
        """
        with self.guard:
            return prefill_steps(self, prompt_ids, parent, return_hidden, return_heads)

    def chunk_prompt(self, prompt_ids: Sequence[int], parent: int | None = None) -> PromptChunks:
        """Check a prompt (token ids in the model's vocabulary, at least one; ``parent`` a node of the tree or
        None) and cut it into chunks of at most ``prefill_chunk`` tokens: what :meth:`prefill` runs, and
        what a scheduler program adds chunk by chunk (:class:`~treedec.engine.prompt.PromptChunks`). Changes
        nothing; the caller checks the positions against its limits and waits for (or refuses) the pages."""
        tokens = int_list(prompt_ids, "prompt_ids", low=0)
        if not tokens:
            raise TreeError("prefill needs at least one prompt token, got 0")
        check_token_ids(np.asarray(tokens), self.model.config.vocab_size, "prompt_ids")
        if parent is not None and parent not in self.tree:
            raise TreeError(f"unknown parent node id {parent!r}")
        chunk = self.prefill_chunk
        return PromptChunks(parent, tuple(tuple(tokens[i:i + chunk]) for i in range(0, len(tokens), chunk)),
                            0 if parent is None else len(self.tree.sequence(parent)), self.pool.pages_for(len(tokens)))

    def step(self, logits_rows: Sequence[int] | np.ndarray | torch.Tensor | None = None,
             return_hidden: bool = False, tokens: torch.Tensor | None = None, return_heads: bool = False,
             hidden_rows: Sequence[int] | np.ndarray | None = None, return_aux: bool = False,
             features: torch.Tensor | None = None, dynamic: DynamicSpans | Sequence[DynamicSpans] | None = None,
             token_rows: Sequence[int] | np.ndarray | None = None, tail: StepTail | None = None) -> StepOutput:
        """One forward over the tree's pending tokens; commits them.

        The queries are in ``tree.layout()`` order: depth-first over the nodes, then token
        order within a node (:meth:`pending_nodes` gives each one's node; for the nodes of a
        token tree, which are not depth-first in general, :meth:`pending_rows` gives the rows
        in the caller's order).

        Parameters
        ----------
        logits_rows : [r] ints, optional
            Which queries (row indices in that order) to return logits for; default all.
        return_hidden : bool
            Also return hidden states after the final norm (the ``lm_head`` input, e.g. for
            Medusa heads) at ``hidden_rows``; such steps replay the same CUDA graphs as the others.
        tokens : [Q] int64 tensor on the engine's device, optional
            The pending tokens' ids, read on the device instead of the tree's (which then hold
            placeholders): the previous step's sampled tokens, not yet read back, so that this
            step is planned and launched while that one still runs (pipelined decoding; record
            the real ids with :meth:`SequenceTree.set_tokens`). They must be ids in
            ``[0, vocab)``: a device tensor is not checked (that would wait for it).
            With ``token_rows``: ``[k]``, the ids of the queries at those rows only.
        return_heads : bool
            Also return the row heads' outputs (:meth:`add_row_head`) at ``logits_rows``, as a
            dict ``{name: [r, ...] tensor}``.
        hidden_rows : [h] ints, optional
            The rows of the hidden states and ``aux`` outputs, when not ``logits_rows`` (e.g. every
            prompt token's hidden state but the last token's logits only).
        return_aux : bool
            Also return the residual stream entering each layer of :attr:`hidden_layers` at
            ``hidden_rows`` (what EAGLE-3 drafters read), ``[h, len(hidden_layers), hidden_size]``.
        features : [Q, feature_size] tensor on the engine's device, optional
            Per-query input features, for models that read them (EAGLE drafters: the target's
            hidden state paired with each token), in query order.
        dynamic : DynamicSpans or several, optional
            Pipelined speculative decoding's spans, one a request, as arrays (:mod:`treedec.attention.dynamic_span`;
            several are concatenated once; not on
            the ``reference`` backend, a wait on ``torch``)
        token_rows : [k] ints, optional
            With ``tokens``: the query rows whose ids ``tokens`` gives (the others' ids are the tree's), e.g. the
            lanes' placeholders (:mod:`treedec.runtime.lanes`). The rows travel with the step's inputs (no copy
            of their own), the ids are written into them on the device. ``tokens`` may be longer (a fixed
            buffer, e.g. with a ``tail``): its first ``k`` are the rows' ids.
        tail : StepTail, optional
            Device work on the step's logits (:mod:`treedec.engine.step_tail`, e.g. the lanes' batched draw),
            recorded in the step's CUDA graph when it is graphed (one replay: placeholders, forward, tail), else run
            after the eager forward. Needs ``logits_rows``; device ``tokens`` go by ``token_rows``.

        Returns
        -------
        StepOutput
            ``logits [r, vocab]`` (default ``[Q, vocab]``) in the model dtype, on the model's device;
            ``hidden [h, hidden_size]``, ``aux`` and the row heads' dict ``heads`` when asked for
            (else None).
        """
        with self.guard:
            return self._step(logits_rows, return_hidden, tokens, return_heads, hidden_rows, return_aux, features,
                              dynamic, token_rows, tail)

    def _step(self, logits_rows, return_hidden, tokens, return_heads, hidden_rows, return_aux, features, dynamic,
              token_rows, tail) -> StepOutput:
        layout = self.tree.layout()
        num_q = layout.num_queries
        if num_q == 0:
            raise TreeError("step() needs pending tokens: add some with tree.extend / extend_many / branch / "
                            "add_token_tree (or use prefill) first")
        rows = check_rows(logits_rows, num_q)
        hrows = rows if hidden_rows is None else check_rows(hidden_rows, num_q, "hidden_rows")
        if return_aux and not self._hidden_layers:
            raise ValueError("return_aux needs hidden-state layers: call engine.capture_hidden_layers(layers) first")
        if features is not None or self._feature_size is not None:
            features = check_features(features, num_q, self._feature_size, self.device, self.model.dtype)
        positions = layout.query_position
        if self._window_cap is not None:
            check_window(self._window_cap, int(positions.max()))
        trows = None if token_rows is None else check_rows(token_rows, num_q, "token_rows")
        if trows is not None and tokens is None:
            raise ValueError("token_rows gives the rows of the device ids in tokens: pass tokens too")
        device_tokens = check_device_tokens(tokens, num_q if trows is None else len(trows), self.device,
                                            "one per pending token" if trows is None else None)
        if tail is not None and (rows is None or not len(rows) or (device_tokens is not None and trows is None)):
            raise ValueError("a step with a tail needs logits_rows (at least one), and its device tokens given "
                             "with token_rows")
        tokens, slots = self.tree.pending_tokens(), layout.query_slot
        check_token_ids(tokens, self.model.config.vocab_size, "the pending tokens")
        if self._release_window is not None:   # once the step is checked (holds only: the layout stays)
            self.tree.release_outside_window(self._release_window, margin=self.pool.page_size)
        started = time.perf_counter()
        graph = None
        spans = DynamicSpans.of(dynamic)   # (the step's spans as one set of arrays; None: none)
        host_plans, ranges = self.attention.plan_host(layout, spans)   # one a group (no spans: as planned)
        if self._graphs is not None:
            # The rows to gather travel with the step's inputs (no copy of their own after the replay).
            gathers = (rows, hrows if hidden_rows is not None and (return_hidden or return_aux) else None,
                       None if trows is None else token_sources(trows, num_q))
            graph = self._graphs.load(host_plans, tokens, positions, slots, gathers)
        plans = self.attention.prepare(host_plans, self.device) if graph is None else None
        if spans is not None and self.attn.backend_impl.span_masking is SpanMasking.DEVICE:
            for g, host_plan in enumerate(host_plans):
                mask_on_device(host_plan, plans[g].entry_mask if graph is None
                               else graph.statics[g].device_plan.entry_mask, spans, ranges[g])
        self.stats["plan_seconds"] += time.perf_counter() - started
        self.stats["kv_tokens_read"] += self.attention.kv_tokens_read(host_plans)
        if plans is not None:
            out = self.eager_forward(plans, tokens, positions, slots, rows, device_tokens, features, spans,
                                     token_rows=trows)
            logits, hidden_all, aux_all = out.logits, out.hidden, out.aux
            if tail is not None:
                self._run_tail(tail, logits, torch.arange(tail.rows, device=self.device).clamp_(max=len(rows) - 1))
            heads = None
            if return_heads:
                with torch.no_grad():
                    picked = take_rows(hidden_all, rows, self.device)
                    heads = {name: head(picked) for name, head in self._row_heads.items()}
        else:  # copies: the graph's output buffers are overwritten by its next replay
            inputs = graph.static.extra["inputs"]
            shift_positions(inputs[1], spans)
            row_inputs = None if features is None else {"features": features}
            if tail is None:
                # (stream-ordered after the load's copy of the placeholders and their sources)
                if trows is not None:
                    fill_tokens(inputs, device_tokens)
                elif device_tokens is not None:
                    inputs[0, :num_q].copy_(device_tokens)
                outputs = self._graphs.run(graph, num_q, row_inputs)
            else:
                if tail.rows > inputs.shape[1]:
                    raise ValueError(f"the tail reads {tail.rows} logits rows, more than the step's graph has "
                                     f"({inputs.shape[1]})")

                def body():   # the placeholders' ids, the forward, the tail: one graph
                    if device_tokens is not None:
                        fill_tokens(inputs, device_tokens)
                    forward = self._graphs.forward(graph)
                    self._run_tail(tail, forward[0], inputs[3, :tail.rows])
                    return forward

                given = () if device_tokens is None else (device_tokens,)
                key = (tail.graph_key, self.vocab_limit, tuple((t.data_ptr(), t.shape, t.stride()) for t in given))
                outputs = self._graphs.run(graph, num_q, row_inputs, tail=(key, body, tail.buffers + given, tail.state))
            logits = self._gather(graph, outputs[0], rows, 0)
            hidden_all = outputs[1]
            aux_all = outputs[2] if self._hidden_layers else None
            first_head = 3 if self._hidden_layers else 2
            heads = dict(zip(self._row_heads, (self._gather(graph, t, rows, 0)
                                               for t in outputs[first_head:]))) if return_heads else None
            if return_hidden or return_aux:   # copies too (the views would change at the next replay)
                which = 0 if hidden_rows is None else 1
                hidden_all = self._gather(graph, hidden_all, hrows, which)
                aux_all = None if aux_all is None else self._gather(graph, aux_all, hrows, which)
                hrows = None
        if self.vocab_limit is not None:
            with torch.inference_mode():   # the eager forward's logits are inference tensors
                logits[..., self.vocab_limit:] = float("-inf")
        self.tree.commit_step()
        self.stats["steps"] += 1
        self.stats["queries"] += num_q
        return StepOutput(logits, take_rows(hidden_all, hrows, self.device) if return_hidden else None,
                          take_rows(aux_all, hrows, self.device) if return_aux else None, heads)

    def calibrate_kv_scales(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Set an fp8 pool's scales from ``prompts``' K/V (lists of token ids; see
        :func:`~treedec.engine.kv_cache.calibrate_kv_scales`) before the pool holds any: ValueError once it does
        (their K/V were stored with the old scales) or for a pool of the model's dtype. Returns the scales
        ``[num_layers, 2, num_kv_heads]``."""
        if self.pool.num_free_pages != self.pool.num_pages:
            raise ValueError("calibrate_kv_scales: the KV pool holds tokens already, stored with the old scales; "
                             "calibrate before the first prefill")
        scales = calibrate_kv_scales(self.model, self.pool, prompts)
        self.kv_scale_source = f"calibrated on {len(prompts)} prompt(s) (amax / 448)"
        return scales

    def capture_hidden_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Make every step able to return the residual stream entering each of ``layers`` (:meth:`step`'s
        ``return_aux``), inside its CUDA graph. Layers add to those already captured (several drafters
        may read different ones); returns :attr:`hidden_layers`, whose order ``aux`` follows. Captured
        graphs are dropped when the set grows (and recaptured at their next step)."""
        wanted = self.model.check_aux_layers(layers)
        merged = tuple(sorted(set(self._hidden_layers) | set(wanted)))
        if merged != self._hidden_layers:
            self._hidden_layers = merged
            if self._graphs is not None:
                self._graphs.reset()
        return self._hidden_layers

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The layers whose input :meth:`step` returns as ``aux`` (:meth:`capture_hidden_layers`), ascending."""
        return self._hidden_layers

    def pending_nodes(self) -> np.ndarray:
        """[Q] int64 node id of each pending token, in step (query) order."""
        layout = self.tree.layout()
        return layout.node_ids[layout.query_node]

    def pending_rows(self, node_ids: Sequence[int]) -> np.ndarray:
        """[k] int64 query row of the last pending token of each node in ``node_ids``.

        E.g. ``engine.step(logits_rows=engine.pending_rows(ids))`` for the ids that
        ``tree.add_token_tree`` returned gives the logits in token order.
        """
        return self._query_rows.last(self.tree.layout(), node_ids)

    def pending_token_rows(self, node_ids: Sequence[int]) -> np.ndarray:
        """[k] int64 query rows of EVERY pending token of each node in ``node_ids``, node by node in
        token order (e.g. the hidden states of a whole prompt chunk: ``step(hidden_rows=...)``)."""
        layout = self.tree.layout()
        owner = layout.node_ids[layout.query_node]
        parts = [np.flatnonzero(owner == n) for n in node_ids]
        missing = [n for n, p in zip(node_ids, parts) if not len(p)]
        if missing:
            raise TreeError(f"node(s) {missing[:5]} have no pending tokens")
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @property
    def graph_stats(self) -> Counter:
        """CUDA-graph counters: captures, replays, and ``eager: <reason>`` for steps run eagerly."""
        return Counter() if self._graphs is None else self._graphs.stats

    # ================================================================ the engine package's interface

    @property
    def window_cap(self) -> int | None:
        """The positions a step may not reach (its ``check_window``): the config's sliding window where the model's
        variants do not attend it as a window, else None. For the engine package (a StepChain's steps)."""
        return self._window_cap

    @property
    def graph_runner(self) -> GraphRunner | None:
        """The runner of the graphed steps (None without ``cuda_graphs``). For the engine package: a
        :class:`~treedec.engine.step_chain.StepChain` writes its steps' static plans and captures through it."""
        return self._graphs

    def eager_forward(self, plans: tuple[DeviceTreePlan, ...], tokens, positions, slots, rows,
                      device_tokens: torch.Tensor | None = None, features: torch.Tensor | None = None,
                      spans: DynamicSpans | None = None, token_rows: np.ndarray | None = None):
        """The model's ``ForwardOutput`` of a step over its prepared ``plans`` (one per attention group,
        :class:`~treedec.engine.attention_groups.LayerAttention`; host ``tokens``, ``positions``,
        ``slots`` ``[queries]``; logits at ``rows``, None: all; ``device_tokens`` int64 in place of ``tokens``, or
        of those at ``token_rows``; ``spans``' positions moved back on the device), and nothing else (no commit,
        stats or vocabulary mask). For the engine package (:meth:`step`, a :class:`StepChain`'s eager steps);
        programs call :meth:`step`."""
        q = len(tokens)
        given = [a for a in (rows, token_rows) if a is not None]
        flat = self._staging.to_device(np.concatenate([tokens, positions, slots, *given]))   # one transfer
        inputs = flat[:3 * q].view(3, q)
        shift_positions(inputs[1], spans)
        rows_t = None if rows is None else flat[3 * q:3 * q + len(rows)]
        token_ids = inputs[0] if device_tokens is None else device_tokens
        if token_rows is not None:
            token_ids = inputs[0].index_copy(0, flat[len(flat) - len(token_rows):], device_tokens[:len(token_rows)])
        return self.model(token_ids, inputs[1], StepAttend(self.attention, self.pool, inputs[2], plans), rows_t,
                          self._hidden_layers, features)

    # ================================================================ private

    def _run_tail(self, tail: StepTail, logits: torch.Tensor, rows: torch.Tensor) -> None:
        """``tail`` on the vocabulary-masked ``logits`` at ``rows`` ([tail.rows] device indices)."""
        with torch.inference_mode():   # (an eager forward's logits are inference tensors)
            scores = logits.index_select(0, rows)
            if self.vocab_limit is not None:
                scores[:, self.vocab_limit:] = float("-inf")
            tail.run(scores)

    def _gather(self, graph, output: torch.Tensor, rows: np.ndarray | None, which: int) -> torch.Tensor:
        """A copy of ``output``'s ``rows`` (all for None) of a graphed step, indexed by the step's gather
        ``which`` already on the device where :meth:`GraphRunner.load` sent it."""
        index = None if rows is None else self._graphs.gather_index(graph, which)
        if index is None:
            return take_rows(output, rows, self.device, copy=True)
        return output.index_select(0, index)

    @property
    def feature_size(self) -> int | None:
        """Width of the per-query features the model reads (:meth:`step`'s ``features``), or None."""
        return self._feature_size

    def _static_forward(self, statics: tuple[StaticPlan, ...], row_inputs: dict[str, torch.Tensor],
                        ops: bool = False) -> tuple[torch.Tensor, ...]:
        """The forward of a CUDA-graph step, read from the device buffers of ``statics`` (one static plan per
        attention group; the first holds the inputs) and ``row_inputs`` (the per-row features of a drafter):
        (logits, hidden, aux when :attr:`hidden_layers`, each row head's output), every row. ``ops``: attention
        and the K/V store as custom ops (what ``torch.compile`` traces)."""
        tokens, positions, slots = statics[0].extra["inputs"][:3]
        attend = StepAttend(self.attention, self.pool, slots.long(), tuple(s.device_plan for s in statics), ops)
        forward = self.model.forward_graph if ops else self.model
        out = forward(tokens, positions, attend, None, self._hidden_layers, row_inputs.get("features"))
        with torch.no_grad():
            return (out.logits, out.hidden, *((out.aux,) if self._hidden_layers else ()),
                    *(head(out.hidden) for head in self._row_heads.values()))

def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: ``[..., vocab]`` logits -> ``[...]`` int64 token ids (argmax)."""
    return logits.argmax(dim=-1)
