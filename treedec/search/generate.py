"""Plain greedy decoding of one request, one token per engine step: the reference that greedy speculative
decoding (:mod:`treedec.search.speculative.program`) and every batched path must equal, pipelined on a GPU."""
from __future__ import annotations

from typing import Sequence

from treedec.engine import Engine
from treedec.search.request import MODEL_EOS, eos_token_ids
from treedec.transfer import HostCopy

__all__ = ["greedy_generate"]


def greedy_generate(engine: Engine, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | str | None = MODEL_EOS, pipeline: bool | None = None
                    ) -> list[int]:
    """Plain greedy decoding, one token per engine step: the reference that greedy
    speculative decoding must equal.

    Returns the new tokens up to and including the first EOS id (``eos_token_id`` as in
    :func:`speculative_generate`), at most ``max_new_tokens``. The request stays in
    ``engine.tree`` (its root node): the prompt and every new token but the last.

    ``pipeline`` (default: on for a CUDA engine, where the device runs asynchronously; off on the
    CPU, where nothing would overlap): each step is planned and launched before the previous
    step's token is read back (:meth:`Engine.step` reads it on the device), so the host's work
    runs while the device computes. After an EOS one step more has run; its token is dropped
    from the tree (:meth:`SequenceTree.truncate`), so the result and the tree are the same.
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    eos = frozenset(eos_token_ids(eos_token_id, engine.model))
    prompt = [int(x) for x in prompt_ids]
    pipeline = engine.device.type == "cuda" if pipeline is None else pipeline
    prefilled = engine.prefill(prompt)
    node = prefilled.node
    if not pipeline:
        out = [int(prefilled.logits.argmax())]
        while len(out) < max_new_tokens and out[-1] not in eos:
            engine.tree.extend(node, out[-1:])
            out.append(int(engine.step().logits[0].argmax()))
        return out
    tree = engine.tree
    pending = prefilled.logits.argmax().reshape(1)
    read = HostCopy(pending)
    out: list[int] = []
    while True:
        launched = None
        if len(out) + 1 < max_new_tokens:
            tree.extend(node, [0])    # a placeholder: the step reads `pending` on the device
            launched = engine.step(tokens=pending).logits[0].argmax().reshape(1)
            next_read = HostCopy(launched)
        token = read.result()[0]
        if launched is not None:
            tree.set_tokens(node, len(prompt) + len(out), [token])
        out.append(token)
        if token in eos or len(out) >= max_new_tokens:
            if launched is not None:
                tree.truncate(node, len(prompt) + len(out) - 1)
            return out
        pending, read = launched, next_read
