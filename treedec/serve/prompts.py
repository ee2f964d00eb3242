"""Prompts to token ids for the server, bounded before any work, done off the event loop: :class:`PromptEncoder`.

A text is refused before it is tokenized when it is longer than any text the model's context can hold:
``positions x longest`` characters, ``longest`` the characters of the tokenizer's longest token (its vocabulary's
strings, added tokens included: a byte-level BPE token's string has one character per byte, a SentencePiece one
its characters, so a token covers at most that many characters of text). A chat's bound is on its messages' text
(the template only adds to it). The tokenizer and the chat template run in worker threads (the tokenizers library
releases the GIL while it encodes), the template itself in worker processes within a time, memory and size budget
(:class:`~treedec.serve.templates.ChatTemplateRenderer`): one request's prompt never stalls the others'.

The bound assumes a tokenizer that keeps the text's characters (byte-level BPE, SentencePiece: every decoder-only
model's); one whose normalizer drops or merges characters could fit a longer text, which is refused all the same.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from treedec.models.text import ChatTemplateError, encode_prompt
from treedec.serve.protocol import ServeError
from treedec.serve.templates import ChatTemplateRenderer

__all__ = ["PromptEncoder", "longest_token_chars"]

logger = logging.getLogger("treedec.serve")


def longest_token_chars(tokenizer) -> int:
    """The characters of ``tokenizer``'s longest token string (``get_vocab()``, added tokens included), at least 1."""
    vocab = tokenizer.get_vocab() if callable(getattr(tokenizer, "get_vocab", None)) else None
    if not vocab:
        raise TypeError(f"the server needs a transformers tokenizer (one with get_vocab()) to bound its text prompts, "
                        f"got {type(tokenizer).__name__}")
    return max(1, max(len(token) for token in vocab))


class PromptEncoder:
    """A tokenizer's prompts to token ids for the server (see the module docstring).

    Parameters
    ----------
    tokenizer : a transformers tokenizer.
    positions : the model's context (:func:`~treedec.runtime.request.position_limit`).
    threads : the worker threads that tokenize.
    template_timeout, template_workers : the chat template's time budget (seconds) and worker processes.

    Attributes
    ----------
    max_chars : the longest text (or chat's messages) taken: ``positions x longest_token_chars(tokenizer)``.
    """

    def __init__(self, tokenizer, positions: int, threads: int = 4, template_timeout: float = 5.0,
                 template_workers: int = 2):
        self.tokenizer, self.positions, self.longest = tokenizer, positions, longest_token_chars(tokenizer)
        self.max_chars = positions * self.longest
        self.templates = ChatTemplateRenderer(tokenizer, template_timeout, self.max_chars,
                                              workers=template_workers) \
            if getattr(tokenizer, "chat_template", None) else None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="treedec-encode")

    def start(self) -> None:
        """Start a chat-template worker in the background (the first chat request need not wait for it)."""
        if self.templates is not None:
            self._pool.submit(self._warm)

    def close(self) -> None:
        """Stop the threads (queued work is dropped) and the template workers."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.templates is not None:
            self.templates.close()

    def check_length(self, prompt: str | list[dict[str, Any]], what: str) -> None:
        """ServeError (400 ``context_length_exceeded``, naming ``what``) for a text, or messages, longer than
        :attr:`max_chars`: nothing is tokenized."""
        chars = len(prompt) if isinstance(prompt, str) else \
            sum(len(v) for m in prompt for v in m.values() if isinstance(v, str))
        if chars > self.max_chars:
            raise ServeError(f"This model's maximum context length is {self.positions} tokens, and its tokenizer's "
                             f"longest token has {self.longest} characters: a text of more than {self.max_chars} "
                             f"characters cannot fit. However, the {what} has {chars} characters. Please reduce the "
                             f"length of the {what}.", param=what, code="context_length_exceeded")

    async def encode(self, prompt: str | list[dict[str, Any]], chat: bool, what: str, *,
                     add_special_tokens: bool | None = None, add_generation_prompt: bool = True) -> list[int]:
        """``prompt``'s token ids (a text, or messages through the chat template when ``chat``; the options as
        :func:`~treedec.models.text.encode_prompt`'s), after :meth:`check_length`, in a worker thread; ServeError
        (400, naming ``what``) for a prompt the tokenizer or the template refuses."""
        self.check_length(prompt, what)
        render = None if self.templates is None else self.templates.render
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(
                encode_prompt, self.tokenizer, prompt, chat, render, add_special_tokens=add_special_tokens,
                add_generation_prompt=add_generation_prompt))
        except ChatTemplateError as e:
            raise ServeError(str(e), param=what, code="chat_template_failed") from None
        except (ValueError, TypeError) as e:
            raise ServeError(str(e), param=what) from None

    async def decode(self, ids: list[int], what: str, vocab: int, skip_special_tokens: bool = False) -> str:
        """The text of token ids ``ids`` (special tokens kept unless ``skip_special_tokens``, as vLLM's
        ``/detokenize`` keeps them), in a worker thread. Sizes
        are checked first: at most :attr:`positions` ids (a longer sequence is nothing a model reads or writes),
        each in ``[0, vocab)`` (ServeError 400 naming ``what`` and the first id out of vocabulary)."""
        if len(ids) > self.positions:
            raise ServeError(f"{what} must hold at most {self.positions} token ids (the model's max_model_len), got "
                             f"{len(ids)}", param=what)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ServeError(f"{what}: token id {bad} is out of vocabulary (the tokenizer's vocabulary has {vocab} "
                             f"tokens: ids must be in [0, {vocab}))", param=what)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(
            self.tokenizer.decode, ids, skip_special_tokens=skip_special_tokens))

    def _warm(self) -> None:
        try:
            self.templates.warm()
        except Exception:   # (a chat request then says it too)
            if not self.templates.closed:   # (else the server stopped before it was up)
                logger.exception("the chat-template worker did not start")
