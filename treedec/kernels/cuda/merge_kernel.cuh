// Stage 2: the deterministic per-query merge of stage 1's partial states (O, LSE) into the output.
#pragma once
#include <cmath>
#include <cstdint>

#include "dtype_traits.cuh"
#include "launch.h"
#include "pdl.cuh"
#include "softmax.cuh"

namespace treedec {

constexpr int kMergeWarps = 4;

// Stage 2: one warp per (query, head); lane l holds columns [l * D/32, (l+1) * D/32).
// Entries go in batches of 32: each lane loads one entry's index and LSE (one round trip for the
// batch, not one per entry), the batch's weights come from a warp max, and the partial rows are
// then read UNROLL at a time, so their loads overlap. The order of every sum is fixed by the
// plan's CSR: deterministic.
//
// The merge kernel of a launch loads up to 4, 8 or 16 rows at once (16 with head dim 256 would not
// fit in registers: 8), the fewest that take the plan's most partials of a query in one round: each
// round is an L2 round trip. 16 only while the (query, head) pairs fit one wave of its warps
// (merge_wave_pairs): its registers halve the resident warps, which many pairs need more.
template <int D> constexpr int merge_unroll_max() { return D == 256 ? 8 : 16; }

template <typename T, int D, int UNROLL>
__global__ void __launch_bounds__(kMergeWarps * 32)
merge_partials_kernel(const MergeParams p) {
  constexpr int kPer = D / 32;
  launch_dependents();  // the next stage 1 waits for this grid before its data
  const int pair = blockIdx.x * kMergeWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (pair >= p.num_queries * p.num_qo_heads) return;
  const int query = pair / p.num_qo_heads;
  const int head = pair % p.num_qo_heads;
  const int begin = p.query_entry_start[query];
  const int end = p.query_entry_start[query + 1];
  if (end - begin <= 1) return;  // stage 1 wrote it (or a padded query of a graph's capacity)
  float acc[kPer];
  #pragma unroll
  for (int i = 0; i < kPer; ++i) acc[i] = 0.f;
  float m = -INFINITY, s = 0.f;  // running max (log2 units) and weight sum, equal in every lane
  constexpr float kLog2e = 1.4426950408889634f;
  int64_t next_e = lane < end - begin ? p.query_entries[begin + lane] : 0;  // plan data: before the wait
  wait_for_primary();
  for (int base = begin; base < end; base += 32) {
    const int n = min(32, end - base);
    const int64_t my_e = next_e;
    if (base + 32 < end) next_e = lane < end - base - 32 ? p.query_entries[base + 32 + lane] : 0;
    const float my_lse = lane < n ? p.lse_ws[my_e * p.num_qo_heads + head] * kLog2e : -INFINITY;
    float mb = my_lse;
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, off));
    const float mn = fmaxf(m, mb);
    const float scale = m == -INFINITY ? 0.f : exp2f(m - mn);  // 0 on the first batch
    const float my_w = lane < n && mn != -INFINITY ? exp2f(my_lse - mn) : 0.f;
    #pragma unroll
    for (int i = 0; i < kPer; ++i) acc[i] *= scale;
    float wsum = my_w;
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, off);
    s = s * scale + wsum;
    m = mn;
    for (int j0 = 0; j0 < n; j0 += UNROLL) {
      float o[UNROLL][kPer];
      float w[UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {  // issue every load of the group first
        w[u] = 0.f;
        #pragma unroll
        for (int i = 0; i < kPer; ++i) o[u][i] = 0.f;
        const int j = j0 + u;
        if (j >= n) continue;  // past the batch (warp-uniform): no load
        const int64_t e = __shfl_sync(0xffffffffu, my_e, j);
        w[u] = __shfl_sync(0xffffffffu, my_w, j);
        const float* src = p.o_ws + (e * p.num_qo_heads + head) * D + lane * kPer;
        #pragma unroll
        for (int i = 0; i < kPer; i += 2) {
          const float2 x = *reinterpret_cast<const float2*>(src + i);
          o[u][i] = x.x;
          o[u][i + 1] = x.y;
        }
      }
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        #pragma unroll
        for (int i = 0; i < kPer; ++i) acc[i] += w[u] * o[u][i];
    }
  }
  const float inv = 1.f / s;
  T* dst = static_cast<T*>(p.out) + query * p.out_stride_q + head * p.out_stride_h + lane * kPer;
  #pragma unroll
  for (int i = 0; i < kPer; i += 2)
    *reinterpret_cast<uint32_t*>(dst + i) = TypeTraits<T>::pack(acc[i] * inv, acc[i + 1] * inv);
  if (lane == 0) p.lse[query * p.lse_stride_q + head] = (m + __log2f(s)) * kLn2;
}

}  // namespace treedec
