"""OpenAI's response shapes: completions and chat completions, whole or as stream chunks; usage; logprobs."""
from __future__ import annotations

import time
from typing import Callable

from treedec.runtime.requests import RequestResult

__all__ = ["Choices", "chat_logprobs", "completion_logprobs", "prompt_logprobs", "usage"]


class Choices:
    """The response objects of one request ``rid`` (``n`` choices a prompt; choice ``k * n + j`` is prompt ``k``'s
    output ``j``): a chat completion (``chat``) or a text completion, of the prompts ``prompt_ids``.

    With ``echo`` (a completion's: each prompt's text) a choice's text starts with its prompt's (a stream: in the
    choice's first chunk). With ``token_ids`` (vLLM's ``return_token_ids``): a completion choice holds its prompt's
    ``prompt_token_ids`` and its ``token_ids``; a chat completion holds ``prompt_token_ids`` at its top level (a
    stream: on its first chunk) and each choice its ``token_ids``, as vLLM's do. A stream gives a choice's
    ``token_ids`` (all of them) on the chunk that ends it; vLLM gives each chunk the ids of its own text.
    """

    def __init__(self, rid: str, model: str, n: int, chat: bool, token_ids: bool = False,
                 prompt_ids: list[list[int]] | None = None, echo: list[str] | None = None):
        self.rid, self.model, self.n, self.chat, self.token_ids = rid, model, n, chat, token_ids
        self.prompt_ids, self.echo = prompt_ids or [], echo
        self.created = int(time.time())

    def _head(self, kind: str) -> dict:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def response(self, results: list[list[RequestResult]], logprobs: Callable[[RequestResult], dict] | None,
                 prompt_logprobs: Callable[[RequestResult], list] | None = None) -> dict:
        """The whole response (``stream=false``); ``prompt_logprobs``: vLLM's, a completion choice's own, a chat
        completion's at its top level."""
        choices = []
        for k, request in enumerate(results):
            for r in request:
                choice = {"index": k * self.n + r.index}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": r.text}
                else:
                    choice["text"] = r.text if self.echo is None else self.echo[k] + r.text
                choice["logprobs"] = None if logprobs is None else logprobs(r)
                choice["finish_reason"] = finish_reason(r.stop_reason)
                if prompt_logprobs is not None and not self.chat:
                    choice["prompt_logprobs"] = prompt_logprobs(r)
                choices.append(self._ids(choice, r.prompt_ids, r.output_ids))
        out = self._head("chat.completion" if self.chat else "text_completion")
        if self.chat and self.token_ids:
            out["prompt_token_ids"] = list(results[0][0].prompt_ids)
        if self.chat and prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs(results[0][0])
        return {**out, "choices": choices, "usage": usage(results)}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        """A stream chunk; with ``usage``: the last one (no choices, ``stream_options.include_usage``), or any one
        (``continuous_usage_stats``)."""
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def first_chunk(self, usage: dict | None = None) -> dict:
        """A chat stream's first chunk: every choice's role (and, with ``token_ids``, the prompt's ids)."""
        out = self.chunk([self.delta(k * self.n + j, {"role": "assistant", "content": ""})
                          for k in range(len(self.prompt_ids)) for j in range(self.n)], usage)
        if self.token_ids:
            out["prompt_token_ids"] = list(self.prompt_ids[0])
        return out

    def running_usage(self, k: int, tokens: int) -> dict:
        """``continuous_usage_stats``: a chunk's usage, prompt ``k``'s tokens and its choice's ``tokens`` so far
        (vLLM's: the choice's, not the request's)."""
        prompt = len(self.prompt_ids[k])
        return {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}

    def delta(self, index: int, delta: dict) -> dict:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def text(self, index: int, text: str) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None}

    def end(self, index: int, k: int, text: str, stop_reason: str, token_ids: list[int]) -> dict:
        """Choice ``index``'s (of prompt ``k``) last chunk, when it ends: its last ``text`` (as vLLM's last chunk
        carries it) and its finish reason."""
        reason = finish_reason(stop_reason)
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        return self._ids(choice, self.prompt_ids[k], token_ids)

    def _ids(self, choice: dict, prompt_ids, output_ids) -> dict:
        """``return_token_ids``: the choice's output token ids added (and a completion's, its prompt's)."""
        if self.token_ids:
            if not self.chat:
                choice["prompt_token_ids"] = list(prompt_ids)
            choice["token_ids"] = list(output_ids)
        return choice


def finish_reason(stop_reason: str) -> str:
    """OpenAI's, of an output's stop reason: ``"length"`` (``max_tokens``), else ``"stop"`` (an EOS, a stop token
    or a stop string)."""
    return "length" if stop_reason == "length" else "stop"


def usage(results: list[list[RequestResult] | None]) -> dict:
    """Tokens of a request's prompts (each counted once) and outputs, and the prompts' tokens read from the prefix
    cache (``prompt_tokens_details.cached_tokens``)."""
    done = [request for request in results if request]
    prompt = sum(len(request[0].prompt_ids) for request in done)
    completion = sum(len(r.output_ids) for request in done for r in request)
    cached = sum(request[0].stats.get("cached_tokens", 0) for request in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _top(entry: dict, chosen: int, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of a position's logprobs (id -> Logprob), by rank."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(t, lp.logprob) for t, lp in ranked if lp.rank <= k]


def completion_logprobs(r: RequestResult, tokenizer, k: int, echo: bool = False) -> dict:
    """A completion choice's ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the ``k`` most likely
    and the chosen token) and ``text_offset`` (each token's start in the text); with ``echo`` the prompt's tokens
    first (from ``r.prompt_logprobs``; its first token has none: None, as vLLM's)."""
    tokens, chosen_lp, tops, offsets = [], [], [], []
    offset = 0
    rows = list(zip(r.output_ids, r.logprobs or ()))
    if echo:
        rows = list(zip(r.prompt_ids, r.prompt_logprobs)) + rows
    for token, entry in rows:
        piece = _piece(tokenizer, token)
        tokens.append(piece)
        if entry is None:   # (the prompt's first token: nothing before it)
            chosen_lp.append(None)
            tops.append(None)
            offsets.append(offset)
            offset += len(piece)
            continue
        chosen_lp.append(entry[token].logprob)
        top: dict[str, float] = {}
        for t, lp in _top(entry, token, k):   # (tokens that decode alike: the likeliest one's)
            top.setdefault(_piece(tokenizer, t), lp)
        top.setdefault(piece, entry[token].logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": chosen_lp, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(r: RequestResult, tokenizer) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of a result: per prompt token None (the first) or ``{token id: {"logprob",
    "rank", "decoded_token"}}`` of the token and the most likely ones."""
    return [None if entry is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": _piece(tokenizer, t)} for t, lp in entry.items()}
            for entry in r.prompt_logprobs]


def chat_logprobs(r: RequestResult, tokenizer, k: int) -> dict:
    """A chat choice's ``logprobs``: ``content``, per token its ``token``, ``logprob``, ``bytes`` and
    ``top_logprobs`` (the ``k`` most likely)."""
    content = []
    for token, entry in zip(r.output_ids, r.logprobs or ()):
        piece = _piece(tokenizer, token)
        content.append({"token": piece, "logprob": entry[token].logprob, "bytes": list(piece.encode()),
                        "top_logprobs": [{"token": (p := _piece(tokenizer, t)), "logprob": lp,
                                          "bytes": list(p.encode())} for t, lp in _top(entry, token, k)]})
    return {"content": content}


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"
