// Flatten chunks that balance unit time: balanced_chunks.light_ends, balanced_flatten_bounds and
// longest_unit_cost.
#pragma once

#include "common.h"
#include "readers.h"

namespace treedec::planner {

// balanced_chunks.light_ends: per kTileTokens-token tile s, the first tile up to which a chunk starting
// at s has at most light_readers distinct readers (num_tiles when never more). The (light_readers + 1)-th
// smallest "next token read at or after tile s" over the queries, found per tile among the queries that
// read anything from s on (the others' next read is "never").
inline Vec light_ends(const Intervals& runs, i64 total, i64 light_readers, i64 num_queries) {
  const i64 num_tiles = ceil_div(total, kTileTokens);
  Vec ends(num_tiles, num_tiles);
  if (num_queries <= light_readers) return ends;
  // An interval is its query's first to end after tile start s for s in [ceil(prev_hi / T), ceil(hi / T)).
  Vec count(num_tiles + 1, 0);
  auto for_each_tile = [&](auto&& visit) {
    for (i64 i = 0; i < runs.size(); ++i) {
      const i64 prev_hi = (i > 0 && runs.q[i - 1] == runs.q[i]) ? runs.hi[i - 1] : 0;
      for (i64 s = ceil_div(prev_hi, kTileTokens); s < ceil_div(runs.hi[i], kTileTokens); ++s) {
        visit(s, std::max(runs.lo[i], s * kTileTokens));
      }
    }
  };
  for_each_tile([&](i64 s, i64) { ++count[s + 1]; });
  for (i64 s = 0; s < num_tiles; ++s) count[s + 1] += count[s];
  Vec next_read(count[num_tiles]), cursor(count.begin(), count.end() - 1);
  for_each_tile([&](i64 s, i64 token) { next_read[cursor[s]++] = token; });
  for (i64 s = 0; s < num_tiles; ++s) {
    auto begin = next_read.begin() + count[s], end = next_read.begin() + count[s + 1];
    if (end - begin <= light_readers) continue;  // at most light_readers readers from s on: light to the end
    std::nth_element(begin, begin + light_readers, end);
    ends[s] = begin[light_readers] / kTileTokens;
  }
  return ends;
}

// balanced_chunks.longest_unit_cost: the longest unit's tiles, light chunks' weighted light_tile_cost.
inline double longest_unit_cost(const Vec& bounds, const Vec& readers, i64 query_tile, double light_tile_cost) {
  double longest = -INFINITY;
  for (size_t c = 0; c + 1 < bounds.size(); ++c) {
    const double tiles = static_cast<double>(ceil_div(bounds[c + 1] - bounds[c], kTileTokens));
    longest = std::max(longest, tiles * (readers[c] <= query_tile / 2 ? light_tile_cost : 1.0));
  }
  return longest;
}

// balanced_chunks.balanced_flatten_bounds: tile-aligned chunks cut greedily under a time budget, the
// budget bisected down to the smallest whose units fit the grid; nullopt when none fits.
inline std::optional<Vec> balanced_flatten_bounds(const Readers& readers, i64 total, i64 num_queries, i64 query_tile,
                                                  i64 num_kv_heads, i64 ctas, double light_tile_cost, i64 max_chunk) {
  const Intervals& runs = readers.runs;
  const i64 num_tiles = ceil_div(total, kTileTokens);
  if (num_queries * num_tiles > kMaxQueryTilePairs) return std::nullopt;
  const Vec ends = light_ends(runs, total, query_tile / 2, num_queries);
  const i64 max_tiles = std::max<i64>(max_chunk / kTileTokens, 1);

  auto cut = [&](double budget) {
    Vec borders{0};
    const i64 light_len = static_cast<i64>(budget / light_tile_cost + 1e-9);
    const i64 heavy_len = static_cast<i64>(budget + 1e-9);
    for (i64 start = 0; start < num_tiles;) {
      i64 end = start + light_len;
      if (end > ends[start]) end = std::max(ends[start], start + heavy_len);  // more readers: heavy, or light to there
      start = std::min({std::max(end, start + 1), start + max_tiles, num_tiles});
      borders.push_back(start);
    }
    for (i64& b : borders) b = std::min(b * kTileTokens, total);
    return borders;
  };
  auto fits = [&](const Vec& bounds) { return readers.units(bounds, query_tile) * num_kv_heads <= ctas; };

  // The budgets at which a cut changes (np.unique of whole tiles and multiples of the light cost).
  std::vector<double> budgets;
  for (i64 i = 1; i <= max_tiles; ++i) budgets.push_back(static_cast<double>(i));
  const i64 light_steps = static_cast<i64>(static_cast<double>(max_tiles) / light_tile_cost);
  for (i64 i = 1; i <= light_steps; ++i) {
    const double budget = static_cast<double>(i) * light_tile_cost;
    if (budget <= static_cast<double>(max_tiles)) budgets.push_back(budget);
  }
  std::sort(budgets.begin(), budgets.end());
  budgets.erase(std::unique(budgets.begin(), budgets.end()), budgets.end());
  const double floor = static_cast<double>(num_tiles) * light_tile_cost /
                       static_cast<double>(std::max<i64>(ctas / num_kv_heads, 1));
  const double lowest = std::min(floor, static_cast<double>(max_tiles));
  budgets.erase(budgets.begin(), std::lower_bound(budgets.begin(), budgets.end(), lowest));

  Vec best = cut(budgets.back());
  if (!fits(best)) return std::nullopt;
  i64 low = 0, high = static_cast<i64>(budgets.size()) - 1;  // invariant: budgets[high] fits
  while (low < high) {
    const i64 middle = (low + high) / 2;
    Vec bounds = cut(budgets[middle]);
    if (fits(bounds)) {
      best = std::move(bounds);
      high = middle;
    } else {
      low = middle + 1;
    }
  }
  return best;
}

}  // namespace treedec::planner
