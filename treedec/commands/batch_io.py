"""Prompts files in, per-request results files out, for the commands that run a batch.

:func:`read_prompts` reads a prompts file (:func:`~treedec.commands.requests_file.read_requests`)
and refuses, naming the file and line, a request whose text is not Unicode text (a lone
surrogate), before a model is loaded.

``treedec generate``, ``treedec spec --prompts`` and ``treedec tot --tasks`` run many requests
(searches) in one batch. Each finished request's result lines are appended to the results JSONL
file the moment it finishes, and flushed, so a run that fails (or is interrupted) later keeps
every result it finished; the lines come in the order the requests finish (each line's ``id``
says which request it is). The error of a failed run then says how many requests finished,
where their results are, and which requests did not finish (their id, and the prompts file's
line).
"""
from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path

from treedec.models.text import check_text, encode_prompt
from treedec.runtime.requests import RequestSpec
from treedec.commands.requests_file import RequestsFileError, read_requests

__all__ = ["ResultsWriter", "read_prompts", "request_kv_tokens", "request_name"]


def read_prompts(path: str | Path, defaults: Mapping[str, object] | None = None) -> list[RequestSpec]:
    """The requests of the prompts file at ``path`` (see :func:`~treedec.commands.requests_file.read_requests`),
    their text checked too: a prompt, a message (any of its keys and values) or a stop string that is
    not Unicode text raises :class:`~treedec.commands.requests_file.RequestsFileError` naming the line."""
    specs = read_requests(path, defaults)
    for spec in specs:
        for field, value in (("prompt", spec.prompt), ("messages", spec.messages), ("stop", spec.params.stop)):
            try:
                check_text(value, field)
            except ValueError as e:
                raise RequestsFileError(path, spec.line, f"request {spec.id!r}: {e}") from None
    return specs


def request_kv_tokens(specs: Sequence[RequestSpec], tokenizer, chat_template: bool, page_size: int,
                      extra: int = 0) -> list[int] | None:
    """The most KV tokens each request may take, for the size of a CPU pool
    (:func:`~treedec.engine.pool_sizing.cpu_pool_tokens`): its prompt's pages and each of its ``n`` outputs'
    (``max_tokens``), as the batch's own check counts them, and ``extra`` tokens (a speculative request's draft
    trees). None when a text prompt cannot be encoded here (no tokenizer: the batch says why)."""
    need = []
    for spec in specs:
        if spec.prompt_ids is not None:
            prompt = len(spec.prompt_ids)
        elif tokenizer is None:
            return None
        else:
            prompt = len(encode_prompt(tokenizer, spec.prompt if spec.prompt is not None else list(spec.messages),
                                       chat_template or spec.messages is not None))
        pages = -(-prompt // page_size) + spec.params.n * -(-spec.params.max_tokens // page_size)
        need.append(pages * page_size + extra)
    return need


def request_name(request_id, line: int | None = None) -> str:
    """How an error names a request: its id, and the line of the file it came from."""
    return f"{request_id!r}" + ("" if line is None else f" (line {line})")


class ResultsWriter:
    """Appends each finished request's results to a JSONL file, one JSON object a line, flushed.

    Use it as a context manager around the run, and call :meth:`write` from the batch's
    per-request done callback. The file is created (or emptied) when the first result comes:
    a run that fails before any request finishes leaves an existing file as it was. When the
    run raises, the exception gets a note (shown by ``treedec`` on its one error line) saying
    which requests finished, where their results are and which did not finish.

    Parameters
    ----------
    path : the results file.
    requests : every request's key (the key :meth:`write` is called with) -> its name in
        messages (:func:`request_name`), in request order.
    noun : what the messages call a request (plural: with an "s").
    """

    def __init__(self, path: str | Path, requests: Mapping[Hashable, str], noun: str = "request"):
        self.path, self.noun = Path(path), noun
        self._unfinished = dict(requests)
        self._total = len(self._unfinished)
        self._file = None
        self._failed = False

    def write(self, key: Hashable, records: Iterable[dict]) -> None:
        """Append one finished request's records (JSON objects) and flush them to the file.

        Text is written as UTF-8; a string that UTF-8 cannot encode (a lone surrogate) is written
        as its JSON escape, so no finished result is lost to it.
        """
        if key not in self._unfinished:
            raise ValueError(f"{self.noun} {key!r} is not one of this run's unfinished {self.noun}s")
        text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        try:
            if self._file is None:
                self._file = open(self.path, "w", encoding="utf-8", errors="backslashreplace")
            self._file.write(text)
            self._file.flush()
        except OSError as e:   # a full disk, a vanished folder: say which file, and stop the run
            self._failed = True
            raise OSError(e.errno, f"cannot write the results file {self.path}: {e.strerror or e}") from e
        del self._unfinished[key]

    @property
    def finished(self) -> int:
        """How many requests were written."""
        return self._total - len(self._unfinished)

    def failure_note(self) -> str:
        """What a failed run leaves: the finished requests' file, the requests that did not finish."""
        if self.finished == 0:
            return f"no {self.noun} finished; {self.path} was not written"
        names = list(self._unfinished.values())
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return (f"{self.finished} of {self._total} {self.noun}s finished, their results are in {self.path}; "
                f"not finished: {shown}")

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                if not self._failed:   # after a failed write, closing fails the same way: reported already
                    raise

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close()
        if error is not None and self._unfinished:
            # BaseException.add_note's list, kept by hand: add_note is Python 3.11+, treedec runs on 3.10
            error.__notes__ = [*getattr(error, "__notes__", ()), self.failure_note()]
