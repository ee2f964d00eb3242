// Chunk borders and automatic chunk sizes: planners.auto_chunk_size, _flatten_bounds, _node_bounds,
// _one_round_chunk_size and balanced_chunks.readers_per_chunk / units_per_kv_head.
#pragma once

#include "common.h"

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

// Chunk lookups (`chunk_of`) for readers_per_chunk and plan_from_bounds, which the chunk-size searches
// call many times: one division for flatten's even chunks, a binary search for other borders.
// token / step by a multiplication (an integer division is several times slower), corrected by one:
// tokens stay far below 2^52, where the product is off by less than one.
struct Divider {
  i64 step;
  double inverse;
  explicit Divider(i64 s) : step(s), inverse(s > 0 ? 1.0 / static_cast<double>(s) : 0.0) {}
  i64 operator()(i64 token) const {
    i64 q = static_cast<i64>(static_cast<double>(token) * inverse);
    if (q * step > token) {
      --q;
    } else if ((q + 1) * step <= token) {
      ++q;
    }
    return q;
  }
};

struct EvenChunks {
  Divider divide;
  i64 count;
  EvenChunks(i64 step, i64 num) : divide(step), count(num) {}
  i64 num_chunks() const { return count; }
  i64 operator()(i64 token) const { return divide(token); }
};

struct Chunks {  // any borders; even ones found by a check of every border
  const Vec& bounds;
  Divider divide;  // step > 0: bounds[i] == min(i * step, total) for every i

  explicit Chunks(const Vec& b) : bounds(b), divide(even_step(b)) {}
  i64 num_chunks() const { return static_cast<i64>(bounds.size()) - 1; }
  i64 operator()(i64 token) const { return divide.step > 0 ? divide(token) : chunk_of(bounds, token); }

  static i64 even_step(const Vec& bounds) {
    const i64 step = bounds.size() > 1 ? bounds[1] - bounds[0] : 0;
    for (size_t i = 0; i < bounds.size() && step > 0; ++i) {
      if (bounds[i] != std::min(static_cast<i64>(i) * step, bounds.back())) return 0;
    }
    return step;
  }
};

// balanced_chunks.readers_per_chunk: distinct queries reading each chunk (runs sorted by (q, lo)).
// Each run adds a reader to its chunks; one starting in the chunk where its query's previous run
// ended takes that reader back.
template <class Chunks>
Vec readers_per_chunk(const Chunks& chunks, const Intervals& runs) {
  const i64 num_chunks = chunks.num_chunks();
  Vec delta(num_chunks + 2, 0);
  i64 prev_q = -1, prev_last = -1;
  for (i64 i = 0; i < runs.size(); ++i) {
    const i64 first = chunks(runs.lo[i]), last = chunks(runs.hi[i] - 1);
    delta[first] += 1;
    delta[last + 1] -= 1;
    if (runs.q[i] == prev_q && first == prev_last) {
      delta[first] -= 1;
      delta[first + 1] += 1;
    }
    prev_q = runs.q[i];
    prev_last = last;
  }
  Vec readers(num_chunks);
  i64 running = 0;
  for (i64 c = 0; c < num_chunks; ++c) readers[c] = running += delta[c];
  return readers;
}

inline Vec readers_per_chunk(const Vec& bounds, const Intervals& runs) {
  return readers_per_chunk(Chunks(bounds), runs);
}

// balanced_chunks.units_per_kv_head: work items of the chunks, query_tile readers to an item.
template <class Chunks>
i64 units_per_kv_head(const Chunks& chunks, const Intervals& runs, i64 query_tile) {
  i64 units = 0;
  for (i64 r : readers_per_chunk(chunks, runs)) units += ceil_div(r, query_tile);
  return units;
}

// planners._one_round_chunk_size: coarsen (then, from kPersistentRefineChunk on, refine by bisection)
// flatten's chunk until its units fit one round of the persistent grid.
inline i64 one_round_chunk_size(i64 chunk_size, i64 query_tile, i64 num_kv_heads, i64 ctas, const Intervals& runs,
                                i64 total) {
  auto fits = [&](i64 n) {  // n even chunks: flatten_bounds(total, ceil(total / n)), as EvenChunks
    const i64 chunk = ceil_div(total, n), count = ceil_div(total, chunk);
    const i64 units = total ? units_per_kv_head(EvenChunks(ceil_div(total, count), count), runs, query_tile) : 0;
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
