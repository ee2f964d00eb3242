// Online softmax over a tile of S in base 2 (masked by the rows' mask words), the O rescale, the
// row sums, and P repacked as the A operand of O += P V.
#pragma once
#include <cmath>
#include <cstdint>

#include "dtype_traits.cuh"

namespace treedec {

constexpr float kLn2 = 0.6931471805599453f;

// One online-softmax step for the thread's two fragment rows (r0 = lane / 4 of its 16-row
// slice, r1 = r0 + 8) over a BN-token tile of S (the mma.sync C layout per n8 block: column of
// s[j][e], e = 0,1, is j * 8 + (lane % 4) * 2 + e; e = 2,3 are row r1). S is scaled to base 2,
// masked by the rows' mask words unless `full` (every row reads the whole tile), and becomes
// P = exp2(S - max); the running max m and sum l move on. Returns the rows' O rescale factors.
//
// BRANCH_FREE (the warp-specialized kernel): the mask is applied to every tile with selects,
// `full` ignored. A branch between a wgmma's issue and its wait makes ptxas move the wait up
// (the SASS had the PV wait above this softmax), which costs more than the selects.
template <int BN, bool BRANCH_FREE = false>
__device__ __forceinline__ float2 online_softmax(float (&s)[BN / 8][4], const uint32_t* mw0, const uint32_t* mw1,
                                                 bool full, float scale_log2, int lane,
                                                 float& m0, float& m1, float& l0, float& l1) {
  // The max runs over raw scores (scale_log2 > 0 keeps the order); each P element is then one
  // FFMA and one EX2: exp2(s * scale - max * scale).
  float mx0 = -INFINITY, mx1 = -INFINITY;
  if constexpr (BRANCH_FREE) {
    const int shift = (lane & 3) * 2;  // then column j * 8 + (lane % 4) * 2 + e is bit (j % 4) * 8 + e
    #pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const uint32_t w0 = mw0[j >> 2] >> shift, w1 = mw1[j >> 2] >> shift;
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t bit = 1u << ((j & 3) * 8 + e);
        s[j][e] = (w0 & bit) ? s[j][e] : -INFINITY;
        s[j][2 + e] = (w1 & bit) ? s[j][2 + e] : -INFINITY;
        mx0 = fmaxf(mx0, s[j][e]);
        mx1 = fmaxf(mx1, s[j][2 + e]);
      }
    }
  } else {
    #pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (!full) {
          const int bit = (j & 3) * 8 + (lane & 3) * 2 + e;
          if (!((mw0[j >> 2] >> bit) & 1u)) s[j][e] = -INFINITY;
          if (!((mw1[j >> 2] >> bit) & 1u)) s[j][2 + e] = -INFINITY;
        }
        mx0 = fmaxf(mx0, s[j][e]);
        mx1 = fmaxf(mx1, s[j][2 + e]);
      }
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m0, mx0 * scale_log2), mn1 = fmaxf(m1, mx1 * scale_log2);
  const float ms0 = mn0 == -INFINITY ? 0.f : mn0;  // rows with nothing read yet
  const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
  const float2 alpha = make_float2(exp2f(m0 - ms0), exp2f(m1 - ms1));
  m0 = mn0;
  m1 = mn1;
  float sum0 = 0.f, sum1 = 0.f;
  #pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    s[j][0] = exp2f(fmaf(s[j][0], scale_log2, -ms0));
    s[j][1] = exp2f(fmaf(s[j][1], scale_log2, -ms0));
    s[j][2] = exp2f(fmaf(s[j][2], scale_log2, -ms1));
    s[j][3] = exp2f(fmaf(s[j][3], scale_log2, -ms1));
    sum0 += s[j][0] + s[j][1];
    sum1 += s[j][2] + s[j][3];
  }
  l0 = l0 * alpha.x + sum0;
  l1 = l1 * alpha.y + sum1;
  return alpha;
}

// O *= alpha per row (alpha.x: the thread's row r0, alpha.y: r1).
template <int D>
__device__ __forceinline__ void scale_o(float (&acc)[D / 8][4], float2 alpha) {
  #pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    acc[j][0] *= alpha.x;
    acc[j][1] *= alpha.x;
    acc[j][2] *= alpha.y;
    acc[j][3] *= alpha.y;
  }
}

// Whether some row of the warp moved its max (after the first tiles it rarely does).
__device__ __forceinline__ bool any_rescale(float2 alpha) {
  return __any_sync(0xffffffffu, alpha.x != 1.f || alpha.y != 1.f);
}

// O *= alpha per row, skipped when no row of the warp moved its max.
template <int D>
__device__ __forceinline__ void rescale_o(float (&acc)[D / 8][4], float2 alpha) {
  if (any_rescale(alpha)) scale_o<D>(acc, alpha);
}

// P (fp32, the S layout) as wgmma/mma.sync A fragments: 16 x 16 blocks of two S n8 tiles.
template <typename T, int BN>
__device__ __forceinline__ void pack_p(const float (&s)[BN / 8][4], uint32_t (&pa)[BN / 16][4]) {
  #pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    pa[kk][0] = TypeTraits<T>::pack(s[2 * kk][0], s[2 * kk][1]);
    pa[kk][1] = TypeTraits<T>::pack(s[2 * kk][2], s[2 * kk][3]);
    pa[kk][2] = TypeTraits<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[kk][3] = TypeTraits<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// Sum of a row's l over the quad (4 lanes) that holds it.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace treedec
