"""The lane table's columns (:mod:`treedec.runtime.lanes`): one row per lane, host arrays and device tensors, kept
compact and in order (added at the end, removed by one stable compaction per event), grown by doubling.

Rows stay in the order their lanes were added, so a group's lanes (one Decode's, added together with a uid larger
than every earlier one) are consecutive rows and the ``group`` column is non-decreasing.

Columns of one kind are views of one array (the host's int columns of one ``[capacity, k]`` int64 array, its small
ones of one int8 array; the device's per-step values, sampling parameters and stop ids of one tensor each), so that
a compaction is a gather per group and a step reads its lanes' parameters as slices: nothing is rebuilt per lane
when the batch changes.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.sampling.sampler import SamplingRows
from treedec.transfer import to_device

__all__ = ["LaneTable"]

#: host int64 columns (views of one array)
_INTS = ("group", "index", "node", "parent", "start", "length", "max_new", "next_token", "seed", "stream", "text_key",
         "fed")
#: host int8 / bool columns (views of one int8 array)
_SMALL = ("state", "reason", "placed", "fresh", "keep", "text", "greedy", "top_k_cut", "top_p_cut", "min_p_cut",
          "penalized")
#: the device's per-lane values a step writes and reads back: [capacity, 4] int64
_OUT = ("drawn", "stopped", "ok", "drawn_count")


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
        # what is derived from the rows until they change: the SamplingRows of blocks [0, n) by n (and the lanes'
        # graphed draws, Lanes.step_tail)
        self._rows: dict = {}
        self._grow(16)

    # ------------------------------------------------------------ the sampling rows

    def sampling_rows(self, block: int | None = None) -> SamplingRows:
        """The :class:`~treedec.sampling.sampler.SamplingRows` of rows ``[0, block)`` (default: the lanes), slices
        of the device columns, with the flags of the lanes (rows past them are padding: a graphed draw's block,
        :mod:`treedec.runtime.lane_draw`); made once per change of the rows."""
        n = self.size if block is None else block
        rows = self._rows.get(n)
        if rows is None:
            f, i, lanes = self.fparams[:n], self.iparams[:n], self.size
            flag = lambda name: bool(getattr(self, name)[:lanes].any())   # noqa: E731
            rows = self._rows[n] = SamplingRows(
                temperature=f[:, 0], top_p=f[:, 1], min_p=f[:, 2], repetition=f[:, 3], presence=f[:, 4],
                frequency=f[:, 5], top_k=i[:, 0], seed=i[:, 1], stream=i[:, 2], greedy=flag("greedy"),
                sampled=not bool(self.greedy[:lanes].all()), top_k_cut=flag("top_k_cut"), top_p_cut=flag("top_p_cut"),
                min_p_cut=flag("min_p_cut"), penalized=flag("penalized"))
        return rows

    def write_params(self, start: int, params, seeds: np.ndarray) -> None:
        """Rows ``start .. start + k`` get ``params`` (one :class:`~treedec.sampling.params.SamplingParams` for all)
        and their ``seeds`` / streams (``self.seed``, ``self.stream``, written already): one copy to the device."""
        k, p = len(seeds), params
        floats = np.array([0.0 if p.greedy else p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                           p.presence_penalty, p.frequency_penalty], dtype=np.float32)
        # (through pinned memory: a pageable copy would wait for the steps in flight, at every admission)
        self.fparams[start:start + k] = to_device(floats, self.device)
        ints = np.stack([np.full(k, p.top_k or 0), self.seed[start:start + k], self.stream[start:start + k]], axis=1)
        self.iparams[start:start + k] = to_device(ints.astype(np.int64), self.device)
        rows = slice(start, start + k)
        self.greedy[rows] = p.greedy
        self.top_k_cut[rows] = p.top_k is not None and not p.greedy
        self.top_p_cut[rows] = p.top_p < 1 and not p.greedy
        self.min_p_cut[rows] = p.min_p > 0 and not p.greedy
        self.penalized[rows] = p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
        self.params[rows] = p
        self._rows = {}

    # ------------------------------------------------------------ storage

    def _grow(self, need: int) -> None:
        if need <= self._capacity:
            return
        capacity = max(need, 2 * self._capacity, 16)
        old, self._capacity = self._capacity, capacity

        def host(shape, dtype, fill, previous):
            column = np.full(shape, fill, dtype=dtype)
            if old:
                column[:old] = previous
            return column

        self._ints = host((capacity, len(_INTS)), np.int64, 0, getattr(self, "_ints", None))
        self._small = host((capacity, len(_SMALL)), np.int8, 0, getattr(self, "_small", None))
        self.params = host(capacity, object, None, getattr(self, "params", None))
        self._row_of = np.zeros(capacity, dtype=np.int64)   # a step's scratch: each lane's row of its logits
        self._arange = np.arange(capacity, dtype=np.int64)
        self._false = np.zeros(capacity, dtype=bool)
        self._false.setflags(write=False)
        tokens = np.zeros((capacity, max(self._width, 64)), dtype=np.int64)
        if old:
            tokens[:old, :self._width] = self.tokens
        self.tokens, self._width = tokens, tokens.shape[1]

        def device(shape, dtype, fill, previous):
            column = torch.full(shape, fill, dtype=dtype, device=self.device)
            if old:
                column[:old] = previous
            return column

        self.out = device((capacity, len(_OUT)), torch.int64, 0, getattr(self, "out", None))
        self.fparams = device((capacity, 6), torch.float32, 0, getattr(self, "fparams", None))
        self.iparams = device((capacity, 3), torch.int64, 0, getattr(self, "iparams", None))
        self.eos = device((capacity, max(self._eos_width, 1)), torch.int64, -1, getattr(self, "eos", None))
        self._eos_width = self.eos.shape[1]
        if self.counts is not None:
            self.counts = device((capacity, self.vocab), torch.int32, 0, self.counts)
            self.prompt_mask = device((capacity, self.vocab), torch.bool, False, self.prompt_mask)
        self._bind()

    def _bind(self) -> None:
        """The named columns as views of their arrays."""
        for k, name in enumerate(_INTS):
            setattr(self, name, self._ints[:, k])
        for k, name in enumerate(_SMALL):
            column = self._small[:, k]
            setattr(self, name, column.view(bool) if name not in ("state", "reason") else column)
        for k, name in enumerate(_OUT):
            setattr(self, name, self.out[:, k])
        self._rows = {}

    def _penalty_columns(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self._capacity, self.vocab, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self._capacity, self.vocab, dtype=torch.bool, device=self.device)
            self._rows = {}   # (the graphed draws read them)

    def _widen(self, need: int) -> None:
        width = max(need, 2 * self._width)
        tokens = np.zeros((self._capacity, width), dtype=np.int64)
        tokens[:, :self._width] = self.tokens
        self.tokens, self._width = tokens, width

    def _widen_eos(self, need: int) -> None:
        eos = torch.full((self._capacity, need), -1, dtype=torch.int64, device=self.device)
        eos[:, :self._eos_width] = self.eos
        self.eos, self._eos_width = eos, need
        self._rows = {}

    def _compact(self, keep: np.ndarray) -> None:
        """Keep the rows where ``keep`` ([size] bool) is True, in order (one gather per group of columns)."""
        if keep.all():
            return
        rows = np.flatnonzero(keep)
        k = len(rows)
        for array in (self._ints, self._small, self.params, self.tokens):
            array[:k] = array[rows]
        index = to_device(rows, self.device)
        for tensor in (self.out, self.fparams, self.iparams, self.eos) + (
                (self.counts, self.prompt_mask) if self.counts is not None else ()):
            tensor[:k] = tensor[index]
        self.size = k
        self._changed()

    def _changed(self) -> None:
        """The rows changed (a compaction): what is derived from them is out of date."""
        self._rows = {}
