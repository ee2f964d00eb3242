"""LANES: the batch-level per-token data path. One row per growing leaf of every request, as arrays.

A program that decodes outputs token by token (generation, parallel sampling, ToT thoughts and values) yields a
:class:`Decode` once and is resumed when its outputs have ended, with a :class:`DecodeResult`; meanwhile each of
its outputs is a *lane*, a row of :class:`Lanes`, advanced by the scheduler's loop every step with every other
lane of the batch:

- the lanes' next tokens are appended to the tree (placeholders while the tokens are still on the device), pages
  taken where a node's tail page is full;
- the engine's step computes them with the other programs' tokens (one plan, one forward);
- ONE batched sampler (:func:`~treedec.sampling.sampler.sample_rows`) draws every lane's next token from its row
  of the step's logits (each lane's temperature, top-k, top-p, min-p, penalties, and a counter-based random number
  keyed by its seed, its output's index and the draw's index: a seeded request's tokens do not depend on the batch),
  EOS / stop ids are matched on the device, and ONE device-to-host copy brings every lane's (token, stopped) back
  while the next step runs (pipelined on a GPU; at once on the CPU, where nothing would overlap);
- host work per step is a fixed number of array operations, whatever the number of lanes; Python runs per lane
  only on events (a lane starts, ends, waits for pages, draws a token that may end a stop string:
  :mod:`~treedec.runtime.lane_text`), for lanes that stream their text and for lanes with user logits processors;
  a Decode that streams token ids (``on_tokens``: a server's engine core, whose frontend detokenizes) costs one call
  a step for all its lanes, with no text made.

Rows are kept compact and in a stable order (vLLM's persistent batch, ``InputBatch``, keeps its requests' state so):
lanes added at the end, ended ones removed by one stable compaction of every column per event (host and device
alike), so a step's parameters are slices of the columns, never rebuilt.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter
from typing import Any, Mapping

import numpy as np
import torch

from treedec.runtime.decode import Decode, DecodeResult, PlacedLanes
from treedec.runtime.lane_group import LaneGroup
from treedec.runtime.lane_table import LaneTable
from treedec.runtime.lane_text import TextEvents
from treedec.sampling.grammar import BitmaskRows
from treedec.engine.step_tail import StepTail
from treedec.runtime.lane_draw import LaneDrawWork, draw_block, lane_bucket, store_draws
from treedec.runtime.lane_ends import DRAWN, FINISH, KNOWN, LaneEnds
from treedec.sampling.sampler import sample_rows
from treedec.sampling.logits import drawable_rows
from treedec.sampling.params import SEED_MAX
from treedec.sampling.stops import StopChecker
from treedec.transfer import HostCopy, PinnedStaging, to_device

__all__ = ["Lanes"]

logger = logging.getLogger("treedec")



class Lanes(LaneDrawWork, LaneEnds, LaneTable):
    """The lane table of one scheduler loop over ``engine`` (see the module docstring).

    Parameters
    ----------
    engine : the engine (its tree and pool hold the lanes' nodes).
    pipeline : read each step's draws back while the next step runs (default on a CUDA engine).
    seed : seeds the outputs whose :class:`Decode` gives none.
    """

    def __init__(self, engine, pipeline: bool | None = None, seed: int = 0):
        self.engine, self.tree, self.pool, self.device = engine, engine.tree, engine.pool, engine.device
        self.pipeline = engine.device.type == "cuda" if pipeline is None else pipeline
        super().__init__(engine.model.config.vocab_size, engine.device)
        self._seeds = np.random.default_rng(seed)
        self._uids = itertools.count()
        self.groups: dict[int, LaneGroup] = {}
        self._read: tuple[np.ndarray, HostCopy] | None = None   # (slots, copy) of draws being read back
        self._blocked: set = set()   # owners of lanes the last place() left out for want of pages
        self._failures: list[tuple[Any, Exception]] = []
        self._ended: list[int] = []   # nodes of ended outputs that keep none, pruned together (LaneEnds._prune_ended)
        self._special: set[int] = set()   # groups whose rows are processed before the batched draw (LaneGroup.special)
        self._logprobs: set[int] = set()  # groups whose outputs report logprobs
        self._grammar: set[int] = set()   # groups with structured outputs (a grammar matcher per lane)
        self._token_streams: set[int] = set()   # groups whose outputs stream token ids (Decode.on_tokens)
        self._bitmasks: BitmaskRows | None = None   # their batched bitmask fill, made for the first such group
        self._text_events = TextEvents(self.vocab)   # the tokens text lanes are checked at
        self._fresh = False   # lanes were added since the last draw_fresh
        self.draws: Counter = Counter()   # how the steps drew: "in the step's graph", "eager: <reason>"
        self._staging = PinnedStaging(self.device, turns=4)    # the steps' host-to-device index copies
        self._readback = PinnedStaging(self.device, turns=2)   # each step's draws read back

    # ------------------------------------------------------------ events

    @property
    def num_lanes(self) -> int:
        return self.size

    def add(self, owner, decode: Decode) -> int:
        """Start ``decode``'s lanes for program ``owner``; returns its group id. Their first tokens are drawn at the
        next :meth:`after_step` (from ``decode.logits``), or taken from ``decode.first``."""
        d = decode
        if d.logits is None and d.first is None:
            raise ValueError("Decode needs the first draw's logits (or the first tokens)")
        if d.on_parent and (d.count != 1 or not isinstance(d.parent, int)):
            raise ValueError(f"on_parent grows one output on the parent's node, got count={d.count}")
        parents = np.full(d.count, d.parent, dtype=np.int64) if isinstance(d.parent, (int, np.integer)) \
            else np.asarray(d.parent, dtype=np.int64)
        if parents.shape != (d.count,):
            raise ValueError(f"Decode.parent must be a node or one node per output ({d.count}), got {len(parents)}")
        if d.on_text is not None and d.tokenizer is None:
            raise ValueError("on_text streams detokenized text: the Decode needs the tokenizer")
        uid = next(self._uids)
        group = LaneGroup(d, owner, uid, [None] * d.count, d.count)
        first = d.params.detokenizer(d.tokenizer, list(d.prompt_ids))
        detokenizers = [None] * d.count if first is None else [first] + first.copies(d.count - 1)
        group.checkers = [None if detok is None else StopChecker(d.rule, detok) for detok in detokenizers]
        text_key = self._text_events.key(d, detokenizers[0], self.text_key[:self.size][self.text[:self.size]])
        group.shown = [0] * d.count
        group.prepare(self.vocab, self.device)
        self.groups[uid] = group
        if group.special:
            self._special.add(uid)
        if d.params.logprobs is not None:
            self._logprobs.add(uid)
        if d.on_tokens is not None:
            self._token_streams.add(uid)
        if group.matchers is not None:
            self._grammar.add(uid)
            if self._bitmasks is None:
                self._bitmasks = BitmaskRows(self.vocab, self.device)
        k, start = d.count, self.size
        self._grow(start + k)
        slots = np.arange(start, start + k)
        seed = d.params.seed if d.params.seed is not None else d.seed
        if seed is None:
            seed = int(self._seeds.integers(0, SEED_MAX))
        self.group[slots], self.index[slots] = uid, np.arange(k)
        self.node[slots] = d.parent if d.on_parent else -1
        self.parent[slots] = parents
        self.start[slots] = self.tree.node_length(d.parent) if d.on_parent else 0
        self.length[slots], self.max_new[slots] = 0, d.rule.max_new_tokens
        self.state[slots], self.placed[slots], self.fresh[slots], self.keep[slots] = 0, False, True, d.keep
        self.text[slots], self.text_key[slots], self.fed[slots] = text_key >= 0, text_key, 0
        eos = list(d.rule.eos_token_ids)
        if len(eos) > self._eos_width:
            self._widen_eos(len(eos))
        row = np.full(self._eos_width, -1, dtype=np.int64)
        row[:len(eos)] = eos
        self.eos[start:start + k] = to_device(row, self.device)
        # (drawn, stopped, ok, draw count)
        self.out[start:start + k] = to_device(np.array([0, 0, 1, 0], dtype=np.int64), self.device)
        p = d.params
        if p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0:
            self._penalty_columns()
            self.counts[start:start + k] = 0
            self.prompt_mask[start:start + k] = False
            if len(d.prompt_ids):
                ids = to_device(np.asarray(d.prompt_ids, dtype=np.int64), self.device)
                self.prompt_mask[start:start + k, ids] = True
        self.seed[start:start + k], self.stream[start:start + k] = seed, np.arange(k)
        self.write_params(start, d.params, self.seed[start:start + k])
        self.size += k
        self._fresh = True
        return uid

    def pending_pages(self, result: DecodeResult) -> int:
        """Pages :meth:`place_pending` takes for ``result``."""
        nodes = self._pending_nodes(result)
        grow = nodes >= 0
        return len(nodes) - int(np.add.reduce(grow)) + self.tree.pages_to_append(nodes[grow], checked=False)

    def place_pending(self, result: DecodeResult) -> None:
        """Append the last tokens of ``result``'s ``last_pending`` outputs to the tree, pending, in one edit of the
        grown outputs' nodes (:meth:`~treedec.tree.SequenceTree.append_tokens`) and one of the others' (a first
        token: a new child of its parent, its output's ``node``; :meth:`~treedec.tree.SequenceTree.branch_many`)."""
        pending, outputs = result.pending, result.outputs
        if not pending:
            return
        nodes = self._pending_nodes(result)
        tokens = np.array([token for _, _, token in pending], dtype=np.int64)
        grow = nodes >= 0
        if np.logical_or.reduce(grow):
            self.tree.append_tokens(nodes[grow], tokens[grow], checked=False)
        if not np.logical_and.reduce(grow):
            fresh = np.flatnonzero(~grow).tolist()
            parents = np.array([pending[j][1] for j in fresh], dtype=np.int64)
            for j, node in zip(fresh, self.tree.branch_many(parents, tokens[~grow], checked=False).tolist()):
                outputs[pending[j][0]].node = node
        result.pending = []

    @staticmethod
    def _pending_nodes(result: DecodeResult) -> np.ndarray:
        """[k] int64: the node of each of ``result``'s pending outputs (-1: none yet, its token is its first)."""
        outputs = result.outputs
        return np.array([-1 if outputs[i].node is None else outputs[i].node for i, _, _ in result.pending],
                        dtype=np.int64)

    def reset(self) -> None:
        """Forget every lane (the run failed: its programs are closed and free their nodes)."""
        self.groups.clear()
        self.size, self._rows, self._read, self._blocked, self._failures, self._ended = 0, {}, None, set(), [], []
        self._fresh = False
        self._special.clear()
        self._logprobs.clear()
        self._grammar.clear()
        self._token_streams.clear()

    def blocked_owners(self) -> set:
        """The programs some of whose ready lanes the last :meth:`place` left out for want of pages."""
        return self._blocked

    def take_failures(self) -> list[tuple[Any, Exception]]:
        """``(owner, error)`` of each program whose lanes failed (a logits processor raised) since the last call;
        their lanes are removed."""
        failures, self._failures = self._failures, []
        return failures

    def drop(self, owner, kept: Mapping[int, int] | None = None) -> None:
        """Remove every lane of program ``owner`` (closed or preempted: no results; its ``finally`` frees its
        nodes). ``kept``: output index -> its tokens a caller kept (a frontend's stop string ended it there): each
        such output's conversation to there is offered to the prefix cache first (:meth:`offer_kept`)."""
        assert self._read is None, "lanes are dropped between iterations, never with draws being read back"
        uids = [uid for uid, g in self.groups.items() if g.owner is owner]
        if not uids:
            return
        for uid in uids:
            if kept:
                self.offer_kept(self.groups[uid], kept)
            del self.groups[uid]
            self._forget_group(uid)
        self._compact(~np.isin(self.group[:self.size], uids))

    # ------------------------------------------------------------ the step

    def _pages_each(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots)] pages appending one token to each of ``slots``' nodes takes (one by one: only when the
        pool cannot take them all and the oldest lanes go first)."""
        tree = self.tree
        return np.fromiter((1 if node < 0 else tree.pages_to_extend(int(node), 1) for node in self.node[slots]),
                           dtype=np.int64, count=len(slots))

    def _pages(self, nodes: np.ndarray) -> int:
        """Pages appending one token to each of ``nodes`` takes, in one call (-1, a first token: a page of its
        own, its node a new child)."""
        grow = nodes >= 0
        if np.logical_and.reduce(grow):
            return self.tree.pages_to_append(nodes, checked=False)
        return len(nodes) - int(np.add.reduce(grow)) + self.tree.pages_to_append(nodes[grow], checked=False)

    def place(self, free_pages: int) -> PlacedLanes:
        """Append every ready lane's next token to the tree, within ``free_pages`` pages (the oldest lanes first;
        the others wait: :meth:`blocked_owners`)."""
        size = self.size
        state = self.state[:size]
        drawn = state == DRAWN
        # (a drawn token that is its output's last by length is never computed, unless the output's node is kept)
        last = drawn & (self.length[:size] + 1 >= self.max_new[:size]) & ~self.keep[:size]
        ready = ((state > 0) & ~last).nonzero()[0]
        if self._blocked:
            self._blocked = set()
        if not len(ready):
            return PlacedLanes.NONE
        nodes = self.node[ready]
        if self._pages(nodes) > free_pages:
            fits = np.cumsum(self._pages_each(ready)) <= free_pages
            self._blocked = {self.groups[int(u)].owner for u in np.unique(self.group[ready[~fits]]).tolist()}
            ready, nodes = ready[fits], nodes[fits]
            if not len(ready):
                return PlacedLanes.NONE
        drawn = drawn[ready]
        self._append(ready, nodes, np.where(drawn, 0, self.next_token[ready]))
        self.placed[ready] = True
        n = len(ready)
        # Pipelined: the lanes' ids on the device (a drawn lane's placeholder, and for the others the id the tree
        # holds: the drawn column keeps every lane's next token until its next draw), one per lane placed.
        # (every lane: the whole column, a buffer of fixed shape that a graphed step's fill reads)
        ids = None if not self.pipeline or not np.logical_or.reduce(drawn) else \
            self.drawn if n == size else self.drawn[self._staging.to_device(ready)]
        groups = self.group[ready]   # (non-decreasing: lanes are added in uid order and kept in order)
        return PlacedLanes(self.node[ready], ids, 1 + int(np.add.reduce(groups[1:] != groups[:-1])))

    def step_tail(self, placed: PlacedLanes, alone: bool) -> StepTail | None:
        """The draw of the step that computes ``placed`` as device work the engine records in the step's CUDA graph
        (:class:`~treedec.engine.step_tail.StepTail`: every lane's next token drawn on the device right after the
        forward, in one replay with it), or None where it cannot be (the lanes draw after the step, eagerly; the
        reason is counted in :attr:`draws`). ``alone``: the lanes' rows are the step's only logits rows."""
        reason = None
        if self.engine.graph_runner is None:
            reason = "the engine has no CUDA graphs"
        elif not alone:
            reason = "programs' rows in the step"
        elif len(placed.nodes) != self.size:
            reason = "lanes waiting (not placed)"
        elif self._special:
            reason = "logits processors or token masks (processors, allowed_token_ids, bad_words, min_tokens, " \
                     "logit_bias)"
        elif self._logprobs:
            reason = "logprobs"
        elif self._grammar:
            reason = "structured outputs (the grammars' token bitmasks)"
        if reason is not None:
            self._count_draw(f"eager: {reason}")
            return None
        self._count_draw("in the step's graph")
        block = lane_bucket(self.size, self._capacity)
        tail = self._rows.get(("tail", block))   # (made once per change of the rows, as their SamplingRows)
        if tail is None:
            rows = self.sampling_rows(block)
            flags = (rows.greedy, rows.sampled, rows.top_k_cut, rows.top_p_cut, rows.min_p_cut, rows.penalized)
            buffers = (self.out, self.fparams, self.iparams, self.eos) + (
                () if self.counts is None else (self.counts, self.prompt_mask))
            state = (self.out,) + (() if self.counts is None else (self.counts,))
            tail = self._rows["tail", block] = StepTail(("lanes", block, flags), block,
                                                        lambda scores: draw_block(self, scores, rows), buffers, state)
        return tail

    def _count_draw(self, how: str) -> None:
        if how not in self.draws and how.startswith("eager") and self.engine.graph_runner is not None:
            logger.info("lanes draw after the step, eagerly: %s", how[len("eager: "):])
        self.draws[how] += 1

    @property
    def unread(self) -> bool:
        """Some lane's draw is still on the device (pipelined)."""
        return bool(np.logical_or.reduce(self.state[:self.size] == DRAWN))

    def read_back(self) -> list[tuple[Any, DecodeResult]]:
        """Read the draws back when no step is run (e.g. every draw ends its output): as :meth:`after_step`."""
        self.start_read()
        return self.after_step(None, PlacedLanes.NONE)

    def start_read(self) -> None:
        """Pipelined: start copying the draws not read back yet to the host (before the step is launched)."""
        if not self.pipeline:
            return
        slots = (self.state[:self.size] == DRAWN).nonzero()[0]
        if len(slots):
            self._read = (slots, self._readback.to_host(self._report(slots)))

    def draw_fresh(self) -> list[tuple[Any, DecodeResult]]:
        """Draw the first tokens of the lanes added since the last step (from their Decode's logits, in one batched
        call), so that the next step computes them. Returns the :class:`Decode` results that ended (an output whose
        first token ends it, read back at once when not pipelined)."""
        if not self._fresh:
            return []
        self._fresh = False
        return self._drawn_then(self.fresh[:self.size].nonzero()[0], None, None)

    def after_step(self, logits: torch.Tensor | None, placed: PlacedLanes, drawn: bool = False
                   ) -> list[tuple[Any, DecodeResult]]:
        """After the step that computed the placed lanes' tokens (``logits``: their rows, in placement order):
        read back what was drawn, end the lanes that stopped, draw every going lane's next token (``drawn``: the
        step drew every lane's already, its :meth:`step_tail`). Returns ``(owner, result)`` for each
        :class:`Decode` whose last output ended."""
        finished: list[LaneGroup] = []
        size = self.size
        placed = self.placed[:size].nonzero()[0]
        row_of = self._row_of[:size]   # each lane's row of ``logits`` (-1: not placed)
        row_of[:] = -1
        row_of[placed] = self._arange[:len(placed)]
        self.placed[:size] = False
        if self._read is not None:
            slots, copy = self._read
            self._read = None
            self._accept(slots, copy.tensor().numpy().T, row_of[slots] >= 0, row_of, logits, finished)
        # lanes placed with their token known: they go on (ended ones were ended when read); FINISH: ended
        state = self.state[placed]
        if np.logical_or.reduce(state == FINISH):
            for slot in placed[state == FINISH].tolist():
                self._end(slot, logits[row_of[slot]], finished, computed=True)
        self.state[placed[state == KNOWN]] = 0
        return self._drawn_then(placed[self.state[placed] == 0], logits, row_of, finished, drawn)

    def _drawn_then(self, sample: np.ndarray, logits, row_of, finished: list | None = None, drawn: bool = False
                    ) -> list[tuple[Any, DecodeResult]]:
        """Draw ``sample``'s next tokens (``drawn``: the step drew them, in its graph; read back at once when not
        pipelined), drop failed and ended lanes; the finished Decodes' results."""
        finished = [] if finished is None else finished
        if len(sample):
            if drawn:
                self.state[sample] = DRAWN
            else:
                self._draw(sample, logits, row_of)
            if not self.pipeline:   # read back at once: the next step places the tokens known
                values = self._report(sample).cpu().numpy().T
                self._accept(sample, values, self._false[:len(sample)], row_of, None, finished)
        for owner, _ in self._failures:   # (their programs are closed by the scheduler: no results)
            for uid in [u for u, g in self.groups.items() if g.owner is owner]:
                self.state[:self.size][self.group[:self.size] == uid] = -1
                del self.groups[uid]
                self._forget_group(uid)
        self._prune_ended()
        self._compact(self.state[:self.size] != -1)
        return [(g.owner, DecodeResult(g.outputs, g.pending)) for g in finished] if finished else finished

    def _forget_group(self, uid: int) -> None:
        self._special.discard(uid)
        self._logprobs.discard(uid)
        self._grammar.discard(uid)
        self._token_streams.discard(uid)

    def _fail(self, group: LaneGroup, error: Exception) -> None:
        if all(owner is not group.owner for owner, _ in self._failures):
            self._failures.append((group.owner, error))

    # ------------------------------------------------------------ private: the draw

    def _draw(self, slots: np.ndarray, logits: torch.Tensor | None, row_of: np.ndarray) -> None:
        """Draw the next token of each lane of ``slots``: going lanes from their row of the step's ``logits``,
        fresh ones from their Decode's first-draw logits (or its first tokens)."""
        fresh = self.fresh[slots]
        if not np.logical_or.reduce(fresh):   # (a step's draws: every lane a row of the step's logits)
            # (slots ascending, each row of ``logits`` a placed lane's in slot order: as many are all of them)
            raw = logits if len(slots) == logits.shape[0] else logits[self._staging.to_device(row_of[slots])]
            if len(slots) == self.size and not self._special and not self._grammar:   # every lane: the draw a
                # graphed step records
                tokens = draw_block(self, raw, self.sampling_rows())
                self.state[slots] = DRAWN
                self._record_logprobs(slots, tokens, raw)
                return
            self._keep_drawn(slots, self._sample(slots, raw), raw)
            return
        parts, order = [], []
        if not np.logical_and.reduce(fresh):
            going = slots[~fresh]
            rows = row_of[going]
            parts.append(logits if len(rows) == logits.shape[0] else logits[self._staging.to_device(rows)])
            order.append(going)
        given: list[tuple[np.ndarray, torch.Tensor]] = []
        for uid in np.unique(self.group[slots[fresh]]).tolist():
            d = self.groups[uid].decode
            members = slots[fresh][self.group[slots[fresh]] == uid]
            if d.first is not None:
                given.append((members, d.first.reshape(-1).to(self.device, torch.int64)))
                continue
            rows = d.logits.reshape(-1, d.logits.shape[-1])
            parts.append(rows.expand(len(members), -1) if rows.shape[0] == 1 else rows)
            order.append(members)
        self.fresh[slots] = False
        if parts:
            drawn_slots = np.concatenate(order)
            raw = torch.cat(parts) if len(parts) > 1 else parts[0]
            tokens = self._sample(drawn_slots, raw)
            self._keep_drawn(drawn_slots, tokens, raw)
        for members, tokens in given:
            self._keep_drawn(members, tokens, None)

    def _sample(self, slots: np.ndarray, raw: torch.Tensor) -> torch.Tensor:
        whole = len(slots) == self.size   # (``slots`` ascending: then every lane, in order)
        index = None if whole else self._staging.to_device(slots)
        rows = self.sampling_rows() if whole else self.sampling_rows().take(index)
        scores = self._masked(slots, raw) if self._grammar else raw
        scores = self._process(slots, scores) if self._special else scores
        if self._special or self._grammar or rows.penalized:   # (read back with the tokens: a row with nothing to
            # draw fails alone)
            self.ok[slice(0, self.size) if whole else index] = drawable_rows(scores.float()).long()
        draws = self.drawn_count[:self.size] if whole else self.drawn_count[index]
        masks = counts = None
        if rows.penalized:
            masks = self.prompt_mask[:self.size] if whole else self.prompt_mask[index]
            counts = self.counts[:self.size] if whole else self.counts[index]
        return sample_rows(scores, rows, draws, masks, counts)

    def _keep_drawn(self, slots: np.ndarray, tokens: torch.Tensor, raw: torch.Tensor | None) -> None:
        """Store the drawn ``tokens`` of ``slots``: their stop flags (EOS / stop ids) on the device, counters,
        penalties' counts, log-probabilities."""
        store_draws(self, slice(0, self.size) if len(slots) == self.size else self._staging.to_device(slots), tokens)
        self.state[slots] = DRAWN
        self._record_logprobs(slots, tokens, raw)

    # ------------------------------------------------------------ private: reading back

    def _report(self, slots: np.ndarray) -> torch.Tensor:
        """[k, 4] int64 on the device: each lane's drawn token, stop flag, whether its row could be drawn from, and
        its draw count (one block of :attr:`out`: a slice when ``slots`` are all the lanes)."""
        return self.out[:self.size] if len(slots) == self.size else self.out[self._staging.to_device(slots)]

    # ------------------------------------------------------------ private: the tree

    def _append(self, slots: np.ndarray, nodes: np.ndarray, tokens: np.ndarray) -> None:
        """Append one token to each lane's node (``nodes``: ``slots``' nodes; a new child of its parent for a first
        token)."""
        tree = self.tree
        grow = nodes >= 0
        if np.logical_and.reduce(grow):
            tree.append_tokens(nodes, tokens, checked=False)
            return
        if np.logical_or.reduce(grow):
            tree.append_tokens(nodes[grow], tokens[grow], checked=False)
        fresh = slots[~grow]
        if len(fresh):   # new children, one edit: each parent's in slot order, the parents ascending
            parents = self.parent[fresh]
            order = parents.argsort(kind="stable")
            self.node[fresh[order]] = tree.branch_many(parents[order], tokens[~grow][order], checked=False)

    def _set_ids(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """The real ids of placeholders (each lane's last token in its node), in one call."""
        if len(slots):
            self.tree.set_last_tokens(self.node[slots], tokens, checked=False)
