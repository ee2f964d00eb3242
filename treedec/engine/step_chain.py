"""Step chains: several engine steps whose shapes do not depend on the values they compute, planned
together on the host and replayed as ONE CUDA graph.

EAGLE's drafting is the case (DESIGN.md, "One decode step"): after the step that syncs the drafter,
``depth - 1`` drafter steps each compute ``top_k`` chains one token deeper. Which token and feature
each chain takes next is chosen on the device (top-k of cumulative scores), but the chains' tree
shape, their positions and KV slots are known before the first of them runs. So a chain's
:meth:`StepChain.run`

1. applies every step's tree edits (``edit(i)``; the pending tokens of step ``i`` are its queries,
   their ids placeholders) and plans each step (:meth:`TreeAttention.plan_host`), committing its
   tokens as the engine's step would: the host's whole share of the chain, at once;
2. writes each plan into a static plan of its own (one per step of the chain, grown when a plan
   outgrows its bounds, which recaptures), the caller's inputs into static device buffers;
3. replays one graph holding ``body``: every step's forward and the device work between them
   (the caller's top-k, gathers, :meth:`Engine.copy_kv`). No host round trip between the steps.

Without CUDA graphs (the engine's ``cuda_graphs`` off, e.g. on the CPU) the same ``body`` runs the
steps one by one through :meth:`Engine.step`, each step's edit applied just before it: the
reference the graphed chain is tested against.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from treedec.engine.cuda_graphs import GraphRunner, _Graph
from treedec.transfer import to_device
from treedec.tree.validate import int_array

__all__ = ["ChainOutput", "ChainStep", "StepChain"]


@dataclass(frozen=True)
class ChainStep:
    """What a chain's ``edit(i)`` says of step ``i`` once its tree edits are applied.

    rows : [r] the query rows (in the step's layout order) the body reads and writes, in the caller's
        order (e.g. ``engine.pending_rows(chains)``); the same ``r`` at every run of the chain.
    ints : optional 2-D int array the body reads on the device after the step (:meth:`ChainContext.ints`),
        e.g. the chains' KV slots; the same shape at every run.
    """

    rows: np.ndarray
    ints: np.ndarray | None = None


@dataclass(frozen=True)
class ChainOutput:
    """One step's outputs at its :attr:`ChainStep.rows`, in their order: logits ``[r, vocab]`` and the
    final-norm hidden states ``[r, hidden_size]``."""

    logits: torch.Tensor
    hidden: torch.Tensor


class StepChain:
    """``length`` steps of ``engine`` run by ``body`` as one CUDA graph (see the module docstring).

    Parameters
    ----------
    engine : the Engine whose tree the edits change and whose model runs the steps.
    length : the number of steps, >= 1.
    edit : ``edit(i) -> ChainStep``: applies step ``i``'s tree edits (adding its queries as pending
        tokens with placeholder ids) and says which rows the body uses.
    body : ``body(ctx, inputs) -> tuple of tensors``: the chain's device work. It calls
        ``ctx.forward(i, tokens, features)`` for ``i = 0 .. length - 1`` in order (the step's token ids
        ``[r]`` and, for models that read them, features ``[r, feature_size]``, in the rows' order), and
        may read ``ctx.ints(i)`` after step ``i`` and move K/V with ``ctx.copy_kv``. It must not read
        values back to the host (it is captured).
    inputs : ``{name: (shape, dtype)}`` of the tensors :meth:`run` takes (copied into static buffers).

    Outputs of a graphed run are the graph's buffers: valid until the next :meth:`run`.
    """

    def __init__(self, engine, length: int, edit: Callable[[int], ChainStep],
                 body: Callable[["ChainContext", dict[str, torch.Tensor]], tuple[torch.Tensor, ...]],
                 inputs: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"length must be a positive int, got {length!r}")
        self.engine, self.length, self.edit, self.body = engine, length, edit, body
        self._input_specs = dict(inputs)
        self._entries: list[_Graph] = []
        self._widths: list[tuple[int, tuple[int, ...] | None]] = []   # per step: (rows, ints shape)
        self._inputs: dict[str, torch.Tensor] = {}
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()

    @property
    def graphed(self) -> bool:
        """Whether runs replay one graph (the engine has CUDA graphs) rather than step one by one."""
        return self.engine._graphs is not None

    def run(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run the chain's ``length`` steps on ``inputs`` (device tensors of the declared shapes): ``body``'s
        outputs. The steps' tokens are committed (their K/V written) when it returns."""
        if set(inputs) != set(self._input_specs):
            raise ValueError(f"a chain run needs inputs {sorted(self._input_specs)}, got {sorted(inputs)}")
        for name, value in inputs.items():
            shape, _ = self._input_specs[name]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
                raise ValueError(f"chain input {name!r} must be a tensor of shape {list(shape)}, got "
                                 f"{getattr(value, 'shape', type(value).__name__)}")
        with self.engine.guard:
            if not self.graphed:
                return tuple(self.body(_EagerSteps(self), inputs))
            return self._run_graphed(inputs)

    # ================================================================ private

    def _run_graphed(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        e, runner = self.engine, self.engine._graphs
        started = time.perf_counter()
        steps = [self._plan_step(i) for i in range(self.length)]
        rebuilt = self._fit(runner, steps)
        for entry, (plan, layout, step) in zip(self._entries, steps):
            runner.write(entry, plan, np.zeros(plan.num_queries, dtype=np.int64), layout.query_position,
                         layout.query_slot, (step.rows,), None if step.ints is None else {"ints": step.ints})
        e.stats["plan_seconds"] += time.perf_counter() - started
        if rebuilt or not self._inputs:
            self._inputs = {name: torch.zeros(shape, dtype=dtype, device=e.device)
                            for name, (shape, dtype) in self._input_specs.items()}
        for name, value in inputs.items():
            self._inputs[name].copy_(value)
        ctx = _GraphedSteps(self)
        if not runner.config.capture:
            runner.stats["chain_static_eager"] += 1
            return tuple(self.body(ctx, self._inputs))
        if self._graph is None:
            self._graph, self._outputs = runner.capture(lambda: self.body(ctx, self._inputs))
        self._graph.replay()
        runner.stats["chain_replays"] += 1
        return self._outputs

    def _plan_step(self, i: int):
        """Step ``i``'s edits, layout and host plan; its tokens committed (the graph computes them)."""
        e = self.engine
        step = self.edit(i)
        if not isinstance(step, ChainStep):
            raise TypeError(f"a chain's edit must return a ChainStep, got {type(step).__name__}")
        layout = e.tree.layout()
        if layout.num_queries == 0:
            raise ValueError(f"step {i} of the chain has no pending tokens: its edit must add its queries")
        e._check_window(int(layout.query_position.max()))
        rows = int_array(step.rows, "ChainStep.rows")
        if len(rows) and (rows.min() < 0 or rows.max() >= layout.num_queries):
            raise ValueError(f"ChainStep.rows must be query rows in [0, {layout.num_queries}), got {rows[:8].tolist()}")
        plan = e.attn.plan_host(layout)
        e.tree.commit_step()
        e.stats["steps"] += 1
        e.stats["queries"] += layout.num_queries
        e.stats["kv_tokens_read"] += plan.kv_tokens_read()
        return plan, layout, ChainStep(rows, step.ints)

    def _fit(self, runner: GraphRunner, steps) -> bool:
        """Make every step's static plan hold its plan (new ones grown from the old bounds); True when any
        was made anew (the graph is then captured again)."""
        widths = [(len(s.rows), None if s.ints is None else tuple(s.ints.shape)) for _, _, s in steps]
        if self._widths and widths != self._widths:
            raise ValueError(f"a chain's steps must keep their rows and ints shapes between runs: first "
                             f"{self._widths}, now {widths}")
        self._widths = widths
        rebuilt = False
        for i, (plan, _, step) in enumerate(steps):
            have = self._entries[i] if i < len(self._entries) else None
            if have is not None and runner.holds(have, plan):
                continue
            extra = None if step.ints is None else {"ints": tuple(step.ints.shape)}
            entry = runner.new_entry(plan, None if have is None else have.static.bounds, extra)
            if have is None:
                self._entries.append(entry)
            else:
                self._entries[i] = entry
            rebuilt = True
        if rebuilt:
            self._graph, self._outputs = None, ()
        return rebuilt


class ChainContext:
    """What a chain's ``body`` calls: :meth:`forward` per step, :meth:`ints`, :meth:`copy_kv`."""

    def __init__(self, chain: StepChain):
        self.chain, self.engine = chain, chain.engine

    def forward(self, i: int, tokens: torch.Tensor, features: torch.Tensor | None = None) -> ChainOutput:
        raise NotImplementedError

    def ints(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def copy_kv(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Move K/V between pool slots, every layer, on the device (:meth:`Engine.copy_kv`)."""
        self.engine.copy_kv(src_slots, dst_slots)

    def _mask_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        limit = self.engine.vocab_limit
        return logits if limit is None else logits.index_fill(
            -1, torch.arange(limit, logits.shape[-1], device=logits.device), float("-inf"))


class _GraphedSteps(ChainContext):
    """Steps over the chain's static plans (inside its graph)."""

    def forward(self, i, tokens, features=None):
        entry = self.chain._entries[i]
        inputs = entry.static.extra["inputs"]
        rows = inputs[3, :self.chain._widths[i][0]].long()
        inputs[0].index_copy_(0, rows, tokens.to(torch.int32))
        if features is not None:
            buffer = entry.row_inputs["features"]
            buffer.index_copy_(0, rows, features.to(buffer.dtype))
        out = self.engine._graphs._forward(entry.static, entry.row_inputs)
        return ChainOutput(self._mask_vocab(out[0].index_select(0, rows)), out[1].index_select(0, rows))

    def ints(self, i):
        return self.chain._entries[i].static.extra["ints"].long()


class _EagerSteps(ChainContext):
    """Steps one by one through :meth:`Engine.step`, each step's edit applied just before it."""

    def __init__(self, chain: StepChain):
        super().__init__(chain)
        self._ints: dict[int, torch.Tensor] = {}

    def forward(self, i, tokens, features=None):
        e = self.engine
        step = self.chain.edit(i)
        at = to_device(np.asarray(step.rows), e.device)
        q_tokens = torch.empty(e.tree.num_pending, dtype=torch.long, device=e.device)
        q_tokens[at] = tokens.long()
        q_features = None
        if features is not None:
            q_features = features.new_empty(e.tree.num_pending, features.shape[-1])
            q_features[at] = features
        logits, hidden = e.step(logits_rows=step.rows, return_hidden=True, tokens=q_tokens, features=q_features)
        if step.ints is not None:
            self._ints[i] = to_device(np.asarray(step.ints, dtype=np.int64), e.device)
        return ChainOutput(logits, hidden)

    def ints(self, i):
        return self._ints[i]
