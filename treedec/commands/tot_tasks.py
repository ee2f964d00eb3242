"""``treedec tot``'s tasks: a user's task class (``--task module:Class``) and a tasks file (``--tasks``).

A tasks file is JSONL, one search per line: a JSON object of the task class's constructor
arguments, and an optional ``"id"``; for the shipped Game of 24::

    {"id": "p1", "numbers": [4, 9, 10, 13]}
    {"numbers": [1, 1, 4, 6]}

A user task is any :class:`~treedec.programs.tot.task.ToTTask` subclass importable as
``module:Class``, e.g. ``--task mytasks:Crossword``. Trust: importing the module runs its code,
with the user's rights, as ``python -c "import mytasks"`` would; give only modules you would run.
For a user's ``--task`` (never for the default, the Game of 24) the current directory is added
to the END of the import path while the module is imported, so a file there can add a task
module but never stands in for an installed one (a ``fractions.py`` there is not imported in
place of the standard library's). A module that fails at import (SyntaxError, ImportError, any
exception it raises, ``sys.exit``) raises ValueError naming the module and the exception.
A bad line raises :class:`~treedec.commands.requests_file.RequestsFileError` naming the file and
the line, before anything runs.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from pathlib import Path

from treedec.commands.requests_file import RequestsFileError
from treedec.programs.tot.task import ToTTask

DEFAULT_TASK = "treedec.programs.tot.game24:Game24Task"


def load_task_class(spec: str) -> type[ToTTask]:
    """The class named by ``module:Class``: a concrete ToTTask subclass; ValueError saying what is wrong otherwise.

    The module is imported, which runs its code (see the module docstring for the import path).
    """
    module_name, colon, class_name = spec.partition(":")
    if not colon or not module_name or not class_name:
        raise ValueError(f"--task must be module:Class (e.g. mytasks:Crossword), got {spec!r}")
    if module_name.startswith("."):
        raise ValueError(f"--task {spec}: {module_name!r} is a relative module name; give the module's full "
                         f"name (e.g. mytasks or package.mytasks)")
    module = _import_task_module(spec, module_name)
    cls = getattr(module, class_name, None)
    where = f"module {module_name!r} ({getattr(module, '__file__', None) or 'built in'})"
    if cls is None:
        raise ValueError(f"--task {spec}: {where} has no {class_name!r}")
    if not isinstance(cls, type) or not issubclass(cls, ToTTask):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"of type {type(cls).__name__}"
        raise ValueError(f"--task {spec}: {class_name!r} of {where} is not a ToTTask subclass (it is {what})")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"--task {spec}: {cls.__name__} is abstract (it does not define {missing}); name a "
                         f"subclass that defines them")
    return cls


def _import_task_module(spec: str, module_name: str):
    """Import the task's module: the default's as installed; a user's with the current directory
    appended to the import path for the import (see the module docstring)."""
    here = os.getcwd()
    widen = spec != DEFAULT_TASK and here not in sys.path
    if widen:
        sys.path.append(here)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            hint = (f" (give the module name without .py: --task {module_name[:-3]}:...)"
                    if module_name.endswith(".py") else
                    f"; put {module_name.split('.')[0]}.py in the current directory or a folder on PYTHONPATH")
            raise ValueError(f"--task {spec}: no module named {e.name!r}{hint}") from None
        raise ValueError(f"--task {spec}: module {module_name!r} failed at import: {type(e).__name__}: {e}") from None
    except SystemExit as e:   # the module called sys.exit(): the command reports it, it does not exit through it
        raise ValueError(f"--task {spec}: module {module_name!r} called sys.exit({e.code!r}) at import") from None
    except Exception as e:   # SyntaxError, ImportError, whatever its code raises: it is the user's module
        raise ValueError(f"--task {spec}: module {module_name!r} failed at import: {type(e).__name__}: {e}") from None
    finally:
        if widen:   # the entry appended (the last one, unless the module's code appended more)
            del sys.path[len(sys.path) - 1 - sys.path[::-1].index(here)]


def read_tasks(path: str | Path, cls: type[ToTTask], configure) -> list[tuple[str, ToTTask, dict]]:
    """``(id, task, arguments)`` for every line of the tasks file at ``path``; ``configure(task)`` applies
    the command line's settings to each task (and may raise ValueError)."""
    out, ids = [], set()
    lines = Path(path).read_bytes().splitlines()
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise RequestsFileError(path, number, f"not UTF-8 text (byte {e.start + 1}: {e.reason})") from None
        if not line.strip():
            continue
        try:
            arguments = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestsFileError(path, number, f"not JSON: {e.msg}") from None
        except RecursionError:
            raise RequestsFileError(path, number, "not JSON: nested too deeply") from None
        except ValueError as e:   # e.g. an integer of more digits than Python converts
            raise RequestsFileError(path, number, f"not JSON: {e}") from None
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
        except Exception as e:   # the task class's own checks (TypeError, ValueError; a user class's anything)
            detail = str(e) if isinstance(e, (TypeError, ValueError)) else f"{type(e).__name__}: {e}"
            raise RequestsFileError(path, number, f"{cls.__name__}(**{json.dumps(arguments)[:200]}): {detail}") \
                from None
        out.append((task_id, task, arguments))
    if not out:
        raise RequestsFileError(path, None, "no tasks (one JSON object per line)")
    return out
