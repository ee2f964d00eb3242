"""PagedKVPool: the K/V storage of every tree token, in fixed-size pages.

A *slot* is one token's place in the pool: ``slot = page * page_size + offset``. Nodes of a
:class:`~treedec.tree.SequenceTree` hold slots, never memory; the pool counts, for every
page, how many nodes hold slots in it, and a page returns to the free list when that
count drops to zero.

The pool owns the K/V tensors (allocated once, in the layout the attention kernels read, never
reallocated: CUDA graphs keep their addresses) and the one primitive that moves K/V between
slots, :meth:`PagedKVPool.copy_slots`: accepting a speculative path, rearranging a draft's
chains and keeping a pipelined step's accepted tokens all go through it.

K/V are stored in the pool's ``kv_dtype``, independent of the model's: the model's dtype (vLLM's
``kv_cache_dtype="auto"``), or ``float8_e4m3fn`` (``"fp8"``), half the bytes of bf16, with a scale per layer and
KV head (:attr:`PagedKVPool.kv_scale`; :mod:`treedec.tree.kv_cache_dtype` says how K/V are quantized). The pool
quantizes what it stores (:meth:`PagedKVPool.write`, :meth:`PagedKVPool.store`) and moves the stored bytes as
they are.

Every method that takes page ids or host slots checks them all (integers, in range, pages in
use) before it changes anything: a bad id raises ``TypeError`` / ``ValueError`` naming the
argument, never wraps around as a negative numpy index.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.checks import describe, is_int, nonnegative_int, positive_int, show_int
from treedec.errors import PoolExhaustedError
from treedec.tree.kv_cache_dtype import dequantize_kv, is_fp8, kv_storage_dtype, quantize_kv
from treedec.transfer import resolve_device, to_device
from treedec.tree.validate import int_array, int_value


class PagedKVPool:
    """K/V pages for all layers plus the page bookkeeping.

    Parameters
    ----------
    num_pages, page_size:
        Capacity is ``num_pages * page_size`` tokens. ``page_size`` may be 1.
    num_layers, num_kv_heads, head_dim:
        Shape of the storage.
    dtype, device:
        The dtype K/V come in and are read back as (the model's), and the device of the K/V tensors.
    kv_dtype:
        What K/V are stored as: None (or ``"auto"``) for ``dtype``, ``"fp8"`` / ``"fp8_e4m3"`` (or
        ``torch.float8_e4m3fn``) for e4m3 with the scales of :attr:`kv_scale` (see :mod:`treedec.tree.kv_cache_dtype`).
    allocate_storage:
        False: no tensors are made, a bookkeeping-only pool (pages, refcounts, free list). Trees
        planned without a model use it: the replay driver's page accounting of a recorded
        schedule, the planners' benchmarks and tests. Every storage method then raises.
    scratch_pages:
        Pages of storage past the ``num_pages`` the pool hands out, never allocated: a CUDA-graph
        step's padded rows write their K/V there (from :attr:`scratch_slot` on), so no live
        token's K/V is touched. They are not part of :attr:`k` / :attr:`v`.

    Attributes
    ----------
    k, v : torch.Tensor
        ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]`` in :attr:`kv_dtype` (each layer contiguous;
        the kernels read :meth:`layer`'s views of them), or None without storage.
    kv_dtype : torch.dtype
        What K/V are stored as (``dtype``, or ``torch.float8_e4m3fn``).
    kv_scale : torch.Tensor or None
        ``[num_layers, 2, num_kv_heads]`` float32 on the device, an fp8 pool's scales (row 0 K's, row 1 V's; 1.0
        until :meth:`set_kv_scales`): a stored value times its scale is the value; None for a pool that stores
        ``dtype``. Set in place (CUDA graphs keep its address); :meth:`layer_scale` is one layer's.
    k_slots, v_slots : tuple of torch.Tensor
        Per layer, the same storage as one row per slot, ``[num_slots + scratch_pages * page_size,
        num_kv_heads, head_dim]`` (scratch slots included): where a step stores its new tokens' K/V
        by slot on the device (empty without storage).
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
        scratch_pages: int = 0,
        kv_dtype: str | torch.dtype | None = None,
    ):
        for name, value in [("num_pages", num_pages), ("page_size", page_size),
                            ("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)]:
            positive_int(name, value, numpy=True)
        nonnegative_int("scratch_pages", scratch_pages, numpy=True)
        device = resolve_device(device)   # (a CUDA device torch does not have: said here, not at the first use)
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.scratch_pages = int(scratch_pages)
        self.dtype = dtype
        self.kv_dtype = kv_storage_dtype(kv_dtype, dtype)
        self.kv_scale: torch.Tensor | None = None
        if is_fp8(self.kv_dtype):
            self.kv_scale = torch.ones(self.num_layers, 2, self.num_kv_heads, dtype=torch.float32, device=device)
        self.refcount = np.zeros(self.num_pages, dtype=np.int32)
        self._offsets = np.arange(self.page_size)   # of the slots in a page
        # A stack, ``_free[:_num_free]`` with its top last: the most recently freed page is reused first (warm in
        # cache). An array, so that taking or returning k pages is one slice copy, whatever k.
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_pages
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.k_slots: tuple[torch.Tensor, ...] = ()
        self.v_slots: tuple[torch.Tensor, ...] = ()
        self._storage: tuple[torch.Tensor, torch.Tensor] | None = None   # K, V with the scratch pages
        if allocate_storage:
            shape = (self.num_layers, self.num_pages + self.scratch_pages, self.page_size, self.num_kv_heads,
                     self.head_dim)
            self._storage = (torch.zeros(shape, dtype=self.kv_dtype, device=device),
                             torch.zeros(shape, dtype=self.kv_dtype, device=device))
            self.k, self.v = (t[:, :self.num_pages] for t in self._storage)
            self.k_slots, self.v_slots = (tuple(t[i].view(-1, self.num_kv_heads, self.head_dim)
                                                for i in range(self.num_layers)) for t in self._storage)

    # ----------------------------------------------------------------- public API

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def free_pages(self) -> np.ndarray:
        """[num_free_pages] int64, a copy: the free pages in the order :meth:`allocate` hands them out."""
        return self._free[:self._num_free][::-1].copy()

    @property
    def num_slots(self) -> int:
        """Slots the pool hands out (the scratch pages' are past them)."""
        return self.num_pages * self.page_size

    @property
    def has_storage(self) -> bool:
        """Whether the pool holds K/V tensors (``allocate_storage``)."""
        return self._storage is not None

    @property
    def scratch_slot(self) -> int:
        """The first scratch slot (:attr:`num_slots`): where padded query rows store their K/V."""
        if not self.scratch_pages:
            raise RuntimeError("this PagedKVPool has no scratch pages (scratch_pages=0)")
        return self.num_slots

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens from the start of a fresh page."""
        if type(num_tokens) is not int or num_tokens < 0:  # the check inlined: called per leaf and step
            num_tokens = int_value(num_tokens, "num_tokens", low=0)
        return -(-num_tokens // self.page_size)

    def whole_pages(self, slots: np.ndarray) -> int:
        """How many of ``slots``' leading ``page_size`` runs are whole pages in slot order (a page's slots
        ``page * page_size + 0 .. page_size - 1``)."""
        n = len(slots) // self.page_size
        runs = np.asarray(slots[:n * self.page_size]).reshape(n, self.page_size)
        bad = np.flatnonzero(np.any(runs != runs[:, :1] // self.page_size * self.page_size + self._offsets, axis=1))
        return int(bad[0]) if len(bad) else n

    def allocate(self, num_pages: int) -> np.ndarray:
        """Take ``num_pages`` free pages with refcount 1. Returns int64 page ids.

        Raises PoolExhaustedError (and takes nothing) if fewer pages are free.
        """
        if type(num_pages) is not int or num_pages < 0:  # the check inlined, as in pages_for
            num_pages = int_value(num_pages, "num_pages", low=0)
        pages = self._take(num_pages)
        self.refcount[pages] = 1
        return pages

    def allocate_slots(self, num_slots: int) -> np.ndarray:
        """Take ``ceil(num_slots / page_size)`` free pages and return their first ``num_slots`` slots
        (``[num_slots]`` int64, in page order), each page holding one reference per slot returned:
        for one-token nodes packed page by page (a speculative token tree).

        Raises PoolExhaustedError (and takes nothing) if fewer pages are free.
        """
        if type(num_slots) is not int or num_slots < 0:
            num_slots = int_value(num_slots, "num_slots", low=0)
        ps = self.page_size
        pages = self._take(-(-num_slots // ps))
        if len(pages):
            self.refcount[pages] = ps
            self.refcount[pages[-1]] = num_slots - (len(pages) - 1) * ps
        return (pages[:, None] * ps + self._offsets).reshape(-1)[:num_slots]

    def allocate_slot_groups(self, groups: int, size: int) -> np.ndarray:
        """``groups`` calls of :meth:`allocate_slots` of ``size`` slots in one: ``[groups, size]`` int64, each row
        packed into ``ceil(size / page_size)`` fresh pages of its own (many requests' token trees of one shape).

        Raises PoolExhaustedError (and takes nothing) if fewer pages are free.
        """
        groups = int_value(groups, "groups", low=0)
        size = int_value(size, "size", low=0)
        ps = self.page_size
        per = -(-size // ps)
        pages = self._take(groups * per).reshape(groups, per)
        if per:
            self.refcount[pages] = ps
            self.refcount[pages[:, -1]] = size - (per - 1) * ps
        return (pages[:, :, None] * ps + self._offsets).reshape(groups, per * ps)[:, :size]

    def incref(self, pages: np.ndarray) -> None:
        """One more holder for each page in ``pages`` (``[n]`` ints; each must be in use)."""
        pages = self._pages_in_use(pages, "incref")
        np.add.at(self.refcount, pages, 1)

    def decref(self, pages: np.ndarray, times: np.ndarray | None = None) -> np.ndarray:
        """One holder fewer for each page in ``pages`` (``[n]`` ints, a page at most as often as it has
        holders); or, given ``times`` (``[n]`` ints >= 1, ``pages`` then distinct), ``times[i]`` holders
        fewer for ``pages[i]``. Returns the int64 pages that became free, ascending."""
        pages = self._pages_in_use(pages, "decref")
        if times is None:
            pages, times = np.unique(pages, return_counts=True)
        else:
            times = int_array(times, "times", low=1)
            if len(times) != len(pages):
                raise ValueError(f"decref: times must hold one count per page ({len(pages)}), got {len(times)}")
            if len(set(pages.tolist())) != len(pages):
                raise ValueError(f"decref: pages must be distinct when times are given, got {describe(pages)}")
        over = self.refcount[pages] < times
        if over.any():
            raise ValueError(f"decref: pages {pages[over][:10].tolist()} are listed {times[over][:10].tolist()} "
                             f"times but have only {self.refcount[pages[over]][:10].tolist()} holder(s)")
        return self.release(pages, times)

    def release(self, pages: np.ndarray, times: np.ndarray) -> np.ndarray:
        """:meth:`decref` for a caller whose holds these are (a tree dropping the pages its pruned nodes hold):
        ``times[i]`` holders fewer for ``pages[i]`` (``[n]`` int64 each: distinct pages in use, counts >= 1),
        without checking the arguments' types and ranges; it still refuses (changing nothing) to drop a page
        below zero holders. Returns the int64 pages that became free, ascending."""
        left = self.refcount[pages] - times
        if np.logical_or.reduce(left < 0):
            over = left < 0
            raise ValueError(f"release: pages {pages[over][:10].tolist()} are listed {times[over][:10].tolist()} "
                             f"times but have only {self.refcount[pages[over]][:10].tolist()} holder(s)")
        self.refcount[pages] = left
        freed = pages[left == 0]
        freed.sort()
        top = self._num_free
        self._free[top:top + len(freed)] = freed[::-1]   # the lowest on top; fits: they had holders
        self._num_free = top + len(freed)
        return freed

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each ``[num_pages, page_size, num_kv_heads, head_dim]``."""
        self._require_storage()
        if not is_int(layer):
            raise TypeError(f"layer must be an int, got {describe(layer)}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be in [0, {self.num_layers}), got {show_int(int(layer))}")
        return self.k[layer], self.v[layer]

    def write(self, layer: int, slots: torch.Tensor | np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V: ``k``, ``v`` are ``[n, num_kv_heads, head_dim]``, ``slots`` ``[n]`` ints (checked;
        :meth:`store` is the step's unchecked path). An fp8 pool quantizes them with the layer's scales."""
        self.layer(layer)
        slots = self._slots(slots, "slots")
        expected = (len(slots), self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
        self.store(layer, to_device(slots, self.k.device), k, v)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A step's store of ``k``, ``v`` ``[n, num_kv_heads, head_dim]`` at ``slots`` ``[n]`` int64 on the pool's
        device (scratch slots included), unchecked: the engine's path, as :func:`store_kv_slots` (what the
        ``treedec::store_kv`` custom op runs too)."""
        store_kv_slots(self.k_slots[layer], self.v_slots[layer], slots, k, v, self.layer_scale(layer))

    def layer_scale(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s K/V scales, ``[2, num_kv_heads]`` float32 (a view of :attr:`kv_scale`), or None for a
        pool that stores the model's dtype."""
        return None if self.kv_scale is None else self.kv_scale[layer]

    def set_kv_scales(self, k_scale, v_scale) -> None:
        """Set an fp8 pool's scales in place: each a number, ``[num_layers]`` (a scale per layer, as fp8
        checkpoints hold) or ``[num_layers, num_kv_heads]``, finite and > 0. K/V stored before keep the scales
        they were stored with, so set them before the first store. ValueError (changing nothing) otherwise."""
        if self.kv_scale is None:
            raise ValueError(f"set_kv_scales: this pool stores K/V as {self.kv_dtype}, which takes no scales "
                             f"(kv_dtype='fp8' does)")
        scales = []
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            t = torch.as_tensor(value, dtype=torch.float32).detach().cpu()
            shape = tuple(t.shape)
            if t.dim() == 1 and shape[0] == self.num_layers:
                t = t[:, None]
            if t.dim() == 1 or t.dim() > 2 or (t.dim() == 2 and t.shape[1] != 1 and
                                                tuple(t.shape) != (self.num_layers, self.num_kv_heads)):
                raise ValueError(f"set_kv_scales: {name} must be a number, [{self.num_layers}] or "
                                 f"[{self.num_layers}, {self.num_kv_heads}], got shape {list(shape)}")
            if not (torch.isfinite(t).all() and (t > 0).all()):
                raise ValueError(f"set_kv_scales: {name} must be finite and > 0, got {t.flatten()[:8].tolist()}")
            scales.append(t.expand(self.num_layers, self.num_kv_heads))
        self.kv_scale.copy_(torch.stack(scales, dim=1))

    @property
    def bytes_per_token(self) -> int:
        """Bytes of storage one token takes (K and V of every layer, in :attr:`kv_dtype`)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def gather(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` (``[n]`` ints) in every layer, each ``[num_layers, n, num_kv_heads, head_dim]``
        in ``dtype`` (an fp8 pool's de-quantized; a copy, to read: moves between slots are :meth:`copy_slots`)."""
        self._require_storage()
        index = to_device(self._slots(slots, "slots"), self.k.device)
        out = []
        for i, t in enumerate((self.k, self.v)):
            flat = self._slot_view(t)
            if self.kv_scale is None:
                out.append(flat.index_select(1, index))
            else:   # (index_select has no fp8 kernel on every device: the bytes are gathered)
                stored = flat.view(torch.uint8).index_select(1, index).view(self.kv_dtype)
                out.append(torch.stack([dequantize_kv(stored[layer], self.kv_scale[layer, i], self.dtype)
                                        for layer in range(self.num_layers)]))
        return tuple(out)

    def copy_slots(self, src_slots: torch.Tensor | np.ndarray, dst_slots: torch.Tensor | np.ndarray,
                   checked: bool = True) -> None:
        """Copy the K/V held at slots ``src_slots`` to ``dst_slots``, in every layer: the pool's one slot-copy
        primitive (a gather and a scatter of all layers on the device, of the stored bytes: an fp8 pool's
        are moved as they are, never re-quantized). ``src_slots`` is read whole before anything is written, so
        the two may overlap. The pages' refcounts do not change.

        Each is ``[n]`` slots, of one length: an int64 tensor on the pool's CUDA device is used as it is
        (not read back, so the copy never waits for the device and a CUDA graph may capture it; its values
        must be slots of the pool, scratch slots included); anything else (host ints, a CPU tensor) is
        checked to be slots in ``[0, num_slots)`` and sent to the device. ``checked``: False for a caller that
        made both itself as ``[n]`` int64 tensors on the pool's device (the verify group, every step): they are
        used as they are on the CPU too, where checking a tensor reads it back.
        """
        self._require_storage()
        if checked:
            src = self._index(src_slots, "src_slots")
            dst = self._index(dst_slots, "dst_slots")
        else:
            src, dst = src_slots, dst_slots
        if src.shape != dst.shape:
            raise ValueError(f"src_slots and dst_slots must be 1-D of one length, got {len(src)} and {len(dst)} "
                             f"slots")
        for t in self._storage:   # every layer in one gather and one scatter
            flat = t.view(self.num_layers, -1, self.num_kv_heads, self.head_dim)
            if self.kv_scale is not None:
                flat = flat.view(torch.uint8)   # (index_copy_ has no fp8 kernel on the CPU)
            flat.index_copy_(1, dst, flat.index_select(1, src))

    def check_invariants(self) -> None:
        """Check that the free list and refcounts agree; raises RuntimeError naming the broken invariant.

        Real checks, not ``assert``: they also run under ``python -O``.
        """
        free = self._free[:self._num_free]
        if np.any((free < 0) | (free >= self.num_pages)):
            raise RuntimeError(f"pool invariant broken: free list holds page ids outside [0, {self.num_pages}): "
                               f"{free[(free < 0) | (free >= self.num_pages)][:10].tolist()}")
        pages, times = np.unique(free, return_counts=True)
        if np.any(times > 1):
            raise RuntimeError(f"pool invariant broken: pages {pages[times > 1][:10].tolist()} are on the free "
                               f"list twice")
        if np.any(self.refcount[free] != 0):
            bad = free[self.refcount[free] != 0][:10]
            raise RuntimeError(f"pool invariant broken: free pages {bad.tolist()} have refcounts "
                               f"{self.refcount[bad].tolist()}, expected 0")
        if np.any(self.refcount < 0):
            bad = np.flatnonzero(self.refcount < 0)[:10]
            raise RuntimeError(f"pool invariant broken: pages {bad.tolist()} have negative refcounts "
                               f"{self.refcount[bad].tolist()}")
        unused = int((self.refcount == 0).sum())
        if unused != len(free):
            raise RuntimeError(f"pool invariant broken: {unused} pages have refcount 0 but {len(free)} are on "
                               f"the free list")

    # ----------------------------------------------------------------- private

    def _take(self, num_pages: int) -> np.ndarray:
        """Pop ``num_pages`` pages off the free list (the most recently freed first), or raise and take none."""
        top = self._num_free
        if num_pages > top:
            raise PoolExhaustedError(
                f"KV pool exhausted: need {num_pages} page(s) of {self.page_size} tokens, "
                f"{top} of {self.num_pages} free")
        self._num_free = top - num_pages
        return self._free[top - num_pages:top][::-1].copy()

    def _slot_view(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.num_layers, self.num_slots, self.num_kv_heads, self.head_dim)

    def _pages_in_use(self, pages, op: str) -> np.ndarray:
        """``pages`` as int64 page ids, checked to be in ``[0, num_pages)`` and in use."""
        pages = int_array(pages, "pages", low=0, high=self.num_pages - 1)
        free = self.refcount[pages] <= 0
        if free.any():
            raise ValueError(f"{op}: pages must be in use, but pages {np.unique(pages[free])[:10].tolist()} are free")
        return pages

    def _slots(self, slots, name: str) -> np.ndarray:
        """``slots`` as int64, checked to be in ``[0, num_slots)``."""
        return int_array(slots, name, low=0, high=self.num_slots - 1)

    def _index(self, slots, name: str) -> torch.Tensor:
        """``slots`` as an int64 index on the storage's device (:meth:`copy_slots` says which are checked)."""
        device = self.k.device
        if isinstance(slots, torch.Tensor) and slots.device.type == "cuda":
            if slots.dtype != torch.int64 or slots.dim() != 1 or slots.device != device:
                raise ValueError(f"{name} must be a 1-D int64 tensor on {device}, got a {slots.dtype} tensor of "
                                 f"shape {list(slots.shape)} on {slots.device}")
            return slots
        return to_device(self._slots(slots, name), device)

    def _require_storage(self) -> None:
        if self._storage is None:
            raise RuntimeError("this PagedKVPool was made with allocate_storage=False: it has no K/V tensors")


def store_kv_slots(k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    """Write ``k``, ``v`` ``[n, Hkv, D]`` at ``slots`` ``[n]`` int64 of a layer's caches viewed as ``[num_slots, Hkv,
    D]`` (:attr:`PagedKVPool.k_slots`), in place: the one K/V store (:meth:`PagedKVPool.store`, the
    ``treedec::store_kv`` op). With ``kv_scale`` (``[2, Hkv]`` float32: an fp8 pool's layer scales) K/V are
    quantized to e4m3 first, saturating."""
    if kv_scale is None:
        k_slots.index_copy_(0, slots, k.to(k_slots.dtype))
        v_slots.index_copy_(0, slots, v.to(v_slots.dtype))
        return
    k_slots.view(torch.uint8).index_copy_(0, slots, quantize_kv(k, kv_scale[0]).view(torch.uint8))
    v_slots.view(torch.uint8).index_copy_(0, slots, quantize_kv(v, kv_scale[1]).view(torch.uint8))
