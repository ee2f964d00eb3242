"""The host columns of a verify group (:mod:`~treedec.programs.speculative.verify_table`): one row per request,
numpy arrays kept compact, and what a step's outcomes read back do to them (stops, stats) in a fixed number of
array operations whatever the number of rows; only the rows whose text is needed every step (stop strings,
streaming, an ``on_step`` callback, ``min_tokens``) go through their :class:`~treedec.sampling.stops.StopChecker`
each step, one by one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Recorded", "VerifyRows"]

_INT = ("node", "length", "flight_root", "tree_size", "garbage", "root_token", "emitted", "max_new", "steps",
        "sizes")


@dataclass
class Recorded:
    """What :meth:`VerifyRows.record` found in a step's read-back outcomes, for its rows ``at`` ([P] positions).

    Attributes
    ----------
    stop : [P] bool: the request ended (its launched step is rolled back).
    cut : [P] int64: tokens to drop from the end of its node when it ended (its unused reservation).
    kept : [P] int64: accepted draft tokens kept (rows with a verification step read: ``stepped``).
    stepped : [P] bool: the read was a verification step's (not the first token's).
    """

    stop: np.ndarray
    cut: np.ndarray
    kept: np.ndarray
    stepped: np.ndarray


class VerifyRows:
    """The host columns of ``depth``-deep trees' requests (see the module docstring).

    Columns ([R] int64 unless said): ``node`` (the sequence node), ``length`` (its tokens), ``flight_root`` (the
    root node of its launched tree, -1: none), ``trees`` [R, m] (its tree's nodes in token order, -1 padded: kept
    from step to step, :meth:`~treedec.tree.SequenceTree.advance_token_trees`), ``tree_size`` (their number, 0:
    none), ``reserved`` (bool: its node ends with the ``1 + depth`` slots
    reserved for the tree whose outcome is read next), ``garbage`` (reserved slots the last outcome left unused),
    ``root_token`` (the root of the tree whose outcome is read next), ``emitted``, ``max_new``, ``text`` (bool:
    checked one by one), ``steps``, ``sizes`` (draft sizes recorded); ``eos`` [R, W] (-1 padded), ``tokens``,
    ``accepted``, ``draft_sizes`` [R, width] int64 and ``seconds`` [R, width] float64 (grown by doubling).
    """

    def __init__(self, depth: int, m: int):
        self.depth = depth
        self.size = 0
        self.trees = np.full((0, m), -1, dtype=np.int64)
        for name in _INT:
            setattr(self, name, np.zeros(0, dtype=np.int64))
        self.reserved = np.zeros(0, dtype=bool)
        self.text = np.zeros(0, dtype=bool)
        self.eos = np.full((0, 1), -1, dtype=np.int64)
        self.tokens = np.zeros((0, 16), dtype=np.int64)
        self.accepted = np.zeros((0, 16), dtype=np.int64)
        self.draft_sizes = np.zeros((0, 16), dtype=np.int64)
        self.seconds = np.zeros((0, 16), dtype=np.float64)

    def add(self, node: int, length: int, max_new: int, eos: tuple[int, ...], text: bool) -> None:
        """A new row at the end (an event)."""
        for name, value in zip(_INT, (node, length, -1, 0, 0, 0, 0, max_new, 0, 0)):
            setattr(self, name, np.append(getattr(self, name), value))
        self.trees = np.concatenate([self.trees, np.full((1, self.trees.shape[1]), -1, dtype=np.int64)])
        self.reserved = np.append(self.reserved, False)
        self.text = np.append(self.text, text)
        width = max(self.eos.shape[1], len(eos))
        eos_row = np.full((1, width), -1, dtype=np.int64)
        eos_row[0, :len(eos)] = eos
        self.eos = np.concatenate([np.pad(self.eos, ((0, 0), (0, width - self.eos.shape[1])), constant_values=-1),
                                   eos_row])
        for name in ("tokens", "accepted", "draft_sizes", "seconds"):
            table = getattr(self, name)
            setattr(self, name, np.concatenate([table, np.zeros((1, table.shape[1]), dtype=table.dtype)]))
        self.size += 1

    def keep(self, mask: np.ndarray) -> None:
        """Keep the rows of ``mask`` ([R] bool), in order (one compaction of every column, an event)."""
        for name in (*_INT, "trees", "reserved", "text", "eos", "tokens", "accepted", "draft_sizes", "seconds"):
            setattr(self, name, getattr(self, name)[mask])
        self.size = int(mask.sum())

    def record(self, at: np.ndarray, values: np.ndarray, checkers: list, seconds: float) -> Recorded:
        """Step outcomes read back for rows ``at`` ([P] positions): ``values [P, 2 + 2 * depth]`` (accepted length,
        bonus, the path's tree indices, the path's tokens; -1 padded). Records each row's emitted tokens (its
        path cut at an EOS, then its bonus, within ``max_new``; ``checkers[i]``: the :class:`StopChecker` of the
        rows checked token by token, by row position; None for the others), its step's stats, and the next root;
        returns what ended."""
        d = self.depth
        length, bonus, path = values[:, 0], values[:, 1].copy(), values[:, 2 + d:2 + 2 * d]
        stepped = self.reserved[at]
        cols = np.arange(d)
        real = cols[None, :] < length[:, None]
        stops = self.eos[at]                                    # [P, W], -1 padded (no token is -1)
        # (the ufuncs' reduce, not the ndarray methods: their Python wrappers cost a call each, every step)
        eos = np.logical_or.reduce(path[:, :, None] == stops[:, None, :], axis=2) & real
        has = np.logical_or.reduce(eos, axis=1)
        first = np.where(has, eos.argmax(axis=1), length)      # an EOS on the path ends it there, as the bonus
        bonus = np.where(has, path[np.arange(len(at)), np.minimum(first, d - 1)] if d else bonus, bonus)
        count = first + 1                                       # tokens emitted: the path kept, then the bonus
        room = self.max_new[at] - self.emitted[at]
        keep = np.minimum(count, room)
        ended = (keep == room) | (np.logical_or.reduce(bonus[:, None] == stops, axis=1) & (keep == count))
        ended &= ~self.text[at]
        kept = np.minimum(keep, first)
        for i in self.text[at].nonzero()[0].tolist():       # rows whose text is checked token by token
            checker = checkers[at[i]]
            decision = checker.accept(path[i, :first[i]].tolist() + [int(bonus[i])])
            keep[i], kept[i] = decision.keep, min(decision.keep, first[i])
            ended[i] = checker.stopped
        emitted = np.concatenate([path, bonus[:, None]], axis=1)
        emitted[np.arange(len(at)), first] = bonus              # [P, d + 1]: the path cut, then the bonus
        self._widen(int(np.maximum.reduce(self.emitted[at] + keep, initial=0)), "tokens")
        rows_, cols_ = (np.arange(d + 1)[None, :] < keep[:, None]).nonzero()
        self.tokens[at[rows_], self.emitted[at][rows_] + cols_] = emitted[rows_, cols_]
        self.emitted[at] += keep
        s = at[stepped]
        self._widen(int(np.maximum.reduce(self.steps[s], initial=0)) + 1, "accepted", "seconds")
        self.accepted[s, self.steps[s]] = kept[stepped]
        self.seconds[s, self.steps[s]] = seconds
        self.steps[s] += 1
        self.garbage[at] = np.where(stepped, d - length, 0)
        self.root_token[at] = bonus
        cut = np.where(stepped, d - kept, 0)
        return Recorded(ended, cut, kept, stepped)

    def launched(self, at: np.ndarray, size: int) -> None:
        """Rows ``at`` go on with a launched step of ``size`` draft tokens (its size recorded)."""
        self._widen(int(np.maximum.reduce(self.sizes[at], initial=0)) + 1, "draft_sizes")
        self.draft_sizes[at, self.sizes[at]] = size
        self.sizes[at] += 1

    def result(self, i: int) -> tuple[list[int], list[int], list[int], list[float]]:
        """Row ``i``'s tokens, accepted counts, draft sizes and step seconds (at its end)."""
        steps = int(self.steps[i])
        return (self.tokens[i, :self.emitted[i]].tolist(), self.accepted[i, :steps].tolist(),
                self.draft_sizes[i, :self.sizes[i]].tolist(), self.seconds[i, :steps].tolist())

    def _widen(self, width: int, *names: str) -> None:
        if width <= self.tokens.shape[1] and width <= self.accepted.shape[1] and width <= self.draft_sizes.shape[1]:
            return   # (the tables grow by doubling: most steps widen none)
        for name in names:
            table = getattr(self, name)
            if width > table.shape[1]:
                grown = np.zeros((table.shape[0], max(width, 2 * table.shape[1])), dtype=table.dtype)
                grown[:, :table.shape[1]] = table
                setattr(self, name, grown)
