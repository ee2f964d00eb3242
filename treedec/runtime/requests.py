"""A request and its results, the types every program, the scheduler, the server and the prompts files share:
:class:`RequestSpec` (a prompt and its :class:`~treedec.sampling.params.SamplingParams`) and :class:`RequestResult`
(one output of one request)."""
from __future__ import annotations

from dataclasses import dataclass, field

from treedec.checks import describe, is_int, positive_int
from treedec.models.text import check_messages
from treedec.sampling.params import SamplingParams
from treedec.sampling.stops import token_id_list

__all__ = ["PROMPT_KEYS", "RequestResult", "RequestSpec"]

#: The keys a request gives its prompt by; each request has exactly one of them.
PROMPT_KEYS = ("prompt", "messages", "prompt_ids")


@dataclass(frozen=True)
class RequestSpec:
    """One request: its prompt and its :class:`~treedec.sampling.params.SamplingParams`. Checked on
    construction (a ValueError names the field, the expected and the given value).

    Attributes
    ----------
    id : an int or a non-empty string naming the request in the results (a prompts file's
        default: the line number).
    prompt : a non-empty text; or
    messages : chat messages (see :func:`~treedec.models.text.check_messages`), as a tuple of
        dicts, for the checkpoint's chat template; or
    prompt_ids : token ids (ints >= 0; the program checks them against its vocabulary).
        Exactly one of the three is given.
    params : how its outputs are drawn and when they end (vLLM's defaults: ``max_tokens`` 16,
        ``temperature`` 1.0, ``n`` 1, ...).
    line : the prompts file's line it came from (None when built in code).
    """

    id: int | str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None
    params: SamplingParams = SamplingParams()
    line: int | None = None

    def __post_init__(self):
        if not (is_int(self.id) or isinstance(self.id, str) and self.id):
            raise ValueError(f"id must be an int or a non-empty string, got {describe(self.id)}")
        if is_int(self.id):
            object.__setattr__(self, "id", int(self.id))
        given = [key for key in PROMPT_KEYS if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(f"a request needs exactly one of {', '.join(PROMPT_KEYS)}, got "
                             f"{' and '.join(given) if given else 'none of them'}")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise ValueError(f"prompt must be a non-empty string, got {describe(self.prompt)}")
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(check_messages(self.messages, "messages")))
        if self.prompt_ids is not None:
            ids = token_id_list(self.prompt_ids, "prompt_ids")
            if not ids:
                raise ValueError("prompt_ids must hold at least one token id, got []")
            object.__setattr__(self, "prompt_ids", tuple(ids))
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {describe(self.params)}")
        if self.line is not None:
            positive_int("line", self.line)

    @property
    def name(self) -> str:
        """How errors name the request: ``request 'b'``, with ``(line 3)`` when it came from a file."""
        return f"request {self.id!r}" + ("" if self.line is None else f" (line {self.line})")


@dataclass
class RequestResult:
    """One output of one request: a line of a results file.

    Attributes
    ----------
    id : the request's id.
    index : which of the request's ``n`` outputs (0 for the first).
    prompt : the request's text or chat messages; None for a ``prompt_ids`` request.
    prompt_ids : the prompt's token ids (after the chat template).
    output_ids : the output's token ids (an EOS that ended it included).
    text : the output's text (cut at a stop string); None without a tokenizer.
    stop_reason : ``"eos"``, ``"stop_string"`` or ``"length"``.
    stats : the program's counters for this request (steps, accepted lengths, seconds, ...).
    logprobs : with ``SamplingParams.logprobs``: one dict per output token, token id ->
        :class:`~treedec.sampling.logits.Logprob` (log-probability under the raw logits, rank), holding the
        chosen token and the ``logprobs`` most likely ones; else None.
    prompt_logprobs : with ``SamplingParams.prompt_logprobs``: the same for the prompt's tokens (None for the
        first); else None.
    cumulative_logprob : the sum of the output tokens' log-probabilities (with ``logprobs``), else None.
    """

    id: int | str
    index: int
    prompt: str | list[dict] | None
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    stop_reason: str
    stats: dict = field(default_factory=dict)
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None
    cumulative_logprob: float | None = None
