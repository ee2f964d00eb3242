// treedec CUDA tree attention: DeFT-Flatten stage 1 (partial attention per work unit, on a
// persistent grid) and stage 2 (deterministic per-query merge). sm_80+: mma.sync m16n8k16.
// Built for sm_90a (-DTREEDEC_SM90A), head dims 64/128 run the warp-specialized wgmma kernel of
// tree_attention_ws.cuh (Stage1 below picks); the single-role wgmma variant of this kernel
// (step 4) stays for comparisons (TREEDEC_CUDA_FLAGS=-DTREEDEC_WARP_SPECIALIZED=0).
//
// Stage 1, one CTA of WARPS warps, 16 rows each (PartialConfig), loops over its units. For a unit:
//   1. rows -> (entry, query, head) in shared memory; Q rows gathered into smem (cp.async);
//   2. only the unit's *live* tiles (some row reads a token; the CPU schedule lists them, in
//      kListTileTokens-token tiles) are loaded and computed (dead tiles cost nothing);
//   3. live tiles go through a STAGES-deep cp.async pipeline: K/V rows gathered through the
//      slot table (16-byte vectors, XOR-swizzled smem, zero-filled past the chunk), the rows'
//      mask words beside them; slots of the tile after next are prefetched into registers;
//   4. per warp: S = Q K^T (ldmatrix + mma.sync, fp32 accumulate; or per warpgroup of 64 rows
//      one wgmma batch reading Q and K from 128-byte-swizzled smem), bit mask in registers
//      (skipped when the warp's rows read the whole tile; with mma.sync the whole tile skipped
//      when they read none of it), online softmax in base 2, O += P V (P re-packed from the S
//      accumulators into A fragments; V through ldmatrix.trans or as wgmma's MN-major B);
//   5. O / l and the LSE go to the output (the entry is its query's only partial) or to the
//      fp32 partial workspace.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>
#include <utility>

#include "launch.h"

namespace treedec {

constexpr int kMergeWarps = 4;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T> struct TypeTraits;
template <> struct TypeTraits<__half> {
  using Mma = cute::SM80_16x8x16_F32F16F16F32_TN;
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <> struct TypeTraits<__nv_bfloat16> {
  using Mma = cute::SM80_16x8x16_F32BF16BF16F32_TN;
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// Element offset of (row, col) in a [rows][D] 16-bit tile whose 16-byte vectors are XOR-swizzled
// by the row (so that ldmatrix's 8 row addresses hit 8 different bank groups).
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Tile shape per head dim: KV tokens per tile, pipeline stages, warps (16 rows each), and
// resident CTAs per SM asked of the compiler (2: 16 warps per SM to hide latency).
template <int D, bool WGMMA> struct PartialConfig;
// mma.sync (sm_80+)
template <> struct PartialConfig<64, false> { static constexpr int kBN = 32, kStages = 4, kWarps = 8, kMinBlocks = 2; };
template <> struct PartialConfig<128, false> { static constexpr int kBN = 32, kStages = 3, kWarps = 8, kMinBlocks = 2; };
template <> struct PartialConfig<256, false> { static constexpr int kBN = 32, kStages = 5, kWarps = 4, kMinBlocks = 1; };
// wgmma (sm_90a): two warpgroups of 64 rows share each K/V tile; BN = 64 (the N of S's wgmma).
template <> struct PartialConfig<64, true> { static constexpr int kBN = 64, kStages = 4, kWarps = 8, kMinBlocks = 2; };
#ifndef TREEDEC_WGMMA128_STAGES  // tuning knobs (TREEDEC_CUDA_FLAGS="-DTREEDEC_WGMMA128_STAGES=5 ...")
#define TREEDEC_WGMMA128_STAGES 2
#endif
#ifndef TREEDEC_WGMMA128_MIN_BLOCKS
#define TREEDEC_WGMMA128_MIN_BLOCKS 2
#endif
template <> struct PartialConfig<128, true> {
  static constexpr int kBN = 64, kStages = TREEDEC_WGMMA128_STAGES, kWarps = 8,
                       kMinBlocks = TREEDEC_WGMMA128_MIN_BLOCKS;
};
#if defined(TREEDEC_SM90A)
constexpr bool kUseWgmma = true;   // built for sm_90a (cuda_build passes -DTREEDEC_SM90A)
#else
constexpr bool kUseWgmma = false;
#endif
template <int D> constexpr bool use_wgmma() { return kUseWgmma && D <= 128; }

// Offset of (row, col) in a [rows][D] tile stored the way wgmma reads a 128-byte-swizzled
// operand: D/64 column blocks of [rows][64], each 8-row x 128-byte atom XOR-swizzled
// (16-byte chunk c of row r at c ^ (r % 8)). Buffers start 1024-byte aligned.
__device__ __forceinline__ int swz128(int row, int col, int rows) {
  return (col >> 6) * (rows * 64) + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

// Programmatic dependent launch (sm_90): stage 1 lets the merge kernel launch at once; the
// merge reads its plan arrays, then waits for stage 1's memory (no-ops before sm_90).
// TREEDEC_PDL_STAGE1 (sm_90a builds): stage 1 itself is launched as a programmatic dependent of the
// kernel before it in the stream (the model's, or the previous call's merge), so its CTAs start
// and read their plan arrays while that kernel drains; wait_for_primary() then stands before its
// first read of q, k, v and its first write. Plan arrays are written by host copies (plan()),
// never by a kernel, so reading them early is safe. TREEDEC_MERGE_TRIGGER: the merge kernel lets
// the next stage 1 launch as soon as all of its blocks run.
#ifndef TREEDEC_PDL_STAGE1
#define TREEDEC_PDL_STAGE1 1
#endif
#ifndef TREEDEC_MERGE_TRIGGER
#define TREEDEC_MERGE_TRIGGER 1
#endif
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// wgmma shared-memory descriptor, 128-byte swizzle: 8-row (K-major) or 8-token (MN-major)
// groups 1024 bytes apart; `lbo_bytes` apart are the 64-column blocks of an MN-major operand.
__device__ __forceinline__ uint64_t gmma_desc(const void* smem, uint32_t lbo_bytes) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem) >> 4);
  desc.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo_bytes >> 4);
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::B128);
  return desc.desc_;
}

// The descriptor of the operand `bytes` further on (16-byte aligned, inside the same smem
// window): the start address is the low field, so this is one add, not a rebuild.
__device__ __forceinline__ uint64_t gmma_desc_add(uint64_t desc, int bytes) {
  // a 32-bit add on the low word (no carry into the high word: addresses < 256 KiB)
  const uint32_t lo = static_cast<uint32_t>(desc) + static_cast<uint32_t>(bytes >> 4);
  return (desc & 0xffffffff00000000ull) | lo;
}

namespace gmma = cute::SM90::GMMA;
template <typename T> struct Gmma;
// The wgmma atom of width N (64, 96 or 128) among the three given.
template <int N, class A64, class A96, class A128>
using GmmaOfWidth = std::conditional_t<N == 64, A64, std::conditional_t<N == 96, A96, A128>>;
template <> struct Gmma<__half> {
  template <int N> using SS = GmmaOfWidth<N,
      gmma::MMA_64x64x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x96x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x128x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>>;
  template <int N> using RS = GmmaOfWidth<N,
      gmma::MMA_64x64x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x96x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x128x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>>;
  template <int N> using RSK = GmmaOfWidth<N,  // B K-major (S = Q K^T, Q in registers)
      gmma::MMA_64x64x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x96x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x128x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>>;
};
template <> struct Gmma<__nv_bfloat16> {
  template <int N> using SS = GmmaOfWidth<N,
      gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x96x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x128x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>>;
  template <int N> using RS = GmmaOfWidth<N,
      gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x96x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>>;
  template <int N> using RSK = GmmaOfWidth<N,
      gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x96x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>>;
};

// S[64 x N] of a warpgroup (s[N/8][4] per thread: the mma.sync C layout per n8 block).
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float (&s)[N / 8][4], bool accumulate,
                                        std::index_sequence<I...>) {
  Atom::fma(da, db, s[I / 4][I % 4]..., accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}

// C[64 x N] (+)= A (registers: the mma.sync A layout, 16 x 16 per warp) B (descriptor); acc[N/8][4]:
// O += P V, or S = Q K^T with Q in registers.
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t db, float (&acc)[N / 8][4],
                                        std::index_sequence<I...>, bool accumulate = true) {
  Atom::fma(a[0], a[1], a[2], a[3], db, acc[I / 4][I % 4]..., accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}

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

// Unit u's record (PartialParams::unit_info) into registers; zeros for u < 0.
__device__ __forceinline__ void load_record(const PartialParams& p, int u, int (&rec)[kUnitFields]) {
  #pragma unroll
  for (int f = 0; f < kUnitFields; ++f) rec[f] = u >= 0 ? p.unit_info[kScheduleHeader + kUnitFields * u + f] : 0;
}

// Sum of a row's l over the quad (4 lanes) that holds it.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Issue S[64 x BN] = Q K^T for a warpgroup as one wgmma commit group (no wait): q_wg its 64 Q rows
// in a [ROWS][D] 128-byte-swizzled tile (swz128), cK a [BN][D] K tile laid out the same way.
template <typename T, int D, int ROWS, int BN = 64>
__device__ __forceinline__ void issue_wgmma_qk(const T* q_wg, const T* cK, float (&s)[BN / 8][4]) {
  #pragma unroll
  for (int j = 0; j < BN / 8; ++j)
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(s[j][e]);
  const uint64_t dq = gmma_desc(q_wg, 16), dk = gmma_desc(cK, 16);  // k steps: constant offsets
  cute::warpgroup_arrive();
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int q_k = (kk / 4) * (ROWS * 64) + (kk % 4) * 16;  // elements
    const int k_k = (kk / 4) * (BN * 64) + (kk % 4) * 16;
    gmma_ss<typename Gmma<T>::template SS<BN>, BN>(gmma_desc_add(dq, q_k * 2), gmma_desc_add(dk, k_k * 2), s,
                                                   kk > 0, std::make_index_sequence<BN / 2>{});
  }
  cute::warpgroup_commit_batch();
}

// Issue S[64 x BN] = Q K^T as issue_wgmma_qk does, with the warpgroup's Q rows in registers (qa: per
// 16-column step the mma.sync A fragment, load_q_fragments): the wgmma reads only K from smem.
template <typename T, int D, int BN = 64>
__device__ __forceinline__ void issue_wgmma_qk_rs(const uint32_t (&qa)[D / 16][4], const T* cK, float (&s)[BN / 8][4]) {
  #pragma unroll
  for (int j = 0; j < BN / 8; ++j)
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(s[j][e]);
  const uint64_t dk = gmma_desc(cK, 16);
  cute::warpgroup_arrive();
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    gmma_rs<typename Gmma<T>::template RSK<BN>, BN>(qa[kk], gmma_desc_add(dk, ((kk / 4) * (BN * 64) + (kk % 4) * 16) * 2),
                                                    s, std::make_index_sequence<BN / 2>{}, kk > 0);
  cute::warpgroup_commit_batch();
}

// A warp's 16 Q rows (row0 ..) of a [ROWS][D] 128-byte-swizzled smem tile (swz128) as the A fragments
// of issue_wgmma_qk_rs, through ldmatrix.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_q_fragments(const T* sQ, int row0, int lane, uint32_t (&qa)[D / 16][4]) {
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    cute::SM75_U32x4_LDSM_N::copy(
        *reinterpret_cast<const cute::uint128_t*>(sQ + swz128(row0 + (lane & 15), kk * 16 + (lane >> 4) * 8, ROWS)),
        qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]);
}

// Issue O[64 x D] += P[64 x BN] V[BN x D] for a warpgroup as one wgmma commit group (no wait):
// P in registers (pack_p), V an MN-major operand in 128-byte-swizzled smem at cV.
template <typename T, int D, int BN>
__device__ __forceinline__ void issue_wgmma_pv(const uint32_t (&pa)[BN / 16][4], const T* cV, float (&acc)[D / 8][4]) {
  #pragma unroll
  for (int j = 0; j < D / 8; ++j)
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(acc[j][e]);
  const uint64_t dv = gmma_desc(cV, BN * 128);
  cute::warpgroup_arrive();
  #pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    gmma_rs<typename Gmma<T>::template RS<D>, D>(pa[kk], gmma_desc_add(dv, kk * 16 * 64 * 2), acc,
                                                 std::make_index_sequence<D / 2>{});
  cute::warpgroup_commit_batch();
}

template <int D, int BN, int STAGES, int WARPS>
struct SmemLayout {
  static constexpr int kRows = WARPS * 16;
  static constexpr int kQ = kRows * D;                 // elements
  static constexpr int kKV = BN * D;                   // elements per stage per K or V
  static constexpr int kMaskWords = BN / 32;           // per row per tile
  static constexpr int kBytes16 = 2 * (kQ + 2 * STAGES * kKV);
  static constexpr int kBytes = kBytes16
      + 4 * STAGES * kRows * kMaskWords   // masks
      + 4 * 3 * kRows;                    // row entry/query/head
};

template <typename T, int D, int BN, int STAGES, int WARPS, int MIN_BLOCKS, bool WGMMA>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
tree_attn_partial_kernel(const PartialParams p) {
  launch_dependents();
  wait_for_primary();  // reads q, k, v and writes only after the kernel before it (TREEDEC_PDL_STAGE1)
  static_assert(!WGMMA || (BN == 64 && WARPS % 4 == 0 && D <= 128), "wgmma tile shape");
  using L = SmemLayout<D, BN, STAGES, WARPS>;
  constexpr int kThreads = WARPS * 32;
  constexpr int kRows = L::kRows;
  using Mma = typename TypeTraits<T>::Mma;
  constexpr int kVecPerRow = D / 8;                       // 16-byte vectors per row
  constexpr int kRowsPerPass = kThreads / kVecPerRow;     // rows one pass of all threads copies
  constexpr int kKVPasses = BN / kRowsPerPass;            // >= 1 for every instantiation
  constexpr int kMW = L::kMaskWords;
  static_assert(BN % kRowsPerPass == 0 && BN % 32 == 0 && kListTileTokens % BN == 0, "tile shape");

  extern __shared__ __align__(128) uint8_t smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + L::kQ;
  T* sV = sK + STAGES * L::kKV;
  uint32_t* sMask = reinterpret_cast<uint32_t*>(smem_raw + L::kBytes16);   // [STAGES][kRows][kMW]
  int* sRowEntry = reinterpret_cast<int*>(sMask + STAGES * kRows * kMW);   // [kRows], -1: padding
  int* sRowQuery = sRowEntry + kRows;
  int* sRowHead = sRowQuery + kRows;

  // Element offset of (row, col) in a [rows][D] smem tile: the ldmatrix layout or wgmma's.
  auto tile_offset = [](int row, int col, int rows) {
    if constexpr (WGMMA) return swz128(row, col, rows);
    else return swz<D>(row, col);
  };
  if constexpr (WGMMA) {  // descriptors address 1 KiB swizzle atoms
    if (threadIdx.x == 0 && (cute::cast_smem_ptr_to_uint(smem_raw) & 1023u)) __trap();
  }
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);

  // The copy role of this thread: one 16-byte column `cp_vec` of rows cp_row0 + i * kRowsPerPass.
  const int cp_vec = tid % kVecPerRow;
  const int cp_row0 = tid / kVecPerRow;

  const int unit_begin = p.cta_unit_start[blockIdx.x];
  const int unit_end = p.cta_unit_start[blockIdx.x + 1];
  if (tid == 0 && p.unit_info[0] != kListTileTokens) __trap();  // a schedule for another kernel (the host checks first)
  for (int u = unit_begin; u < unit_end; ++u) {
    const int* info = p.unit_info + kScheduleHeader + kUnitFields * u;
    const int chunk = info[0], kv_head = info[1], item_entry = info[2], row_begin = info[3], row_end = info[4];
    const int kv_begin = p.chunk_kv_start[chunk];
    const int chunk_len = p.chunk_kv_start[chunk + 1] - kv_begin;
    if (tid < kRows) {
      const int r = row_begin + tid;
      int entry = -1, query = 0, head = 0;
      if (r < row_end) {
        entry = item_entry + r / p.group;
        query = p.entry_query[entry];
        head = kv_head * p.group + r % p.group;
      }
      sRowEntry[tid] = entry;
      sRowQuery[tid] = query;
      sRowHead[tid] = head;
    }
    __syncthreads();

    // Q rows into shared memory (first cp.async group of the unit).
    #pragma unroll
    for (int i = 0; i < kRows / kRowsPerPass; ++i) {
      const int r = cp_row0 + i * kRowsPerPass;
      const bool valid = sRowEntry[r] >= 0;
      const T* src = valid ? q + sRowQuery[r] * p.q_stride_q + sRowHead[r] * p.q_stride_h + cp_vec * 8 : q;
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
          *reinterpret_cast<const cute::uint128_t*>(src),
          *reinterpret_cast<cute::uint128_t*>(sQ + tile_offset(r, cp_vec * 8, kRows)), valid);
    }

    // This thread's two fragment rows (r0 = warp * 16 + lane / 4, r1 = r0 + 8).
    const int r0 = warp * 16 + (lane >> 2);
    const int r1 = r0 + 8;
    const int entry0 = sRowEntry[r0], entry1 = sRowEntry[r1];

    float acc[D / 8][4];
    #pragma unroll
    for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    // Live tiles of the unit: the CPU schedule's list of 64-token tiles, kSub of ours each.
    constexpr int kSub = kListTileTokens / BN;
    const int tile_begin = info[5];
    const int num_live = (info[6] - tile_begin) * kSub;
    auto tile_token = [&](int i) {  // first chunk token of live tile i
      return (p.unit_info[tile_begin + i / kSub] & ~kFullTileFlag) * kListTileTokens + (i % kSub) * BN;
    };

    // -- cp.async pipeline over the live tiles.
    int slots[kKVPasses];
    auto fetch_slots = [&](int i) {  // slot of each of this thread's rows of live tile i (-1: none)
      #pragma unroll
      for (int pass = 0; pass < kKVPasses; ++pass) {
        const int tok = i < num_live ? tile_token(i) + cp_row0 + pass * kRowsPerPass : chunk_len;
        slots[pass] = tok < chunk_len ? p.kv_slots[kv_begin + tok] : -1;
      }
    };
    auto issue_tile = [&](int i) {  // loads of live tile i into stage i % STAGES, one commit group
      if (i < num_live) {
        const int stage = i % STAGES;
        T* dK = sK + stage * L::kKV;
        T* dV = sV + stage * L::kKV;
        #pragma unroll
        for (int pass = 0; pass < kKVPasses; ++pass) {
          const int r = cp_row0 + pass * kRowsPerPass;
          const bool valid = slots[pass] >= 0;
          const int64_t slot = valid ? slots[pass] : 0;
          const T* srcK = k + slot * p.k_stride_s + kv_head * p.k_stride_h + cp_vec * 8;
          const T* srcV = v + slot * p.v_stride_s + kv_head * p.v_stride_h + cp_vec * 8;
          cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
              *reinterpret_cast<const cute::uint128_t*>(srcK),
              *reinterpret_cast<cute::uint128_t*>(dK + tile_offset(r, cp_vec * 8, BN)), valid);
          cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
              *reinterpret_cast<const cute::uint128_t*>(srcV),
              *reinterpret_cast<cute::uint128_t*>(dV + tile_offset(r, cp_vec * 8, BN)), valid);
        }
        const int word = tile_token(i) / 32;
        for (int idx = tid; idx < kRows * kMW; idx += kThreads) {
          const int r = idx / kMW, w = idx % kMW;
          const int e = sRowEntry[r];
          const bool valid = e >= 0 && (word + w) * 32 < chunk_len;
          const int* src = valid ? p.entry_mask + static_cast<int64_t>(e) * p.mask_stride + word + w : p.entry_mask;
          cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint32_t>::copy(
              *reinterpret_cast<const uint32_t*>(src), sMask[(stage * kRows + r) * kMW + w], valid);
        }
      }
      cute::cp_async_fence();
    };

    fetch_slots(0);
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
      issue_tile(i);
      fetch_slots(i + 1);
    }
    for (int i = 0; i < num_live; ++i) {
      cute::cp_async_wait<STAGES - 2>();
      if constexpr (WGMMA) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async -> wgmma
      __syncthreads();
      issue_tile(i + STAGES - 1);
      fetch_slots(i + STAGES);
      const int stage = i % STAGES;
      const T* cK = sK + stage * L::kKV;
      const T* cV = sV + stage * L::kKV;
      const uint32_t* cMask = sMask + stage * kRows * kMW;
      if constexpr (WGMMA) {  // a warpgroup whose 64 rows are all padding has nothing to compute
        if (row_end - row_begin <= (warp / 4) * 64) continue;
      }

      uint32_t mw0[kMW], mw1[kMW];
      uint32_t any = 0u, all = 0xffffffffu;
      #pragma unroll
      for (int w = 0; w < kMW; ++w) {
        mw0[w] = cMask[r0 * kMW + w];
        mw1[w] = cMask[r1 * kMW + w];
        any |= mw0[w] | mw1[w];
        all &= mw0[w] & mw1[w];
      }
      // No row of this warp reads the tile: skip it (mma.sync only; wgmma needs the whole warpgroup).
      if (!WGMMA && !__any_sync(0xffffffffu, any != 0u)) continue;
      const bool full = __all_sync(0xffffffffu, all == 0xffffffffu);

      // S = Q K^T for the warp's 16 rows and the tile's BN tokens.
      float s[BN / 8][4];
      #pragma unroll
      for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      if constexpr (WGMMA) {
        // Warpgroup wg owns rows 64 wg .. 64 wg + 63: S = Q K^T, both operands in shared memory.
        issue_wgmma_qk<T, D, kRows>(sQ + (warp / 4) * 64 * 64, cK, s);
        cute::warpgroup_wait<0>();
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(s[j][e]);
      } else {
      #pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        cute::SM75_U32x4_LDSM_N::copy(
            *reinterpret_cast<const cute::uint128_t*>(sQ + swz<D>(warp * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8)),
            a[0], a[1], a[2], a[3]);
        #pragma unroll
        for (int nn = 0; nn < BN / 16; ++nn) {
          uint32_t b[4];
          cute::SM75_U32x4_LDSM_N::copy(
              *reinterpret_cast<const cute::uint128_t*>(
                  cK + swz<D>(nn * 16 + (lane >> 4) * 8 + (lane & 7), kk * 16 + ((lane >> 3) & 1) * 8)),
              b[0], b[1], b[2], b[3]);
          Mma::fma(s[2 * nn][0], s[2 * nn][1], s[2 * nn][2], s[2 * nn][3], a[0], a[1], a[2], a[3], b[0], b[1],
                   s[2 * nn][0], s[2 * nn][1], s[2 * nn][2], s[2 * nn][3]);
          Mma::fma(s[2 * nn + 1][0], s[2 * nn + 1][1], s[2 * nn + 1][2], s[2 * nn + 1][3], a[0], a[1], a[2], a[3],
                   b[2], b[3], s[2 * nn + 1][0], s[2 * nn + 1][1], s[2 * nn + 1][2], s[2 * nn + 1][3]);
        }
      }

      }  // mma.sync

      const float2 alpha = online_softmax<BN>(s, mw0, mw1, full, p.qk_scale_log2, lane, m0, m1, l0, l1);
      rescale_o<D>(acc, alpha);

      // O += P V: P's A fragments are two adjacent S accumulator tiles; V through ldmatrix.trans
      // (mma.sync) or straight from shared memory (wgmma: V is an MN-major B operand).
      if constexpr (WGMMA) {
        uint32_t pa[BN / 16][4];
        pack_p<T, BN>(s, pa);
        issue_wgmma_pv<T, D, BN>(pa, cV, acc);
        cute::warpgroup_wait<0>();
        #pragma unroll
        for (int j = 0; j < D / 8; ++j)
          for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(acc[j][e]);
      } else
      #pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[4];
        a[0] = TypeTraits<T>::pack(s[2 * kk][0], s[2 * kk][1]);
        a[1] = TypeTraits<T>::pack(s[2 * kk][2], s[2 * kk][3]);
        a[2] = TypeTraits<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = TypeTraits<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        #pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t b[4];
          cute::SM75_U16x8_LDSM_T::copy(
              *reinterpret_cast<const cute::uint128_t*>(
                  cV + swz<D>(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), dn * 16 + (lane >> 4) * 8)),
              b[0], b[1], b[2], b[3]);
          Mma::fma(acc[2 * dn][0], acc[2 * dn][1], acc[2 * dn][2], acc[2 * dn][3], a[0], a[1], a[2], a[3],
                   b[0], b[1], acc[2 * dn][0], acc[2 * dn][1], acc[2 * dn][2], acc[2 * dn][3]);
          Mma::fma(acc[2 * dn + 1][0], acc[2 * dn + 1][1], acc[2 * dn + 1][2], acc[2 * dn + 1][3],
                   a[0], a[1], a[2], a[3], b[2], b[3],
                   acc[2 * dn + 1][0], acc[2 * dn + 1][1], acc[2 * dn + 1][2], acc[2 * dn + 1][3]);
        }
      }
    }
    cute::cp_async_wait<0>();
    __syncthreads();  // the next unit overwrites the stages

    // Epilogue: rows of this thread; the quad (4 lanes) shares a row.
    store_row<T, D>(p, acc, 0, entry0, sRowQuery[r0], sRowHead[r0], m0, quad_sum(l0), lane);
    store_row<T, D>(p, acc, 1, entry1, sRowQuery[r1], sRowHead[r1], m1, quad_sum(l1), lane);
    __syncthreads();  // the next unit rewrites the row tables and sQ
  }
}

}  // namespace treedec

#include "tree_attention_ws.cuh"

namespace treedec {

// Stage 2: one warp per (query, head); lane l holds columns [l * D/32, (l+1) * D/32).
// Entries go in batches of 32: each lane loads one entry's index and LSE (one round trip for the
// batch, not one per entry), the batch's weights come from a warp max, and the partial rows are
// then read UNROLL at a time, so their loads overlap. The order of every sum is fixed by the
// plan's CSR: deterministic. (Merging in stage 1's own tail behind a grid barrier measured even
// over the suite on an H200: bench/README.md, ...-fused-grid-merge.patch.)
//
// The merge kernel of a launch loads up to 4, 8 or 16 rows at once (16 with head dim 256 would not
// fit in registers: 8), the fewest that take the plan's most partials of a query in one round (16
// only while the (query, head) pairs fit one wave of its warps: merge_wave_pairs). On an
// H200 (head dim 128; ...-merge-unroll-ab.json, ...-merge-rounds-ab.json) one round ran the graphed
// call of tot_d5w10 (12 partials a query) 1.7 us faster than rounds of 4 and fewshot_b30 (10) 1.5 us,
// while 16 at once for medusa256's 2 partials (8192 (query, head) pairs) ran 2.9 us slower: 108
// registers a thread, under half the resident warps of the 4-row kernel.
template <int D> constexpr int merge_unroll_max() { return D == 256 ? 8 : 16; }

template <typename T, int D, int UNROLL>
__global__ void __launch_bounds__(kMergeWarps * 32)
merge_partials_kernel(const MergeParams p) {
  constexpr int kPer = D / 32;
  if (TREEDEC_MERGE_TRIGGER) launch_dependents();  // the next stage 1 waits for this grid before its data
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

#ifndef TREEDEC_WARP_SPECIALIZED  // 0: sm_90a runs the single-role wgmma kernel above (for comparisons)
#define TREEDEC_WARP_SPECIALIZED 1
#endif

// The stage-1 kernel of (T, D) for list tiles of TILE tokens on the build's arch: the warp-specialized
// wgmma kernel of that tile on sm_90a (head dims 64/128; tiles of 64 or 96 tokens), else
// tree_attn_partial_kernel with PartialConfig's shape (tiles of kListTileTokens). kTakes: whether
// such a kernel exists.
constexpr bool kWarpSpecialized = kUseWgmma && TREEDEC_WARP_SPECIALIZED;
template <typename T, int D, int TILE, bool WS = kWarpSpecialized && D <= 128>
struct Stage1 {
  using C = PartialConfig<D, use_wgmma<D>()>;
  static constexpr bool kTakes = TILE == kListTileTokens;
  static constexpr int kThreads = C::kWarps * 32;
  static constexpr int kRows = C::kWarps * 16;
  static constexpr int kSmem = SmemLayout<D, C::kBN, C::kStages, C::kWarps>::kBytes;
  static constexpr auto kernel() {
    return tree_attn_partial_kernel<T, D, C::kBN, C::kStages, C::kWarps, C::kMinBlocks, use_wgmma<D>()>;
  }
};
#if defined(TREEDEC_SM90A)
template <typename T, int D, int TILE>
struct Stage1<T, D, TILE, true> {
  static constexpr bool kTakes = TILE == 64 || TILE == 96;
  static constexpr int kBN = kTakes ? TILE : 64;
  static constexpr int kThreads = ws::kThreads;
  static constexpr int kRows = ws::kRows;
  static constexpr int kSmem = ws::Smem<D, kBN, ws::Tile<kBN>::kStages>::kBytes;
  static constexpr auto kernel() { return ws::tree_attn_partial_ws_kernel<T, D, kBN>; }
};
#endif

// Programmatic dependent launches need sm_90 (the sm_90a build); elsewhere kernels launch in plain order.
// Stage 1 launches so unless TREEDEC_PDL_STAGE1=0 or in trace builds (their first stamps are
// written before the wait).
#if defined(TREEDEC_SM90A)
constexpr bool kProgrammaticLaunch = true;
constexpr bool kProgrammaticStage1 = TREEDEC_PDL_STAGE1 && !TREEDEC_WS_TRACE;
#else
constexpr bool kProgrammaticLaunch = false;
constexpr bool kProgrammaticStage1 = false;
#endif
inline cudaLaunchAttribute programmatic_launch() {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}
// A cudaLaunchKernelEx configuration with the given attribute (or none).
struct LaunchConfig : cudaLaunchConfig_t {
  LaunchConfig(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, cudaLaunchAttribute* attr) : cudaLaunchConfig_t{} {
    gridDim = grid;
    blockDim = block;
    dynamicSmemBytes = smem;
    this->stream = stream;
    attrs = attr;
    numAttrs = attr ? 1 : 0;
  }
};

template <typename T, int D, int TILE>
cudaError_t launch_partial_tile(const PartialParams& p, cudaStream_t stream) {
  using S = Stage1<T, D, TILE>;
  if (!S::kTakes) return cudaErrorInvalidValue;
  static bool configured = false;  // the attribute is per function, set once per process
  if (!configured) {
    cudaError_t err = cudaFuncSetAttribute(S::kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmem);
    if (err != cudaSuccess) return err;
    configured = true;
  }
  if (p.num_ctas == 0) return cudaSuccess;
  cudaLaunchAttribute attr = programmatic_launch();  // starts while the kernel before it drains
  LaunchConfig config(dim3(p.num_ctas), dim3(S::kThreads), S::kSmem, stream, kProgrammaticStage1 ? &attr : nullptr);
  return cudaLaunchKernelEx(&config, S::kernel(), p);
}

template <typename T, int D>
cudaError_t launch_partial_typed(const PartialParams& p, cudaStream_t stream) {
  switch (p.tile_tokens) {
    case 64: return launch_partial_tile<T, D, 64>(p, stream);
    case 96: return launch_partial_tile<T, D, 96>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int D>
constexpr int rows_per_unit() { return Stage1<T, D, kListTileTokens>::kRows; }

template <typename T, int D>
constexpr bool takes_tile(int tile_tokens) {
  return tile_tokens == 64 ? Stage1<T, D, 64>::kTakes : tile_tokens == 96 && Stage1<T, D, 96>::kTakes;
}

template <typename T, int D, int TILE>
int partial_ctas_per_sm_tile() {
  using S = Stage1<T, D, TILE>;
  if (cudaFuncSetAttribute(S::kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmem) != cudaSuccess) return 0;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, S::kernel(), S::kThreads, S::kSmem) != cudaSuccess) return 0;
  return blocks;
}

// Resident CTAs per SM of every tile's kernel (the persistent grid must fit each of them).
template <typename T, int D>
int partial_ctas_per_sm_typed() {
  const int b64 = partial_ctas_per_sm_tile<T, D, 64>();
  const int b96 = Stage1<T, D, 96>::kTakes ? partial_ctas_per_sm_tile<T, D, 96>() : b64;
  return b64 < b96 ? b64 : b96;
}

// (query, head) pairs one wave of the widest merge kernel holds on the current device (its warps
// resident at once, one pair each). Past that the 8-row kernel runs: 16 rows at once take 108
// registers a thread (head dim 128), and for a merge of many pairs the resident warps count more
// (H200, medusa256's 8192 pairs: 16 rows 2.9 us slower than 4 or 8, ...-merge-unroll-ab.json).
template <typename T, int D>
cudaError_t merge_wave_pairs(int& pairs) {
  constexpr int kDevices = 64;
  static int cached[kDevices] = {};  // 0: not computed yet
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < kDevices && cached[device] > 0) {
    pairs = cached[device];
    return cudaSuccess;
  }
  int sms = 0, blocks = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess)
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, merge_partials_kernel<T, D, merge_unroll_max<D>()>,
                                                        kMergeWarps * 32, 0);
  if (err != cudaSuccess) return err;
  pairs = sms * blocks * kMergeWarps;
  if (device < kDevices) cached[device] = pairs;
  return cudaSuccess;
}

template <typename T, int D>
cudaError_t launch_merge_typed(const MergeParams& p, cudaStream_t stream) {
  const int pairs = p.num_queries * p.num_qo_heads;
  if (pairs == 0) return cudaSuccess;
  cudaLaunchAttribute attr = programmatic_launch();  // launched while stage 1 runs; waits in wait_for_primary()
  LaunchConfig config(dim3((pairs + kMergeWarps - 1) / kMergeWarps), dim3(kMergeWarps * 32), 0, stream,
                      kProgrammaticLaunch ? &attr : nullptr);
  if (p.max_query_entries <= 4) return cudaLaunchKernelEx(&config, merge_partials_kernel<T, D, 4>, p);
  int wave = 0;
  if (merge_unroll_max<D>() > 8 && p.max_query_entries > 8) {
    cudaError_t err = merge_wave_pairs<T, D>(wave);
    if (err != cudaSuccess) return err;
  }
  if (pairs > wave) return cudaLaunchKernelEx(&config, merge_partials_kernel<T, D, 8>, p);
  return cudaLaunchKernelEx(&config, merge_partials_kernel<T, D, merge_unroll_max<D>()>, p);
}

}  // namespace treedec

namespace treedec {

// The launch functions of one input dtype, switching on the head dim. Members are defined
// out of class (not inline), so that partial_<dtype>.cu instantiates them (and the kernels)
// once and dispatch.cu, declaring them extern, compiles none.
template <typename T>
struct DtypeFunctions {
  static cudaError_t launch_partial(int head_dim, const PartialParams& p, cudaStream_t stream);
  static cudaError_t launch_merge(int head_dim, const MergeParams& p, cudaStream_t stream);
  static int ctas_per_sm(int head_dim);
  static int rows_per_unit(int head_dim);
  static bool takes_tile(int head_dim, int tile_tokens);
};

template <typename T>
cudaError_t DtypeFunctions<T>::launch_partial(int head_dim, const PartialParams& p, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch_partial_typed<T, 64>(p, stream);
    case 128: return launch_partial_typed<T, 128>(p, stream);
    case 256: return launch_partial_typed<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t DtypeFunctions<T>::launch_merge(int head_dim, const MergeParams& p, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch_merge_typed<T, 64>(p, stream);
    case 128: return launch_merge_typed<T, 128>(p, stream);
    case 256: return launch_merge_typed<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
int DtypeFunctions<T>::ctas_per_sm(int head_dim) {
  switch (head_dim) {
    case 64: return partial_ctas_per_sm_typed<T, 64>();
    case 128: return partial_ctas_per_sm_typed<T, 128>();
    case 256: return partial_ctas_per_sm_typed<T, 256>();
    default: return 0;
  }
}

template <typename T>
int DtypeFunctions<T>::rows_per_unit(int head_dim) {
  switch (head_dim) {
    case 64: return treedec::rows_per_unit<T, 64>();
    case 128: return treedec::rows_per_unit<T, 128>();
    case 256: return treedec::rows_per_unit<T, 256>();
    default: return 0;
  }
}

template <typename T>
bool DtypeFunctions<T>::takes_tile(int head_dim, int tile_tokens) {
  switch (head_dim) {
    case 64: return treedec::takes_tile<T, 64>(tile_tokens);
    case 128: return treedec::takes_tile<T, 128>(tile_tokens);
    case 256: return treedec::takes_tile<T, 256>(tile_tokens);
    default: return false;
  }
}

}  // namespace treedec
