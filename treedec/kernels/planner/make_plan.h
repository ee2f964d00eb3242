// One step's plan from a TreeLayout's arrays: planners.make_plan (and read_intervals, _plan_paths, position_windows).
#pragma once

#include <limits>
#include <string>

#include "balanced_chunks.h"
#include "chunk_sizes.h"
#include "common.h"
#include "plan_arrays.h"
#include "position_windows.h"
#include "split_kv.h"

namespace treedec::planner {

// A TreeLayout's arrays (tree/layout.py), borrowed.
struct LayoutView {
  const i64* parent;
  const i64* kv_start;  // [N + 1]
  const i64* kv_slots;  // [T]
  const i64* query_node;
  const i64* query_offset;
  i64 num_nodes, num_tokens, num_queries;
};

// planners.PlanConfig, resolved: chunk_size <= 0 is automatic, persistent_ctas <= 0 is None,
// light_tile_cost is 1.0 where the config has None; window: AttentionVariant.window, <= 0 for None;
// batch_invariant: the config's (the path planner with a fixed chunk_size, checked by PlanConfig).
struct PlanOptions {
  int planner;
  i64 chunk_size, query_tile, num_kv_heads, num_sms, persistent_ctas;
  double light_tile_cost;
  i64 group_size;
  i64 window;
  bool batch_invariant;
};

struct Plan {
  PlanArrays arrays;
  bool layout_slots;  // kv_slots is the layout's own array (every node needed): `kv_slots` is empty
  Vec kv_slots;
  i64 chunk_size;     // -1: None (the node planner)
  i64 max_slot;
};

struct QueryIntervals {
  Intervals iv;          // sorted by (q, lo)
  Vec node_start, node_len;
  bool all_needed;
  Vec kv_slots;          // the compacted slots when some node is not needed
  Vec first;             // each query's first key position (windowed reads; empty: 0, the root)
};

inline void check_layout(const LayoutView& L) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("compiled planner: " + what); };
  if (L.kv_start[0] != 0 || L.kv_start[L.num_nodes] != L.num_tokens) fail("kv_start does not span kv_slots");
  for (i64 n = 0; n < L.num_nodes; ++n) {
    if (L.parent[n] < -1 || L.parent[n] >= L.num_nodes) fail("parent index out of range");
    if (L.kv_start[n + 1] < L.kv_start[n]) fail("kv_start is not nondecreasing");
  }
  for (i64 q = 0; q < L.num_queries; ++q) {
    const i64 n = L.query_node[q];
    if (n < 0 || n >= L.num_nodes) fail("query_node out of range");
    if (L.query_offset[q] < 0 || L.query_offset[q] >= L.kv_start[n + 1] - L.kv_start[n]) {
      fail("query_offset out of range");
    }
  }
}

// read_intervals._whole_paths: each query's read set as intervals over the compacted flattened KV (only
// nodes some query reads keep their tokens). A walk up from each query; a parent cycle raises.
inline QueryIntervals query_intervals(const LayoutView& L) {
  QueryIntervals out;
  std::vector<std::uint8_t> needed(L.num_nodes, 0);
  i64 num_needed = 0;
  for (i64 q = 0; q < L.num_queries; ++q) {
    i64 steps = 0;
    for (i64 n = L.query_node[q]; n >= 0 && !needed[n]; n = L.parent[n]) {
      if (++steps > L.num_nodes) throw std::invalid_argument("compiled planner: the layout's parents form a cycle");
      needed[n] = 1;
      ++num_needed;
    }
  }
  out.all_needed = num_needed == L.num_nodes;
  out.node_start.resize(L.num_nodes);
  out.node_len.resize(L.num_nodes);
  i64 start = 0;
  for (i64 n = 0; n < L.num_nodes; ++n) {
    const i64 len = L.kv_start[n + 1] - L.kv_start[n];
    out.node_start[n] = out.all_needed ? L.kv_start[n] : start;
    out.node_len[n] = needed[n] ? len : 0;
    if (!out.all_needed && needed[n]) {
      out.kv_slots.insert(out.kv_slots.end(), L.kv_slots + L.kv_start[n], L.kv_slots + L.kv_start[n + 1]);
      start += len;
    }
  }
  std::vector<std::pair<i64, i64>> reads;  // one query's (lo, hi) pairs
  for (Vec* v : {&out.iv.q, &out.iv.lo, &out.iv.hi}) v->reserve(4 * L.num_queries);
  for (i64 q = 0; q < L.num_queries; ++q) {
    reads.clear();
    const i64 own = L.query_node[q];
    reads.emplace_back(out.node_start[own], out.node_start[own] + L.query_offset[q] + 1);
    i64 steps = 0;
    for (i64 n = L.parent[own]; n >= 0; n = L.parent[n]) {
      if (++steps > L.num_nodes) {
        throw std::invalid_argument("compiled planner: the layout's parents form a cycle");
      }
      if (out.node_len[n] > 0) reads.emplace_back(out.node_start[n], out.node_start[n] + out.node_len[n]);
    }
    std::reverse(reads.begin(), reads.end());  // root first: ascending in preorder
    if (!std::is_sorted(reads.begin(), reads.end())) std::sort(reads.begin(), reads.end());  // any other order
    for (const auto& [lo, hi] : reads) {
      out.iv.q.push_back(q);
      out.iv.lo.push_back(lo);
      out.iv.hi.push_back(hi);
    }
  }
  return out;
}

// read_intervals._windowed: each query's intervals clipped to the positions its window shows (from
// AttentionVariant.first_visible: max(position - window + 1, 0)); a node's tokens before every reader's first
// visible one are dropped from the flattened KV, as are nodes no clipped interval reads.
inline QueryIntervals windowed_query_intervals(const LayoutView& L, i64 window) {
  QueryIntervals out;
  constexpr i64 kNone = std::numeric_limits<i64>::max();
  Vec node_skip(L.num_nodes, kNone);
  struct Row { i64 q, node, skip, read; };
  std::vector<Row> rows;
  rows.reserve(4 * L.num_queries);
  out.first.resize(L.num_queries);
  Vec path;  // one query's nodes, its own first
  for (i64 q = 0; q < L.num_queries; ++q) {
    path.clear();
    const i64 own = L.query_node[q];
    i64 total = L.query_offset[q] + 1;  // the root path's tokens, then each row's first position
    path.push_back(own);
    for (i64 n = L.parent[own]; n >= 0; n = L.parent[n]) {
      if (static_cast<i64>(path.size()) > L.num_nodes) {
        throw std::invalid_argument("compiled planner: the layout's parents form a cycle");
      }
      path.push_back(n);
      total += L.kv_start[n + 1] - L.kv_start[n];
    }
    const i64 first = std::max<i64>(total - 1 - (window - 1), 0);
    out.first[q] = first;
    i64 start = total;  // the first position of the row below (none yet: one past the query)
    for (size_t i = 0; i < path.size(); ++i) {
      const i64 n = path[i];
      const i64 read = i == 0 ? L.query_offset[q] + 1 : L.kv_start[n + 1] - L.kv_start[n];
      start -= read;
      const i64 skip = std::max<i64>(first - start, 0);
      if (read > skip) {
        rows.push_back({q, n, skip, read});
        node_skip[n] = std::min(node_skip[n], skip);
      }
    }
  }
  bool all_kept = true;
  for (i64 n = 0; n < L.num_nodes; ++n) all_kept = all_kept && node_skip[n] == 0;
  out.all_needed = all_kept;
  out.node_start.resize(L.num_nodes);
  out.node_len.resize(L.num_nodes);
  i64 start = 0;
  for (i64 n = 0; n < L.num_nodes; ++n) {
    const bool needed = node_skip[n] != kNone;
    if (!needed) node_skip[n] = 0;
    const i64 len = needed ? L.kv_start[n + 1] - L.kv_start[n] - node_skip[n] : 0;
    out.node_start[n] = all_kept ? L.kv_start[n] : start;
    out.node_len[n] = len;
    if (!all_kept && len > 0) {
      out.kv_slots.insert(out.kv_slots.end(), L.kv_slots + L.kv_start[n] + node_skip[n], L.kv_slots + L.kv_start[n + 1]);
      start += len;
    }
  }
  std::vector<std::pair<i64, i64>> reads;  // one query's (lo, hi) pairs
  for (Vec* v : {&out.iv.q, &out.iv.lo, &out.iv.hi}) v->reserve(rows.size());
  for (size_t r = 0; r < rows.size();) {
    const i64 q = rows[r].q;
    reads.clear();
    for (; r < rows.size() && rows[r].q == q; ++r) {
      const i64 base = out.node_start[rows[r].node] - node_skip[rows[r].node];
      reads.emplace_back(base + rows[r].skip, base + rows[r].read);
    }
    std::sort(reads.begin(), reads.end());
    for (const auto& [lo, hi] : reads) {
      out.iv.q.push_back(q);
      out.iv.lo.push_back(lo);
      out.iv.hi.push_back(hi);
    }
  }
  return out;
}

// planners._plan_paths: each query's path copied into its own segment, cut into chunks.
inline Plan plan_paths(const LayoutView& L, const PlanOptions& o, const QueryIntervals& qi) {
  const Intervals& iv = qi.iv;
  const i64* slots = qi.all_needed ? L.kv_slots : qi.kv_slots.data();
  Plan plan;
  plan.layout_slots = false;
  Vec path_start(L.num_queries, 0), path_len(L.num_queries, 0);
  for (i64 i = 0; i < iv.size(); ++i) {
    path_len[iv.q[i]] += iv.hi[i] - iv.lo[i];
    plan.kv_slots.insert(plan.kv_slots.end(), slots + iv.lo[i], slots + iv.hi[i]);
  }
  i64 total = 0;
  for (i64 q = 0; q < L.num_queries; ++q) path_start[q] = total, total += path_len[q];
  plan.chunk_size = o.chunk_size > 0 ? o.chunk_size : auto_chunk_size(total * o.num_kv_heads, o.num_sms,
                                                                        o.persistent_ctas);
  Intervals own;
  for (i64 q = 0; q < L.num_queries; ++q) {
    own.q.push_back(q);
    own.lo.push_back(path_start[q]);
    own.hi.push_back(path_start[q] + path_len[q]);
  }
  plan.arrays = plan_from_bounds(L.num_queries, own, node_bounds(path_start, path_len, total, plan.chunk_size),
                                 o.query_tile);
  return plan;
}

// planners._numpy_plan's batch_invariant branch: position_windows' chunks, planned by plan_from_bounds.
inline Plan plan_position_windows(const LayoutView& L, const PlanOptions& o, const QueryIntervals& qi) {
  const i64* slots = qi.all_needed ? L.kv_slots : qi.kv_slots.data();
  const i64 total = qi.all_needed ? L.num_tokens : static_cast<i64>(qi.kv_slots.size());
  WindowChunks windows = position_windows(qi.iv, slots, total, qi.first, L.num_queries, o.chunk_size);
  Plan plan;
  plan.layout_slots = false;
  plan.chunk_size = o.chunk_size;
  plan.arrays = plan_from_bounds(L.num_queries, windows.reads, std::move(windows.bounds), o.query_tile);
  plan.kv_slots = std::move(windows.kv_slots);
  return plan;
}

inline i64 longest_chunk(const Vec& bounds) {
  i64 longest = 0;
  for (size_t c = 0; c + 1 < bounds.size(); ++c) longest = std::max(longest, bounds[c + 1] - bounds[c]);
  return longest;
}

// planners._balances_unit_time and _balanced_or_even: the balanced chunks when their modeled longest unit
// is at most kBalancedMinGain of the even chunks', else the even ones; returns the chunk size.
inline i64 balance_flatten(Vec& bounds, i64 chunk_size, const PlanOptions& o, const Readers& readers, i64 total) {
  if (o.persistent_ctas <= 0 || !(o.light_tile_cost < 1.0) || chunk_size <= kPersistentRefineChunk / 2) {
    return chunk_size;
  }
  const Intervals& runs = readers.runs;
  const Vec even_readers = readers(bounds);
  if (std::all_of(even_readers.begin(), even_readers.end(), [&](i64 r) { return r > o.query_tile / 2; })) {
    return chunk_size;  // no light chunk to lengthen
  }
  i64 num_queries = 0;  // distinct queries of the runs (sorted by query)
  for (i64 i = 0; i < runs.size(); ++i) num_queries += i == 0 || runs.q[i] != runs.q[i - 1];
  std::optional<Vec> balanced = balanced_flatten_bounds(readers, total, num_queries, o.query_tile, o.num_kv_heads,
                                                        o.persistent_ctas, o.light_tile_cost, kPersistentMaxChunk);
  const double even_cost = longest_unit_cost(bounds, even_readers, o.query_tile, o.light_tile_cost);
  if (!balanced || longest_unit_cost(*balanced, readers(*balanced), o.query_tile, o.light_tile_cost) >
                       kBalancedMinGain * even_cost) {
    return chunk_size;
  }
  bounds = std::move(*balanced);
  return longest_chunk(bounds);
}

// planners.make_plan, from the point where the query tile is resolved and the layout has queries.
inline Plan make_plan(const LayoutView& L, const PlanOptions& o) {
  check_layout(L);
  QueryIntervals qi = o.window > 0 ? windowed_query_intervals(L, o.window) : query_intervals(L);
  Plan plan;
  if (o.batch_invariant) {
    plan = plan_position_windows(L, o, qi);
  } else if (o.planner == kPath) {
    plan = plan_paths(L, o, qi);
  } else {
    const i64 total = qi.all_needed ? L.num_tokens : static_cast<i64>(qi.kv_slots.size());
    const bool auto_chunk = o.chunk_size <= 0, persistent_flatten = o.persistent_ctas > 0 && o.planner == kFlatten;
    i64 chunk_size = o.chunk_size;
    std::optional<Vec> bounds;
    if (auto_chunk && persistent_flatten) {
      if (std::optional<Vec> segments = unshared_segments(qi.iv, total)) {  // no KV shared: split-KV pieces
        bounds = split_kv_bounds(*segments, o.num_kv_heads, o.persistent_ctas, o.group_size, kPersistentMinChunk,
                                 kPersistentMaxChunk);
        if (bounds) chunk_size = longest_chunk(*bounds);
      }
    }
    if (!bounds) {
      // (the tree's order counts readers of whole ancestors: not those of windowed reads)
      const Readers readers{qi.iv, persistent_flatten && auto_chunk && o.window <= 0
                                       ? TreeOrder::of(L.parent, qi.node_start, qi.node_len, L.query_node,
                                                       L.query_offset, L.num_queries)
                                       : std::nullopt};
      if (auto_chunk && o.planner != kNode) {
        i64 read = 0;
        for (i64 i = 0; i < qi.iv.size(); ++i) read += qi.iv.hi[i] - qi.iv.lo[i];
        const double work = (static_cast<double>(read) / static_cast<double>(o.query_tile) +
                             0.5 * static_cast<double>(total)) * static_cast<double>(o.num_kv_heads);
        chunk_size = auto_chunk_size(static_cast<i64>(work), o.num_sms, o.persistent_ctas);
        if (persistent_flatten) {
          chunk_size = one_round_chunk_size(chunk_size, o.query_tile, o.num_kv_heads, o.persistent_ctas, readers, total);
        }
      }
      if (o.planner == kFlatten) {
        bounds = flatten_bounds(total, chunk_size);
        if (auto_chunk) chunk_size = balance_flatten(*bounds, chunk_size, o, readers, total);
      } else {
        bounds = node_bounds(qi.node_start, qi.node_len, total, o.planner == kNodeChunk ? chunk_size : 0);
      }
    }
    plan.arrays = plan_from_bounds(L.num_queries, qi.iv, std::move(*bounds), o.query_tile);
    plan.chunk_size = o.planner == kNode ? -1 : chunk_size;
    plan.layout_slots = qi.all_needed;
    plan.kv_slots = std::move(qi.kv_slots);
  }
  const i64* slots = plan.layout_slots ? L.kv_slots : plan.kv_slots.data();
  plan.max_slot = max_of(slots, plan.layout_slots ? L.num_tokens : static_cast<i64>(plan.kv_slots.size()));
  return plan;
}

}  // namespace treedec::planner
