"""Bulk requests: a program hands the runtime a long-running request that a *table* advances every step with every
other request of that table, at a fixed number of array operations whatever their number (the lanes pattern of
:mod:`treedec.runtime.lanes`, for any kind of per-step work).

A program yields a :class:`Bulk` once and is resumed when its request ends, with what the table returns for it
(as a :class:`~treedec.runtime.decode.Decode` is resumed with its lanes' outputs). The scheduler's loop keeps one
table per :attr:`Bulk.table` class (made as ``table(engine)`` on first use) and calls it every iteration:
:meth:`BulkTable.place` puts its rows' tokens in the tree and says what the step is to compute and read for them
(a :class:`~treedec.runtime.program.StepRequest`), :meth:`BulkTable.after_step` takes the step's rows and the
values read, and returns the requests that ended. Python per request runs in the table only on events.
Pipelined speculative decoding is such a table
(:class:`~treedec.programs.speculative.verify_table.VerifyTable`, yielded as
:class:`~treedec.programs.speculative.verify_table.Verify`).
"""
from __future__ import annotations

from typing import Any, ClassVar

from treedec.runtime.program import StepRequest, StepRows

__all__ = ["Bulk", "BulkTable"]


class BulkTable:
    """The base of a table of bulk requests (one per scheduler loop and :class:`Bulk` kind); every member is
    called by the loop. ``owner``: the loop's handle of the program that yielded the request."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def size(self) -> int:
        """The requests in the table."""
        raise NotImplementedError(f"{type(self).__name__} must define size")

    def add(self, owner, request: Bulk) -> None:
        """Take ``request`` (yielded by ``owner``'s program, its tokens computed): it runs from the next step."""
        raise NotImplementedError(f"{type(self).__name__} must define add(owner, request)")

    def place(self, free_pages: int) -> list[StepRequest]:
        """Put the next step's tokens of as many requests as ``free_pages`` allow in the tree; what the step is to
        compute and read for them (a few requests, e.g. one per group of the table; none: nothing this step).
        Called once per iteration, after the programs' own tokens are placed."""
        raise NotImplementedError(f"{type(self).__name__} must define place(free_pages)")

    def after_step(self, rows: list[StepRows]) -> list[tuple[Any, Any]]:
        """After the step that computed :meth:`place`'s requests (``rows``: each one's rows and read values, in
        order): ``(owner, result)`` for each bulk request that ended (its program is resumed with it)."""
        raise NotImplementedError(f"{type(self).__name__} must define after_step(rows)")

    def blocked(self) -> dict:
        """``{owner: free pages its request needs}`` for the requests the last :meth:`place` left out for want of
        pages: a dict :meth:`place` does not change once returned (the loop compares the one before a place() with
        the one after)."""
        raise NotImplementedError(f"{type(self).__name__} must define blocked()")

    def drop(self, owner) -> None:
        """Forget ``owner``'s request (its program is closed and frees its nodes)."""
        raise NotImplementedError(f"{type(self).__name__} must define drop(owner)")

    def reset(self) -> None:
        """Forget every request (the run failed: the programs are closed and free their nodes)."""
        raise NotImplementedError(f"{type(self).__name__} must define reset()")


class Bulk:
    """The base of what a program yields to run a request in a :class:`BulkTable` (a subclass names its
    table class as :attr:`table`)."""

    table: ClassVar[type[BulkTable]]
