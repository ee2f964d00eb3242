// The host side of a step's dynamic spans (treedec/attention/dynamic_span.py): where a plan's flattened KV holds
// each span's slots, and the mask patch that clears each span's unused slots on the device. A pipelined speculative
// step runs both every step; numpy takes some ninety calls for them, here one each.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include "common.h"

namespace treedec::planner {

// DynamicSpans.places and the ranges DynamicSpans.locate makes of them: every position of the plan's flattened KV
// `plan_kv` holding a span's slot, ascending, with that slot's span and its index in the span; `ranges` the runs of
// consecutive positions as [start, stop) pairs; `bad` the first span whose slots are not one run of the tree's
// flattened KV `layout_kv` where its first slot is (DynamicSpans._check_runs; -1: none, and then the rest holds).
struct SpanPlaces {
  Vec position, span, slot, ranges;
  i64 bad = -1;
};

// A slot -> value map over the slots [lo, hi] (-1: none), dense: the spans' slots are a few hundred, the KV
// scanned against them every step up to the whole pool.
struct SlotMap {
  i64 lo = 0, hi = -1;
  std::vector<std::int32_t> value;
  SlotMap(const i64* slots, i64 n) {
    for (i64 i = 0; i < n; ++i) {
      if (slots[i] < 0) continue;
      if (hi < lo) lo = hi = slots[i];
      lo = std::min(lo, slots[i]);
      hi = std::max(hi, slots[i]);
    }
    value.assign(hi >= lo ? hi - lo + 1 : 0, -1);
  }
  std::int32_t* at(i64 s) { return s >= lo && s <= hi ? &value[s - lo] : nullptr; }
};

inline SpanPlaces span_places(const i64* layout_kv, i64 layout_tokens, const i64* plan_kv, i64 plan_tokens,
                              const i64* slots, i64 num_slots, const i64* lengths, i64 num_spans) {
  SpanPlaces out;
  Vec offset(num_spans), first;
  i64 sum = 0, nonempty = 0;
  for (i64 i = 0; i < num_spans; ++i) {
    offset[i] = sum;
    sum += lengths[i];
    if (lengths[i] > 0) {
      ++nonempty;
      first.push_back(slots[offset[i]]);
    }
  }
  if (nonempty == 0 || plan_tokens == 0) return out;
  // each span of tokens: one run of the layout's tokens from where its first slot is (the last such place, as
  // numpy's assignment leaves it), or absent
  SlotMap where(first.data(), static_cast<i64>(first.size()));
  for (i64 p = 0; p < layout_tokens; ++p) {
    if (std::int32_t* w = where.at(layout_kv[p])) *w = static_cast<std::int32_t>(p);
  }
  for (i64 i = 0; i < num_spans; ++i) {
    const i64 d = lengths[i];
    if (d <= 0) continue;
    std::int32_t* w = where.at(slots[offset[i]]);
    if (w == nullptr || *w < 0) continue;
    for (i64 j = 0; j < d; ++j) {
      if (*w + j >= layout_tokens || layout_kv[*w + j] != slots[offset[i] + j]) {
        out.bad = i;
        return out;
      }
    }
  }
  // every position of the plan's KV holding a span's slot (a slot named twice: its last index, as numpy's)
  SlotMap which(slots, num_slots);
  Vec owner(num_slots);
  for (i64 i = 0; i < num_spans; ++i) {
    for (i64 j = 0; j < lengths[i]; ++j) owner[offset[i] + j] = i;
  }
  for (i64 k = 0; k < num_slots; ++k) {
    if (std::int32_t* w = which.at(slots[k])) *w = static_cast<std::int32_t>(k);
  }
  for (i64 p = 0; p < plan_tokens; ++p) {
    const std::int32_t* w = which.at(plan_kv[p]);
    if (w == nullptr || *w < 0) continue;
    const i64 s = owner[*w];
    out.position.push_back(p);
    out.span.push_back(s);
    out.slot.push_back(*w - offset[s]);
    if (out.ranges.empty() || out.ranges.back() != p) {
      out.ranges.push_back(p);
      out.ranges.push_back(p + 1);
    } else {
      out.ranges.back() = p + 1;
    }
  }
  return out;
}

// MaskPatch.of's arrays, in the order its one copy to the device holds them: `flat` = words, at, width, span (each
// [words]), table ([table]), then, when a word is in two spans, the distinct words ([merged]) and each word's index
// among them ([words]). `words` is -1 when the plan holds none of the spans' slots (MaskPatch.of's None).
struct Patch {
  Vec flat;
  i64 words = -1, table = 0, merged = 0;
};

inline Patch mask_patch(const i64* chunk_kv_start, i64 num_chunks, const i64* chunk_entry_start, const i64* position,
                        const i64* place_span, const i64* place_slot, i64 num_places, const i64* lengths,
                        i64 num_spans, i64 stride) {
  Patch out;
  if (num_places == 0) return out;
  const Vec bounds(chunk_kv_start, chunk_kv_start + num_chunks + 1);
  // the places span by span (spans ascending, each one's places in order)
  const Vec by_span = stable_order(num_places, [&](i64 a, i64 b) { return place_span[a] < place_span[b]; });
  Vec words, at, width, span, table;
  std::vector<std::uint32_t> cleared;
  std::vector<std::pair<i64, std::pair<i64, std::uint32_t>>> hits;   // (word, (slot, bit))
  for (i64 g = 0; g < num_places;) {
    const i64 s = place_span[by_span[g]];
    if (s < 0 || s >= num_spans) throw std::invalid_argument("compiled planner: a place's span is out of range");
    const i64 d = lengths[s];
    hits.clear();
    for (; g < num_places && place_span[by_span[g]] == s; ++g) {
      const i64 p = position[by_span[g]], j = place_slot[by_span[g]], c = chunk_of(bounds, p);
      if (c < 0 || c >= num_chunks || j < 0 || j >= d) {
        throw std::invalid_argument("compiled planner: a span's place lies outside the plan or its span");
      }
      const i64 offset = p - bounds[c];
      for (i64 e = chunk_entry_start[c]; e < chunk_entry_start[c + 1]; ++e) {
        hits.push_back({e * stride + offset / kMaskBits, {j, std::uint32_t(1) << (offset % kMaskBits)}});
      }
    }
    std::sort(hits.begin(), hits.end());
    const i64 row0 = static_cast<i64>(table.size());
    Vec mine;   // the span's distinct words, ascending
    for (const auto& h : hits) {
      if (mine.empty() || mine.back() != h.first) mine.push_back(h.first);
    }
    const i64 u = static_cast<i64>(mine.size());
    table.resize(row0 + u * (d + 1));
    size_t h = 0;
    for (i64 q = 0; q < u; ++q) {   // cleared[k]: the bits of the word's slots >= k; a row keeps the rest
      cleared.assign(d + 1, 0);
      for (; h < hits.size() && hits[h].first == mine[q]; ++h) cleared[hits[h].second.first] |= hits[h].second.second;
      for (i64 k = d - 1; k >= 0; --k) cleared[k] |= cleared[k + 1];
      for (i64 k = 0; k <= d; ++k) table[row0 + q + k * u] = static_cast<std::int32_t>(~cleared[k]);
      words.push_back(mine[q]);
      at.push_back(row0 + q);
      width.push_back(u);
      span.push_back(s);
    }
  }
  const i64 n = static_cast<i64>(words.size());
  Vec distinct(words);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  const i64 m = static_cast<i64>(distinct.size()) < n ? static_cast<i64>(distinct.size()) : 0;
  out.flat.reserve(4 * n + table.size() + (m ? m + n : 0));
  for (const Vec* part : {&words, &at, &width, &span, &table}) {
    out.flat.insert(out.flat.end(), part->begin(), part->end());
  }
  if (m) {
    out.flat.insert(out.flat.end(), distinct.begin(), distinct.end());
    for (const i64 w : words) {
      out.flat.push_back(std::lower_bound(distinct.begin(), distinct.end(), w) - distinct.begin());
    }
  }
  out.words = n;
  out.table = static_cast<i64>(table.size());
  out.merged = m;
  return out;
}

}  // namespace treedec::planner
