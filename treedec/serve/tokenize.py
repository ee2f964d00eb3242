"""The server's ``/tokenize`` and ``/detokenize`` routes (vLLM's shapes), over the same
:class:`~treedec.serve.prompts.PromptEncoder` the generation routes encode with: a text's length bounded before it
is tokenized, the tokenizer and the chat template off the event loop.

- ``POST /tokenize`` takes a text (:class:`~treedec.serve.protocol.TokenizeCompletionRequest`: ``prompt``,
  ``add_special_tokens``) or chat messages (:class:`~treedec.serve.protocol.TokenizeChatRequest`: ``messages``,
  ``add_generation_prompt``, ``add_special_tokens``), and ``return_token_strs``; it answers ``{"count",
  "max_model_len", "tokens", "token_strs"}`` (``token_strs`` None unless asked for); a prompt of more than
  ``max_model_len`` tokens is refused (400 ``context_length_exceeded``), as vLLM refuses it.
- ``POST /detokenize`` takes ``tokens`` (at most ``max_model_len`` ids, each in the vocabulary) and answers
  ``{"prompt"}``: their text, special tokens kept (vLLM's).

``model`` may be left out (vLLM's too); given, it must be the served name (404 ``model_not_found`` otherwise).
vLLM's other fields of these bodies (``chat_template``, ``chat_template_kwargs``, ``continue_final_message``,
``tools``, ``mm_processor_kwargs``) are refused (400), not ignored.
"""
from __future__ import annotations

from treedec.serve.prompts import PromptEncoder
from treedec.serve.protocol import DetokenizeRequest, ServeError, TokenizeChatRequest, TokenizeCompletionRequest

__all__ = ["detokenize", "tokenize"]


async def tokenize(encoder: PromptEncoder, body: TokenizeCompletionRequest | TokenizeChatRequest,
                   max_model_len: int) -> dict:
    """The ``/tokenize`` answer for ``body`` (its model checked by the caller)."""
    if isinstance(body, TokenizeChatRequest):
        ids = await encoder.encode(body.conversation(), True, "messages", add_special_tokens=body.add_special_tokens,
                                   add_generation_prompt=body.add_generation_prompt)
    else:
        if not body.prompt:
            raise ServeError("prompt must be a non-empty text", param="prompt")
        ids = await encoder.encode(body.prompt, False, "prompt", add_special_tokens=body.add_special_tokens)
    if len(ids) > max_model_len:   # (vLLM refuses them too: no request could take the prompt)
        what = "prompt" if isinstance(body, TokenizeCompletionRequest) else "messages"
        raise ServeError(f"This model's maximum context length is {max_model_len} tokens. However, the {what} has "
                         f"{len(ids)} tokens. Please reduce the length of the {what}.", param=what,
                         code="context_length_exceeded")
    strings = encoder.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strings}


async def detokenize(encoder: PromptEncoder, body: DetokenizeRequest, vocab: int) -> dict:
    """The ``/detokenize`` answer for ``body`` (its model checked by the caller)."""
    return {"prompt": await encoder.decode(body.tokens, "tokens", vocab)}
