"""A step's tail: device work a caller hands :meth:`Engine.step <treedec.engine.Engine.step>` to run after the
forward, on the step's logits, inside the step's CUDA graph when the step is graphed (so a graphed step is one
replay: the placeholders' ids filled in, the forward, and the tail, e.g. the lanes' batched draw).

A tail reads and writes only buffers of fixed shapes (its ``buffers``: the graph keeps them alive), reads the logits of
the step's first :attr:`StepTail.rows` logits rows (padded: rows past the step's are copies of its first row, whose
results the tail must ignore), and does no host work: its :meth:`StepTail.run` is recorded once per
:attr:`StepTail.key` and query bucket, and replayed.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

__all__ = ["StepTail"]


@dataclass(frozen=True)
class StepTail:
    """Device work after a step's forward (see the module docstring).

    Attributes
    ----------
    key : what the recorded work depends on besides the step's query bucket (the shapes, the flags that pick its
        operations, the buffers' identity): steps with equal keys replay one graph.
    rows : the logits rows it reads: ``run`` gets ``[rows, V]`` float logits, the step's logits rows first (the step
        must ask at least one), then copies of the first.
    run : ``run(logits)``: the device work, on the vocabulary-masked logits (no host sync, no host values).
    buffers : the tensors ``run`` reads and writes (kept alive with the graph that recorded them).
    state : those of them that ``run`` updates from their own values (counters, written tokens that the next step
        reads): a capture runs the step once to warm up before recording it, and that run is undone on them.
    """

    key: Hashable
    rows: int
    run: Callable[[torch.Tensor], None]
    buffers: tuple[torch.Tensor, ...] = ()
    state: tuple[torch.Tensor, ...] = ()

    @functools.cached_property
    def graph_key(self) -> tuple:
        """``key`` with the buffers' addresses (a graph replays those addresses)."""
        return (self.key, tuple(t.data_ptr() for t in self.buffers))
