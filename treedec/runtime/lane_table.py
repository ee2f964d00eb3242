"""The lane table's columns (:mod:`treedec.runtime.lanes`): host arrays and device tensors with one row per lane,
kept compact and in order (added at the end, removed by one stable compaction of every column per event), grown
by doubling."""
from __future__ import annotations

import numpy as np
import torch

from treedec.transfer import to_device

__all__ = ["LaneTable"]


class LaneTable:
    """Columns of ``capacity`` rows, of which the first ``size`` are lanes (``vocab``: the penalties' columns'
    width; ``device``: where the device columns live)."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.size = 0
        self._capacity = 0
        self._width = 0            # the token buffer's columns
        self._eos_width = 0        # the EOS-id matrix's columns
        self.counts = self.prompt_mask = None   # the penalties' columns, made for the first penalized lane
        self._grow(16)

    _HOST = ("group", "index", "node", "parent", "start", "length", "max_new", "state", "next_token", "reason",
             "placed", "fresh", "keep", "text", "seed", "stream")
    _DEVICE = ("drawn", "stopped", "ok", "drawn_count", "eos")

    def _grow(self, need: int) -> None:
        if need <= self._capacity:
            return
        capacity = max(need, 2 * self._capacity, 16)
        old, self._capacity = self._capacity, capacity

        def host(name, dtype):
            column = np.zeros(capacity, dtype=dtype)
            if old:
                column[:old] = getattr(self, name)
            setattr(self, name, column)

        for name in ("group", "index", "node", "parent", "start", "length", "max_new", "next_token", "seed",
                     "stream"):
            host(name, np.int64)
        for name in ("state", "reason"):
            host(name, np.int8)
        for name in ("placed", "fresh", "keep", "text"):
            host(name, bool)
        params = [None] * capacity
        if old:
            params[:old] = self.params
        self.params = params
        tokens = np.zeros((capacity, max(self._width, 64)), dtype=np.int64)
        if old:
            tokens[:old, :self._width] = self.tokens
        self.tokens, self._width = tokens, tokens.shape[1]

        def device(name, shape, dtype, fill=0):
            column = torch.full(shape, fill, dtype=dtype, device=self.device)
            if old:
                column[:old] = getattr(self, name)
            setattr(self, name, column)

        device("drawn", (capacity,), torch.int64)
        device("stopped", (capacity,), torch.bool, False)
        device("ok", (capacity,), torch.bool, True)
        device("drawn_count", (capacity,), torch.int64)
        device("eos", (capacity, max(self._eos_width, 1)), torch.int64, -1)
        self._eos_width = self.eos.shape[1]
        if self.counts is not None:
            device("counts", (capacity, self.vocab), torch.int32)
            device("prompt_mask", (capacity, self.vocab), torch.bool, False)

    def _penalty_columns(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self._capacity, self.vocab, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self._capacity, self.vocab, dtype=torch.bool, device=self.device)

    def _widen(self, need: int) -> None:
        width = max(need, 2 * self._width)
        tokens = np.zeros((self._capacity, width), dtype=np.int64)
        tokens[:, :self._width] = self.tokens
        self.tokens, self._width = tokens, width

    def _widen_eos(self, need: int) -> None:
        eos = torch.full((self._capacity, need), -1, dtype=torch.int64, device=self.device)
        eos[:, :self._eos_width] = self.eos
        self.eos, self._eos_width = eos, need

    def _compact(self, keep: np.ndarray) -> None:
        """Keep the rows where ``keep`` ([size] bool) is True, in order (one gather per column)."""
        if keep.all():
            return
        rows = np.flatnonzero(keep)
        k = len(rows)
        for name in self._HOST:
            column = getattr(self, name)
            column[:k] = column[rows]
        self.tokens[:k] = self.tokens[rows]
        self.params[:k] = [self.params[r] for r in rows.tolist()]
        index = to_device(rows, self.device)
        for name in self._DEVICE + (("counts", "prompt_mask") if self.counts is not None else ()):
            column = getattr(self, name)
            column[:k] = column[index]
        self.size = k
        self._changed()

    def _changed(self) -> None:
        """The rows changed (a compaction): what is derived from them is out of date."""
