// Stage-1 epilogue: a thread's finished rows, O / l and the LSE, to the output or to the fp32
// partial workspace.
#pragma once
#include <cstdint>

#include "dtype_traits.cuh"
#include "launch.h"
#include "softmax.cuh"

namespace treedec {

// Epilogue of the thread's fragment rows: O / l and the LSE to the output (the entry is its
// query's only partial) or to the fp32 partial workspace. `half` 0: row r0 (acc[j][0..1]),
// 1: row r1; l is the row's full sum (quad-reduced). Padding rows (entry < 0) write nothing.
template <typename T, int D>
__device__ __forceinline__ void store_row(const PartialParams& p, const float (&acc)[D / 8][4], int half,
                                          int entry, int query, int head, float m, float l, int lane) {
  if (entry < 0 || l == 0.f) return;  // padding row (every real entry reads >= 1 token)
  const float inv = 1.f / l;
  const float lse = (m + __log2f(l)) * kLn2;
  const int col0 = (lane & 3) * 2;
  if (p.entry_direct[entry]) {
    T* dst = static_cast<T*>(p.out) + query * p.out_stride_q + head * p.out_stride_h + col0;
    #pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(dst + j * 8) = TypeTraits<T>::pack(acc[j][2 * half] * inv, acc[j][2 * half + 1] * inv);
    if ((lane & 3) == 0) p.lse[query * p.lse_stride_q + head] = lse;
  } else {
    float* dst = p.o_ws + (static_cast<int64_t>(entry) * p.num_qo_heads + head) * D + col0;
    #pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<float2*>(dst + j * 8) = make_float2(acc[j][2 * half] * inv, acc[j][2 * half + 1] * inv);
    if ((lane & 3) == 0) p.lse_ws[static_cast<int64_t>(entry) * p.num_qo_heads + head] = lse;
  }
}

}  // namespace treedec
