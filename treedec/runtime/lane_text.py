"""Which tokens a lane's text is checked at (:mod:`treedec.runtime.lanes`): the stop-string events.

A lane with stop strings needs its text only where a stop string may end: at a token that may write the last
character of one (:meth:`~treedec.models.text.IncrementalDetokenizer.may_write`), and when the lane ends (its text
is its output's). Between two such tokens its tokens wait in the lane table and are fed to its
:class:`~treedec.sampling.stops.StopChecker` together at the next one, in order (the same text, the same decision:
no stop string can end before the last of them). So a step's stop-string work is one table lookup for every text
lane, and Python runs per lane only at its events. A lane that streams its text (``on_text``) has every token an
event.

Whether a token is an event depends on the tokenizer, the detokenizer's options and the stop strings' last
characters (a *key*); it is found the first time a key meets the token (one ``decode``), then read from the key's
row of a [keys, vocab] table: a run classifies the tokens it draws, never the whole vocabulary.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from treedec.models.text import IncrementalDetokenizer
from treedec.runtime.decode import Decode

__all__ = ["KEPT_KEYS", "TextEvents"]

#: Keys kept classified while no lane uses them (a ToT search's next level, the next request with the same stops).
KEPT_KEYS = 32


class TextEvents:
    """The event tables of one lane table (``vocab``: the model's vocabulary, the ids drawn)."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self._keys: list[tuple[Any, bool, bool, frozenset[str], bool]] = []
        self._detokenizers: list[IncrementalDetokenizer] = []   # a key's first detokenizer (its options, its decode)
        self._known = np.zeros((0, vocab), dtype=bool)   # [keys, vocab]: whether the token was classified
        self._event = np.zeros((0, vocab), dtype=bool)   # [keys, vocab]: whether it is an event (once known)

    def key(self, decode: Decode, detokenizer: IncrementalDetokenizer | None, live: np.ndarray) -> int:
        """The row of ``decode``'s lanes (-1: they have no text): its tokenizer, its params' detokenizer options, its
        stop strings' last characters and whether it streams (then every token is an event); ``detokenizer``: one of
        its lanes' fresh detokenizers (None: no text). ``live``: the rows of the lanes running; past
        :data:`KEPT_KEYS` keys, a new one takes the row of one they do not use (an online run meets many)."""
        if detokenizer is None:
            return -1
        chars, every = frozenset(s[-1] for s in decode.rule.stop_strings), decode.on_text is not None
        p = decode.params
        key = (decode.tokenizer, p.skip_special_tokens, p.spaces_between_special_tokens, chars, every)
        for row, known in enumerate(self._keys):
            if known[0] is key[0] and known[1:] == key[1:]:
                return row
        unused = sorted(set(range(len(self._keys))) - set(live.tolist())) if len(self._keys) >= KEPT_KEYS else []
        if unused:
            row = unused[0]
            self._keys[row], self._detokenizers[row] = key, detokenizer
        else:
            row = len(self._keys)
            self._keys.append(key)
            self._detokenizers.append(detokenizer)
            self._known = np.concatenate([self._known, np.zeros((1, self.vocab), dtype=bool)])
            self._event = np.concatenate([self._event, np.zeros((1, self.vocab), dtype=bool)])
        self._known[row], self._event[row] = every, every
        return row

    def due(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """[k] bool: whether each lane's new token (``tokens`` [k], of lanes of key ``rows`` [k]) is an event of its
        key; the tokens a key meets first are classified here (once per key and token)."""
        known = self._known[rows, tokens]
        if not known.all():
            for row, token in set(zip(rows[~known].tolist(), tokens[~known].tolist())):
                self._event[row, token] = self._detokenizers[row].may_write(token, self._keys[row][3])
                self._known[row, token] = True
        return self._event[rows, tokens]
