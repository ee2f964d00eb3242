"""``treedec tot``'s tasks: a user's task class (``--task module:Class``) and a tasks file (``--tasks``).

A tasks file is JSONL, one search per line: a JSON object of the task class's constructor
arguments, and an optional ``"id"``; for the shipped Game of 24::

    {"id": "p1", "numbers": [4, 9, 10, 13]}
    {"numbers": [1, 1, 4, 6]}

A user task is any :class:`~treedec.search.tot_task.ToTTask` subclass importable as
``module:Class`` (the current directory is on the import path), e.g. ``--task mytasks:Crossword``.
A bad line raises :class:`~treedec.search.requests_file.RequestsFileError` naming the file and
the line, before anything runs.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from treedec.search.requests_file import RequestsFileError
from treedec.search.tot_task import ToTTask

DEFAULT_TASK = "treedec.search.game24:Game24Task"


def load_task_class(spec: str) -> type[ToTTask]:
    """The class named by ``module:Class``; ValueError saying what is wrong otherwise."""
    module_name, colon, class_name = spec.partition(":")
    if not colon or not module_name or not class_name:
        raise ValueError(f"--task must be module:Class (e.g. mytasks:Crossword), got {spec!r}")
    here = os.getcwd()   # a task module in the current directory, as `python -m` finds it
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--task {spec}: cannot import module {module_name!r}: {e}") from None
    finally:
        if added:
            sys.path.remove(here)
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, ToTTask):
        what = "has no" if cls is None else "is not a ToTTask subclass:"
        raise ValueError(f"--task {spec}: module {module_name!r} {what} {class_name!r}"
                         + ("" if cls is None else f" ({type(cls).__name__})"))
    return cls


def read_tasks(path: str | Path, cls: type[ToTTask], configure) -> list[tuple[str, ToTTask, dict]]:
    """``(id, task, arguments)`` for every line of the tasks file at ``path``; ``configure(task)`` applies
    the command line's settings to each task (and may raise ValueError)."""
    out, ids = [], set()
    lines = Path(path).read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            arguments = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestsFileError(path, number, f"not JSON: {e.msg}") from None
        if not isinstance(arguments, dict):
            raise RequestsFileError(path, number, f"a task is a JSON object of {cls.__name__}'s arguments, got "
                                                  f"{type(arguments).__name__}")
        task_id = str(arguments.pop("id", len(out)))
        if task_id in ids:
            raise RequestsFileError(path, number, f"task id {task_id!r} is used twice")
        ids.add(task_id)
        try:
            task = cls(**arguments)
            configure(task)
        except (TypeError, ValueError) as e:
            raise RequestsFileError(path, number, f"{cls.__name__}(**{json.dumps(arguments)}): {e}") from None
        out.append((task_id, task, arguments))
    if not out:
        raise RequestsFileError(path, None, "no tasks (one JSON object per line)")
    return out
