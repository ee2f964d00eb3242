// The host side of static_plan.StaticPlan.write: a step's arrays written, padded, into the sections of
// one int32 host buffer, and the word ranges to copy to the device, coalesced.
#pragma once

#include <utility>

#include "common.h"

namespace treedec::planner {

// How a section is padded past the values (static_plan.py says why each array is padded so).
enum Padding : int {
  kPrefix = 0,     // only the values' part is written and copied (what nothing reads to the bounds)
  kZeros = 1,      // 1-D, zeros to the section's end (read to the bounds: empty work items)
  kEdge = 2,       // 1-D, the last value repeated to the end (CSR starts: empty rows)
  kZeroTails = 3,  // 2-D, each written row zero past the values' width (entry_mask's words past a chunk)
};

// One section: a [rows, cols] (cols 0: 1-D [rows]) int32 view at word `offset`, and the values to write
// there, [value_rows, value_cols] (value_cols 0: 1-D), read through `value(i)` (row-major index).
struct Section {
  i64 offset, rows, cols, value_rows, value_cols;
  int padding;
};

constexpr i64 kCoalesceGap = 16384;  // static_plan._COALESCE_GAP

// Writes one section's values, cast to int32 (wrapping, as numpy's assignment does), and its padding;
// returns the [start, end) words to copy.
template <class Value>
std::pair<i64, i64> write_section(std::int32_t* host, const Section& s, Value value) {
  std::int32_t* out = host + s.offset;
  if (s.cols == 0) {  // 1-D
    const i64 n = s.value_rows;
    for (i64 i = 0; i < n; ++i) out[i] = static_cast<std::int32_t>(value(i));
    if (s.padding == kPrefix) return {s.offset, s.offset + n};
    const std::int32_t pad = s.padding == kEdge && n > 0 ? out[n - 1] : 0;
    std::fill(out + n, out + s.rows, pad);
    return {s.offset, s.offset + s.rows};
  }
  const i64 width = s.value_cols;
  for (i64 r = 0; r < s.value_rows; ++r) {
    std::int32_t* row = out + r * s.cols;
    for (i64 c = 0; c < width; ++c) row[c] = static_cast<std::int32_t>(value(r * width + c));
    if (s.padding == kZeroTails) std::fill(row + width, row + s.cols, 0);
  }
  if (s.value_rows == 0) return {s.offset, s.offset};
  const i64 last = s.padding == kZeroTails ? s.cols : width;  // the last written row's words
  return {s.offset, s.offset + (s.value_rows - 1) * s.cols + last};
}

// static_plan._coalesce: sorted ranges merged where the gap between them is at most kCoalesceGap words.
inline std::vector<std::pair<i64, i64>> coalesce(std::vector<std::pair<i64, i64>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<i64, i64>> out;
  for (const auto& [start, end] : ranges) {
    if (!out.empty() && start - out.back().second <= kCoalesceGap) {
      out.back().second = std::max(out.back().second, end);
    } else {
      out.emplace_back(start, end);
    }
  }
  return out;
}

}  // namespace treedec::planner
