"""Planners: TreeLayout -> TreePlan, vectorized numpy (no per-token Python loops).

All four share one core and differ only in where chunks are cut in the flattened KV:

- ``flatten`` (DeFT-Flatten): even chunks of at most ``chunk_size`` tokens over the whole
  flattened tree, crossing node borders.
- ``node`` (DeFT-Node): one chunk per node, whatever its length.
- ``node_chunk`` (DeFT-Node-Chunk): each node cut into even pieces of at most
  ``chunk_size`` tokens.
- ``path`` (the Radix-style baseline, Q-guided): every query reads its own root-to-query
  path as chunks of its own, so a shared prefix is read once per query; the same kernels
  run it, which makes it the side-by-side baseline of the DeFT paper's comparisons. In a
  ``batch_invariant`` config it cuts each path at absolute positions instead and shares a
  window's chunk among the queries that read exactly its keys
  (:mod:`~treedec.attention.position_windows`).

A sliding window (the variant's mask field, ``AttentionVariant.window``) clips each query's root-path intervals
to the positions it may read (:meth:`AttentionVariant.first_visible`; a token's position is its index on its
root path); a node's tokens before every reader's window are dropped from the flattened KV, so chunks outside
every window are never planned nor read, and a shared prefix within the windows is still one chunk that all its
readers share (the grouping is the same; only the intervals are shorter).

Only tokens that some query reads are flattened (a paused branch costs nothing). On a persistent
grid (the cuda backend) with automatic chunks, a step whose queries share no KV token (an unshared
decode batch) is cut by :mod:`~treedec.attention.split_kv` instead: chunks within each query's own
tokens.

This module is the reference; :func:`make_plan` runs the compiled port of it
(``treedec/kernels/planner``) where :func:`~treedec.attention.planner_choice.planner_impl` says so,
which gives the same plans bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from treedec.attention.balanced_chunks import (balanced_flatten_bounds, longest_unit_cost, readers_per_chunk,
                                               units_per_kv_head)
from treedec.attention.planner_choice import planner_impl
from treedec.attention.position_windows import position_windows
from treedec.attention.read_intervals import read_intervals
from treedec.attention.split_kv import split_kv_bounds, unshared_segments
from treedec.attention.tree_plan import MASK_BITS, TreePlan
from treedec.attention.variant import AttentionVariant
from treedec.checks import fraction, positive_int
from treedec.errors import PlanError
from treedec.tree.layout import TreeLayout

PLANNERS = ("flatten", "node", "node_chunk", "path")
PERSISTENT_MIN_CHUNK = 256  # smallest automatic chunk for a persistent grid (auto_chunk_size)
PERSISTENT_MAX_CHUNK = 4096  # largest automatic chunk (auto_chunk_size's cap)
PERSISTENT_REFINE_CHUNK = 1024  # from here on flatten's one-round chunk is searched between powers of two
BALANCED_MIN_GAIN = 1.0  # balanced chunks replace even ones when their modeled longest unit is <= this of the even one's
_LOW_BITS = (np.int64(1) << np.arange(MASK_BITS + 1, dtype=np.int64)) - 1  # _LOW_BITS[n]: n low bits set
_LOW_BITS.setflags(write=False)


@dataclass(frozen=True)
class PlanConfig:
    """How to cut and tile.

    ``chunk_size`` (ignored by the ``node`` planner): None chooses it per step from the
    tree (:func:`auto_chunk_size`). ``query_tile`` (entries per work item): None chooses
    it from the GQA group size, so that a program has about 64 rows (queries x heads).
    ``num_kv_heads`` and ``num_sms`` feed the automatic chunk size (programs run per KV
    head, on that many multiprocessors). ``persistent_ctas`` (the cuda backend's persistent
    grid) switches the automatic chunk size to one that spreads the work evenly over that many
    CTAs (for ``flatten``, so that its units, work items x KV heads, fit one round of them).
    ``light_tile_cost`` (in (0, 1]; None means 1 unless the cuda backend fills it in for its
    sm_90a kernel): what a KV tile costs a unit whose rows fill at most half of it, relative to a
    fuller unit's. Below 1, ``flatten`` on a persistent grid with long units cuts chunks that
    balance unit time instead of tokens (:mod:`~treedec.attention.balanced_chunks`): chunks that
    few queries read grow longer.

    ``batch_invariant``: plans whose every query's reduction order is a function of its own root path and
    ``chunk_size`` alone, whatever the rest of the forest (the batch-invariant mode): it needs the ``path``
    planner with a fixed ``chunk_size`` C (each query's path cut at absolute positions, windows ``[k*C, (k+1)*C)``,
    its partials merged in window order; a window's chunk shared by the queries that read exactly its keys:
    :mod:`~treedec.attention.position_windows`), and backends that compute each row of a chunk on its own
    (:meth:`~treedec.attention.backends.Backend.why_not_batch_invariant`).
    """

    planner: str = "flatten"
    chunk_size: int | None = None
    query_tile: int | None = None
    num_kv_heads: int = 8
    num_sms: int = 132
    persistent_ctas: int | None = None
    light_tile_cost: float | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        if self.planner not in PLANNERS:
            raise PlanError(f"planner must be one of {PLANNERS}, got {self.planner!r}")
        if self.batch_invariant and (self.planner != "path" or self.chunk_size is None):
            raise PlanError(f"batch_invariant plans need planner='path' and a fixed chunk_size (a query's chunks "
                            f"then follow its own path only), got planner={self.planner!r}, "
                            f"chunk_size={self.chunk_size!r}")
        for name in ("chunk_size", "query_tile", "num_kv_heads", "num_sms", "persistent_ctas"):
            value = getattr(self, name)
            if value is None and name in ("chunk_size", "query_tile", "persistent_ctas"):
                continue
            if type(value) is not int or value < 1:   # every reference plan (replace): a plain int skips the call
                positive_int(name, value, error=PlanError, numpy=True)
        if self.light_tile_cost is not None:
            fraction("light_tile_cost", self.light_tile_cost, error=PlanError)


def default_query_tile(group_size: int, rows: int = 64) -> int:
    """Entries per work item so that a program has about ``rows`` rows (``group_size`` = Hq / Hkv)."""
    if group_size < 1:
        raise PlanError(f"group_size must be >= 1, got {group_size}")
    return max(1, rows // group_size)


def make_plan(layout: TreeLayout, config: PlanConfig = PlanConfig(), group_size: int = 1,
              variant: AttentionVariant = AttentionVariant()) -> TreePlan:
    """Plan one step: see the module docstring for the planners.

    ``group_size`` (Hq / Hkv) sizes the query tile when ``config.query_tile`` is None. ``variant``'s mask
    fields (its window) clip the reads; its logit fields do not concern plans. The compiled planner or the
    numpy reference runs, as :func:`~treedec.attention.planner_choice.planner_impl` reports; both give the
    same plan.
    """
    if not isinstance(layout, TreeLayout):
        raise TypeError(f"layout must be a TreeLayout (SequenceTree.layout() gives the step's), got "
                        f"{type(layout).__name__}")
    if not isinstance(config, PlanConfig):
        raise TypeError(f"config must be a PlanConfig, got {type(config).__name__}")
    if not isinstance(variant, AttentionVariant):
        raise TypeError(f"variant must be an AttentionVariant, got {type(variant).__name__}")
    positive_int("group_size", group_size, error=PlanError, numpy=True)
    if layout.num_queries == 0:
        raise PlanError("the layout has no queries: nothing to attend (no pending tokens in the tree?)")
    query_tile = default_query_tile(group_size) if config.query_tile is None else config.query_tile
    module = planner_impl().module
    if module is not None:
        return _compiled_plan(module, layout, config, query_tile, group_size, variant)
    plan = _numpy_plan(layout, replace(config, query_tile=query_tile), group_size, variant)
    return plan if variant.window is None else replace(plan, window=variant.window)


def _numpy_plan(layout: TreeLayout, config: PlanConfig, group_size: int, variant: AttentionVariant) -> TreePlan:
    """The reference planner (``config.query_tile`` resolved)."""
    q_idx, lo, hi, kv_slots, node_start, node_len = read_intervals(layout, variant)
    if config.batch_invariant:
        first = np.zeros(layout.num_queries, np.int64) if variant.window is None else \
            variant.first_visible(layout.query_position)
        windows = position_windows(q_idx, lo, hi, kv_slots, first, config.chunk_size)
        return _plan_from_bounds(layout, config, windows.q_idx, windows.lo, windows.hi, windows.kv_slots,
                                 windows.bounds)
    if config.planner == "path":
        return _plan_paths(layout, config, q_idx, lo, hi, kv_slots)
    total = len(kv_slots)
    auto_chunk = config.chunk_size is None
    persistent_flatten = config.persistent_ctas is not None and config.planner == "flatten"
    if auto_chunk and persistent_flatten:
        segments = unshared_segments(q_idx, lo, hi, total)
        bounds = None if segments is None else split_kv_bounds(  # no KV shared: pieces of each query's own tokens
            segments, config.num_kv_heads, config.persistent_ctas, group_size, PERSISTENT_MIN_CHUNK,
            PERSISTENT_MAX_CHUNK)
        if bounds is not None:
            config = replace(config, chunk_size=int(np.diff(bounds).max()))
            return _plan_from_bounds(layout, config, q_idx, lo, hi, kv_slots, bounds)
    runs = _sorted_runs(q_idx, lo, hi) if auto_chunk and persistent_flatten else None  # the unit counts' input
    if auto_chunk and config.planner != "node":
        # KV loads per KV head: sum over tokens of ceil(readers / query_tile), estimated
        # as readers / query_tile + 1/2 per token (the rule rounds to a power of two).
        work = ((hi - lo).sum() / config.query_tile + 0.5 * total) * config.num_kv_heads
        chunk_size = auto_chunk_size(int(work), config.num_sms, config.persistent_ctas)
        if persistent_flatten:
            chunk_size = _one_round_chunk_size(chunk_size, config, runs, total)
        config = replace(config, chunk_size=chunk_size)
    if config.planner == "flatten":
        bounds = _flatten_bounds(total, config.chunk_size)
        if auto_chunk and _balances_unit_time(config):
            bounds, chunk_size = _balanced_or_even(bounds, config, runs, total)
            config = replace(config, chunk_size=chunk_size)
    else:
        piece = config.chunk_size if config.planner == "node_chunk" else None
        bounds = _node_bounds(node_start, node_len, total, piece)
    return _plan_from_bounds(layout, config, q_idx, lo, hi, kv_slots, bounds)


def auto_chunk_size(work: int, num_sms: int = 132, persistent_ctas: int | None = None) -> int:
    """Chunk size for ``work`` KV tokens streamed by all programs together.

    ``work`` is the sum over KV heads, query tiles and tokens of one load each (KV
    heads x sum over tokens of ceil(readers / query_tile)); it hardly depends on the
    chunk size. Larger chunks
    mean fewer partial states to merge, smaller ones more programs to fill the GPU; the
    best chunk, swept on an H200 (132 SMs) over the 8 workloads of BENCH.md
    (bench/results/2026-11-21-nvidia-h200-triton-configs.json), is the power of two
    nearest to sqrt(2.2 * work * 132 / num_sms), between 64 and 4096 tokens.

    With ``persistent_ctas`` (a persistent grid that balances units itself), the power of two
    nearest to ``work / persistent_ctas``: about one unit per CTA (swept on an H200:
    bench/results/2026-11-22-nvidia-h200-cuda-chunk-sweep.json), and at least
    PERSISTENT_MIN_CHUNK tokens: below that a unit's fixed cost (Q rows, pipeline fill, partial
    state) buys little parallelism, and small trees would multiply their partial states. The
    ``flatten`` planner then counts the units it would make and coarsens (or, for long units,
    refines) it to one round of them (``_one_round_chunk_size``).
    """
    if persistent_ctas is not None:
        ideal = max(work / persistent_ctas, PERSISTENT_MIN_CHUNK)
    else:
        ideal = math.sqrt(2.2 * max(work, 1) * 132 / num_sms)
    return int(min(PERSISTENT_MAX_CHUNK, max(64, 2 ** round(math.log2(ideal)))))


def plan_flatten(layout: TreeLayout, chunk_size: int = 256, query_tile: int = 16) -> TreePlan:
    return make_plan(layout, PlanConfig("flatten", chunk_size, query_tile))


def plan_node(layout: TreeLayout, query_tile: int = 16) -> TreePlan:
    return make_plan(layout, PlanConfig("node", 1, query_tile))


def plan_node_chunk(layout: TreeLayout, chunk_size: int = 256, query_tile: int = 16) -> TreePlan:
    return make_plan(layout, PlanConfig("node_chunk", chunk_size, query_tile))


# ===================================================================== private


def _compiled_plan(module, layout: TreeLayout, config: PlanConfig, query_tile: int, group_size: int,
                   variant: AttentionVariant) -> TreePlan:
    """:func:`make_plan` by the compiled planner (``treedec/kernels/planner/make_plan.h``)."""
    (kv_slots, chunk_kv_start, chunk_entry_start, entry_query, entry_mask, query_entry_start, query_entries,
     entry_direct, item_chunk, item_entry_start, item_num_entries, chunk_size, max_slot) = module.make_plan(
        layout.parent, layout.kv_start, layout.kv_slots, layout.query_node, layout.query_offset,
        PLANNERS.index(config.planner), config.chunk_size or 0, query_tile, config.num_kv_heads, config.num_sms,
        config.persistent_ctas or 0, float(config.light_tile_cost or 1.0), group_size, variant.window or 0,
        config.batch_invariant)
    return TreePlan(planner=config.planner, num_queries=layout.num_queries,
                    kv_slots=layout.kv_slots if kv_slots is None else kv_slots, chunk_kv_start=chunk_kv_start,
                    chunk_entry_start=chunk_entry_start, entry_query=entry_query, entry_mask=entry_mask,
                    query_entry_start=query_entry_start, query_entries=query_entries, entry_direct=entry_direct,
                    item_chunk=item_chunk, item_entry_start=item_entry_start, item_num_entries=item_num_entries,
                    chunk_size=chunk_size, query_tile=query_tile, max_slot=max_slot, layout=layout,
                    window=variant.window)


def _flatten_bounds(total: int, chunk_size: int) -> np.ndarray:
    """[C + 1] token bounds of ``flatten``'s even chunks of at most ``chunk_size`` tokens."""
    num_chunks = -(-total // chunk_size)
    step = -(-total // num_chunks)
    return np.minimum(np.arange(num_chunks + 1, dtype=np.int64) * step, total)


def _units_per_kv_head(total: int, chunk_size: int, runs, query_tile: int) -> int:
    """Work items a flatten plan of ``chunk_size`` over ``total`` tokens would have: per chunk, the
    distinct queries reading it, ``query_tile`` to an item (one persistent unit per KV head when an
    item's rows fit a unit, as the cuda backend's query tile makes them). ``runs`` are the read
    intervals sorted by query, then start (:func:`_sorted_runs`)."""
    return units_per_kv_head(_flatten_bounds(total, chunk_size), runs, query_tile) if total else 0


def _sorted_runs(q_idx, lo, hi):
    """The read intervals ``(q_idx, lo, hi)`` sorted by query, then start."""
    order = np.lexsort((lo, q_idx))
    return q_idx[order], lo[order], hi[order]


def _one_round_chunk_size(chunk_size: int, config: PlanConfig, runs, total: int) -> int:
    """Double ``chunk_size`` (up to PERSISTENT_MAX_CHUNK) while the step has more units than the
    persistent grid has CTAs: a few CTAs running a second unit each set the step's time (H200,
    bench/results/2026-11-22-nvidia-h200-small-chunks.json: tot_sorting1 160 units on 132 CTAs
    29.9 us at 256 tokens, 80 units 24.3 us at 512).

    From PERSISTENT_REFINE_CHUNK tokens on, units are long enough that their length sets the
    step's time, and the chunk becomes the finest even one between that power of two and half of
    it whose units still fit one round (a binary search: units grow with the chunk count; each
    chunk has a unit per KV head). H200, one run (...-planner-ab-*.json): fewshot_b50_p16k 90.4 ->
    78.7 us (4096 -> 3273 tokens), fewshot_b30_p4k 34.5 -> 30.1 (1024 -> 625); below it finer
    chunks lost (tot_sorting1 21.2 -> 23.6 us at 512 -> 310 tokens: units of a few tiles wait on
    latency, not tiles, and every chunk adds a partial state per query to merge). ``runs``: the read
    intervals of :func:`_sorted_runs`."""

    def fits(n: int) -> bool:  # n even chunks
        units = _units_per_kv_head(total, -(-total // n), runs, config.query_tile)
        return units * config.num_kv_heads <= config.persistent_ctas

    while chunk_size < PERSISTENT_MAX_CHUNK and not fits(-(-total // chunk_size)):
        chunk_size *= 2
    if chunk_size < PERSISTENT_REFINE_CHUNK:
        return chunk_size
    fewest = -(-total // chunk_size)
    if not fits(fewest):
        return chunk_size
    most = max(fewest, min(-(-total // (chunk_size // 2)), config.persistent_ctas // config.num_kv_heads))
    while fewest < most:  # invariant: fits(fewest)
        mid = (fewest + most + 1) // 2
        if fits(mid):
            fewest = mid
        else:
            most = mid - 1
    return -(-total // fewest)


def _balances_unit_time(config: PlanConfig) -> bool:
    """Whether ``flatten``'s automatic chunks balance unit time: on a persistent grid, with light units
    cheaper, and only for chunks the one-round rule refined (> PERSISTENT_REFINE_CHUNK / 2 tokens):
    shorter units wait on latency, not tiles (see :func:`_one_round_chunk_size`)."""
    return (config.persistent_ctas is not None and (config.light_tile_cost or 1.0) < 1.0
            and config.chunk_size > PERSISTENT_REFINE_CHUNK // 2)


def _balanced_or_even(even, config: PlanConfig, runs, total: int):
    """``(bounds, chunk_size)``: the balanced chunks of :mod:`~treedec.attention.balanced_chunks` when their
    longest unit is at most BALANCED_MIN_GAIN of the even chunks' (``even``) under its cost model, else the
    even ones. On an H200 a 16% shorter modeled unit ran fewshot_b30_p4k 7% faster
    (bench/results/2026-11-22-nvidia-h200-balanced-chunks-ab.json); a 4% shorter one ran fewshot_b50_p16k
    0.5 us slower with 64-token KV tiles (ibid.: a margin of 10% kept it even) but 2.0 us faster (72.2 ->
    70.1 us) with the 96-token tiles its long chunks now run (...-balanced-96-ab.json), so no margin."""
    even_readers = readers_per_chunk(even, runs)
    if (even_readers > config.query_tile // 2).all():
        return even, config.chunk_size  # no light chunk to lengthen (saves the search: ~0.5 ms a step)
    balanced = balanced_flatten_bounds(runs, total, config.query_tile, config.num_kv_heads, config.persistent_ctas,
                                       config.light_tile_cost, PERSISTENT_MAX_CHUNK)
    even_cost = longest_unit_cost(even, runs, config.query_tile, config.light_tile_cost, even_readers)
    if balanced is None or (longest_unit_cost(balanced, runs, config.query_tile, config.light_tile_cost)
                            > BALANCED_MIN_GAIN * even_cost):
        return even, config.chunk_size
    return balanced, int(np.diff(balanced).max())


def _plan_paths(layout, config, q_idx, lo, hi, kv_slots) -> TreePlan:
    """The ``path`` planner: each query's path copied into its own segment, cut into chunks."""
    order = np.lexsort((lo, q_idx))                       # per query, root to leaf
    q_idx, lo, hi = q_idx[order], lo[order], hi[order]
    span = hi - lo
    starts = np.cumsum(span) - span
    gather = np.repeat(lo - starts, span) + np.arange(int(span.sum()))
    path_len = np.bincount(q_idx, weights=span, minlength=layout.num_queries).astype(np.int64)
    path_start = np.cumsum(path_len) - path_len
    if config.chunk_size is None:
        config = replace(config, chunk_size=auto_chunk_size(int(path_len.sum()) * config.num_kv_heads,
                                                            config.num_sms, config.persistent_ctas))
    bounds = _node_bounds(path_start, path_len, int(path_len.sum()), config.chunk_size)
    queries = np.arange(layout.num_queries, dtype=np.int64)
    return _plan_from_bounds(layout, config, queries, path_start, path_start + path_len, kv_slots[gather], bounds)


def _node_bounds(node_start, node_len, total, piece):
    """Chunk borders at node borders, each node optionally cut into even pieces <= piece."""
    nonempty = node_len > 0
    starts, lens = node_start[nonempty], node_len[nonempty]
    if piece is None:
        return np.append(starts, total).astype(np.int64)
    pieces = -(-lens // piece)
    step = -(-lens // pieces)
    node_of = np.repeat(np.arange(len(lens)), pieces)
    k = np.arange(len(node_of)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    return np.append(starts[node_of] + k * step[node_of], total).astype(np.int64)


def _plan_from_bounds(layout, config, q_idx, lo, hi, kv_slots, bounds) -> TreePlan:
    num_q = layout.num_queries
    chunk_len = np.diff(bounds)
    num_chunks = len(chunk_len)
    words = -(-int(chunk_len.max()) // MASK_BITS)

    # Split every interval into its pieces per chunk.
    c0 = np.searchsorted(bounds, lo, side="right") - 1
    c1 = np.searchsorted(bounds, hi - 1, side="right") - 1
    span = c1 - c0 + 1
    src = np.repeat(np.arange(len(lo)), span)
    chunk = c0[src] + np.arange(len(src)) - np.repeat(np.cumsum(span) - span, span)
    p_lo = np.maximum(lo[src], bounds[chunk]) - bounds[chunk]
    p_hi = np.minimum(hi[src], bounds[chunk + 1]) - bounds[chunk]
    query = q_idx[src]

    # Entries: distinct (chunk, query), sorted by chunk then query.
    keys, entry_of_piece = _unique_inverse(chunk * num_q + query, num_chunks * num_q)
    entry_chunk, entry_query = keys // num_q, keys % num_q
    num_entries = len(keys)

    # Masks. An entry that reads its whole chunk (the common case: a shared prefix) gets
    # its chunk's full row; the others OR the bit runs of their pieces, word by word.
    p_len = p_hi - p_lo
    full = np.bincount(entry_of_piece, weights=p_len, minlength=num_entries) == chunk_len[entry_chunk]
    col = np.arange(words, dtype=np.int64) * MASK_BITS
    full_rows = _bit_runs(0, chunk_len[:, None], col[None, :]).astype(np.uint32)  # [C, W]
    entry_mask = np.take(full_rows, entry_chunk, axis=0)                            # [E, W]
    part = ~full[entry_of_piece]
    if part.any():
        partial = np.flatnonzero(~full)
        row = np.searchsorted(partial, entry_of_piece[part])   # each piece's row among the partial entries
        entry_mask[partial] = _run_masks(p_lo[part], p_hi[part], row, len(partial), words)
    entry_mask = entry_mask.view(np.int32)

    chunk_entry_start = np.zeros(num_chunks + 1, dtype=np.int64)
    np.cumsum(np.bincount(entry_chunk, minlength=num_chunks), out=chunk_entry_start[1:])
    per_query = np.bincount(entry_query, minlength=num_q)
    query_entry_start = np.zeros(num_q + 1, dtype=np.int64)
    np.cumsum(per_query, out=query_entry_start[1:])
    query_entries = np.argsort(entry_query, kind="stable")

    # Work items: each chunk's entries in tiles of query_tile, heaviest first.
    qt = config.query_tile
    group = np.diff(chunk_entry_start)
    tiles = -(-group // qt)
    item_chunk = np.repeat(np.arange(num_chunks), tiles)
    tile = np.arange(len(item_chunk)) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    item_entry_start = chunk_entry_start[item_chunk] + tile * qt
    item_num_entries = np.minimum(qt, group[item_chunk] - tile * qt)
    order = np.argsort(-(item_num_entries + chunk_len[item_chunk]), kind="stable")

    return TreePlan(
        planner=config.planner,
        num_queries=num_q,
        kv_slots=kv_slots,
        chunk_kv_start=bounds,
        chunk_entry_start=chunk_entry_start,
        entry_query=entry_query,
        entry_mask=entry_mask,
        query_entry_start=query_entry_start,
        query_entries=query_entries,
        entry_direct=per_query[entry_query] == 1,
        item_chunk=item_chunk[order],
        item_entry_start=item_entry_start[order],
        item_num_entries=item_num_entries[order],
        chunk_size=None if config.planner == "node" else config.chunk_size,
        query_tile=qt,
        max_slot=int(kv_slots.max()),
        layout=layout,
    )


def _run_masks(lo, hi, row, num_rows: int, words: int) -> np.ndarray:
    """[num_rows, words] masks (float64 holding 32-bit words exactly), row ``row[i]`` with bits
    ``[lo[i], hi[i])`` set (runs of a row disjoint).

    Each run sets its first and last word bit by bit; the words strictly between them are whole
    (all 32 bits), found as the words a difference array over each row counts as covered. So
    the cost is a few passes over the output plus two words per run, not one word per covered word.
    """
    w0, w1 = lo // MASK_BITS, (hi - 1) // MASK_BITS
    # Boundary words: the run's bits in its first and (when different) last word. Runs of one row
    # are disjoint (a query reads a token once), so a float sum of their bits is an exact OR.
    last = w1 > w0
    ends = np.concatenate([w0, w1[last]])
    end_rows = np.concatenate([row, row[last]])
    end_bits = _bit_runs(np.concatenate([lo, lo[last]]), np.concatenate([hi, hi[last]]), ends * MASK_BITS)
    masks = np.bincount(end_rows * words + ends, weights=end_bits, minlength=num_rows * words)
    inner = w1 > w0 + 1
    if inner.any():
        # +1 after a run's first word, -1 at its last: each row's deltas sum to 0, so one flat
        # cumsum over all rows counts each row's covered words.
        stride = words + 1
        delta = np.bincount(np.concatenate([row[inner] * stride + w0[inner] + 1, row[inner] * stride + w1[inner]]),
                            weights=np.repeat([1.0, -1.0], int(inner.sum())), minlength=num_rows * stride)
        covered = np.cumsum(delta).reshape(num_rows, stride)[:, :words] > 0
        masks[covered.reshape(-1)] = float(_LOW_BITS[MASK_BITS])
    return masks.reshape(num_rows, words)


def _bit_runs(lo, hi, word_start):
    """int64 words holding bits [lo, hi) clipped to the 32 bits that start at ``word_start``."""
    b_lo = np.minimum(np.maximum(lo - word_start, 0), MASK_BITS)
    b_hi = np.minimum(np.maximum(hi - word_start, 0), MASK_BITS)
    return _LOW_BITS[np.maximum(b_hi - b_lo, 0)] << b_lo


def _unique_inverse(keys, num_keys: int):
    """``np.unique(keys, return_inverse=True)`` for keys in [0, num_keys).

    A dense presence table when the key space is small, else one stable sort; both are
    several times faster than np.unique here.
    """
    if num_keys <= 8 * len(keys) + 65536:
        present = np.bincount(keys, minlength=num_keys) > 0
        rank = np.cumsum(present) - 1
        return np.flatnonzero(present), rank[keys]
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    new_run = np.empty(len(keys), dtype=bool)
    new_run[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new_run[1:])
    inverse = np.empty(len(keys), dtype=np.int64)
    inverse[order] = np.cumsum(new_run) - 1
    return ordered[new_run], inverse
