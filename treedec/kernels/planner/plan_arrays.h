// A plan's arrays from its chunk borders: planners._plan_from_bounds.
#pragma once

#include "common.h"
#include "readers.h"

namespace treedec::planner {

// The TreePlan arrays a planner computes (tree_plan.TreePlan documents each).
struct PlanArrays {
  Vec chunk_kv_start, chunk_entry_start, entry_query, query_entry_start, query_entries;
  std::vector<std::int32_t> entry_mask;  // [E, mask_words], row-major
  i64 mask_words = 0;
  std::vector<std::uint8_t> entry_direct;  // numpy bool
  Vec item_chunk, item_entry_start, item_num_entries;
};

// Bits [lo, hi) of a mask row (lo < hi).
inline void set_bits(std::uint32_t* row, i64 lo, i64 hi) {
  const i64 w0 = lo / kMaskBits, w1 = (hi - 1) / kMaskBits;
  const std::uint32_t first = ~0u << (lo % kMaskBits), last = ~0u >> (kMaskBits - 1 - (hi - 1) % kMaskBits);
  if (w0 == w1) {
    row[w0] |= first & last;
    return;
  }
  row[w0] |= first;
  std::fill(row + w0 + 1, row + w1, ~0u);
  row[w1] |= last;
}

// Entries are the distinct (chunk, query) pairs, sorted by chunk then query. `iv` is sorted by
// (q, lo), so a query's pieces come chunk by chunk: its entries appear in chunk order, each once,
// and a counting sort by chunk (stable) gives the (chunk, query) order. An entry's mask is the OR of
// its pieces' bit runs (the numpy planner's full rows and run masks are that OR).
inline PlanArrays plan_from_bounds(i64 num_queries, const Intervals& iv, Vec bounds, i64 query_tile) {
  PlanArrays out;
  const i64 num_chunks = static_cast<i64>(bounds.size()) - 1;
  Vec chunk_len(num_chunks);
  i64 longest = 0;
  for (i64 c = 0; c < num_chunks; ++c) longest = std::max(longest, chunk_len[c] = bounds[c + 1] - bounds[c]);
  const i64 words = ceil_div(longest, kMaskBits);

  // Pass 1: entries in (query, chunk) order, their pieces, and entries per chunk.
  const Chunks chunks(bounds);
  Vec q_entry_query, q_entry_chunk, piece_entry, piece_lo, piece_hi, per_chunk(num_chunks + 1, 0);
  for (Vec* v : {&q_entry_query, &q_entry_chunk, &piece_entry, &piece_lo, &piece_hi}) {
    v->reserve(iv.size() + num_chunks);
  }
  for (i64 i = 0; i < iv.size(); ++i) {
    const i64 q = iv.q[i], c0 = chunks(iv.lo[i]), c1 = chunks(iv.hi[i] - 1);
    for (i64 c = c0; c <= c1; ++c) {
      if (q_entry_query.empty() || q_entry_query.back() != q || q_entry_chunk.back() != c) {
        q_entry_query.push_back(q);
        q_entry_chunk.push_back(c);
        ++per_chunk[c + 1];
      }
      piece_entry.push_back(static_cast<i64>(q_entry_query.size()) - 1);
      piece_lo.push_back(std::max(iv.lo[i], bounds[c]) - bounds[c]);
      piece_hi.push_back(std::min(iv.hi[i], bounds[c + 1]) - bounds[c]);
    }
  }
  const i64 num_entries = static_cast<i64>(q_entry_query.size());
  for (i64 c = 0; c < num_chunks; ++c) per_chunk[c + 1] += per_chunk[c];
  out.chunk_entry_start = per_chunk;

  // Each entry's index in (chunk, query) order; the per-query CSR lists it in chunk order.
  Vec index(num_entries), cursor(per_chunk.begin(), per_chunk.end() - 1), per_query(num_queries, 0);
  out.entry_query.resize(num_entries);
  for (i64 k = 0; k < num_entries; ++k) {
    index[k] = cursor[q_entry_chunk[k]]++;
    out.entry_query[index[k]] = q_entry_query[k];
    ++per_query[q_entry_query[k]];
  }
  out.query_entry_start.assign(num_queries + 1, 0);
  for (i64 q = 0; q < num_queries; ++q) out.query_entry_start[q + 1] = out.query_entry_start[q] + per_query[q];
  out.query_entries = index;
  out.entry_direct.resize(num_entries);
  for (i64 e = 0; e < num_entries; ++e) out.entry_direct[e] = per_query[out.entry_query[e]] == 1;

  // Pass 2: masks.
  out.mask_words = words;
  out.entry_mask.assign(num_entries * words, 0);
  auto* masks = reinterpret_cast<std::uint32_t*>(out.entry_mask.data());
  for (size_t p = 0; p < piece_entry.size(); ++p) {
    set_bits(masks + index[piece_entry[p]] * words, piece_lo[p], piece_hi[p]);
  }

  // Work items: each chunk's entries in tiles of query_tile, heaviest first (rows + kv_tokens, stable).
  Vec item_chunk, item_entry_start, item_num_entries;
  for (i64 c = 0; c < num_chunks; ++c) {
    const i64 group = per_chunk[c + 1] - per_chunk[c];
    for (i64 t = 0; t * query_tile < group; ++t) {
      item_chunk.push_back(c);
      item_entry_start.push_back(per_chunk[c] + t * query_tile);
      item_num_entries.push_back(std::min(query_tile, group - t * query_tile));
    }
  }
  const i64 num_items = static_cast<i64>(item_chunk.size());
  const Vec order = stable_order(num_items, [&](i64 x, i64 y) {
    return item_num_entries[x] + chunk_len[item_chunk[x]] > item_num_entries[y] + chunk_len[item_chunk[y]];
  });
  out.item_chunk.resize(num_items);
  out.item_entry_start.resize(num_items);
  out.item_num_entries.resize(num_items);
  for (i64 k = 0; k < num_items; ++k) {
    out.item_chunk[k] = item_chunk[order[k]];
    out.item_entry_start[k] = item_entry_start[order[k]];
    out.item_num_entries[k] = item_num_entries[order[k]];
  }
  out.chunk_kv_start = std::move(bounds);
  return out;
}

}  // namespace treedec::planner
