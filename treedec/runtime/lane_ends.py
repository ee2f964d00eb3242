"""The lanes' draws read back (:mod:`treedec.runtime.lanes`): each lane given its drawn token (recorded, its
grammar advanced, its text checked at its events), the lanes that end ended (their outputs, their nodes kept,
truncated or pruned), and the lane states between steps. Functions of the :class:`~treedec.runtime.lanes.Lanes`
table they act on (the table's own methods call them).
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.runtime.decode import LaneOutput
from treedec.runtime.lane_draw import grammar_rows
from treedec.sampling.grammar import GrammarError
from treedec.sampling.logits import NonFiniteLogitsError

__all__ = ["DRAWN", "FINISH", "KNOWN", "accept_draws", "advance_grammar", "end_lane"]

# a lane's state between steps (0: going, its next token to draw; -1: gone)
DRAWN = 1    # its next token is drawn on the device, not read back yet
KNOWN = 2    # its next token is read back (the output goes on) and not in the tree yet
FINISH = 3   # it ended, its node is kept, and its last token is still to be computed (placed once more)


def accept_draws(lanes, slots: np.ndarray, values: np.ndarray, placed: np.ndarray, row_of: np.ndarray,
                 logits: torch.Tensor | None, finished: list) -> None:
    """Give each lane of ``slots`` its drawn token (``values``: :meth:`Lanes._report`'s, read back; ``placed``: its
    placeholder is in the tree, computed by the step just launched, whose ``logits`` rows are at ``row_of``):
    record it, end the lanes it ends. A lane whose row had nothing to draw from fails its request."""
    tokens, stopped, ok = values[0], values[1] != 0, values[2] != 0
    if not np.logical_and.reduce(ok):
        bad = np.unique(lanes.group[slots[~ok]]).tolist()
        for uid in bad:
            lanes._fail(lanes.groups[uid], NonFiniteLogitsError(
                f"{lanes.groups[uid].decode.name}: after its logits processing (processors, penalties, "
                "logit_bias, allowed_token_ids, bad_words, min_tokens) an output's logits have no finite value "
                "(or a NaN or +inf): there is nothing to draw from; the request is stopped"))
        keep = ~np.isin(lanes.group[slots], bad)
        lanes.state[slots[~keep]] = -1
        slots, tokens, stopped, placed = slots[keep], tokens[keep], stopped[keep], placed[keep]
    if lanes._grammar:
        slots, tokens, stopped, placed = advance_grammar(lanes, slots, tokens, stopped, placed)
    if not len(slots):
        return
    at = lanes.length[slots]
    if np.maximum.reduce(at) >= lanes._width:
        lanes._widen(int(np.maximum.reduce(at)) + 1)
    lanes.tokens[slots, at] = tokens
    lanes.length[slots] = at + 1
    ended = stopped | (at + 1 >= lanes.max_new[slots])
    reasons = stopped + (ended & ~stopped) * 2   # 1 eos, 2 length, 3 stop string
    text = lanes.text[slots]   # (checked at their events and ends only, fed what came since)
    text = text.nonzero()[0] if np.logical_or.reduce(text) else ()
    for i in text[ended[text] | lanes._text_events.due(lanes.text_key[slots[text]], tokens[text])].tolist() \
            if len(text) else ():
        slot, fed = int(slots[i]), int(lanes.fed[slots[i]])
        lanes.fed[slot] = at[i] + 1
        reason = lanes.groups[int(lanes.group[slot])].accept_text(int(lanes.index[slot]),
                                                                lanes.tokens[slot, fed:at[i] + 1].tolist())
        reasons[i] = {"eos": 1, "length": 2, "stop_string": 3, None: 0}[reason]
        ended[i] = reason is not None
    # going lanes: a placeholder's real id goes into the tree; unplaced ones wait with their token known
    goes = ~ended
    on = goes & placed
    lanes._set_ids(slots[on], tokens[on])
    lanes.state[slots[on]] = 0
    waits = goes & ~placed
    lanes.state[slots[waits]], lanes.next_token[slots[waits]] = KNOWN, tokens[waits]
    for i in ended.nonzero()[0].tolist() if np.logical_or.reduce(ended) else ():
        slot = int(slots[i])
        lanes.reason[slot] = reasons[i]
        g = lanes.groups[int(lanes.group[slot])]
        if placed[i]:   # its token is computed by the step just launched
            if g.decode.keep:
                lanes._set_ids(np.array([slot]), tokens[i:i + 1])
            end_lane(lanes, slot, None if logits is None else logits[row_of[slot]], finished, computed=True)
        elif g.decode.keep and not g.decode.last_pending:
            lanes.state[slot], lanes.next_token[slot] = FINISH, tokens[i]
        else:
            end_lane(lanes, slot, None, finished, computed=False)


def advance_grammar(lanes, slots: np.ndarray, tokens: np.ndarray, stopped: np.ndarray, placed: np.ndarray):
    """Advance the matchers of the lanes of ``slots`` that have a grammar with their drawn ``tokens`` (one
    batched call). A token its grammar refuses (which its mask forbade: a bug, never a model's choice) fails its
    request. Returns the lanes kept. (A grammar ends at one of its output's EOS ids:
    :meth:`~treedec.sampling.grammar.Grammar.stop_rule`, so the EOS check ends it.)"""
    mine, matchers = grammar_rows(lanes, slots)
    if len(mine) == 0:
        return slots, tokens, stopped, placed
    accepted = lanes._bitmasks.accept(matchers, tokens[mine])
    if accepted.all():
        return slots, tokens, stopped, placed
    bad = np.unique(lanes.group[slots[mine[~accepted]]]).tolist()
    for uid in bad:
        g = lanes.groups[uid]
        lanes._fail(g, GrammarError(f"{g.decode.name}: its grammar does not accept the token drawn under its "
                                   f"mask ({int(tokens[mine[~accepted]][0])}); the request is stopped"))
    keep = ~np.isin(lanes.group[slots], bad)
    lanes.state[slots[~keep]] = -1
    return slots[keep], tokens[keep], stopped[keep], placed[keep]


def end_lane(lanes, slot: int, logits: torch.Tensor | None, finished: list, computed: bool) -> None:
    """Lane ``slot`` ended: its output, its node kept, truncated or pruned; its group finished when it was the
    last one."""
    g, i = lanes.groups[int(lanes.group[slot])], int(lanes.index[slot])
    d, node, count = g.decode, int(lanes.node[slot]), int(lanes.length[slot])
    checker = g.checkers[i]
    tokens = lanes.tokens[slot, :count].tolist()
    if checker is not None:
        output = LaneOutput(tokens, checker.stop_reason, checker.text, checker.stop_string)
    else:
        output = LaneOutput(tokens, ("eos", "length")[int(lanes.reason[slot]) - 1])
    end = int(lanes.start[slot]) + count   # the node's length with every output token in it
    if d.keep:
        output.node, output.logits = node, logits
        if not computed:   # last_pending: the program's next step computes it (placed when it is resumed)
            g.pending.append((i, int(lanes.parent[slot]), tokens[-1]))
    elif d.on_parent:
        output.node = node
        if lanes.tree.node_length(node) >= end:   # (its last token was placed and computed: dropped)
            lanes.tree.truncate(node, end - 1)
    elif node >= 0:
        if d.offer is not None:   # the conversation but its last token (whose K/V is not kept)
            d.offer(node, lanes.tree.sequence_length(node) - lanes.tree.node_length(node) + end - 1)
        lanes.tree.prune(node)
    g.outputs[i] = output
    g.left -= 1
    lanes.state[slot] = -1
    if g.left == 0:
        g.assemble_logprobs()
        del lanes.groups[g.uid]
        lanes._forget_group(g.uid)
        finished.append(g)
