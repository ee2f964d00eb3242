"""The lanes' draws read back (:class:`~treedec.runtime.lanes.Lanes`' part that gives each lane its drawn token:
recorded, its grammar advanced, its text checked at its events; and ends the lanes that end: their outputs, their
nodes kept, truncated or pruned), and the lane states between steps.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from treedec.runtime.decode import LaneOutput, OutputTokens
from treedec.runtime.program import kept_length
from treedec.sampling.grammar import GrammarError
from treedec.sampling.logits import NonFiniteLogitsError

__all__ = ["DRAWN", "FINISH", "KNOWN", "LaneEnds"]

# a lane's state between steps (0: going, its next token to draw; -1: gone)
DRAWN = 1    # its next token is drawn on the device, not read back yet
KNOWN = 2    # its next token is read back (the output goes on) and not in the tree yet
FINISH = 3   # it ended, its node is kept, and its last token is still to be computed (placed once more)

#: The stop reasons by the codes ``_accept`` gives them (0: the output goes on).
_REASONS = (None, "eos", "length", "stop_string")


class LaneEnds:
    """Reading the draws back and ending lanes: methods of :class:`~treedec.runtime.lanes.Lanes`."""

    def _accept(self, slots: np.ndarray, values: np.ndarray, placed: np.ndarray, row_of: np.ndarray,
                logits: torch.Tensor | None, finished: list) -> None:
        """Give each lane of ``slots`` its drawn token (``values``: :meth:`_report`'s, read back; ``placed``: its
        placeholder is in the tree, computed by the step just launched, whose ``logits`` rows are at ``row_of``):
        record it, end the lanes it ends. A lane whose row had nothing to draw from fails its request."""
        tokens, stopped, ok = values[0], values[1] != 0, values[2] != 0
        if not np.logical_and.reduce(ok):
            bad = np.unique(self.group[slots[~ok]]).tolist()
            for uid in bad:
                self._fail(self.groups[uid], NonFiniteLogitsError(
                    f"{self.groups[uid].decode.name}: after its logits processing (processors, penalties, "
                    "logit_bias, allowed_token_ids, bad_words, min_tokens) an output's logits have no finite value "
                    "(or a NaN or +inf): there is nothing to draw from; the request is stopped"))
            keep = ~np.isin(self.group[slots], bad)
            self.state[slots[~keep]] = -1
            slots, tokens, stopped, placed = slots[keep], tokens[keep], stopped[keep], placed[keep]
        if self._grammar:
            slots, tokens, stopped, placed = self._advance_grammar(slots, tokens, stopped, placed)
        if not len(slots):
            return
        at = self.length[slots]
        if np.maximum.reduce(at) >= self._width:
            self._widen(int(np.maximum.reduce(at)) + 1)
        self.tokens[slots, at] = tokens
        self.length[slots] = at + 1
        ended = stopped | (at + 1 >= self.max_new[slots])
        reasons = stopped + (ended & ~stopped) * 2   # 1 eos, 2 length, 3 stop string
        text = self.text[slots]   # (checked at their events and ends only, fed what came since)
        text = text.nonzero()[0] if np.logical_or.reduce(text) else ()
        for i in text[ended[text] | self._text_events.due(self.text_key[slots[text]], tokens[text])].tolist() \
                if len(text) else ():
            slot, fed = int(slots[i]), int(self.fed[slots[i]])
            self.fed[slot] = at[i] + 1
            reason = self.groups[int(self.group[slot])].accept_text(int(self.index[slot]),
                                                                    self.tokens[slot, fed:at[i] + 1].tolist())
            reasons[i] = {"eos": 1, "length": 2, "stop_string": 3, None: 0}[reason]
            ended[i] = reason is not None
        if self._token_streams:
            self._stream_tokens(slots, tokens, at, np.where(ended, reasons, 0))
        # going lanes: a placeholder's real id goes into the tree; unplaced ones wait with their token known
        goes = ~ended
        on = goes & placed
        self._set_ids(slots[on], tokens[on])
        self.state[slots[on]] = 0
        waits = goes & ~placed
        self.state[slots[waits]], self.next_token[slots[waits]] = KNOWN, tokens[waits]
        for i in ended.nonzero()[0].tolist() if np.logical_or.reduce(ended) else ():
            slot = int(slots[i])
            self.reason[slot] = reasons[i]
            g = self.groups[int(self.group[slot])]
            if placed[i]:   # its token is computed by the step just launched
                if g.decode.keep:
                    self._set_ids(np.array([slot]), tokens[i:i + 1])
                self._end(slot, None if logits is None else logits[row_of[slot]], finished, computed=True)
            elif g.decode.keep and not g.decode.last_pending:
                self.state[slot], self.next_token[slot] = FINISH, tokens[i]
            else:
                self._end(slot, None, finished, computed=False)

    def _stream_tokens(self, slots: np.ndarray, tokens: np.ndarray, at: np.ndarray, reasons: np.ndarray) -> None:
        """Hand the new ``tokens`` of ``slots`` (at positions ``at``; ``reasons``: 0 going, 1 eos, 2 length, 3 stop
        string) to their groups' ``on_tokens``, one call a group (its logprobs with them), groups in uid order."""
        # (grouped by one stable sort and read back by one tolist each: a group costs list slices, not array passes)
        groups = self.group[slots]
        order = np.argsort(groups, kind="stable")
        uids, starts = np.unique(groups[order], return_index=True)
        bounds = starts.tolist() + [len(order)]
        indices, tokens, at = self.index[slots[order]].tolist(), tokens[order].tolist(), at[order].tolist()
        ends = [_REASONS[r] for r in reasons[order].tolist()]
        streams = self._token_streams
        for k, uid in enumerate(uids.tolist()):
            if uid not in streams:
                continue
            a, b = bounds[k], bounds[k + 1]
            g = self.groups[uid]
            mine = indices[a:b]
            g.decode.on_tokens(OutputTokens(mine, tokens[a:b], ends[a:b], g.logprobs_at(mine, at[a:b])
                                            if g.decode.params.logprobs is not None else None))

    def _advance_grammar(self, slots: np.ndarray, tokens: np.ndarray, stopped: np.ndarray, placed: np.ndarray):
        """Advance the matchers of the lanes of ``slots`` that have a grammar with their drawn ``tokens`` (one
        batched call). A token its grammar refuses (which its mask forbade: a bug, never a model's choice) fails its
        request. Returns the lanes kept. (A grammar ends at one of its output's EOS ids:
        :meth:`~treedec.sampling.grammar.Grammar.stop_rule`, so the EOS check ends it.)"""
        mine, matchers = self._grammar_rows(slots)
        if len(mine) == 0:
            return slots, tokens, stopped, placed
        accepted = self._bitmasks.accept(matchers, tokens[mine])
        if accepted.all():
            return slots, tokens, stopped, placed
        bad = np.unique(self.group[slots[mine[~accepted]]]).tolist()
        for uid in bad:
            g = self.groups[uid]
            self._fail(g, GrammarError(f"{g.decode.name}: its grammar does not accept the token drawn under its "
                                       f"mask ({int(tokens[mine[~accepted]][0])}); the request is stopped"))
        keep = ~np.isin(self.group[slots], bad)
        self.state[slots[~keep]] = -1
        return slots[keep], tokens[keep], stopped[keep], placed[keep]

    def offer_kept(self, g, kept: Mapping[int, int]) -> None:
        """Before group ``g``'s lanes are dropped (its program aborted): each live output ``i`` of ``kept`` offers
        its conversation to the prefix cache to its ``kept[i]`` tokens (a frontend's stop string ended it there:
        :func:`~treedec.runtime.program.kept_length`)."""
        offer = g.decode.offer
        if offer is None:
            return
        tree = self.tree
        for slot in np.flatnonzero((self.group[:self.size] == g.uid) & (self.state[:self.size] >= 0)).tolist():
            i, node = int(self.index[slot]), int(self.node[slot])
            if i not in kept or node < 0:
                continue
            before = tree.sequence_length(node) - tree.node_length(node) + int(self.start[slot])
            length = kept_length(tree, node, before, self.tokens[slot, :int(self.length[slot])].tolist(), kept[i])
            if length:
                offer(node, length)

    def _prune_ended(self) -> None:
        """Prune the nodes of the outputs ended since the last call that keep none (one edit)."""
        if self._ended:
            self.tree.prune_many(np.array(self._ended, dtype=np.int64), checked=False)
            self._ended = []

    def _end(self, slot: int, logits: torch.Tensor | None, finished: list, computed: bool) -> None:
        """Lane ``slot`` ended: its output, its node kept, truncated or pruned; its group finished when it was the
        last one."""
        g, i = self.groups[int(self.group[slot])], int(self.index[slot])
        d, node, count = g.decode, int(self.node[slot]), int(self.length[slot])
        checker = g.checkers[i]
        tokens = self.tokens[slot, :count].tolist()
        if checker is not None:
            output = LaneOutput(tokens, checker.stop_reason, checker.text, checker.stop_string)
        else:
            output = LaneOutput(tokens, ("eos", "length")[int(self.reason[slot]) - 1])
        end = int(self.start[slot]) + count   # the node's length with every output token in it
        if d.keep:
            output.node, output.logits = node, logits
            if not computed:   # last_pending: the program's next step computes it (placed when it is resumed)
                g.pending.append((i, int(self.parent[slot]), tokens[-1]))
        elif d.on_parent:
            output.node = node
            if self.tree.node_length(node) >= end:   # (its last token was placed and computed: dropped)
                self.tree.truncate(node, end - 1)
        elif node >= 0 and d.offer is not None:
            # the conversation but its last token (whose K/V is not kept), offered with the pages of the outputs
            # ended before it freed (the cache may copy into free pages)
            self._prune_ended()
            d.offer(node, self.tree.sequence_length(node) - self.tree.node_length(node) + end - 1)
            self.tree.prune(node)
        elif node >= 0:
            self._ended.append(node)   # (pruned with the step's other ended outputs: _prune_ended)
        g.outputs[i] = output
        g.left -= 1
        self.state[slot] = -1
        if g.left == 0:
            g.assemble_logprobs()
            del self.groups[g.uid]
            self._forget_group(g.uid)
            finished.append(g)
