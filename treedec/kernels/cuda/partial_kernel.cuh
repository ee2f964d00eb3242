// The single-role stage-1 kernel: every warp gathers and computes with mma.sync (sm_80, sm_86, sm_89; the
// sm_90a build runs the warp-specialized kernel of partial_ws_kernel.cuh for every head dim).
#pragma once
#include <cmath>
#include <cstdint>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/util.hpp>
#include <cute/numeric/int.hpp>

#include "dtype_traits.cuh"
#include "epilogue.cuh"
#include "launch.h"
#include "pdl.cuh"
#include "softmax.cuh"
#include "swizzle.cuh"
#include "tile_sizes.cuh"
#include "variants.cuh"

namespace treedec {

// Stage 1 of DeFT-Flatten (partial attention per work unit, on a persistent grid), every warp
// loading and computing with mma.sync m16n8k16. Built for sm_90a (-DTREEDEC_SM90A), every head dim
// runs the warp-specialized wgmma kernel of partial_ws_kernel.cuh instead (Stage1 in launch_template.cuh
// picks).
//
// Stage 1, one CTA of WARPS warps, 16 rows each (PartialConfig), loops over its units. For a unit:
//   1. rows -> (entry, query, head) in shared memory; Q rows gathered into smem (cp.async);
//   2. only the unit's *live* tiles (some row reads a token; the CPU schedule lists them, in
//      kListTileTokens-token tiles) are loaded and computed (dead tiles cost nothing);
//   3. live tiles go through a STAGES-deep cp.async pipeline: K/V rows gathered through the
//      slot table (16-byte vectors, XOR-swizzled smem, zero-filled past the chunk), the rows'
//      mask words beside them; slots of the tile after next are prefetched into registers;
//   4. per warp: S = Q K^T (ldmatrix + mma.sync, fp32 accumulate), the variant's logit hook (Logits,
//      variants.cuh), bit mask in registers
//      (skipped when the warp's rows read the whole tile; the whole tile skipped when they read
//      none of it), online softmax in base 2, O += P V (P re-packed from the S accumulators into
//      A fragments; V through ldmatrix.trans);
//   5. O / l and the LSE go to the output (the entry is its query's only partial) or to the
//      fp32 partial workspace.
template <typename T, int D, int BN, int STAGES, int WARPS, int MIN_BLOCKS, class Logits>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
tree_attn_partial_kernel(const PartialParams p) {
  launch_dependents();
  wait_for_primary();  // reads q, k, v and writes only after the kernel before it (pdl.cuh)
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
          *reinterpret_cast<cute::uint128_t*>(sQ + swz<D>(r, cp_vec * 8)), valid);
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
              *reinterpret_cast<cute::uint128_t*>(dK + swz<D>(r, cp_vec * 8)), valid);
          cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
              *reinterpret_cast<const cute::uint128_t*>(srcV),
              *reinterpret_cast<cute::uint128_t*>(dV + swz<D>(r, cp_vec * 8)), valid);
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
      __syncthreads();
      issue_tile(i + STAGES - 1);
      fetch_slots(i + STAGES);
      const int stage = i % STAGES;
      const T* cK = sK + stage * L::kKV;
      const T* cV = sV + stage * L::kKV;
      const uint32_t* cMask = sMask + stage * kRows * kMW;

      uint32_t mw0[kMW], mw1[kMW];
      uint32_t any = 0u, all = 0xffffffffu;
      #pragma unroll
      for (int w = 0; w < kMW; ++w) {
        mw0[w] = cMask[r0 * kMW + w];
        mw1[w] = cMask[r1 * kMW + w];
        any |= mw0[w] | mw1[w];
        all &= mw0[w] & mw1[w];
      }
      // No row of this warp reads the tile: skip it.
      if (!__any_sync(0xffffffffu, any != 0u)) continue;
      const bool full = __all_sync(0xffffffffu, all == 0xffffffffu);

      // S = Q K^T for the warp's 16 rows and the tile's BN tokens.
      float s[BN / 8][4];
      #pragma unroll
      for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
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

      Logits::apply(s, p);
      const float2 alpha = online_softmax<BN>(s, mw0, mw1, full, p.qk_scale_log2, lane, m0, m1, l0, l1);
      rescale_o<D>(acc, alpha);

      // O += P V: P's A fragments are two adjacent S accumulator tiles; V through ldmatrix.trans.
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
