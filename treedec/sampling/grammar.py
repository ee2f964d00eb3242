"""Structured outputs as token bitmasks, over xgrammar (the grammar engine vLLM and SGLang use by default; chosen over
llguidance for its fill time per row and its draft-tree traversal: ``bench/README.md``).

- :class:`GrammarCompiler`: one per (tokenizer, model vocabulary); compiles a
  :class:`~treedec.sampling.structured.StructuredOutputsParams` into a :class:`Grammar`, cached by its key (LRU,
  thread-safe: a server compiles off its event loop, the engine thread finds it cached). A constraint xgrammar
  cannot compile raises :class:`GrammarError` (a ValueError) with xgrammar's reason.
- :class:`Grammar`: a compiled constraint; :meth:`Grammar.matcher` makes one output's matcher (its parsing state:
  an ``xgrammar.GrammarMatcher``, forked for a branch, advanced with each token drawn).
- :class:`BitmaskRows`: the batched fill of a step (every grammar row's matcher into one int32 ``[rows, ceil(V/32)]``
  host buffer in one xgrammar call, one copy to the device) and :func:`apply_bitmask`, one torch op for all rows.
- :class:`DraftGrammar`: one sequence's matcher over a speculative token tree: each draft token checked against the
  grammar state of its parent node (one xgrammar traversal of the tree), rejected ones pruned before verification,
  and the target's logits masked at every node, so that greedy acceptance picks the masked argmax.

A bitmask bit ``j`` of row ``i`` (word ``j // 32``, bit ``j % 32``) is 1 where token ``j`` may be drawn.
"""
from __future__ import annotations

import dataclasses
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from treedec.sampling.stops import StopRule
from treedec.sampling.structured import StructuredOutputsParams
from treedec.transfer import to_device

try:   # (the ``structured`` extra)
    import xgrammar as xgr
except ImportError:   # pragma: no cover - reported when a constraint is compiled
    xgr = None

__all__ = ["BitmaskRows", "DraftGrammar", "Grammar", "GrammarCompiler", "GrammarError", "apply_bitmask",
           "bitmask_width"]


class GrammarError(ValueError):
    """A structured-output constraint that cannot be compiled (an unsupported or malformed schema, regex or grammar),
    or a token its grammar does not accept: the message says which and why."""


def bitmask_width(vocab: int) -> int:
    """The int32 words of one row's bitmask: ``ceil(vocab / 32)``."""
    return (vocab + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [m, V] (any float dtype) with every token whose bit is 0 in ``bitmask`` [m, ceil(V/32)] int32 (on
    ``logits.device``) set to -inf, in place; returns ``logits``. One unpack and one masked fill for all rows."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    v = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :v]
    if allowed.shape[1] < v:
        raise ValueError(f"the bitmask covers {allowed.shape[1]} tokens, the logits have {v}")
    return logits.masked_fill_(allowed == 0, float("-inf"))


def _require_xgrammar() -> None:
    if xgr is None:
        raise ModuleNotFoundError("structured outputs need the xgrammar package: pip install 'treedec[structured]'")


_LOCATION = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")   # xgrammar's "[time] file.cc:line: " before its reason


def _reason(error: Exception) -> str:
    return _LOCATION.sub("", str(error)).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint (:meth:`GrammarCompiler.compile`): ``key`` its
    :attr:`~treedec.sampling.structured.StructuredOutputsParams.key`, ``vocab`` the model's vocabulary,
    ``stop_token_ids`` the compiler's (the checkpoint's EOS ids, or the tokenizer's)."""

    compiled: object   # xgrammar.CompiledGrammar
    key: tuple
    vocab: int
    stop_token_ids: tuple[int, ...] = ()

    def stop_rule(self, rule: StopRule) -> StopRule:
        """An output's ``rule`` for this grammar: itself when it has EOS ids (the grammar's stop tokens are then
        those: :meth:`matcher`), else (``ignore_eos``, a checkpoint without EOS ids) with the compiler's stop ids
        as its EOS ids, so that an output whose grammar ends stops there (finish reason ``"stop"``)."""
        return rule if rule.eos_token_ids else dataclasses.replace(rule, eos_token_ids=self.stop_token_ids)

    def matcher(self, stop_token_ids: Sequence[int] = ()):
        """A fresh matcher (an ``xgrammar.GrammarMatcher`` at the grammar's start): one output's parsing state. Its
        stop tokens are ``stop_token_ids`` (an output's EOS and stop ids: drawn only where the grammar may end, and
        they end it), or the checkpoint's (:class:`GrammarCompiler`'s ``stop_token_ids``) when none are given."""
        stops = [int(t) for t in stop_token_ids] or None
        return xgr.GrammarMatcher(self.compiled, override_stop_tokens=stops)


class GrammarCompiler:
    """Compiles structured-output constraints for one tokenizer and model vocabulary, caching them by key.

    Parameters
    ----------
    tokenizer : a transformers tokenizer (xgrammar reads its vocabulary and decoder).
    vocab_size : the model's vocabulary (its logits' width; ids past the tokenizer's are never allowed).
    stop_token_ids : the ids that end a grammar's output (the checkpoint's EOS ids); default the tokenizer's.
    cache_size : compiled grammars kept (least recently used dropped first).
    max_threads : xgrammar's compile threads.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int] | None = None,
                 cache_size: int = 256, max_threads: int = 1):
        _require_xgrammar()
        stops = None if stop_token_ids is None or not len(stop_token_ids) else [int(t) for t in stop_token_ids]
        try:
            self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        except Exception as error:
            raise GrammarError(f"structured outputs: xgrammar cannot read the tokenizer "
                               f"({type(tokenizer).__name__}): {_reason(error)}") from None
        self.vocab = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self.hits = self.misses = 0

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """``params`` compiled (from the cache when compiled before). Raises :class:`GrammarError` naming the
        constraint's kind and xgrammar's reason."""
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"params must be a StructuredOutputsParams, got {type(params).__name__}")
        key = params.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return found
        # (compiled outside the lock: other keys compile meanwhile)
        grammar = Grammar(self._compile(params), key, self.vocab, tuple(self.info.stop_token_ids))
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, p: StructuredOutputsParams):
        c, kind = self._compiler, p.kind
        try:
            if kind == "json":
                return c.compile_json_schema(p.json, any_whitespace=not p.disable_any_whitespace)
            if kind == "json_object":   # (OpenAI's: an object; vLLM's xgrammar backend takes any JSON value)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=not p.disable_any_whitespace,
                                             strict_mode=False)
            if kind == "regex":
                return c.compile_regex(p.regex)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(_ebnf_string(s) for s in p.choice))
            return c.compile_grammar(p.grammar)
        except Exception as error:   # (xgrammar raises RuntimeError for every malformed constraint)
            raise GrammarError(f"structured_outputs.{kind}: cannot be compiled: {_reason(error)}") from None


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


class BitmaskRows:
    """The host buffer of a step's grammar rows and their batched fill (one per lane table: not shared across
    threads). :meth:`fill` writes every matcher's next-token bitmask (one xgrammar call for all) and returns it on
    ``device``."""

    def __init__(self, vocab: int, device: torch.device):
        _require_xgrammar()
        self.vocab, self.device, self.width = vocab, device, bitmask_width(vocab)
        self._host = torch.zeros((0, self.width), dtype=torch.int32)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def fill(self, matchers: list) -> torch.Tensor:
        """[len(matchers), ceil(V/32)] int32 on the device: each matcher's allowed next tokens."""
        k = len(matchers)
        if self._host.shape[0] < k:
            self._host = torch.zeros((max(k, 2 * self._host.shape[0], 16), self.width), dtype=torch.int32)
        host = self._host[:k]
        self._batch.batch_fill_next_token_bitmask(matchers, host)
        return to_device(host.numpy(), self.device) if self.device.type == "cuda" else host.clone()

    def accept(self, matchers: list, tokens: Sequence[int]) -> np.ndarray:
        """Advance each matcher with its token (one xgrammar call); [k] bool, whether each accepted it."""
        return np.asarray(self._batch.batch_accept_token(matchers, [int(t) for t in tokens]), dtype=bool)


class DraftGrammar:
    """One sequence's grammar state over speculative token trees (:class:`~treedec.programs.speculative.program.
    SpeculativeProgram`): ``matcher`` has accepted every token the sequence emitted (a tree's root included)."""

    def __init__(self, grammar: Grammar, device: torch.device, stop_token_ids: Sequence[int] = ()):
        self.grammar, self.device = grammar, device
        self.matcher = grammar.matcher(stop_token_ids)
        self.width = bitmask_width(grammar.vocab)

    def mask_first(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] (the prompt's last row) masked at the grammar's start: a copy."""
        mask = torch.zeros((1, self.width), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(mask, 0)
        return apply_bitmask(logits.reshape(1, -1).float().clone(), mask.to(logits.device))[0]

    def prune(self, parents: Sequence[int], tokens: Sequence[int]) -> tuple[np.ndarray, torch.Tensor]:
        """The draft tree (``parents`` [N], ``tokens`` [N]; ``tokens[0]``, the root, is the sequence's last token,
        accepted by the matcher already) checked against the grammar: ``(kept, masks)``, ``kept`` the indices of
        the nodes whose path the grammar accepts (the root first, parents before children), ``masks``
        [len(kept), ceil(V/32)] int32 on the device, each kept node's next-token mask (one xgrammar traversal of
        the tree). The matcher is left as it was."""
        n = len(parents)
        first_child = np.full(n, -1, dtype=np.int64)
        next_sibling = np.full(n, -1, dtype=np.int64)
        for i in range(n - 1, 0, -1):   # (children in order: the first child's later siblings follow it)
            p = parents[i]
            next_sibling[i], first_child[p] = first_child[p], i
        masks = torch.zeros((n, self.width), dtype=torch.int32)
        self.matcher.traverse_draft_tree(torch.from_numpy(first_child), torch.from_numpy(next_sibling),
                                         torch.as_tensor(np.asarray(tokens, dtype=np.int64)), masks)
        words = masks.numpy()
        ok = np.ones(n, dtype=bool)
        for i in range(1, n):   # a node is kept when its parent is and the parent's mask allows its token
            t, p = int(tokens[i]), parents[i]
            ok[i] = ok[p] and bool((int(words[p, t >> 5]) >> (t & 31)) & 1)
        kept = np.flatnonzero(ok)
        return kept, to_device(words[kept], self.device)

    def advance(self, tokens: Sequence[int]) -> None:
        """Accept the tokens the sequence emitted (a step's accepted drafts and its bonus token, the next root)."""
        for t in tokens:
            if not self.matcher.accept_token(int(t)):
                raise GrammarError(f"the grammar does not accept token {int(t)} (an emitted token its mask forbade)")
