// Shared definitions of the compiled planner: integer types, the numpy planner's constants, and the
// few numpy primitives the port needs with numpy's exact semantics (searchsorted, stable argsort).
//
// Every function here and in the other headers mirrors a function of treedec/attention/*.py; the
// mirror is named in its comment. Results must equal the numpy planner's bit for bit (the tests
// compare every array), so floating-point expressions keep numpy's operand order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <vector>

namespace treedec::planner {

using i64 = std::int64_t;
using Vec = std::vector<i64>;

// The numpy planner's constants (tests/kernels/test_compiled_planner.py checks that they agree).
constexpr i64 kMaskBits = 32;                     // tree_plan.MASK_BITS
constexpr i64 kPersistentMinChunk = 256;          // planners.PERSISTENT_MIN_CHUNK
constexpr i64 kPersistentMaxChunk = 4096;         // planners.PERSISTENT_MAX_CHUNK
constexpr i64 kPersistentRefineChunk = 1024;      // planners.PERSISTENT_REFINE_CHUNK
constexpr double kBalancedMinGain = 1.0;          // planners.BALANCED_MIN_GAIN
constexpr i64 kTileTokens = 64;                   // persistent_schedule.TILE_TOKENS (balanced chunks' tile)
constexpr i64 kMaxQueryTilePairs = i64(1) << 23;  // balanced_chunks.MAX_QUERY_TILE_PAIRS
constexpr double kSplitUnitCost = 128.0;          // split_kv.SPLIT_UNIT_COST
constexpr double kCostPerRow = 1.0;               // persistent_schedule.COST_PER_ROW
constexpr double kCostPerKvToken = 1.0;           // persistent_schedule.COST_PER_KV_TOKEN
constexpr double kCostPerUnit = 64.0;             // persistent_schedule.COST_PER_UNIT
constexpr std::int32_t kFullTileFlag = 1 << 30;   // persistent_schedule.FULL_TILE_FLAG

enum Planner : int { kFlatten = 0, kNode = 1, kNodeChunk = 2, kPath = 3 };  // index in planners.PLANNERS

// ceil(a / b) for a >= 0, b > 0: numpy's -(-a // b).
inline i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }

// np.searchsorted(bounds, x, side="right") - 1: the chunk holding token x (the last of equal bounds).
inline i64 chunk_of(const Vec& bounds, i64 x) {
  return static_cast<i64>(std::upper_bound(bounds.begin(), bounds.end(), x) - bounds.begin()) - 1;
}

// The largest of x[0:n] (n > 0): a TreePlan's max_slot, over every slot of the step. Vectorized with AVX2
// where the CPU has it (x86-64's baseline SSE2 has no 64-bit compare; numpy's max dispatches the same way).
template <int Lanes>
inline i64 max_lanes(const i64* x, i64 n) {
  i64 m[Lanes];
  std::fill(m, m + Lanes, x[0]);
  i64 i = 0;
  for (; i + Lanes <= n; i += Lanes) {
    for (int k = 0; k < Lanes; ++k) m[k] = x[i + k] > m[k] ? x[i + k] : m[k];
  }
  for (; i < n; ++i) m[0] = x[i] > m[0] ? x[i] : m[0];
  return *std::max_element(m, m + Lanes);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) inline i64 max_avx2(const i64* x, i64 n) { return max_lanes<8>(x, n); }

inline i64 max_of(const i64* x, i64 n) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2 ? max_avx2(x, n) : max_lanes<4>(x, n);
}
#else
inline i64 max_of(const i64* x, i64 n) { return max_lanes<4>(x, n); }
#endif

// np.argsort(key, kind="stable") for a key read through `less` (ties keep index order).
template <class Less>
Vec stable_order(i64 n, Less less) {
  Vec order(n);
  std::iota(order.begin(), order.end(), i64(0));
  std::stable_sort(order.begin(), order.end(), less);
  return order;
}

// Read intervals of the step: query q reads flattened tokens [lo, hi). Kept sorted by (q, lo),
// the order of planners._sorted_runs (a query's intervals are disjoint, so the keys are unique).
struct Intervals {
  Vec q, lo, hi;
  i64 size() const { return static_cast<i64>(q.size()); }
};

}  // namespace treedec::planner
