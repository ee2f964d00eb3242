"""Text in and out of a checkpoint: its tokenizer, its chat template, streaming detokenization.

:func:`load_tokenizer` reads a local folder, or the checkpoint folder a model argument resolves to
(:func:`~treedec.models.catalog.resolve_model`). Token-id APIs stay: every program takes token ids;
this module turns text (or chat messages) into prompt ids and output ids back into text.

:class:`IncrementalDetokenizer` streams output text the way vLLM does: each new token's
text is the decoding of a short window of recent tokens less the decoding of the window's
head (the *prefix* and *read* offsets), so tokenizers whose tokens decode differently at the
start of a text (SentencePiece's leading space) stream the same text as a one-shot decode,
and a multi-byte character split over several tokens is emitted whole, once its last byte
has arrived: the stream never shows a U+FFFD that the one-shot decode would not.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from treedec.checks import describe, is_int
from treedec.errors import CheckpointError
from treedec.models.catalog import ResolvedModel, resolve_model
from treedec.tree.validate import int_list

__all__ = ["TOKENIZER_FILES", "ChatTemplateError", "IncrementalDetokenizer", "check_messages", "check_text",
           "encode_prompt", "load_tokenizer"]

#: Files of which a checkpoint folder holds at least one when it has a tokenizer that
#: transformers can load (besides ``*.tiktoken`` vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")
_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode shows for bytes that are not (yet) a whole character
# Tokens before the first output token that the first window holds: enough context for a
# tokenizer to decode the first output token as it decodes it inside the whole text (vLLM's value).
_CONTEXT_TOKENS = 5
_FINISHED = "this IncrementalDetokenizer is finished; start a new one for another output"


class ChatTemplateError(ValueError):
    """A chat template that failed on the messages (its own error, e.g. ``raise_exception``), or ran past the budget
    it was rendered within (time, memory, size: :class:`treedec.serve.templates.ChatTemplateRenderer`). The message
    names the chat template."""


def has_tokenizer(model: str | Path | ResolvedModel) -> bool:
    """Whether the checkpoint folder of ``model`` (a folder, or a model argument of
    :func:`~treedec.models.catalog.resolve_model`) holds tokenizer files (one of :data:`TOKENIZER_FILES` or a
    ``*.tiktoken``)."""
    root = _tokenizer_folder(model)
    return any((root / name).is_file() for name in TOKENIZER_FILES) or any(root.glob("*.tiktoken"))


def load_tokenizer(model: str | Path | ResolvedModel):
    """The tokenizer of a checkpoint: ``AutoTokenizer.from_pretrained(folder, local_files_only=True)``.

    Parameters
    ----------
    model : a local folder with tokenizer files (read in place; it needs no ``config.json``), or a
        model argument of :func:`~treedec.models.catalog.resolve_model` (a known name, a ``.gguf`` file,
        a hub repo id in the local cache) or what it returned.

    Returns
    -------
    A transformers tokenizer (a ``PreTrainedTokenizerBase``), with the checkpoint's chat
    template when it has one.

    Raises
    ------
    FileNotFoundError
        ``model`` names nothing (treedec never downloads from the hub: the message lists the forms).
    CheckpointError
        (a ValueError) The folder has none of :data:`TOKENIZER_FILES` (nor a ``*.tiktoken``
        file), or transformers cannot build a tokenizer from what it has (the message names
        the folder and transformers' reason).
    """
    root = _tokenizer_folder(model)
    if not has_tokenizer(root):
        raise CheckpointError(f"{root} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the model's "
                              f"tokenizer files into it, or give prompts as token ids")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    # The tokenizers library raises a bare Exception for a tokenizer.json it cannot read, and
    # transformers raises OSError / ValueError / TypeError / KeyError / ImportError by case.
    except Exception as e:
        raise CheckpointError(f"{root}: cannot load its tokenizer ({type(e).__name__}: {str(e)[:300]})") from e


def _tokenizer_folder(model: str | Path | ResolvedModel) -> Path:
    """The folder :func:`load_tokenizer` reads: ``model`` itself when it is a folder, else its resolved checkpoint."""
    if not isinstance(model, ResolvedModel) and str(model) and Path(model).is_dir():   # ("" is no folder)
        return Path(model)
    return resolve_model(model).checkpoint


def encode_prompt(tokenizer, prompt: str | Sequence[Mapping[str, str]], chat_template: bool,
                  render: Callable[[list[dict], bool], str] | None = None, *, add_special_tokens: bool | None = None,
                  add_generation_prompt: bool = True) -> list[int]:
    """The token ids of a prompt, as a plain text or through the tokenizer's chat template.

    Parameters
    ----------
    tokenizer : a transformers tokenizer (:func:`load_tokenizer`); for plain text also any
        object with ``encode(text) -> list[int]``, such as
        :class:`~treedec.programs.tot.program.ByteTokenizer`.
    prompt : a text, or chat messages: a non-empty list of mappings, each with a string
        ``"role"`` and a string ``"content"`` (other keys go to the template as they are).
    chat_template : False: ``prompt`` must be a text, encoded with the tokenizer's special
        tokens (the BOS its checkpoint puts before a text). True: the messages (a text is
        one ``{"role": "user"}`` message) are rendered by the tokenizer's chat template with
        ``add_generation_prompt=True`` and the rendered text is encoded without adding
        special tokens (the template writes its own BOS), as transformers'
        ``apply_chat_template(..., tokenize=True)`` does.
    render : how the checked messages become the rendered text, called as ``render(messages,
        add_generation_prompt)``: default ``tokenizer.apply_chat_template(messages, add_generation_prompt=...,
        tokenize=False)`` in this thread; a server passes one that renders in a bounded worker
        (:class:`treedec.serve.templates.ChatTemplateRenderer`).
    add_special_tokens : encode with the tokenizer's special tokens (its BOS); default True for a text, False for
        a chat template's rendering (as above). A tokenizer whose ``encode`` takes no such argument is called
        without it when this is None.
    add_generation_prompt : the chat template ends with the assistant's turn opened (default True; vLLM's
        ``/tokenize`` takes False to count a conversation's tokens as they are).

    Returns
    -------
    [n] token ids, n >= 1.

    Raises
    ------
    TypeError
        ``chat_template`` is not a bool; with ``chat_template=False``, a prompt that is
        neither a text nor chat messages.
    ValueError
        Messages with ``chat_template=False``; malformed messages (see :func:`check_messages`);
        a text that is not Unicode text (a lone surrogate, see :func:`check_text`); a tokenizer
        without a chat template; a prompt that encodes to no tokens.
    ChatTemplateError
        (a ValueError) The template refused the messages (its own message), or ``render`` stopped it.
    """
    if not isinstance(chat_template, bool):
        raise TypeError(f"chat_template must be a bool, got {describe(chat_template)}")
    if not chat_template:
        if not isinstance(prompt, str):
            if _is_message_list(prompt):
                raise ValueError("prompt is a list of chat messages: they need chat_template=True")
            raise TypeError(f"prompt must be a text (or chat messages with chat_template=True), got {describe(prompt)}")
        check_text(prompt, "prompt")
        ids = list(tokenizer.encode(prompt) if add_special_tokens is None else
                   tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    else:
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = check_messages(prompt, "prompt")
            check_text(messages, "prompt")
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(f"the tokenizer of {name} has no chat template; encode the prompt as plain text "
                             f"(chat_template=False) or use a checkpoint with one (an instruct / chat model)")
        try:
            text = render(messages, add_generation_prompt) if render is not None else \
                tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2's TemplateError (e.g. raise_exception in the template) and its kin
            raise ChatTemplateError(f"the chat template refused the messages ({type(e).__name__}: "
                                    f"{str(e)[:300]})") from e
        check_text(text, "the chat template's rendering of the prompt")
        ids = list(tokenizer.encode(text, add_special_tokens=bool(add_special_tokens)))
    if not ids:
        raise ValueError(f"prompt {prompt!r:.80} encodes to no tokens; a request needs at least one prompt token")
    return ids


def check_text(value, name: str) -> None:
    """Raise ValueError naming ``name`` if a string in ``value`` is not Unicode text.

    ``value`` is a string, or lists / tuples / mappings holding strings (chat messages, a
    request's stop strings) at any depth. A string is text when UTF-8 can encode it: a lone
    surrogate (``"\\ud800"`` from a JSON escape, or a byte that was not UTF-8 in a command
    line argument, which Python keeps as ``"\\udcff"``) is not, and tokenizers refuse it with
    a TypeError that names nothing. Other values are left alone.
    """
    stack = [(value, name)]
    while stack:   # a loop, not recursion: JSON can nest deeper than Python's stack
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{where} is not text: a lone surrogate (U+{ord(item[e.start]):04X}) at character "
                                 f"{e.start}, which UTF-8 cannot encode (an unpaired \\ud800-\\udfff JSON escape, "
                                 f"or bytes that were not UTF-8); fix the input's encoding") from None
        elif isinstance(item, Mapping):
            for k, v in reversed(list(item.items())):
                stack += [(v, f"{where}[{k!r}]"), (k, f"a key of {where}")]
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))


def check_messages(messages, name: str = "messages") -> list[dict]:
    """Chat messages as a new list of dicts, after checking them; ValueError naming ``name`` otherwise.

    ``messages`` must be a non-empty list (or tuple) of mappings, each with a string ``"role"``
    and a string ``"content"``; other keys are kept (a template may read them).
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{name} must be a list of chat messages ({{'role': ..., 'content': ...}}), got "
                         f"{describe(messages)}")
    if not messages:
        raise ValueError(f"{name} is an empty list of chat messages; give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"{name}[{i}] must be a chat message ({{'role': ..., 'content': ...}}), got "
                             f"{describe(message)}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"{name}[{i}][{key!r}] must be a string, got "
                                 f"{describe(message[key]) if key in message else 'nothing'}")
        out.append(dict(message))
    return out


class IncrementalDetokenizer:
    """Output token ids to text, a few tokens at a time, never showing half a character.

    Feed each new token (or several) to :meth:`feed`; it returns the text they add. A token
    that ends inside a multi-byte UTF-8 character adds the text up to that character; the
    character comes with the token that completes it. :meth:`finish` adds what is still held
    back (the lossy decoding of trailing bytes that never became a character). The text
    streamed then equals ``tokenizer.decode(prompt_ids + output_ids)`` less the prompt's
    text, for byte-level BPE and SentencePiece (byte-fallback) tokenizers. Two exceptions,
    both from how a one-shot decode rewrites text after the fact: a tokenizer that cleans up
    spaces around punctuation (``clean_up_tokenization_spaces``) cleans each window, which
    may differ from cleaning the whole text; and a byte-fallback decoder shows a run of
    ``<0x..>`` tokens that is not valid UTF-8 as one U+FFFD per byte, while the stream has
    already shown the characters that were whole (output of valid text is never affected).

    Feeding several ids at once is the same as feeding them one by one (the text after each
    token is what :class:`~treedec.sampling.stops.StopChecker` looks for stop strings in).

    Parameters
    ----------
    tokenizer : a transformers tokenizer, or any object with ``decode(ids) -> str`` (such as
        :class:`~treedec.programs.tot.program.ByteTokenizer`). Ids are checked against ``len(tokenizer)``
        where it has a length.
    prompt_ids : the request's prompt; its last tokens are the context the first output
        token is decoded in (so a leading space comes out as in the whole text). Its text is
        not part of the output.
    skip_special_tokens : drop special tokens (BOS, EOS, ...) from the text, as
        ``decode(..., skip_special_tokens=True)``: the default, as in vLLM. Only a tokenizer
        that has special tokens (an ``all_special_ids`` attribute, as transformers' have) is
        asked to skip them; other decoders are called as ``decode(ids)``.
    spaces_between_special_tokens : vLLM's option of the same name, as its detokenizer of fast tokenizers
        applies it: True (the default) streams what the tokenizer decodes; False (with
        ``skip_special_tokens=False``) gives an added token that follows another added token as its raw
        content, without whatever the tokenizer's decoder puts before it (a WordPiece decoder's space).
        Byte-level and SentencePiece decoders put nothing between added tokens, so it changes their text in
        no way; a tokenizer without added tokens (no ``added_tokens_decoder``) is not affected.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must have a decode(ids) method, got {describe(tokenizer)}")
        for name, flag in (("skip_special_tokens", skip_special_tokens),
                           ("spaces_between_special_tokens", spaces_between_special_tokens)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {describe(flag)}")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens and hasattr(tokenizer, "all_special_ids")
        self._special_ids = frozenset(tokenizer.all_special_ids) if self._skip_special else frozenset()
        # Added token id -> its content, where an added token after another is emitted raw (see above).
        self._raw_added: dict[int, str] = {}
        added = getattr(tokenizer, "added_tokens_decoder", None)   # (transformers': id -> AddedToken)
        if not (skip_special_tokens or spaces_between_special_tokens) and isinstance(added, Mapping):
            self._raw_added = {int(i): getattr(t, "content", str(t)) for i, t in added.items()}
        self._vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
        self._ids = self._checked(prompt_ids, "prompt_ids")
        self._num_prompt = len(self._ids)
        # The window: text is emitted as decode(ids[prefix:]) less decode(ids[prefix:read]) less
        # the `held` characters already emitted from a token whose last character was incomplete.
        # (decode(ids) as this detokenizer asks it: called per fed token)
        self._decode_ids = functools.partial(tokenizer.decode, skip_special_tokens=True) if self._skip_special \
            else tokenizer.decode
        self._read = self._num_prompt
        self._prefix, prefix_text = self._context_window()
        self._prefix_length = len(prefix_text)
        self._held = 0
        self._parts: list[str] = []
        self._length = 0   # characters in _parts
        self._finished = False

    def copies(self, count: int) -> list[IncrementalDetokenizer]:
        """``count`` fresh detokenizers of this one's tokenizer, options and prompt (this one must be fresh: nothing
        fed), made without checking them again: the other outputs of one request."""
        if len(self._ids) != self._num_prompt or self._finished:
            raise ValueError("copies are made of a fresh IncrementalDetokenizer (no output ids fed, not finished)")
        made = []
        for _ in range(count):
            copy = object.__new__(IncrementalDetokenizer)
            copy.__dict__.update(self.__dict__, _ids=list(self._ids), _parts=[])   # (its own lists)
            made.append(copy)
        return made

    @property
    def text(self) -> str:
        """All the text emitted so far (the concatenation of the deltas)."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def text_length(self) -> int:
        """``len(text)``, without joining the deltas."""
        return self._length

    def text_from(self, start: int) -> str:
        """``text[start:]``, joining only the deltas past ``start``: O(the characters returned + the deltas they
        span), so a stream that asks for its next characters never copies the whole text."""
        if start >= self._length:
            return ""
        parts, covered, k = self._parts, 0, len(self._parts)
        while k and covered < self._length - start:
            k -= 1
            covered += len(parts[k])
        tail = "".join(parts[k:]) if len(parts) - k > 1 else parts[k]
        return tail[len(tail) - (self._length - start):]

    @property
    def vocab_size(self) -> int | None:
        """``len(tokenizer)``: ids fed must be below it; None for a tokenizer without a length."""
        return self._vocab_size

    @property
    def output_ids(self) -> list[int]:
        """The ids fed so far (the prompt not included); a copy."""
        return self._ids[self._num_prompt:]

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` was called (no more ids can be fed)."""
        return self._finished

    def may_write(self, token: int, chars: frozenset[str]) -> bool:
        """Whether feeding ``token`` may add one of ``chars`` to the text, whatever was fed before it (the tokens at
        which a stop string ending in one of ``chars`` may be completed; :mod:`treedec.runtime.lane_text`).

        True when the token's own text (``decode([token])``) holds one of ``chars`` or is empty (a text that depends
        on its neighbours), when it holds U+FFFD and a character of ``chars`` is not ASCII (bytes of a character that
        its neighbours complete: always a multi-byte one), when it is a special token this detokenizer skips or an
        added token it may write raw, and for every token when ``chars`` holds a space or U+FFFD (decoders put
        spaces between tokens: SentencePiece's and WordPiece's word starts, BPE's word ends, the spaces between
        special tokens; a broken byte run shows as U+FFFD). Byte-level BPE, SentencePiece, WordPiece and character
        tokenizers write no other character that the token's own text does not hold.
        """
        if " " in chars or _REPLACEMENT in chars or token in self._raw_added:
            return True
        if self._skip_special and token in self._special_ids:
            return True
        text = self._decode([token])
        return not text or any(c in text for c in chars) or (_REPLACEMENT in text and not all(map(str.isascii, chars)))

    def feed(self, token_ids: int | Sequence[int]) -> str:
        """Add one output token id or several; return the text they add (maybe '').

        Raises TypeError / ValueError for ids that are not token ids of the tokenizer (nothing
        is fed then), RuntimeError after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError(_FINISHED)
        ids = [int(token_ids)] if is_int(token_ids) else token_ids
        return self.feed_checked(self._checked(ids, "token_ids"))

    def feed_checked(self, token_ids: list[int], ends: list[int] | None = None) -> str:
        """:meth:`feed` of ids its caller has checked (ints in ``[0, vocab_size)``, as
        :meth:`~treedec.sampling.stops.StopChecker.accept` checks them): the text they add. ``ends``, a list of
        ``len(token_ids)`` items, gets the length of :attr:`text` after each token. RuntimeError after
        :meth:`finish`."""
        if self._finished:
            raise RuntimeError(_FINISHED)
        ids, decode, raw = self._ids, self._decode_ids, self._raw_added
        prefix, read, prefix_length, held = self._prefix, self._read, self._prefix_length, self._held
        parts, length, first, count = self._parts, self._length, len(self._parts), len(self._ids)
        ids += token_ids
        try:   # (one token at a time, the state in locals: the loop runs per token at a lane's events)
            for i, token in enumerate(token_ids):
                count += 1
                window = decode(ids[prefix:count])
                start = prefix_length + held
                if window[-1:] == _REPLACEMENT:
                    # The last token ends inside a character: emit the whole characters before it now,
                    # keep the window (its bytes are completed by a later token).
                    delta = window.rstrip(_REPLACEMENT)[start:]
                    size = len(delta)
                    held += size
                else:
                    delta = window[start:]
                    size = len(window)
                    if size > prefix_length:   # a token that decodes to nothing does not move the window
                        prefix, read, held = read, count, 0
                        prefix_length = len(decode(ids[prefix:read]))
                    size = size - start if size > start else 0
                    if raw and token in raw and count > self._num_prompt + 1 and ids[count - 2] in raw:
                        delta = raw[token]   # an added token after another: its content, nothing before it
                        size = len(delta)
                if size:
                    parts.append(delta)
                    length += size
                if ends is not None:
                    ends[i] = length
        finally:   # (a decode that raised leaves the tokens before it fed, and its own id appended, as one by one)
            del ids[count:]
            self._prefix, self._read, self._prefix_length, self._held = prefix, read, prefix_length, held
            self._length = length
        new = len(parts) - first
        return "" if not new else parts[first] if new == 1 else "".join(parts[first:])

    def finish(self) -> str:
        """End the output: return the text still held back (trailing bytes that are not a whole
        character, decoded lossily, as a one-shot decode shows them); '' when none."""
        if self._finished:
            return ""
        self._finished = True
        window = self._decode(self._ids[self._prefix:])
        delta = window[self._prefix_length + self._held:]
        if delta:
            self._parts.append(delta)
            self._length += len(delta)
        return delta

    # ------------------------------------------------------------ private

    def _context_window(self) -> tuple[int, str]:
        """(start, text) of the prompt tokens the first window holds: the last few, started
        at a character boundary. A window that starts inside a character does not decode to
        the text's tail: byte fallback turns the whole broken byte run into U+FFFD, so no
        output byte that joins the run would ever decode."""
        start = max(self._num_prompt - _CONTEXT_TOKENS, 0)
        text = self._decode(self._ids[start:self._read])
        for _ in range(3):  # a character is at most 4 bytes: 3 steps back reach its first
            if start == 0 or _REPLACEMENT not in text:
                break
            start -= 1
            text = self._decode(self._ids[start:self._read])
        return start, text

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""

    def _checked(self, ids, name: str) -> list[int]:
        high = self._vocab_size - 1 if self._vocab_size is not None else 2**63 - 1
        return int_list(ids, name, low=0, high=high)


def _is_message_list(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) for m in value)
