// Chunk borders and automatic chunk sizes: planners.auto_chunk_size, _flatten_bounds, _node_bounds and
// _one_round_chunk_size.
#pragma once

#include "common.h"
#include "readers.h"

namespace treedec::planner {

// planners.auto_chunk_size; persistent_ctas <= 0 means None. Python's round() rounds half to even,
// as nearbyint does in the default rounding mode; math.log2 is libm's log2.
inline i64 auto_chunk_size(i64 work, i64 num_sms, i64 persistent_ctas) {
  double ideal;
  if (persistent_ctas > 0) {
    ideal = std::max(static_cast<double>(work) / static_cast<double>(persistent_ctas),
                     static_cast<double>(kPersistentMinChunk));
  } else {
    ideal = std::sqrt(2.2 * static_cast<double>(std::max<i64>(work, 1)) * 132.0 / static_cast<double>(num_sms));
  }
  const double power = std::ldexp(1.0, static_cast<int>(std::nearbyint(std::log2(ideal))));
  return static_cast<i64>(std::min(static_cast<double>(kPersistentMaxChunk), std::max(64.0, power)));
}

// planners._flatten_bounds: [C + 1] borders of even chunks of at most chunk_size tokens (total > 0).
inline Vec flatten_bounds(i64 total, i64 chunk_size) {
  const i64 num_chunks = ceil_div(total, chunk_size);
  const i64 step = ceil_div(total, num_chunks);
  Vec bounds(num_chunks + 1);
  for (i64 i = 0; i <= num_chunks; ++i) bounds[i] = std::min(i * step, total);
  return bounds;
}

// planners._node_bounds: borders at the starts of nonempty nodes, each node cut into even pieces of
// at most `piece` tokens (piece <= 0: whole nodes).
inline Vec node_bounds(const Vec& node_start, const Vec& node_len, i64 total, i64 piece) {
  Vec bounds;
  for (size_t n = 0; n < node_len.size(); ++n) {
    const i64 len = node_len[n];
    if (len <= 0) continue;
    if (piece <= 0) {
      bounds.push_back(node_start[n]);
      continue;
    }
    const i64 pieces = ceil_div(len, piece), step = ceil_div(len, pieces);
    for (i64 k = 0; k < pieces; ++k) bounds.push_back(node_start[n] + k * step);
  }
  bounds.push_back(total);
  return bounds;
}

// planners._one_round_chunk_size: coarsen (then, from kPersistentRefineChunk on, refine by bisection)
// flatten's chunk until its units fit one round of the persistent grid.
inline i64 one_round_chunk_size(i64 chunk_size, i64 query_tile, i64 num_kv_heads, i64 ctas, const Readers& readers,
                                i64 total) {
  auto fits = [&](i64 n) {  // n even chunks
    const i64 units = total ? readers.units(flatten_bounds(total, ceil_div(total, n)), query_tile) : 0;
    return units * num_kv_heads <= ctas;
  };
  while (chunk_size < kPersistentMaxChunk && !fits(ceil_div(total, chunk_size))) chunk_size *= 2;
  if (chunk_size < kPersistentRefineChunk) return chunk_size;
  i64 fewest = ceil_div(total, chunk_size);
  if (!fits(fewest)) return chunk_size;
  i64 most = std::max(fewest, std::min(ceil_div(total, chunk_size / 2), ctas / num_kv_heads));
  while (fewest < most) {  // invariant: fits(fewest)
    const i64 mid = (fewest + most + 1) / 2;
    if (fits(mid)) {
      fewest = mid;
    } else {
      most = mid - 1;
    }
  }
  return ceil_div(total, fewest);
}

}  // namespace treedec::planner
