"""A Decode's lanes as one group (:mod:`treedec.runtime.lanes`): what its outputs share, and the processing of its
rows that the batched draw does not do (user logits processors, token masks and biases)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from treedec.runtime.decode import Decode, LaneOutput
from treedec.sampling.logits import (TokenLogprobs, apply_allowed_tokens, apply_bad_words, apply_logit_bias,
                                   apply_logits_processors, mask_stop_tokens, token_mask)
from treedec.sampling.stops import StopChecker
from treedec.transfer import to_device
from treedec.tree.validate import int_list

__all__ = ["LaneGroup"]


@dataclass(eq=False)
class LaneGroup:
    """One :class:`~treedec.runtime.decode.Decode`'s lanes: what they share (the request's settings, stop checkers,
    streamed text, log-probabilities, token masks and biases) and its outputs as they end."""

    decode: Decode
    owner: Any
    uid: int
    outputs: list[LaneOutput | None]
    left: int
    checkers: list[StopChecker | None] = field(default_factory=list)
    shown: list[int] = field(default_factory=list)       # characters of each output's text streamed so far
    records: list[tuple[np.ndarray, TokenLogprobs]] = field(default_factory=list)   # (output indices, logprobs)
    entries: list[list[dict]] = field(default_factory=list)   # per output, its tokens' logprobs (records read)
    pending: list[tuple[int, int, int]] = field(default_factory=list)   # (output, parent, last token) to place
    allowed: torch.Tensor | None = None        # [1, V] bool: allowed_token_ids
    bias: tuple[torch.Tensor, torch.Tensor] | None = None   # logit_bias: ([k] ids, [k] values)
    stop_ids: torch.Tensor | None = None       # [k] int64: the ids min_tokens keeps from being drawn
    matchers: list | None = None               # structured outputs: each output's grammar matcher

    @property
    def special(self) -> bool:
        """Its rows are processed before the batched draw (user processors, token masks and biases)."""
        p = self.decode.params
        return bool(p.logits_processors) or p.allowed_token_ids is not None or bool(self.decode.bad_words) \
            or p.min_tokens > 0 or p.logit_bias is not None

    def prepare(self, vocab: int, device: torch.device) -> None:
        """Its token masks and biases on the device, checked against the vocabulary on the host."""
        d, p = self.decode, self.decode.params
        if (d.grammar is None) != (p.structured_outputs is None):
            raise ValueError(f"{d.name}: structured_outputs needs its compiled grammar in the Decode (and a grammar "
                             f"needs structured_outputs)")
        if d.grammar is not None:
            if d.grammar.vocab != vocab:
                raise ValueError(f"{d.name}: its grammar was compiled for a {d.grammar.vocab}-token vocabulary, the "
                                 f"model has {vocab}")
            self.matchers = [d.grammar.matcher(d.rule.eos_token_ids) for _ in range(d.count)]
        if p.allowed_token_ids is not None:
            self.allowed = token_mask(p.allowed_token_ids, vocab, device, "allowed_token_ids")
        if p.logit_bias is not None:
            ids = int_list(list(p.logit_bias), "logit_bias' token ids", low=0, high=vocab - 1)
            self.bias = (to_device(ids, device, torch.int64), to_device(list(p.logit_bias.values()), device,
                                                                        torch.float32))
        for word in d.bad_words:
            int_list(word, "bad_words' token ids", low=0, high=vocab - 1)
        if p.min_tokens and d.min_tokens_stop_ids:
            self.stop_ids = to_device(int_list(list(d.min_tokens_stop_ids), "min_tokens' stop ids", low=0,
                                               high=vocab - 1), device, torch.int64)

    def process(self, rows: torch.Tensor, tokens: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        """Its lanes' ``rows`` [m, V] float32 processed in vLLM v1's order
        (:class:`~treedec.sampling.params.SamplingParams`): the user's logits processors (one row at a time),
        ``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``logit_bias`` (:mod:`treedec.sampling.logits`).
        ``tokens`` [m, W] and ``lengths`` [m]: each lane's output tokens so far. A processor's error is raised."""
        d, p = self.decode, self.decode.params
        if p.logits_processors:
            histories = [list(d.prompt_ids) + row[:n].tolist() for row, n in zip(tokens, lengths.tolist())]
            rows = apply_logits_processors(p.logits_processors, histories, rows)
        if self.allowed is not None:
            rows = apply_allowed_tokens(rows, self.allowed)
        if d.bad_words:
            back = max(map(len, d.bad_words)) - 1   # (the output's last tokens a ban looks at)
            outputs = [row[max(0, n - back):n].tolist() for row, n in zip(tokens, lengths.tolist())]
            rows = apply_bad_words(rows, d.bad_words, outputs)
        if self.stop_ids is not None and (lengths < p.min_tokens).any():
            short = np.flatnonzero(lengths < p.min_tokens)
            rows = mask_stop_tokens(rows, self.stop_ids,
                                    None if len(short) == len(lengths) else to_device(short, rows.device))
        if self.bias is not None:
            rows = apply_logit_bias(rows, *self.bias)
        return rows

    def accept_text(self, i: int, tokens: list[int]) -> str | None:
        """Output ``i``'s tokens since its last event, through its stop checker (stop strings) and its stream (only
        the new characters are joined; the output's end streamed with its last text); returns why the output ended,
        or None. None of them but the last is an event (:class:`~treedec.runtime.lane_text.TextEvents`): a stop
        string ended by an earlier one is a tokenizer whose decoder writes a character that the token's own text does
        not hold (a RuntimeError: unsupported)."""
        checker = self.checkers[i]
        decision = checker.accept(tokens)
        if decision.keep < len(tokens):
            raise RuntimeError(f"{self.decode.name}: output {i}'s stop string {checker.stop_string!r} ended at a token "
                               f"whose own text holds none of the stop strings' last characters "
                               f"({tokens[decision.keep - 1]}, {len(tokens) - decision.keep} token(s) before the last "
                               f"one checked); its tokenizer "
                               f"({type(self.decode.tokenizer).__name__}) writes text that depends on the tokens "
                               f"around it, which stop strings do not support (IncrementalDetokenizer.may_write)")
        if self.decode.on_text is not None:
            end = checker.streamable_length
            if end > self.shown[i] or decision.reason is not None:
                delta = checker.text_from(self.shown[i]) if end > self.shown[i] else ""
                self.shown[i] = max(end, self.shown[i])
                self.decode.on_text(i, delta, checker)
        return decision.reason

    def logprobs_at(self, indices: list[int], positions: list[int]) -> list[dict]:
        """The logprobs of output ``indices[j]``'s token ``positions[j]`` (drawn: its record is made), one dict
        each."""
        self._read_records()
        return [self.entries[i][at] for i, at in zip(indices, positions)]

    def assemble_logprobs(self) -> None:
        """Its ended outputs' logprobs, one dict per token, from the draws' records."""
        if self.decode.params.logprobs is None:
            return
        self._read_records()
        for out, entries in zip(self.outputs, self.entries):
            out.logprobs = entries[:len(out.token_ids)]

    def _read_records(self) -> None:
        """The draws' records into each output's entries (one host read of their tensors each; read records are
        dropped): a draw records each of its outputs' next token, in order."""
        if not self.entries:
            self.entries = [[] for _ in self.outputs]
        records, self.records = self.records, []
        for indices, record in records:
            for i, entry in zip(indices.tolist(), record.to_dicts()):
                self.entries[i].append(entry)
