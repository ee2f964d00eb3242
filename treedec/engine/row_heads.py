"""An engine's row heads (:class:`~treedec.engine.engine.Engine`'s ``add_row_head`` and the rest): functions of the
final hidden state computed at every query row of every step, inside the step's CUDA graph."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["RowHeads"]


class RowHeads:
    """The row-head part of :class:`~treedec.engine.engine.Engine` (its ``_row_heads`` dict and ``_graphs``)."""

    _row_heads: dict[str, Callable[[torch.Tensor], torch.Tensor]]

    def add_row_head(self, name: str, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Compute ``head(hidden)`` at every query row of every step from now on, inside the step's
        CUDA graph (and its ``torch.compile``): ``hidden`` is ``[rows, hidden_size]`` (after the
        final norm, as :meth:`step`'s ``return_hidden``), the result ``[rows, ...]``.

        :meth:`step` with ``return_heads`` returns the outputs (its ``heads``). E.g. Medusa heads' top-k
        candidates at every verified token, computed in the verification step's graph rather than
        in a step of their own after it. Every graphed step pays for the head, whether its output
        is asked for or not; captured graphs are dropped (and recaptured at their next step).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not callable(head):
            raise TypeError(f"head must be callable (hidden [rows, hidden_size] -> [rows, ...]), got {head!r:.60}")
        if name in self._row_heads:
            raise ValueError(f"a row head named {name!r} is already added; remove_row_head({name!r}) first")
        self._row_heads[name] = head
        if self._graphs is not None:
            self._graphs.reset()

    def remove_row_head(self, name: str) -> None:
        """Stop computing the row head ``name`` (see :meth:`add_row_head`)."""
        if name not in self._row_heads:
            raise ValueError(f"no row head named {name!r}; the engine has {sorted(self._row_heads)}")
        del self._row_heads[name]
        if self._graphs is not None:
            self._graphs.reset()

    def row_head(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The function of the row head ``name`` (see :meth:`add_row_head`)."""
        if name not in self._row_heads:
            raise ValueError(f"no row head named {name!r}; the engine has {sorted(self._row_heads)}")
        return self._row_heads[name]

    @property
    def row_heads(self) -> tuple[str, ...]:
        """The names of the row heads added (:meth:`add_row_head`), in their order."""
        return tuple(self._row_heads)
