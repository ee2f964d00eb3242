// Chunks of steps whose queries share no KV: split_kv.unshared_segments and split_kv_bounds.
#pragma once

#include "assign_units.h"
#include "common.h"

namespace treedec::planner {

// split_kv.unshared_segments: [S + 1] segment bounds when no token has several readers, else nullopt.
inline std::optional<Vec> unshared_segments(const Intervals& iv, i64 total) {
  const i64 n = iv.size();
  if (n == 0) return std::nullopt;
  i64 read = 0;  // disjoint intervals read at most every token once: more reads is a shared token (no sort)
  for (i64 i = 0; i < n; ++i) read += iv.hi[i] - iv.lo[i];
  if (read > total) return std::nullopt;
  const Vec order = stable_order(n, [&](i64 x, i64 y) { return iv.lo[x] < iv.lo[y]; });
  Vec segments{0};
  for (i64 k = 1; k < n; ++k) {
    const i64 cur = order[k], prev = order[k - 1];
    if (iv.lo[cur] < iv.hi[prev]) return std::nullopt;
    if (iv.q[cur] != iv.q[prev]) segments.push_back(iv.lo[cur]);
  }
  segments.push_back(total);
  return segments;
}

// split_kv.split_kv_bounds: each segment cut into even pieces of the candidate whose modeled longest
// CTA is shortest (the coarsest of equal ones); nullopt when whole segments make fewer units than CTAs.
inline std::optional<Vec> split_kv_bounds(const Vec& segments, i64 num_kv_heads, i64 num_ctas, i64 rows,
                                          i64 min_piece, i64 max_piece) {
  const i64 num_segments = static_cast<i64>(segments.size()) - 1;
  Vec lengths(num_segments);
  for (i64 s = 0; s < num_segments; ++s) lengths[s] = segments[s + 1] - segments[s];
  auto pieces = [&](i64 cap) {
    Vec counts(num_segments);
    for (i64 s = 0; s < num_segments; ++s) counts[s] = ceil_div(lengths[s], cap);
    return counts;
  };
  auto units = [&](i64 cap) {
    i64 sum = 0;
    for (i64 len : lengths) sum += ceil_div(len, cap);
    return num_kv_heads * sum;
  };
  if (units(max_piece) < num_ctas) return std::nullopt;
  std::vector<Vec> candidates{pieces(max_piece)};
  const i64 whole_rounds = ceil_div(units(max_piece), num_ctas);
  for (i64 rounds : {whole_rounds, whole_rounds + 1}) {
    const i64 limit = rounds * num_ctas;
    i64 low = std::min(min_piece, max_piece), high = max_piece;  // the smallest cap whose units fit
    while (low < high) {
      const i64 mid = (low + high) / 2;
      if (units(mid) <= limit) {
        high = mid;
      } else {
        low = mid + 1;
      }
    }
    candidates.push_back(pieces(low));
  }
  auto longest_cta = [&](const Vec& counts) {
    const double base = kSplitUnitCost + kCostPerRow * static_cast<double>(rows);
    std::vector<double> piece_cost;
    for (i64 s = 0; s < num_segments; ++s) {
      const double piece_len = static_cast<double>(lengths[s]) / static_cast<double>(counts[s]);
      piece_cost.insert(piece_cost.end(), counts[s], base + kCostPerKvToken * piece_len);
    }
    std::vector<double> cost;  // np.tile over the KV heads
    cost.reserve(piece_cost.size() * num_kv_heads);
    for (i64 h = 0; h < num_kv_heads; ++h) cost.insert(cost.end(), piece_cost.begin(), piece_cost.end());
    const std::vector<double> loads = assign_units(cost, num_ctas).loads;
    return *std::max_element(loads.begin(), loads.end());
  };
  size_t best = 0;
  double best_cost = longest_cta(candidates[0]);
  for (size_t k = 1; k < candidates.size(); ++k) {
    const double cost = longest_cta(candidates[k]);
    if (cost < best_cost) best = k, best_cost = cost;
  }
  const Vec& counts = candidates[best];
  Vec bounds;
  for (i64 s = 0; s < num_segments; ++s) {
    for (i64 k = 0; k < counts[s]; ++k) bounds.push_back(segments[s] + lengths[s] * k / counts[s]);
  }
  bounds.push_back(segments[num_segments]);
  return bounds;
}

}  // namespace treedec::planner
