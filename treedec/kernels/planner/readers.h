// Distinct queries reading each chunk of a cut (balanced_chunks.readers_per_chunk), which the chunk-size
// searches (one_round_chunk_size, balanced_flatten_bounds) ask of many cuts of one step.
#pragma once

#include "common.h"

namespace treedec::planner {

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

// The chunk of a token (np.searchsorted(bounds, token, "right") - 1): one division for flatten's even
// chunks (bounds[i] == min(i * step, total), found by a check of every border), else a binary search.
struct Chunks {
  const Vec& bounds;
  Divider divide;

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

// balanced_chunks.readers_per_chunk, from the read intervals (runs sorted by (q, lo)): each run adds a
// reader to its chunks; one starting in the chunk where its query's previous run ended takes it back.
inline Vec readers_per_chunk(const Vec& bounds, const Intervals& runs) {
  const Chunks chunks(bounds);
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

// The same counts from the tree's order, O(nodes + chunks) a cut instead of O(read intervals). In depth-first
// preorder a subtree is a contiguous range of nodes and of tokens, so the nodes a chunk overlaps are a
// range [a, b] of the nonempty nodes, and the queries that read the chunk are those of the nodes from a to
// the end of the subtrees of a..b (a query reads every ancestor whole), less those of node a itself that stop
// before the chunk starts (a query reads its own node up to its offset). Nodes no query reads are empty here.
class TreeOrder {
 public:
  // nullopt when `parent` is not a preorder (the layout contract; readers_per_chunk serves any order).
  static std::optional<TreeOrder> of(const i64* parent, const Vec& node_start, const Vec& node_len,
                                     const i64* query_node, const i64* query_offset, i64 num_queries) {
    const i64 n = static_cast<i64>(node_len.size());
    TreeOrder t;
    Vec path;  // the current node's ancestors, in preorder
    for (i64 i = 0; i < n; ++i) {
      while (!path.empty() && path.back() != parent[i]) path.pop_back();
      if (parent[i] >= 0 && path.empty()) return std::nullopt;
      path.push_back(i);
    }
    t.subtree_end.resize(n);
    for (i64 i = 0; i < n; ++i) t.subtree_end[i] = i + 1;
    for (i64 i = n - 1; i > 0; --i) {
      if (parent[i] >= 0) t.subtree_end[parent[i]] = std::max(t.subtree_end[parent[i]], t.subtree_end[i]);
    }
    for (i64 i = 0; i < n; ++i) {
      if (node_len[i] > 0) {
        t.nonempty.push_back(i);
        t.token_start.push_back(node_start[i]);
        t.token_end.push_back(node_start[i] + node_len[i]);
      }
    }
    t.queries_before.assign(n + 1, 0);  // then each node's query offsets, sorted (CSR over queries_before)
    for (i64 q = 0; q < num_queries; ++q) ++t.queries_before[query_node[q] + 1];
    for (i64 i = 0; i < n; ++i) t.queries_before[i + 1] += t.queries_before[i];
    t.offsets.resize(num_queries);
    Vec cursor(t.queries_before.begin(), t.queries_before.end() - 1);
    for (i64 q = 0; q < num_queries; ++q) t.offsets[cursor[query_node[q]]++] = query_offset[q];
    for (i64 i = 0; i < n; ++i) {
      if (t.queries_before[i + 1] - t.queries_before[i] > 1) {
        std::sort(t.offsets.begin() + t.queries_before[i], t.offsets.begin() + t.queries_before[i + 1]);
      }
    }
    return t;
  }

  // Readers of each chunk of `bounds` (borders over the compacted tokens, every one read by some node).
  Vec operator()(const Vec& bounds) const {
    const i64 num_chunks = static_cast<i64>(bounds.size()) - 1;
    Vec readers(num_chunks, 0);
    size_t k = 0;  // the nonempty node holding the chunk's first token
    for (i64 c = 0; c < num_chunks; ++c) {
      const i64 start = bounds[c], end = bounds[c + 1];
      if (start == end) continue;
      while (token_end[k] <= start) ++k;
      const i64 a = nonempty[k];
      i64 last = subtree_end[a];
      size_t j = k;
      while (token_end[j] < end) last = std::max(last, subtree_end[nonempty[++j]]);
      i64 count = queries_before[last] - queries_before[a];
      if (token_start[k] < start) {  // node a's queries that stop before the chunk
        const auto first = offsets.begin() + queries_before[a], stop = offsets.begin() + queries_before[a + 1];
        count -= std::lower_bound(first, stop, start - token_start[k]) - first;
      }
      readers[c] = count;
      k = j;
    }
    return readers;
  }

 private:
  Vec subtree_end;     // per node, one past the last node of its subtree
  Vec nonempty;        // the nodes with tokens, in order, and where their tokens start and end
  Vec token_start, token_end;
  Vec queries_before;  // [N + 1] queries of the nodes before each node
  Vec offsets;         // each node's query offsets, sorted, at queries_before[node]
};

// Readers per chunk by the tree's order where the layout is a preorder, else from the read intervals.
struct Readers {
  const Intervals& runs;
  std::optional<TreeOrder> tree;

  Vec operator()(const Vec& bounds) const { return tree ? (*tree)(bounds) : readers_per_chunk(bounds, runs); }

  // balanced_chunks.units_per_kv_head: work items of the chunks, query_tile readers to an item.
  i64 units(const Vec& bounds, i64 query_tile) const {
    i64 units = 0;
    for (i64 r : (*this)(bounds)) units += ceil_div(r, query_tile);
    return units;
  }
};

}  // namespace treedec::planner
