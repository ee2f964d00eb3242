"""PagedKVPool: the K/V storage of every tree token, in fixed-size pages.

A *slot* is one token's place in the pool: ``slot = page * page_size + offset``. Nodes of a
:class:`~treedec.tree.SequenceTree` hold slots, never memory; the pool counts, for every
page, how many nodes hold slots in it, and a page returns to the free list when that
count drops to zero.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.errors import PoolExhaustedError


class PagedKVPool:
    """K/V pages for all layers plus the page bookkeeping.

    Parameters
    ----------
    num_pages, page_size:
        Capacity is ``num_pages * page_size`` tokens. ``page_size`` may be 1.
    num_layers, num_kv_heads, head_dim:
        Shape of the storage. With ``allocate_storage=False`` no tensors are made (a
        bookkeeping-only pool, for planning and tests without K/V data).
    dtype, device:
        Of the K/V tensors.

    Attributes
    ----------
    k, v : torch.Tensor
        ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``, or None.
    refcount : np.ndarray
        ``[num_pages]`` int32: the number of tree nodes holding slots in each page.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int = 1,
        num_kv_heads: int = 1,
        head_dim: int = 64,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
        allocate_storage: bool = True,
    ):
        for name, value in [("num_pages", num_pages), ("page_size", page_size),
                            ("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)]:
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.refcount = np.zeros(self.num_pages, dtype=np.int32)
        # A stack: the most recently freed page is reused first (warm in cache).
        self._free = list(range(self.num_pages - 1, -1, -1))
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        if allocate_storage:
            shape = (self.num_layers, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)

    # ----------------------------------------------------------------- public API

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens from the start of a fresh page."""
        return -(-int(num_tokens) // self.page_size)

    def allocate(self, num_pages: int) -> np.ndarray:
        """Take ``num_pages`` free pages with refcount 1. Returns int64 page ids.

        Raises PoolExhaustedError (and takes nothing) if fewer pages are free.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_pages > len(self._free):
            raise PoolExhaustedError(
                f"KV pool exhausted: need {num_pages} page(s) of {self.page_size} tokens, "
                f"{len(self._free)} of {self.num_pages} free")
        pages = np.array([self._free.pop() for _ in range(num_pages)], dtype=np.int64)
        self.refcount[pages] = 1
        return pages

    def incref(self, pages: np.ndarray) -> None:
        """One more holder for each page in ``pages`` (each must be in use)."""
        pages = np.asarray(pages, dtype=np.int64)
        assert np.all(self.refcount[pages] > 0), f"incref of free page(s) {pages[self.refcount[pages] <= 0]}"
        np.add.at(self.refcount, pages, 1)

    def decref(self, pages: np.ndarray) -> np.ndarray:
        """One holder fewer for each page; returns the pages that became free."""
        pages = np.asarray(pages, dtype=np.int64)
        assert np.all(self.refcount[pages] > 0), f"decref of free page(s) {pages[self.refcount[pages] <= 0]}"
        np.subtract.at(self.refcount, pages, 1)
        freed = np.unique(pages[self.refcount[pages] == 0])
        self._free.extend(int(p) for p in freed[::-1])
        return freed

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each ``[num_pages, page_size, num_kv_heads, head_dim]``."""
        self._require_storage()
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return self.k[layer], self.v[layer]

    def write(self, layer: int, slots: torch.Tensor | np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V: ``k``, ``v`` are ``[n, num_kv_heads, head_dim]``, ``slots`` ``[n]``."""
        k_layer, v_layer = self.layer(layer)
        slots = torch.as_tensor(slots, dtype=torch.long, device=k_layer.device)
        expected = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
        k_layer.view(-1, self.num_kv_heads, self.head_dim)[slots] = k.to(k_layer.dtype)
        v_layer.view(-1, self.num_kv_heads, self.head_dim)[slots] = v.to(v_layer.dtype)

    def gather(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` in every layer, each ``[num_layers, len(slots), num_kv_heads, head_dim]`` (a copy)."""
        self._require_storage()
        index = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.k.device)
        return tuple(self._slot_view(t).index_select(1, index) for t in (self.k, self.v))

    def scatter(self, slots: np.ndarray, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Store what :meth:`gather` returned into ``slots`` (e.g. to move accepted tokens' K/V)."""
        self._require_storage()
        index = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.k.device)
        for t, data in zip((self.k, self.v), kv):
            self._slot_view(t).index_copy_(1, index, data)

    def check_invariants(self) -> None:
        """Assert the free list and refcounts agree (for tests and debugging)."""
        free = np.array(self._free, dtype=np.int64)
        assert len(np.unique(free)) == len(free), "a page is on the free list twice"
        assert np.all(self.refcount[free] == 0), f"free page(s) with refcount > 0: {free[self.refcount[free] != 0]}"
        assert np.all(self.refcount >= 0), "negative refcount"
        assert int((self.refcount == 0).sum()) == len(free), (
            f"{int((self.refcount == 0).sum())=} pages have refcount 0 but {len(free)=} are free")

    # ----------------------------------------------------------------- private

    def _slot_view(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.num_layers, self.num_slots, self.num_kv_heads, self.head_dim)

    def _require_storage(self) -> None:
        if self.k is None:
            raise RuntimeError("this PagedKVPool was made with allocate_storage=False: it has no K/V tensors")
