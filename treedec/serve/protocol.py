"""The OpenAI API's request bodies (pydantic models) and what treedec makes of them.

:class:`CompletionRequest` (``/v1/completions``) and :class:`ChatCompletionRequest` (``/v1/chat/completions``) take
OpenAI's fields (``logit_bias`` included: token id strings -> a bias in [-100, 100] added to the logit) and vLLM's
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``bad_words``, ``allowed_token_ids``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
``truncate_prompt_tokens``; ``return_token_ids``: a completion choice also holds ``prompt_token_ids`` and
``token_ids``, a chat completion ``prompt_token_ids`` at its top level and each choice its ``token_ids``, as vLLM's,
in a stream on the choice's last chunk (the prompt's on a chat stream's first), e.g. for a client that re-sends a
conversation as token ids; ``seed`` any int64, as vLLM's); :meth:`sampling_params`
turns one into a :class:`~treedec.sampling.params.SamplingParams` (which checks the values: a bad one is a
:class:`ServeError` of status 400). At most :data:`MAX_STOP_STRINGS` stop strings (OpenAI's and vLLM's server's
bound). ``prompt_logprobs`` (vLLM's: the prompt tokens' log-probabilities, ``k`` most likely each; not with
``stream``) and, for completions, ``echo`` (the prompt's text before the completion's; with ``logprobs``, the
prompt's tokens' logprobs first, vLLM's); structured outputs (:meth:`_Sampling.structured_outputs_params`):
OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` and its older
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (one of them a request); vLLM's
``use_beam_search`` (with ``length_penalty``, ``early_stopping``: :meth:`_Sampling.beam_params`). A field OpenAI
has that treedec does not implement (``suffix``, tools, ...) is refused with 400, never ignored; ``user`` is
accepted and ignored, as OpenAI does. Unknown fields are refused (400).
"""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from treedec.programs.beam import BeamSearchParams
from treedec.sampling.params import SamplingParams
from treedec.sampling.structured import MAX_CHOICES, StructuredOutputsParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "ServeError", "StreamOptions",
           "TokenizeChatRequest", "TokenizeCompletionRequest", "TokenizeRequest"]

#: The most log-probabilities a token may report (``logprobs`` of completions, ``top_logprobs`` of chat).
MAX_LOGPROBS = 20
#: The most stop strings a request gives: OpenAI's bound ("up to 4 sequences"), vLLM's server's default
#: (``VLLM_MAX_STOP_STRINGS``). Each is also at most :data:`~treedec.sampling.stops.MAX_STOP_STRING_CHARS` characters.
MAX_STOP_STRINGS = 4


class ServeError(Exception):
    """A request the server answers with an OpenAI-style error (``status``, ``type``, ``param``, ``code``)."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    """A stream's ``stream_options``: ``include_usage`` (a last chunk with the request's usage) and vLLM's
    ``continuous_usage_stats`` (every chunk's usage too: its prompt's tokens and its choice's tokens so far). vLLM
    ignores ``continuous_usage_stats`` without ``include_usage``; treedec refuses it (400)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None   # (accepted and ignored, as OpenAI does)
    return_token_ids: bool = False   # (vLLM's: each choice also gives its prompt's and its output's token ids)
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields (their meaning: SamplingParams)
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None   # (vLLM's)
    use_beam_search: bool = False   # (vLLM's: the request's n outputs are a beam search's best hypotheses)
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def budget_field(self) -> str:
        """The field the completion's token budget was given in (errors name it)."""
        return "max_tokens"

    def token_budget(self) -> int | None:
        """The completion's token budget as given (None: what the model's context leaves after the prompt), checked
        to be >= 1 (a ServeError naming :attr:`budget_field`)."""
        value = self.max_tokens
        if value is not None and value < 1:
            raise ServeError(f"{self.budget_field} must be >= 1, got {value}", param=self.budget_field)
        return value

    def _check_common(self) -> None:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ServeError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}", param="stop")
        if self.stream_options is not None and not self.stream:
            raise ServeError("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats and \
                not self.stream_options.include_usage:
            raise ServeError("stream_options.continuous_usage_stats needs stream_options.include_usage=true",
                             param="stream_options")
        if self.top_k is not None and self.top_k == -1:   # (vLLM's "no top-k")
            self.top_k = None
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ServeError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
                             param="prompt_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise ServeError("prompt_logprobs are not supported with stream=true", param="prompt_logprobs")

    @property
    def structured_field(self) -> str | None:
        """The field that gives the request's structured-output constraint (errors name it), or None."""
        return next((name for name in _STRUCTURED_FIELDS if getattr(self, name) is not None and not (
            name == "response_format" and self.response_format.get("type") == "text")), None)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's structured-output constraint, from whichever one field gives it (``response_format``,
        ``structured_outputs``, ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``), or
        None; its sizes bounded (:mod:`treedec.sampling.structured`). Two of them, an unknown ``response_format``
        type or a bad constraint: a ServeError (400) naming the field."""
        given = {name: getattr(self, name) for name in _STRUCTURED_FIELDS if getattr(self, name) is not None}
        rf = given.get("response_format")
        if rf is not None and rf.get("type") == "text":
            del given["response_format"]
        if len(given) > 1:
            raise ServeError(f"give one structured-output constraint, got {' and '.join(given)}",
                             param=list(given)[1])
        if self.guided_decoding_backend not in (None, "xgrammar", "auto"):
            raise ServeError(f"guided_decoding_backend: this server's grammar engine is xgrammar, got "
                             f"{self.guided_decoding_backend!r:.40}", param="guided_decoding_backend")
        if self.guided_whitespace_pattern is not None:
            raise ServeError("guided_whitespace_pattern is not supported (xgrammar's JSON takes any whitespace, or "
                             "none with structured_outputs.disable_any_whitespace)", param="guided_whitespace_pattern")
        if not given:
            return None
        (name, value), = given.items()
        if name == "guided_choice" and len(value) > MAX_CHOICES:
            raise ServeError(f"guided_choice must hold at most {MAX_CHOICES} choices, got {len(value)}", param=name)
        try:
            if name == "response_format":
                return _response_format(value)
            if name == "structured_outputs":
                choice = value.get("choice")
                if isinstance(choice, list) and len(choice) > MAX_CHOICES:
                    raise ValueError(f"structured_outputs.choice must hold at most {MAX_CHOICES} choices, got "
                                     f"{len(choice)}")
                return StructuredOutputsParams(**value)
            return StructuredOutputsParams(**{name.removeprefix("guided_"): value})
        except TypeError as e:   # (an unknown field of structured_outputs)
            raise ServeError(f"{name}: {str(e).split('(', 1)[-1].rstrip(')')}", param=name) from None
        except ValueError as e:
            raise ServeError(str(e) if name == "structured_outputs" else f"{name}: {e}", param=name) from None

    def beam_params(self, max_tokens: int) -> BeamSearchParams | None:
        """vLLM's ``use_beam_search``: the request's :class:`~treedec.programs.beam.BeamSearchParams` (width ``n``,
        ``length_penalty``, ``early_stopping``, ``ignore_eos``; temperature 0), or None without it. What a beam
        search does not take is refused by name (400), streaming included (its best hypotheses are known when it
        ends)."""
        if not self.use_beam_search:
            for name in ("length_penalty", "early_stopping"):
                if getattr(self, name) is not None:
                    raise ServeError(f"{name} is a beam search's: it needs use_beam_search=true", param=name)
            return None
        if self.stream:
            raise ServeError("use_beam_search cannot be streamed: a beam search's best hypotheses are known when it "
                             "ends; send stream=false", param="stream")
        for name in _NOT_WITH_BEAMS:
            if name in self.model_fields_set and getattr(self, name, None) not in (None, False, [], {}, ""):
                raise ServeError(f"{name} is not supported with use_beam_search (a beam search scores the raw "
                                 f"log-probabilities and ends on EOS ids and max_tokens)", param=name)
        if self.temperature not in (None, 0):
            raise ServeError(f"use_beam_search takes temperature 0 only (transformers' beam search on the raw "
                             f"log-probabilities), got {self.temperature}", param="temperature")
        try:
            return BeamSearchParams(self.n, max_tokens, self.ignore_eos, 0.0,
                                    1.0 if self.length_penalty is None else self.length_penalty, False,
                                    False if self.early_stopping is None else self.early_stopping)
        except (ValueError, TypeError) as e:
            raise ServeError(str(e), param=_field_named(str(e), {"length_penalty": 0, "early_stopping": 0})
                             or "n") from None

    def _params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        given = {"n": self.n, "max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                 "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
                 "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                 "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
                 "include_stop_str_in_output": self.include_stop_str_in_output, "logprobs": logprobs,
                 "stop": (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
                 "stop_token_ids": tuple(self.stop_token_ids or ()), "logit_bias": self.logit_bias or None,
                 "min_tokens": self.min_tokens, "bad_words": tuple(self.bad_words or ()),
                 "allowed_token_ids": self.allowed_token_ids, "skip_special_tokens": self.skip_special_tokens,
                 "spaces_between_special_tokens": self.spaces_between_special_tokens,
                 "truncate_prompt_tokens": self.truncate_prompt_tokens, "prompt_logprobs": prompt_logprobs,
                 "structured_outputs": self.structured_outputs_params()}
        try:
            return SamplingParams(**{k: v for k, v in given.items() if v is not None})
        except (ValueError, TypeError) as e:
            raise ServeError(str(e), param=_field_named(str(e), given)) from None


#: The fields a beam search does not take (:meth:`_Sampling.beam_params` refuses them by name).
_NOT_WITH_BEAMS = ("top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "include_stop_str_in_output", "logit_bias",
                   "min_tokens", "bad_words", "allowed_token_ids", "prompt_logprobs", "logprobs", "top_logprobs",
                   "echo", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                   "guided_grammar")
#: The fields that give a structured-output constraint (at most one a request).
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def _response_format(value: dict) -> StructuredOutputsParams:
    """OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}}`` (``text`` is no constraint: left out before)."""
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("json_schema needs a json_schema object with its schema (json_schema.schema)")
        return StructuredOutputsParams(json=spec["schema"])
    raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r:.40}")


class CompletionRequest(_Sampling):
    """A ``/v1/completions`` body. ``prompt``: a text, a list of texts, token ids, or a list of token-id lists
    (each prompt its own request; its ``n`` choices are numbered ``prompt_index * n + j``)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise ServeError("prompt must be a non-empty text or token ids (or a non-empty list of them)",
                             param="prompt")
        return prompts

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise ServeError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ServeError(f"best_of must equal n (no best-of ranking), got best_of={self.best_of}, n={self.n}",
                             param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ServeError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")
        if self.logprobs is not None and self.stream:
            raise ServeError("logprobs are not supported with stream=true", param="logprobs")
        # (echo with logprobs reports the prompt's too: vLLM's prompt_logprobs = logprobs)
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None or not self.echo else self.logprobs
        return self._params(max_tokens, self.logprobs, prompt)


class ChatCompletionRequest(_Sampling):
    """A ``/v1/chat/completions`` body: ``messages`` through the tokenizer's chat template; ``max_tokens`` (or
    ``max_completion_tokens``) defaults to what the model's positions leave after the prompt."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None

    def conversation(self) -> list[dict[str, str]]:
        """The messages with text contents (a list of ``{"type": "text"}`` parts joined)."""
        return _conversation(self.messages)

    @property
    def budget_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def token_budget(self) -> int | None:
        value = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if value is not None and value < 1:
            raise ServeError(f"{self.budget_field} must be >= 1, got {value}", param=self.budget_field)
        return value

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        self._check_common()
        if self.tools or self.tool_choice not in (None, "none"):
            raise ServeError("tools are not supported", param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise ServeError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ServeError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                             param="top_logprobs")
        if self.logprobs and self.stream:
            raise ServeError("logprobs are not supported with stream=true", param="logprobs")
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs)


class TokenizeCompletionRequest(BaseModel):
    """A ``/tokenize`` body with a text (vLLM's ``TokenizeCompletionRequest``): ``prompt``, encoded with the
    tokenizer's special tokens unless ``add_special_tokens`` is false; ``return_token_strs``: each token's string
    too."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """A ``/tokenize`` body with chat ``messages`` (vLLM's ``TokenizeChatRequest``): rendered by the chat template
    (with the assistant's turn opened unless ``add_generation_prompt`` is false), encoded without special tokens
    unless ``add_special_tokens`` (the template writes its own)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def conversation(self) -> list[dict[str, str]]:
        return _conversation(self.messages)


class DetokenizeRequest(BaseModel):
    """A ``/detokenize`` body (vLLM's): ``tokens``, the ids to turn into text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


#: The ``/tokenize`` body: chat messages when it has ``messages``, else a text (the tags are left out of the field
#: names errors give: :data:`BODY_TAGS`).
TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("tokenize-text")],
                                  Annotated[TokenizeChatRequest, Tag("tokenize-chat")]],
                            Discriminator(lambda v: "tokenize-chat" if isinstance(v, dict) and "messages" in v
                                          else "tokenize-text")]
BODY_TAGS = frozenset({"tokenize-text", "tokenize-chat"})


def _conversation(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The messages with text contents (a list of ``{"type": "text"}`` parts joined)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ServeError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ServeError(f"messages[{i}] must have a string role and a text content", param="messages")
        out.append({**m, "content": content})
    return out


def _field_named(message: str, given: dict) -> str | None:
    """The field a SamplingParams error names (its message starts with it), for the error's ``param``."""
    head = message.split(" ", 1)[0].rstrip(":,").split("[", 1)[0]   # ("logit_bias[5] must be ...": logit_bias)
    return head if head in given else None

