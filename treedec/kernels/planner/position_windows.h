// position_windows.position_windows: a batch-invariant plan's chunks, each query's keys cut at absolute positions
// (windows [k*C, (k+1)*C) of its root path) and one chunk per distinct (k, last key, key count), read by every
// query whose window it is. The module's docstring says why.
#pragma once

#include "common.h"

namespace treedec::planner {

struct WindowChunks {
  Intervals reads;  // the entries' reads, each a whole chunk: sorted by query, then window
  Vec kv_slots;     // the chunks' slots, chunk by chunk
  Vec bounds;       // [C + 1] their borders in kv_slots
};

// `iv`: the read intervals sorted by (q, lo), every query with one at least (its own token) and none empty;
// `slots`: the flattened tokens' pool slots (`num_tokens`); `first`: each query's first key position (empty: 0).
inline WindowChunks position_windows(const Intervals& iv, const i64* slots, i64 num_tokens, const Vec& first,
                                     i64 num_queries, i64 c) {
  const i64 n = iv.size();
  Vec ends(n);  // each interval's end among all queries' keys, in a row
  i64 total = 0;
  for (i64 i = 0; i < n; ++i) ends[i] = total += iv.hi[i] - iv.lo[i];
  auto begin_of = [&](i64 i) { return ends[i] - (iv.hi[i] - iv.lo[i]); };

  struct Window { i64 key, q, key0, length; };  // key0: its first key in the row
  std::vector<Window> windows;
  windows.reserve(static_cast<size_t>(num_queries + total / c + 1));
  for (i64 q = 0, i = 0, row = 0; q < num_queries; ++q) {
    i64 j = i, count = 0;
    for (; j < n && iv.q[j] == q; ++j) count += iv.hi[j] - iv.lo[j];
    const i64 f = first.empty() ? 0 : first[q], last = f + count - 1;
    for (i64 k = f / c, at = i; k <= last / c; ++k) {
      const i64 w_first = std::max(k * c, f), length = std::min(k * c + c, last + 1) - w_first;
      const i64 key0 = row + w_first - f, at_last = key0 + length - 1;
      while (ends[at] <= at_last) ++at;
      const i64 last_flat = iv.lo[at] + at_last - begin_of(at);
      windows.push_back({(k * num_tokens + last_flat) * (c + 1) + length, q, key0, length});
    }
    row += count;
    i = j;
  }

  // np.argsort(key, kind="stable"): (key, window) pairs are distinct, so a plain sort of them is that order
  const i64 num_windows = static_cast<i64>(windows.size());
  std::vector<std::pair<i64, i64>> by_key(num_windows);
  for (i64 w = 0; w < num_windows; ++w) by_key[w] = {windows[w].key, w};
  std::sort(by_key.begin(), by_key.end());
  WindowChunks out;
  Vec chunk_of(num_windows);
  out.bounds.reserve(num_windows + 1);
  out.bounds.push_back(0);
  i64 copied = 0;  // the copies' tokens, for one allocation
  for (i64 r = 0; r < num_windows; ++r) {
    if (r == 0 || by_key[r].first != by_key[r - 1].first) copied += windows[by_key[r].second].length;
  }
  out.kv_slots.reserve(copied);
  for (i64 r = 0; r < num_windows; ++r) {
    const Window& w = windows[by_key[r].second];
    if (r == 0 || by_key[r].first != by_key[r - 1].first) {  // a new chunk: this window's keys are its copy
      out.bounds.push_back(out.bounds.back() + w.length);
      i64 at = static_cast<i64>(std::upper_bound(ends.begin(), ends.end(), w.key0) - ends.begin());
      for (i64 g = w.key0, stop = w.key0 + w.length; g < stop; ++at) {
        const i64 piece_end = std::min(ends[at], stop);
        const i64* from = slots + iv.lo[at] + g - begin_of(at);
        out.kv_slots.insert(out.kv_slots.end(), from, from + (piece_end - g));
        g = piece_end;
      }
    }
    chunk_of[by_key[r].second] = static_cast<i64>(out.bounds.size()) - 2;
  }
  for (Vec* v : {&out.reads.q, &out.reads.lo, &out.reads.hi}) v->reserve(num_windows);
  for (i64 w = 0; w < num_windows; ++w) {
    out.reads.q.push_back(windows[w].q);
    out.reads.lo.push_back(out.bounds[chunk_of[w]]);
    out.reads.hi.push_back(out.bounds[chunk_of[w] + 1]);
  }
  return out;
}

}  // namespace treedec::planner
