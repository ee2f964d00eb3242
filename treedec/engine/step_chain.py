"""Step chains: several engine steps whose shapes do not depend on the values they compute, planned
together on the host and replayed as ONE CUDA graph.

EAGLE's drafting is the case (DESIGN.md, "One decode step"): after the step that syncs the drafter,
``depth - 1`` drafter steps each compute ``top_k`` chains one token deeper. Which token and feature
each chain takes next is chosen on the device (top-k of cumulative scores), but every step's queries,
positions and KV slots are known before the first of them runs: the chains read the drafter's sequence
and their own tokens, which live in scratch slots the caller owns (no tree edit, nothing to free after).
So the caller gives each step as a :class:`~treedec.tree.layout.TreeLayout` (``layout(i)``), and
:meth:`StepChain.run`

1. plans every step (:meth:`TreeAttention.plan_host`): the host's whole share of the chain, at once;
2. writes each plan into a static plan of its own (one per step of the chain, grown when a plan
   outgrows its bounds, which recaptures), the caller's inputs into static device buffers;
3. replays one graph holding ``body``: every step's forward and the device work between them
   (the caller's top-k, gathers, :meth:`PagedKVPool.copy_slots`). No host round trip between the steps.

Without CUDA graphs (the engine's ``cuda_graphs`` off, e.g. on the CPU) the same ``body`` runs the
steps one by one as eager forwards over the same layouts: the reference the graphed chain is tested
against.

A run may carry :class:`~treedec.attention.dynamic_span.DynamicSpans` (pipelined EAGLE: each drafter's
newest tokens, of which only a device-known prefix is real): every step's plan masks the span's unused
slots and moves the span's ``shift_rows`` back, on the device, before the replay.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from treedec.attention import SpanMasking
from treedec.attention.dynamic_span import DynamicSpans, mask_on_device, shift_positions
from treedec.checks import positive_int
from treedec.engine.cuda_graphs import GraphEntry, GraphRunner
from treedec.engine.step_checks import check_window
from treedec.engine.step_output import StepOutput
from treedec.transfer import to_device
from treedec.tree.layout import TreeLayout
from treedec.tree.validate import int_array

__all__ = ["ChainContext", "ChainStep", "StepChain"]


@dataclass(frozen=True)
class ChainStep:
    """Step ``i`` of a chain, as its ``layout(i)`` gives it.

    layout : the step's tree layout: its queries (with their positions and KV slots, where the step writes
        their K/V) and the tokens they read. Same query count at every run of the chain.
    rows : [r] the query rows the body reads and writes, in the caller's order; the same ``r`` at every run.
    """

    layout: TreeLayout
    rows: np.ndarray


class StepChain:
    """``length`` steps of ``engine`` run by ``body`` as one CUDA graph (see the module docstring).

    Parameters
    ----------
    engine : the Engine whose model runs the steps and whose KV pool holds what they read and write.
    length : the number of steps, >= 1.
    layout : ``layout(i) -> ChainStep``: step ``i``'s queries and what they read. The chain writes the K/V
        of its queries at their slots; the tree is not changed (the slots are the caller's to own).
    body : ``body(ctx, inputs) -> tuple of tensors``: the chain's device work. It calls
        ``ctx.forward(i, tokens, features)`` for ``i = 0 .. length - 1`` in order (the step's token ids
        ``[r]`` and, for models that read them, features ``[r, feature_size]``, in the rows' order) and may
        move K/V with ``ctx.engine.pool.copy_slots``. It must not read values back to the host (it is captured).
    inputs : ``{name: (shape, dtype)}`` of the tensors :meth:`run` takes (copied into static buffers).

    Outputs of a graphed run are the graph's buffers: valid until the next :meth:`run`.
    """

    def __init__(self, engine, length: int, layout: Callable[[int], ChainStep],
                 body: Callable[["ChainContext", dict[str, torch.Tensor]], tuple[torch.Tensor, ...]],
                 inputs: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        positive_int("length", length)
        self.engine, self.length, self.layout, self.body = engine, length, layout, body
        self._input_specs = dict(inputs)
        self._entries: list[GraphEntry] = []
        self._widths: list[tuple[int, int]] = []   # per step: (queries, rows)
        self._inputs: dict[str, torch.Tensor] = {}
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()

    @property
    def graphed(self) -> bool:
        """Whether runs replay one graph (the engine has CUDA graphs) rather than step one by one."""
        return self.engine.graph_runner is not None

    def run(self, inputs: dict[str, torch.Tensor], dynamic: DynamicSpans | Sequence[DynamicSpans] | None = None
            ) -> tuple[torch.Tensor, ...]:
        """Run the chain's ``length`` steps on ``inputs`` (device tensors of the declared shapes): ``body``'s
        outputs. ``dynamic``: spans every step reads (each one's ``shift_rows``: each step's queries after it)."""
        spans = DynamicSpans.of(dynamic)
        if set(inputs) != set(self._input_specs):
            raise ValueError(f"a chain run needs inputs {sorted(self._input_specs)}, got {sorted(inputs)}")
        for name, value in inputs.items():
            shape, _ = self._input_specs[name]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
                raise ValueError(f"chain input {name!r} must be a tensor of shape {list(shape)}, got "
                                 f"{getattr(value, 'shape', type(value).__name__)}")
        with self.engine.guard:
            steps = [self._step(i) for i in range(self.length)]
            self.engine.stats["steps"] += len(steps)
            self.engine.stats["queries"] += sum(step.layout.num_queries for step in steps)
            if not self.graphed:
                return tuple(self.body(_EagerSteps(self, steps, spans), inputs))
            return self._run_graphed(steps, inputs, spans)

    # ================================================================ private

    def _step(self, i: int) -> ChainStep:
        """Step ``i``'s layout, checked: the same query and row counts as at the first run."""
        e = self.engine
        step = self.layout(i)
        if not isinstance(step, ChainStep) or not isinstance(step.layout, TreeLayout):
            raise TypeError(f"a chain's layout(i) must return a ChainStep of a TreeLayout, got {step!r:.80}")
        num_q = step.layout.num_queries
        if num_q == 0:
            raise ValueError(f"step {i} of the chain has no queries")
        rows = int_array(step.rows, "ChainStep.rows")
        if len(rows) and (rows.min() < 0 or rows.max() >= num_q):
            raise ValueError(f"ChainStep.rows must be query rows in [0, {num_q}), got {rows[:8].tolist()}")
        width = (num_q, len(rows))
        if i < len(self._widths) and self._widths[i] != width:
            raise ValueError(f"step {i} of a chain must keep its (queries, rows) between runs: first "
                             f"{self._widths[i]}, now {width}")
        if i == len(self._widths):
            self._widths.append(width)
        check_window(e.window_cap, int(step.layout.query_position.max()))
        return ChainStep(step.layout, rows)

    def _run_graphed(self, steps: list[ChainStep], inputs: dict[str, torch.Tensor],
                     spans: DynamicSpans | None) -> tuple[torch.Tensor, ...]:
        e, runner = self.engine, self.engine.graph_runner
        started = time.perf_counter()
        planned = [e.attention.plan_host(step.layout, spans) for step in steps]   # (plans, ranges): one a group
        rebuilt = self._fit(runner, [plans for plans, _ in planned])
        for entry, (plans, ranges), step in zip(self._entries, planned, steps):
            runner.write(entry, plans, np.zeros(plans[0].num_queries, dtype=np.int64), step.layout.query_position,
                         step.layout.query_slot, (step.rows,))
            if spans is not None:   # (stream-ordered after the write, before the replay)
                if e.attn.backend_impl.span_masking is SpanMasking.DEVICE:
                    for static, plan, where in zip(entry.statics, plans, ranges):
                        mask_on_device(plan, static.device_plan.entry_mask, spans, where)
                shift_positions(entry.static.extra["inputs"][1], spans)
            e.stats["kv_tokens_read"] += e.attention.kv_tokens_read(plans)
        e.stats["plan_seconds"] += time.perf_counter() - started
        if rebuilt or not self._inputs:
            self._inputs = {name: torch.zeros(shape, dtype=dtype, device=e.device)
                            for name, (shape, dtype) in self._input_specs.items()}
        for name, value in inputs.items():
            self._inputs[name].copy_(value)
        ctx = _GraphedSteps(self, self._entries, self._widths)
        if not runner.config.capture:
            runner.stats["chain_static_eager"] += 1
            return tuple(self.body(ctx, self._inputs))
        if self._graph is None:
            self._graph, self._outputs = runner.capture(lambda: self.body(ctx, self._inputs))
        self._graph.replay()
        runner.stats["chain_replays"] += 1
        return self._outputs

    def _fit(self, runner: GraphRunner, step_plans) -> bool:
        """Make every step's static plans hold its plans (one a group; new ones grown from the old bounds); True
        when any was made anew (the graph is then captured again)."""
        rebuilt = False
        for i, plans in enumerate(step_plans):
            have = self._entries[i] if i < len(self._entries) else None
            if have is not None and runner.holds(have, plans):
                continue
            entry = runner.new_entry(plans, None if have is None else have.statics)
            if have is None:
                self._entries.append(entry)
            else:
                self._entries[i] = entry
            rebuilt = True
        if rebuilt:
            self._graph, self._outputs = None, ()
        return rebuilt


class ChainContext:
    """What a chain's ``body`` calls: :meth:`forward` once per step, in order (and ``engine.pool.copy_slots``)."""

    def __init__(self, chain: StepChain):
        self.chain, self.engine = chain, chain.engine

    def forward(self, i: int, tokens: torch.Tensor, features: torch.Tensor | None = None) -> StepOutput:
        """Step ``i`` on ``tokens`` ``[r]`` (and ``features [r, feature_size]``) at its rows: the step's logits and
        final-norm hidden states at its rows, in their order."""
        raise NotImplementedError(f"{type(self).__name__} must define forward")

    def _mask_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        limit = self.engine.vocab_limit
        return logits if limit is None else logits.index_fill(
            -1, torch.arange(limit, logits.shape[-1], device=logits.device), float("-inf"))


class _GraphedSteps(ChainContext):
    """Steps over the chain's static plans (inside its graph): step ``i``'s buffers ``entries[i]``, its
    (queries, rows) ``widths[i]``."""

    def __init__(self, chain: StepChain, entries: list[GraphEntry], widths: list[tuple[int, int]]):
        super().__init__(chain)
        self.entries, self.widths = entries, widths

    def forward(self, i, tokens, features=None):
        entry = self.entries[i]
        inputs = entry.static.extra["inputs"]
        rows = inputs[3, :self.widths[i][1]].long()
        inputs[0].index_copy_(0, rows, tokens.to(torch.int32))
        if features is not None:
            buffer = entry.row_inputs["features"]
            buffer.index_copy_(0, rows, features.to(buffer.dtype))
        out = self.engine.graph_runner.forward(entry)
        return StepOutput(self._mask_vocab(out[0].index_select(0, rows)), out[1].index_select(0, rows))


class _EagerSteps(ChainContext):
    """Steps one by one: eager forwards over each step's layout."""

    def __init__(self, chain: StepChain, steps: list[ChainStep], spans: DynamicSpans | None):
        super().__init__(chain)
        self.steps, self.spans = steps, spans

    def forward(self, i, tokens, features=None):
        e, step = self.engine, self.steps[i]
        layout, num_q = step.layout, step.layout.num_queries
        at = to_device(step.rows, e.device)
        q_tokens = torch.zeros(num_q, dtype=torch.long, device=e.device)
        q_tokens[at] = tokens.long()
        q_features = None
        if features is not None:
            q_features = features.new_zeros(num_q, features.shape[-1]).to(e.model.dtype)
            q_features[at] = features.to(e.model.dtype)
        hosts, ranges = e.attention.plan_host(layout, self.spans)
        plans = e.attention.prepare(hosts, e.device)
        if self.spans is not None and e.attn.backend_impl.span_masking is SpanMasking.DEVICE:
            for host, plan, where in zip(hosts, plans, ranges):
                mask_on_device(host, plan.entry_mask, self.spans, where)
        e.stats["kv_tokens_read"] += e.attention.kv_tokens_read(hosts)
        out = e.eager_forward(plans, np.zeros(num_q, dtype=np.int64), layout.query_position, layout.query_slot,
                              step.rows, q_tokens, q_features, self.spans)
        return StepOutput(self._mask_vocab(out.logits), out.hidden[at])
