"""Load-balanced schedule of a TreePlan's work on a persistent grid (the ``cuda`` backend).

The cuda kernel runs a fixed grid of CTAs (about the GPU's resident capacity); each CTA
loops over its list of *units*. A unit is one work item's chunk for one KV head and at
most ``rows_per_unit`` of the item's rows (row ``r = local_entry * group + g``: entry
``local_entry`` of the item, query head ``kv_head * group + g``), so any GQA ratio fits.

Each work item's *live tiles* (the ``tile_tokens``-token tiles of its chunk that some entry of
the item reads; the kernel loads and computes only those) are listed here on the CPU, once per
item, and the unit records point into the list (:meth:`PersistentSchedule.device_array`). A
record also carries what the kernel's first K/V gathers need (the chunk's first slot index and
length, the first live tile), so those start one load after the record, not three. The tile size
is the KV tile the kernel runs: :data:`TILE_TOKENS` (every kernel) or 96 (the sm_90a kernel, for
long units: the backend chooses, ``cuda_backend.choose_tile_tokens``, and launches that
tile's kernel); it heads the device array, where the kernel checks it.

Units are assigned with FlashInfer's cost model (a*rows + b*kv_tokens, greedy
longest-processing-time first; FlashInfer paper section 3.3.1): here the KV tokens are the
*live* ones, in the tiles that some entry of the item reads (the kernel skips the others), and
every unit pays a fixed overhead. The greedy runs in rounds of ``num_ctas`` units (vectorized):
the heaviest remaining units go to the least-loaded CTAs.

:func:`schedule_units` runs the compiled port of this module (``treedec/kernels/planner/schedule.h``,
the same schedule bit for bit) where :func:`~treedec.attention.planner_choice.planner_impl` says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from treedec.attention.planner_choice import planner_impl
from treedec.attention.tree_plan import MASK_BITS, TreePlan
from treedec.checks import positive_int
from treedec.kernels.cuda_tree_attention import TILE_SIZES, TILE_TOKENS

UNIT_FIELDS = ("chunk", "kv_head", "item_entry_start", "row_begin", "row_end", "tile_begin", "tile_end",
               "kv_begin", "chunk_len", "first_tile")
_LIST_FIELDS = [UNIT_FIELDS.index("tile_begin"), UNIT_FIELDS.index("tile_end")]  # offsets into device_array()
SCHEDULE_HEADER = 2       # int32 words before the records in device_array(): tile tokens, 0
COST_PER_ROW = 1.0        # a: per query row of a unit
COST_PER_KV_TOKEN = 1.0   # b: per live KV token
COST_PER_UNIT = 64.0      # setup of a unit (row tables, Q load, pipeline fill, partial state)
# Set on a listed tile when every entry of its item reads every token of the tile and the tile holds
# no position of the plan's ``dynamic_kv`` ranges (whose mask bits the device may clear after the plan
# is written): the sm_90a kernel then copies no mask words for it and runs its softmax without a mask.
# The tile index is ``listed & ~FULL_TILE_FLAG`` (tile indices stay far below 2^30: a chunk has < 2^31 tokens).
FULL_TILE_FLAG = 1 << 30


@dataclass(frozen=True)
class PersistentSchedule:
    """Units and their CTA assignment.

    Attributes
    ----------
    cta_unit_start : [num_ctas + 1] int32
        CTA b runs units ``cta_unit_start[b]:cta_unit_start[b + 1]`` in order.
    unit_info : [U, len(UNIT_FIELDS)] int32
        Per unit, the :data:`UNIT_FIELDS`; the unit's live tiles are ``tiles[tile_begin:tile_end]``,
        the first of them ``first_tile`` (0 if none); ``kv_begin`` and ``chunk_len`` are its chunk's
        ``chunk_kv_start[chunk]`` and length.
    tiles : [N] int32
        Live tiles (index of the tile in its chunk, ascending) of every work item, item by item,
        each with :data:`FULL_TILE_FLAG` set where every entry of the item reads the whole tile and it
        holds no position of the plan's ``dynamic_kv`` ranges.
    cta_cost : [num_ctas] float64
        Cost assigned to each CTA (for reports: the imbalance is ``max / mean``).
    tile_tokens : int
        Tokens per listed tile (one of :data:`TILE_SIZES`): the KV tile the kernel runs.
    """

    cta_unit_start: np.ndarray
    unit_info: np.ndarray
    tiles: np.ndarray
    cta_cost: np.ndarray
    tile_tokens: int = TILE_TOKENS
    _device: np.ndarray | None = field(default=None, repr=False, compare=False)  # the compiled planner's device_array()

    @property
    def num_ctas(self) -> int:
        return len(self.cta_unit_start) - 1

    @property
    def num_units(self) -> int:
        return len(self.unit_info)

    def device_array(self) -> np.ndarray:
        """[SCHEDULE_HEADER + len(UNIT_FIELDS) U + N] int32, as the kernels read it
        (``PartialParams::unit_info``): the header (``tile_tokens``, 0), the unit records, then the
        tile lists (``tile_begin``/``tile_end`` index this array). Read-only where the compiled planner made it."""
        if self._device is not None:
            return self._device
        records = self.unit_info.copy()
        records[:, _LIST_FIELDS] += SCHEDULE_HEADER + records.size
        header = np.array([self.tile_tokens, 0], dtype=np.int32)
        return np.concatenate([header, records.reshape(-1), self.tiles]).astype(np.int32)

    def imbalance(self) -> float:
        """Heaviest CTA's cost over the mean (1.0 is perfect)."""
        busy = self.cta_cost[self.cta_cost > 0]
        return float(busy.max() / busy.mean()) if busy.size else 1.0


def live_tiles(plan: TreePlan, tile_tokens: int = TILE_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """Live tiles of every work item, as CSR (tiles of ``tile_tokens``, one of :data:`TILE_SIZES`).

    Returns
    -------
    item_tile_start : [I + 1] int64
        Item i's live tiles are ``tiles[item_tile_start[i]:item_tile_start[i + 1]]``.
    tiles : [N] int32
        Index (tile t covers chunk tokens ``t * tile_tokens ...``) of each tile that some entry of
        the item reads, ascending per item, plus :data:`FULL_TILE_FLAG` where every entry of the
        item reads all ``tile_tokens`` tokens of the tile (so never a chunk's short last tile) and
        none of them is in a range of ``plan.dynamic_kv`` (ValueError when those are not sorted,
        non-overlapping, non-empty ranges of the plan's tokens).
    """
    _check_tile_tokens(tile_tokens)
    dynamic = _dynamic_ranges(plan)
    if plan.num_items == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int32)
    counts = plan.item_num_entries.astype(np.int64)
    offsets = np.cumsum(counts) - counts                          # items' rows in `rows` below
    rows = np.repeat(plan.item_entry_start - offsets, counts) + np.arange(counts.sum())  # entries, item by item
    masks = plan.entry_mask[rows]                                   # [entries, W], item by item
    ored = np.bitwise_or.reduceat(masks, offsets, axis=0)           # [I, W] (items need not be in entry order)
    anded = np.bitwise_and.reduceat(masks, offsets, axis=0)
    live = _by_tile(ored != 0, tile_tokens).any(axis=2)             # [I, tiles]
    full = _by_tile(anded == -1, tile_tokens).all(axis=2)           # every bit of every word (int32 -1)
    if len(dynamic):  # a tile [first, first + tile_tokens) meeting a range [start, stop) is not full
        first = plan.chunk_kv_start[plan.item_chunk][:, None] + np.arange(full.shape[1]) * tile_tokens
        # The ranges are sorted and disjoint: those starting before the tile's end are a prefix, those
        # stopping at or before its first token a shorter prefix; the tile meets one iff they differ.
        started = np.searchsorted(dynamic[:, 0], first + tile_tokens, side="left")
        ended = np.searchsorted(dynamic[:, 1], first, side="right")
        full &= started == ended
    items, tiles = np.nonzero(live)                                 # item-major, ascending
    item_tile_start = np.zeros(plan.num_items + 1, dtype=np.int64)
    np.cumsum(live.sum(axis=1), out=item_tile_start[1:])
    return item_tile_start, (tiles | np.where(full[items, tiles], FULL_TILE_FLAG, 0)).astype(np.int32)


def _dynamic_ranges(plan: TreePlan) -> np.ndarray:
    """[R, 2] int64 (C-contiguous, as the compiled planner takes it): ``plan.dynamic_kv`` checked, a tuple
    of (start, stop) pairs of ints with ``0 <= start < stop <= plan.num_tokens``, sorted by start and not
    overlapping (ValueError naming the bad range and why otherwise)."""
    value = plan.dynamic_kv
    if isinstance(value, np.ndarray):   # (a batch's spans located as arrays: checked as arrays)
        return _dynamic_array(value, plan.num_tokens)
    if not isinstance(value, tuple):
        raise ValueError(f"dynamic_kv must be a tuple of (start, stop) ranges or an [R, 2] int array, got {value!r}")
    previous, num_tokens = None, plan.num_tokens
    for k, pair in enumerate(value):  # one range per request of a batch: a short loop, kept lean (every step)
        if not (type(pair) is tuple and len(pair) == 2 and isinstance(pair[0], (int, np.integer))
                and isinstance(pair[1], (int, np.integer)) and type(pair[0]) is not bool and type(pair[1]) is not bool):
            raise ValueError(f"dynamic_kv[{k}] must be a (start, stop) pair of ints, got {pair!r}")
        start, stop = pair
        if start >= stop:
            raise ValueError(f"dynamic_kv[{k}] = {pair!r} is empty or reversed: start must be < stop")
        if start < 0 or stop > num_tokens:
            raise ValueError(f"dynamic_kv[{k}] = {pair!r} is outside the plan's KV: "
                             f"0 <= start < stop <= num_tokens ({num_tokens})")
        if previous is not None and start < previous[0]:
            raise ValueError(f"dynamic_kv[{k}] = {pair!r} starts before dynamic_kv[{k - 1}] = {previous!r}: "
                             f"the ranges must be sorted by start")
        if previous is not None and start < previous[1]:
            raise ValueError(f"dynamic_kv[{k}] = {pair!r} overlaps dynamic_kv[{k - 1}] = {previous!r}: "
                             f"the ranges must not overlap (adjacent ones may touch)")
        previous = pair
    return np.array(value, dtype=np.int64).reshape(len(value), 2)


def _dynamic_array(value: np.ndarray, num_tokens: int) -> np.ndarray:
    """:func:`_dynamic_ranges` of an ``[R, 2]`` int array of ranges (the same rules, checked as arrays)."""
    if value.ndim != 2 or value.shape[1] != 2 or value.dtype.kind not in "iu":
        raise ValueError(f"dynamic_kv as an array must be [R, 2] ints, got {value.dtype} {value.shape}")
    start, stop = value[:, 0], value[:, 1]
    checks = ((start >= stop, "is empty or reversed: start must be < stop"),
              ((start < 0) | (stop > num_tokens), f"is outside the plan's KV: 0 <= start < stop <= num_tokens "
                                                   f"({num_tokens})"),
              (np.r_[False, start[1:] < start[:-1]], "starts before the range before it: the ranges must be sorted"),
              (np.r_[False, start[1:] < stop[:-1]], "overlaps the range before it: the ranges must not overlap"))
    for bad, why in checks:
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"dynamic_kv[{k}] = {tuple(value[k].tolist())} {why}")
    return np.ascontiguousarray(value, dtype=np.int64)


def _check_tile_tokens(tile_tokens) -> None:
    if tile_tokens not in TILE_SIZES:
        raise ValueError(f"tile_tokens must be one of {TILE_SIZES}, got {tile_tokens!r}")


def _by_tile(word_flags: np.ndarray, tile_tokens: int) -> np.ndarray:
    """[I, W] bool per mask word -> [I, tiles, words per tile], the words past W False."""
    words_per_tile = tile_tokens // MASK_BITS
    num_items, w = word_flags.shape
    padded = np.zeros((num_items, -(-w // words_per_tile) * words_per_tile), dtype=bool)
    padded[:, :w] = word_flags
    return padded.reshape(num_items, -1, words_per_tile)


def live_kv_tokens(plan: TreePlan, item_tile_start: np.ndarray | None = None,
                   tile_tokens: int = TILE_TOKENS) -> np.ndarray:
    """[I] int64: tokens of each work item's chunk in tiles of ``tile_tokens`` some entry of the
    item reads (``item_tile_start`` of :func:`live_tiles` with that tile, computed when not given)."""
    if item_tile_start is None:
        item_tile_start, _ = live_tiles(plan, tile_tokens)
    chunk_len = np.diff(plan.chunk_kv_start)[plan.item_chunk]
    return np.minimum(np.diff(item_tile_start) * tile_tokens, chunk_len)


def schedule_units(plan: TreePlan, group: int, num_kv_heads: int, num_ctas: int,
                   rows_per_unit: int = 64, tile_tokens: int = TILE_TOKENS) -> PersistentSchedule:
    """Cut ``plan``'s work items into units and assign them to ``num_ctas`` CTAs.

    Parameters
    ----------
    plan : TreePlan
        The tiles holding a position of its ``dynamic_kv`` ranges are never flagged full
        (:func:`live_tiles`); ValueError when those are not sorted, non-overlapping, non-empty ranges
        of the plan's tokens (the message names the bad range).
    group : int
        Query heads per KV head (GQA ratio).
    num_kv_heads : int
    num_ctas : int
        Size of the persistent grid; CTAs left without units exit at once.
    rows_per_unit : int
        Rows one CTA computes at a time (``cuda_tree_attention.ROWS_PER_UNIT`` of the head dim).
    tile_tokens : int
        Tokens per tile of the live lists, the kernel's KV tile (one of :data:`TILE_SIZES`).
    """
    for name, value in (("group", group), ("num_kv_heads", num_kv_heads), ("num_ctas", num_ctas),
                        ("rows_per_unit", rows_per_unit)):
        if type(value) is not int or value < 1:   # every plan: a plain int skips the call
            positive_int(name, value, numpy=True)
    _check_tile_tokens(tile_tokens)
    module = planner_impl().module
    if module is not None:  # the compiled port of the code below (treedec/kernels/planner/schedule.h)
        cta_unit_start, unit_info, tiles, cta_cost, device = module.schedule_units(
            plan.item_chunk, plan.item_entry_start, plan.item_num_entries, plan.chunk_kv_start, plan.entry_mask,
            group, num_kv_heads, num_ctas, rows_per_unit, tile_tokens, _dynamic_ranges(plan))
        device.setflags(write=False)
        return PersistentSchedule(cta_unit_start, unit_info, tiles, cta_cost, tile_tokens, device)
    rows = plan.item_num_entries.astype(np.int64) * group                   # [I]
    blocks = -(-rows // rows_per_unit)                                      # [I]
    item_of_block = np.repeat(np.arange(plan.num_items), blocks)            # [B]
    block_in_item = np.arange(len(item_of_block)) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    row_begin = block_in_item * rows_per_unit
    row_end = np.minimum(row_begin + rows_per_unit, rows[item_of_block])
    item_tile_start, tiles = live_tiles(plan, tile_tokens)
    block_cost = (COST_PER_UNIT + COST_PER_ROW * (row_end - row_begin)
                  + COST_PER_KV_TOKEN * live_kv_tokens(plan, item_tile_start, tile_tokens)[item_of_block])
    # Units: every block for every KV head (block-major, so equal costs stay adjacent).
    num_blocks = len(item_of_block)
    unit_block = np.repeat(np.arange(num_blocks), num_kv_heads)
    unit_head = np.tile(np.arange(num_kv_heads), num_blocks)
    chunk = plan.item_chunk[item_of_block][unit_block]
    tile_begin = item_tile_start[:-1][item_of_block][unit_block]
    tile_end = item_tile_start[1:][item_of_block][unit_block]
    first_tile = np.where(tile_end > tile_begin, np.append(tiles, 0)[tile_begin], 0)  # tile_begin <= len(tiles)
    info = np.stack([chunk, unit_head, plan.item_entry_start[item_of_block][unit_block],
                     row_begin[unit_block], row_end[unit_block], tile_begin, tile_end,
                     plan.chunk_kv_start[chunk], np.diff(plan.chunk_kv_start)[chunk], first_tile],
                    axis=1).astype(np.int32)
    cost = block_cost[unit_block]
    order, cta_of_unit, loads = assign_units(cost, num_ctas)
    # Each CTA runs its units in assignment order (heaviest first).
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    run_order = np.lexsort((position, cta_of_unit))
    counts = np.bincount(cta_of_unit, minlength=num_ctas)
    cta_unit_start = np.zeros(num_ctas + 1, dtype=np.int32)
    np.cumsum(counts, out=cta_unit_start[1:])
    return PersistentSchedule(cta_unit_start, np.ascontiguousarray(info[run_order]), tiles, loads, tile_tokens)


def assign_units(cost: np.ndarray, num_ctas: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy longest-processing-time assignment of units of ``cost`` to ``num_ctas`` CTAs, in rounds
    of ``num_ctas`` units (vectorized): the heaviest remaining units go to the least-loaded CTAs.

    Returns ``order`` (units, heaviest first: the assignment order), ``cta_of_unit`` [U] and the
    CTAs' summed costs ``loads`` [num_ctas]."""
    order = np.argsort(-cost, kind="stable")
    cta_of_unit = np.empty(len(order), dtype=np.int64)
    loads = np.zeros(num_ctas, dtype=np.float64)
    for start in range(0, len(order), num_ctas):
        batch = order[start:start + num_ctas]                   # heaviest remaining first
        targets = np.argsort(loads, kind="stable")[:len(batch)]  # least-loaded CTAs first
        cta_of_unit[batch] = targets
        loads[targets] += cost[batch]
    return order, cta_of_unit, loads
