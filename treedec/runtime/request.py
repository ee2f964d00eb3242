"""What the one-request search programs (beam search, parallel sampling, speculative
decoding, ...) share: the check of their EOS ids, the positions a request may reach against
the model's, and the pages a request holds.

The checks raise ``ValueError`` naming the argument, the expected and the given value, so
a search program can check everything before it touches the engine (its counts and numbers
by :mod:`treedec.checks`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from treedec.checks import is_int
from treedec.models import DecoderModel
from treedec.tree import PagedKVPool


@dataclass
class RequestStats:
    """Counters of one request's decoding run (beam search, parallel sampling).

    Attributes
    ----------
    steps : engine steps after the prefill.
    queries_per_step : tokens computed by each step.
    peak_pages : the most KV pages the request held at once (prompt included).
    """

    steps: int = 0
    queries_per_step: list[int] = field(default_factory=list)
    peak_pages: int = 0


#: The default ``eos_token_id`` of every program: the model's own EOS ids (``model.eos_token_ids``:
#: what its checkpoint's ``generation_config.json`` or ``config.json`` names; none for random weights).
MODEL_EOS = "model"


def eos_token_ids(value: int | Sequence[int] | str | None, model: DecoderModel) -> tuple[int, ...]:
    """The EOS ids a program stops at, as a tuple.

    ``value``: :data:`MODEL_EOS` (``"model"``) for ``model.eos_token_ids``, None for none
    (an empty tuple), or an id or several ids, each a token id in ``[0, vocab_size)``.
    """
    vocab_size = model.config.vocab_size
    if isinstance(value, str):
        if value != MODEL_EOS:
            raise ValueError(f"eos_token_id must be {MODEL_EOS!r} (the model's own EOS ids), a token id, a list of "
                             f"token ids or None, got {value!r}")
        return tuple(model.eos_token_ids)
    if value is None:
        return ()
    ids = [value] if is_int(value) else value
    try:
        ids = list(ids)
    except TypeError:
        raise ValueError(f"eos_token_id must be {MODEL_EOS!r} (the model's own EOS ids), a token id, a list of "
                         f"token ids or None, got {value!r}") from None
    bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab_size]
    if bad or not ids:
        raise ValueError(f"eos_token_id must be token ids in [0, {vocab_size}), got {value!r}")
    return tuple(dict.fromkeys(int(t) for t in ids))


@dataclass(frozen=True)
class Positions:
    """The most positions one of a program's sequences may reach, known before it runs.

    Attributes
    ----------
    count : positions (a sequence of ``count`` tokens reaches position ``count - 1``).
    how : how they add up, for the error (e.g. ``"a 5000-token prompt + max_new_tokens 5000"``).
    """

    count: int
    how: str


def position_limit(model: DecoderModel) -> int:
    """The most positions a sequence may have on ``model``: its ``max_position`` (the checkpoint's
    ``max_position_embeddings``), or its config's sliding window when smaller and the model's layers do not attend
    it as a window (``model.attention_variants()``; e.g. Qwen2's window of some layers: past it the model would
    attend differently). A window its variants implement (Mistral's) bounds nothing."""
    config = model.config
    if config.sliding_window is None or any(v.window is not None for v in model.attention_variants()):
        return config.max_position
    return min(config.max_position, config.sliding_window)


def check_positions(model: DecoderModel, need: Positions, name: str, before_run: bool = False) -> None:
    """Raise ValueError naming ``name`` (e.g. ``"request 'b' (line 3)"``) if ``need`` exceeds the model's
    positions (:func:`position_limit`); ``before_run``: the message says nothing was run."""
    limit = position_limit(model)
    if need.count > limit:
        config = model.config
        has = (f"its sliding window of {limit} tokens (treedec attends to whole paths)" if limit < config.max_position
               else f"max_position {limit} (the checkpoint's max_position_embeddings)")
        raise ValueError(f"{name} may reach {need.count} positions ({need.how}), more than the model's {has}; "
                         f"shorten the prompt or lower the token budget" + ("; nothing was run" if before_run else ""))


def pages_in_use(pool: PagedKVPool) -> int:
    """Pages of ``pool`` held by any node (a request's share: the difference over its run)."""
    return pool.num_pages - pool.num_free_pages
