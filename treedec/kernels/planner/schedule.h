// The cuda backend's persistent schedule: persistent_schedule.live_tiles and schedule_units.
#pragma once

#include "assign_units.h"
#include "common.h"

namespace treedec::planner {

// A TreePlan's arrays the schedule reads, borrowed.
struct ScheduleInput {
  const i64* item_chunk;
  const i64* item_entry_start;
  const i64* item_num_entries;
  const i64* chunk_kv_start;
  const std::int32_t* entry_mask;  // [E, mask_words]
  i64 num_items, mask_words;
  // TreePlan.dynamic_kv, [num_dynamic, 2] (start, stop): sorted, disjoint ranges of flattened positions
  // whose tiles are never full
  const i64* dynamic_kv;
  i64 num_dynamic;
};

constexpr int kUnitFields = 10;  // persistent_schedule.UNIT_FIELDS

constexpr int kScheduleHeader = 2;  // persistent_schedule.SCHEDULE_HEADER
constexpr int kTileBeginField = 5, kTileEndField = 6;  // UNIT_FIELDS.index("tile_begin"), ("tile_end")

struct Schedule {
  std::vector<std::int32_t> cta_unit_start;  // [num_ctas + 1]
  std::vector<std::int32_t> unit_info;       // [U, kUnitFields]
  std::vector<std::int32_t> tiles;           // [N]
  std::vector<double> cta_cost;              // [num_ctas]
  std::vector<std::int32_t> device;          // PersistentSchedule.device_array(): header, records, tiles
};

// persistent_schedule.live_tiles: per item, the tiles some entry reads (OR of its masks) and, flagged,
// those every entry reads whole (AND of its masks all ones over the tile's words, all of them in the row)
// and holding no position of a dynamic_kv range (the device may clear those positions' bits).
inline void live_tiles(const ScheduleInput& in, i64 tile_tokens, Vec& item_tile_start,
                       std::vector<std::int32_t>& tiles) {
  const i64 words = in.mask_words, per_tile = tile_tokens / kMaskBits, num_tiles = ceil_div(words, per_tile);
  std::vector<std::uint32_t> ored(words), anded(words);
  item_tile_start.assign(in.num_items + 1, 0);
  tiles.clear();
  const i64* dyn = in.dynamic_kv;  // range r is [dyn[2r], dyn[2r + 1])
  for (i64 i = 0; i < in.num_items; ++i) {
    const i64 kv_begin = in.chunk_kv_start[in.item_chunk[i]];
    // The first range stopping after the chunk's first token (stops ascend: the ranges are sorted and
    // disjoint); the tiles ascend, so it only moves forward below.
    i64 r = 0;
    for (i64 hi = in.num_dynamic; r < hi;) {
      const i64 mid = r + (hi - r) / 2;
      if (dyn[2 * mid + 1] <= kv_begin) r = mid + 1; else hi = mid;
    }
    std::fill(ored.begin(), ored.end(), 0u);
    std::fill(anded.begin(), anded.end(), ~0u);
    const auto* rows = reinterpret_cast<const std::uint32_t*>(in.entry_mask) + in.item_entry_start[i] * words;
    for (i64 e = 0; e < in.item_num_entries[i]; ++e, rows += words) {
      for (i64 w = 0; w < words; ++w) ored[w] |= rows[w], anded[w] &= rows[w];
    }
    for (i64 t = 0; t < num_tiles; ++t) {
      const i64 w0 = t * per_tile, w1 = std::min(w0 + per_tile, words);
      const i64 first = kv_begin + t * tile_tokens;  // the tile's first flattened position
      while (r < in.num_dynamic && dyn[2 * r + 1] <= first) ++r;
      const bool dynamic = r < in.num_dynamic && dyn[2 * r] < first + tile_tokens;  // range r meets the tile
      bool live = false, full = w1 - w0 == per_tile && !dynamic;  // words past the row count as not full
      for (i64 w = w0; w < w1; ++w) live |= ored[w] != 0, full &= anded[w] == ~0u;
      if (live) tiles.push_back(static_cast<std::int32_t>(t) | (full ? kFullTileFlag : 0));
    }
    item_tile_start[i + 1] = static_cast<i64>(tiles.size());
  }
}

// persistent_schedule.schedule_units: items cut into blocks of rows_per_unit rows, a unit per block and
// KV head (block-major), assigned by assign_units; each CTA runs its units in assignment order.
inline Schedule schedule_units(const ScheduleInput& in, i64 group, i64 num_kv_heads, i64 num_ctas, i64 rows_per_unit,
                               i64 tile_tokens) {
  Schedule out;
  Vec item_tile_start;
  live_tiles(in, tile_tokens, item_tile_start, out.tiles);
  std::vector<std::int32_t> info;
  std::vector<double> cost;
  for (i64 i = 0; i < in.num_items; ++i) {
    const i64 rows = in.item_num_entries[i] * group, chunk = in.item_chunk[i];
    const i64 kv_begin = in.chunk_kv_start[chunk], chunk_len = in.chunk_kv_start[chunk + 1] - kv_begin;
    const i64 tile_begin = item_tile_start[i], tile_end = item_tile_start[i + 1];
    const i64 live_tokens = std::min((tile_end - tile_begin) * tile_tokens, chunk_len);
    const i64 first_tile = tile_end > tile_begin ? out.tiles[tile_begin] : 0;
    for (i64 row_begin = 0; row_begin < rows; row_begin += rows_per_unit) {
      const i64 row_end = std::min(row_begin + rows_per_unit, rows);
      const double block_cost = kCostPerUnit + kCostPerRow * static_cast<double>(row_end - row_begin) +
                                kCostPerKvToken * static_cast<double>(live_tokens);
      for (i64 head = 0; head < num_kv_heads; ++head) {
        const i64 fields[kUnitFields] = {chunk, head, in.item_entry_start[i], row_begin, row_end,
                                         tile_begin, tile_end, kv_begin, chunk_len, first_tile};
        for (i64 f : fields) info.push_back(static_cast<std::int32_t>(f));
        cost.push_back(block_cost);
      }
    }
  }
  const Assignment a = assign_units(cost, num_ctas);
  const i64 num_units = static_cast<i64>(cost.size());
  Vec start(num_ctas + 1, 0);
  for (i64 u = 0; u < num_units; ++u) ++start[a.cta_of_unit[u] + 1];
  for (i64 b = 0; b < num_ctas; ++b) start[b + 1] += start[b];
  out.cta_unit_start.assign(start.begin(), start.end());
  out.unit_info.resize(info.size());
  for (i64 u : a.order) {  // by CTA, then assignment order
    const i64 slot = start[a.cta_of_unit[u]]++;
    std::copy_n(info.begin() + u * kUnitFields, kUnitFields, out.unit_info.begin() + slot * kUnitFields);
  }
  out.cta_cost = a.loads;
  // The device array: the records' tile_begin/tile_end point into it, past the header and the records.
  const auto list_start = static_cast<std::int32_t>(kScheduleHeader + out.unit_info.size());
  out.device.reserve(list_start + out.tiles.size());
  out.device.push_back(static_cast<std::int32_t>(tile_tokens));
  out.device.push_back(0);
  out.device.insert(out.device.end(), out.unit_info.begin(), out.unit_info.end());
  for (i64 u = 0; u < num_units; ++u) {
    out.device[kScheduleHeader + u * kUnitFields + kTileBeginField] += list_start;
    out.device[kScheduleHeader + u * kUnitFields + kTileEndField] += list_start;
  }
  out.device.insert(out.device.end(), out.tiles.begin(), out.tiles.end());
  return out;
}

}  // namespace treedec::planner
