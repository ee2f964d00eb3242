"""Pool pressure in the scheduler's loop (:mod:`treedec.runtime.scheduler`): what idle prefixes and the prefix cache
can give back, and what to do when every live program waits for pages (:class:`PoolRelief`, a part of
:class:`~treedec.runtime.scheduler_loop.SchedulerLoop`)."""
from __future__ import annotations

from treedec.errors import PoolExhaustedError

__all__ = ["PoolRelief"]


class PoolRelief:
    """The loop's pool relief: evicting idle shared prefixes and cached ones, preempting the newest program."""

    def _evictable(self, keep=None) -> int:
        """Pages that evicting the idle shared prefixes and cached ones (but ``keep``) would give back."""
        pool = self.engine.pool
        shared = sum(p.pages(pool) for p in self.groups if p.idle and p is not keep)
        return shared + (0 if self.cache is None else self.cache.evictable_pages(keep))

    def _evict_idle(self, pages: int, keep=None) -> None:
        """Prune idle shared prefixes, then evict the cached ones nothing reads, least recently used first (but
        ``keep``), until ``pages`` more pages are free, or none is left."""
        pool = self.engine.pool
        free = pool.num_free_pages
        for prefix in self.groups:
            if pool.num_free_pages - free >= pages:
                return
            if prefix.idle and prefix is not keep:
                prefix.evict(self.engine.tree)
        if self.cache is not None and pool.num_free_pages - free < pages:
            self.cache.evict(pages - (pool.num_free_pages - free), keep=keep)

    def _relieve(self) -> None:
        """Every live program waits for pages: take back idle prefixes' pages, else preempt the newest, or
        raise if that cannot help."""
        pool = self.engine.pool
        if any(lv.waiting.pages <= pool.num_free_pages for lv in self.live):
            return   # programs that retired after it asked freed enough: it goes on next iteration
        self._evict_idle(min(lv.waiting.pages for lv in self.live) - pool.num_free_pages)
        if any(lv.waiting.pages <= pool.num_free_pages for lv in self.live):
            return
        if not self.preempt or len(self.live) == 1:
            wait = max((lv.waiting for lv in self.live), key=lambda w: w.pages)
            need = wait.reason or (f"a program needs {wait.pages} free pages of {pool.page_size} tokens, "
                                   f"{pool.num_free_pages} of {pool.num_pages} are free")
            error = PoolExhaustedError(f"KV pool exhausted: {need}; nothing else can free pages: give the engine "
                                       f"more kv_tokens")
            if self.on_error is None or len(self.live) != 1:
                raise error
            self._fail(self.live[0], error)   # (online) it cannot run alone in the pool
            return
        victim = max(self.live, key=lambda lv: lv.order)
        self._close(victim)
        self.queue.appendleft(victim.index)
        self.stats.preemptions += 1
