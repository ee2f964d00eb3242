"""``python -m treedec``: the ``treedec`` command line (:mod:`treedec.cli`).

``python -m`` puts the working directory first on ``sys.path``, and an empty entry of ``PYTHONPATH`` puts it
there too: a file of the working directory named as a module treedec uses (a ``fractions.py``, say) would then
be imported in its place. Those entries are removed here, before anything else is imported (the package's
``__init__`` imports nothing; the working directory is still where ``treedec tot --task`` looks, last).
"""
import os
import sys


def _outside_working_directory(path: list[str]) -> list[str]:
    """``path`` without its entries that name the working directory (``""``, ``"."``, its absolute path)."""
    cwd = os.path.realpath(os.getcwd())
    return [entry for entry in path if entry and os.path.realpath(entry) != cwd]


sys.path[:] = _outside_working_directory(sys.path)

from treedec.cli import main  # noqa: E402  (after the path is cleaned)

sys.exit(main())
