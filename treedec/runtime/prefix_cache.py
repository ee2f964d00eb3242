"""The prefix cache across requests: prompts and conversations kept in the KV pool after their requests end.

A finished request's prompt (once computed) and each of its outputs' whole token sequences (the
conversation: a chat's next turn re-sends it) stay in the pool as *cached prefixes*: whole pages, held
by the cache (one reference each), in no tree of the forest, so they cost an engine step nothing.
When a program is admitted, its prompt is matched radix-style against them, page by page
(:meth:`PrefixCache.match`: the longest run of whole pages that some cached sequence starts with,
short of the prompt's last token); the match becomes the program's prefix exactly as a prefix shared
within one call does (:mod:`treedec.runtime.prefixes`): a root node of the forest that reads the
cached pages (:meth:`~treedec.tree.SequenceTree.add_shared_root`), the program's own prompt a child
of it, computed from the first token past the match. Requests matching one cached prefix at one time
read one node: its pages are read from memory once per step for all of them.

Pages are matched by token ids only: a cached page holds the K/V of exactly those tokens at exactly
those positions (it starts at the sequence's start), so a request reading it computes what it would
compute alone, within the attention kernels' reduction order (tokens are equal; float scores may
differ in the last bits, as with any change of batch).

A sequence is offered (:meth:`PrefixCache.offer`) with the slots that hold it. Pages that are whole
and in order are shared with the offering request (one more reference: no copy); from the first page
that is not (an output's node starts on a page of its own after the prompt's partial last page) its
K/V is copied into fresh pages, while the pool has pages free (else the rest is not cached); pages of
the sequence already cached are not stored twice. Cached prefixes no program reads are evicted least
recently used first when the scheduler needs pages (:meth:`PrefixCache.evict`), before any program
waits or is preempted for them; a shorter one that a longer one covers is dropped once nothing
reads it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from treedec.checks import nonnegative_int, positive_int
from treedec.tree import PagedKVPool, SequenceTree

__all__ = ["CacheStats", "CachedPrefix", "PrefixCache"]


@dataclass(eq=False)
class CachedPrefix:
    """One cached token sequence (whole pages), the prefix of the programs admitted on it.

    Attributes
    ----------
    tokens : its token ids (a multiple of the page size).
    slots : the pool slots holding their K/V (whole pages, in order).
    live : running programs reading it.
    node : its root node in the forest while ``live`` (made by the first, pruned after the last).
    """

    tokens: list[int]
    slots: np.ndarray
    page_ids: np.ndarray = field(repr=False)
    cache: "PrefixCache" = field(repr=False)
    end: "_Trie" = field(repr=False)     # the trie node it ends at
    live: int = 0
    node: int | None = None
    used: int = 0                        # the cache's clock at its last use (least recently used: smallest)

    @property
    def idle(self) -> bool:
        """No running program reads it: it may be evicted."""
        return self.live == 0

    def admission_pages(self, pool: PagedKVPool) -> int:
        """Pages admitting a program on it takes for the prefix itself: none (its pages are held)."""
        return 0

    def acquire(self, engine) -> None:
        """A program starts on it: its root node is made unless held."""
        if self.node is None:
            self.node = engine.tree.add_shared_root(self.tokens, self.slots)
        self.live += 1

    def leave(self, tree: SequenceTree, retired: bool) -> None:
        """A program reading it ended or was preempted (either way it no longer reads it): after the last one
        its node is pruned (the cache keeps the pages)."""
        assert self.live > 0, f"{self.live=}"
        self.live -= 1
        if self.live == 0:
            if self.node is not None and self.node in tree:
                tree.prune(self.node)
            self.node = None
            self.cache.released(self)


@dataclass
class CacheStats:
    """Counters of a :class:`PrefixCache`.

    Attributes
    ----------
    offered_tokens : tokens of the sequences offered.
    stored_tokens : tokens stored (whole pages not cached before).
    copied_tokens : of those, tokens whose K/V was copied into fresh pages.
    evicted_pages : pages returned to the pool by evictions.
    """

    offered_tokens: int = 0
    stored_tokens: int = 0
    copied_tokens: int = 0
    evicted_pages: int = 0


class _Trie:
    """A node of the page trie: one page of tokens further than its parent."""

    __slots__ = ("parent", "key", "children", "through", "ending", "depth")

    def __init__(self, parent: "_Trie | None", key: tuple, depth: int):
        self.parent, self.key, self.depth = parent, key, depth
        self.children: dict[tuple, _Trie] = {}
        self.through: set[CachedPrefix] = set()   # cached prefixes that reach this page (or go past it)
        self.ending: CachedPrefix | None = None   # the one that ends here

    @property
    def path(self) -> list["_Trie"]:
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


class PrefixCache:
    """Cached prefixes of a pool's K/V, matched page by page (see the module docstring).

    Parameters
    ----------
    tree : the engine's tree (its pool holds the pages).
    max_pages : the most pages it keeps (None: as many as the scheduler leaves it; it evicts when
        programs need pages); past it, the least recently used idle prefixes are evicted as it stores.
    copy_reserve : free pages an offer leaves free when it copies K/V into fresh pages (default an eighth of
        the pool: the running programs' next steps take free pages, and a copy the scheduler must evict at
        once is wasted).
    """

    def __init__(self, tree: SequenceTree, max_pages: int | None = None, copy_reserve: int | None = None):
        if not isinstance(tree, SequenceTree):
            raise TypeError(f"tree must be a SequenceTree, got {type(tree).__name__}")
        if max_pages is not None:
            positive_int("max_pages", max_pages)
        copy_reserve = tree.pool.num_pages // 8 if copy_reserve is None else copy_reserve
        nonnegative_int("copy_reserve", copy_reserve)
        self.tree, self.pool, self.max_pages, self.copy_reserve = tree, tree.pool, max_pages, copy_reserve
        self.page_size = tree.pool.page_size
        self.stats = CacheStats()
        self._root = _Trie(None, (), 0)
        self._entries: set[CachedPrefix] = set()
        self._held = np.zeros(self.pool.num_pages, dtype=np.int64)   # the cache's references per page
        self._clock = itertools.count(1)

    # ------------------------------------------------------------------ reading

    @property
    def num_prefixes(self) -> int:
        return len(self._entries)

    @property
    def num_pages(self) -> int:
        """Distinct pages it holds."""
        return int((self._held > 0).sum())

    def held(self) -> np.ndarray:
        """Its references per page (``[num_pages]`` int64, a copy): :meth:`SequenceTree.check_invariants`'s ``held``."""
        return self._held.copy()

    def covers(self, tokens: list[int]) -> bool:
        """Whether every whole page of ``tokens`` is cached (changes nothing)."""
        return self._walk(tokens, len(tokens) // self.page_size).depth == len(tokens) // self.page_size

    def match(self, prompt: list[int]) -> CachedPrefix | None:
        """The cached prefix to admit ``prompt`` on: the longest run of its whole pages, short of its last token,
        that a cached sequence starts with (None: not even one page). A match ending inside a longer cached
        sequence becomes a cached prefix of its own, sharing those pages (no copy). Marks it used."""
        ps = self.page_size
        node = self._walk(prompt, (len(prompt) - 1) // ps)
        if node is self._root:
            return None
        entry = node.ending
        if entry is None:
            source = next(iter(node.through))
            entry = self._store(list(prompt[:node.depth * ps]), source.slots[:node.depth * ps], node.path)
        entry.used = next(self._clock)
        return entry

    # ------------------------------------------------------------------ storing

    def offer(self, node: int, length: int | None = None) -> int:
        """Cache the first ``length`` (default all computed) tokens of ``node``'s sequence, as whole pages: those
        cached already are kept, the rest shared with the node's pages where they are whole and in order, else
        copied into fresh pages while the pool has them free. Returns the tokens stored (not cached before)."""
        tree, ps = self.tree, self.page_size
        computed = min(tree.computed_length(node), tree.held_prefix(node))   # (none past a released page)
        length = computed if length is None else min(length, computed)
        pages = length // ps
        if pages == 0:
            return 0
        path = tree.path(node)
        tokens = [t for n in path for t in tree.tokens(n)][:pages * ps]
        slots = np.concatenate([tree.slots(n) for n in path])[:pages * ps]
        self.stats.offered_tokens += pages * ps
        trie = self._walk(tokens, pages)   # what is cached already
        known = trie.depth
        own = slots[known * ps:]
        whole = self.pool.whole_pages(own)
        fresh = max(0, min(pages - known - whole, self.pool.num_free_pages - self.copy_reserve))
        if whole + fresh == 0:   # all of it is cached, or nothing past that can be stored (no page to copy into)
            if known:
                (trie.ending if trie.ending is not None else next(iter(trie.through))).used = next(self._clock)
            return 0
        held = next(iter(trie.through)).slots[:known * ps] if known else np.zeros(0, np.int64)
        if fresh:
            dst = self._allocate(fresh)
            self.pool.copy_slots(own[whole * ps:(whole + fresh) * ps], dst)
            self.stats.copied_tokens += fresh * ps
        keep = known + whole + fresh
        kept = np.concatenate([held, own[:whole * ps]] + ([dst] if fresh else []))
        path_nodes = self._path(tokens[:keep * ps])
        entry = self._store(tokens[:keep * ps], kept, path_nodes, fresh_pages=fresh)
        self.stats.stored_tokens += (keep - known) * ps
        entry.used = next(self._clock)
        self._drop_covered(path_nodes)
        if self.max_pages is not None and self.num_pages > self.max_pages:
            self.evict(self.num_pages - self.max_pages, keep=entry)
        return (keep - known) * ps

    # ------------------------------------------------------------------ evicting

    def evictable_pages(self, keep: CachedPrefix | None = None) -> int:
        """Pages evicting every idle cached prefix (but ``keep``) would return to the pool."""
        idle = [e for e in self._entries if e.idle and e is not keep]
        if not idle:
            return 0
        pages, times = np.unique(np.concatenate([e.page_ids for e in idle]), return_counts=True)
        return int((self.pool.refcount[pages] == times).sum())

    def evict(self, pages: int, keep: CachedPrefix | None = None) -> int:
        """Evict idle cached prefixes (but ``keep``), least recently used first, until ``pages`` pages are back
        in the pool or none is left; returns the pages freed."""
        freed = 0
        for entry in sorted((e for e in self._entries if e.idle and e is not keep), key=lambda e: e.used):
            if freed >= pages:
                break
            freed += self._remove(entry)
        return freed

    def released(self, entry: CachedPrefix) -> None:
        """(:meth:`CachedPrefix.leave`) ``entry`` is read by nothing now: drop it if a longer cached prefix covers
        it."""
        if entry.end.children:
            self._remove(entry)

    def clear(self) -> int:
        """Evict every idle cached prefix; returns the pages freed."""
        return self.evict(self.pool.num_pages)

    # ------------------------------------------------------------------ private

    def _walk(self, tokens: list[int], pages: int) -> _Trie:
        """The deepest trie node that the first ``pages`` whole pages of ``tokens`` reach (its ``depth`` pages)."""
        ps, node = self.page_size, self._root
        for i in range(pages):
            child = node.children.get(tuple(tokens[i * ps:(i + 1) * ps]))
            if child is None:
                break
            node = child
        return node

    def _allocate(self, pages: int) -> np.ndarray:
        ps = self.page_size
        fresh = self.pool.allocate(pages)
        return (fresh[:, None] * ps + np.arange(ps)).reshape(-1)

    def _path(self, tokens: list[int]) -> list[_Trie]:
        """The trie's nodes for ``tokens`` (whole pages), made where missing."""
        ps, node, out = self.page_size, self._root, []
        for i in range(len(tokens) // ps):
            key = tuple(tokens[i * ps:(i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Trie(node, key, i + 1)
            out.append(child)
            node = child
        return out

    def _store(self, tokens: list[int], slots: np.ndarray, path: list[_Trie], fresh_pages: int = 0) -> CachedPrefix:
        """A new cached prefix ending at ``path[-1]``; one reference on each of its pages (``fresh_pages`` of
        them, the last, were allocated for it and have theirs already)."""
        ps = self.page_size
        pages = slots[::ps] // ps
        shared = pages[:len(pages) - fresh_pages]
        if len(shared):
            self.pool.incref(shared)
        self._held[pages] += 1
        entry = CachedPrefix(list(tokens), np.asarray(slots, dtype=np.int64).copy(), pages, self, path[-1])
        assert path[-1].ending is None, "a cached prefix ends there already"
        path[-1].ending = entry
        for trie in path:
            trie.through.add(entry)
        self._entries.add(entry)
        return entry

    def _drop_covered(self, path: list[_Trie]) -> None:
        """Drop the idle cached prefixes that end on ``path`` before its end (the longer one covers them)."""
        for trie in path[:-1]:
            if trie.ending is not None and trie.ending.idle:
                self._remove(trie.ending)

    def _remove(self, entry: CachedPrefix) -> int:
        """Forget an idle cached prefix: its references dropped, its trie nodes pruned where nothing else passes."""
        assert entry.idle and entry.node is None, f"{entry.live=}, {entry.node=}"
        self._entries.discard(entry)
        if entry.end.ending is entry:
            entry.end.ending = None
        trie = entry.end
        while trie is not None and trie.parent is not None:
            trie.through.discard(entry)
            parent = trie.parent
            if not trie.through:
                del parent.children[trie.key]
            trie = parent
        self._held[entry.page_ids] -= 1
        freed = len(self.pool.decref(entry.page_ids))
        self.stats.evicted_pages += freed
        return freed

