// The warp-specialized stage-1 kernel for sm_90a: a cp.async producer warpgroup and two wgmma
// consumer warpgroups around a ring of K/V stages.
#pragma once
#if defined(TREEDEC_SM90A)
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/util.hpp>
#include <cute/numeric/int.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "epilogue.cuh"
#include "kv_fp8.cuh"
#include "launch.h"
#include "pdl.cuh"
#include "scheduler.cuh"
#include "softmax.cuh"
#include "swizzle.cuh"
#include "variants.cuh"
#include "wgmma.cuh"
#include "ws_config.cuh"
#include "ws_pipeline.cuh"
#include "ws_trace.cuh"

namespace treedec {
namespace ws {

// Warp-specialized stage 1 for sm_90a (head dims 64/128/256): one persistent CTA per SM of three
// warpgroups, FlashAttention-3's structure with cp.async gathers in place of TMA.
//
//   warpgroup 0, the producer: for each live tile of a unit (the list the CPU schedule made) it
//     waits for a free stage of the STAGES-deep ring, gathers K/V rows from the pages with
//     cp.async into 128-byte-swizzled smem (the unit's Q rows ride with its first tile, into one
//     of two Q buffers) plus the rows' mask words, and moves on: the stage's mbarrier completes
//     when the copies land (cp.async.mbarrier.arrive.noinc), so many tiles are in flight. After a
//     unit's last tile an END item (no data) tells the consumers to write the unit's rows.
//   warpgroups 1 and 2, the consumers: 64 rows each (setmaxnreg gives them the registers the
//     producer does not need). A unit's Q rows go from smem to registers once (ldmatrix), so
//     S = Q K^T (wgmma RS) reads only K from smem: with both operands from smem the QK wgmmas
//     would take the whole smem bandwidth. Per tile, S = Q K^T and, in the same turn, O += P V of
//     the previous tile (wgmma RS); this tile's softmax runs before the wait for that PV (FA3's
//     intra-warpgroup overlap). The two consumers take turns to issue their wgmmas (named
//     barriers), one's softmax running under the other's matmuls. Tiles the schedule flags full
//     (kFullTileFlag: every row of the item reads the whole tile) come without mask words and run
//     a mask-free copy of the turn. A stage is released once its PV has completed.
//
// Launched as a programmatic dependent (pdl.cuh): the producer loads the first unit's record,
// slots and row queries (plan data) before its griddepcontrol.wait, the consumers wait before any
// store; inside CUDA graphs a call's stage 1 so starts while the previous call's merge drains.
//
// Every item (tile or END) goes through both consumers, so the two stay in step; a consumer whose
// 64 rows of a unit are all padding only takes its turns and frees the stages (decided once per
// unit: a branch between a wgmma's issue and its wait would make ptxas serialize them all).
//
// The kernel of BN-token tiles (the host launches the one the schedule's tile size names), logit
// variant Logits (variants.cuh: its hook runs on S between the QK wait and the softmax) and K/V element
// type TKV: T, or e4m3 (the fp8 KV build, kv_fp8.cuh: staged, widened to T before the wgmmas read them).
template <typename T, typename TKV, int D, int BN, class Logits>
__global__ void __launch_bounds__(kThreads, 1)
tree_attn_partial_ws_kernel(const PartialParams p) {
  launch_dependents();
  if (threadIdx.x == 0) trace_stamp(p, kTraceStart);
  constexpr bool kFp8 = kIsFp8<TKV>;
  constexpr int STAGES = Shape<D, BN, kFp8>::kStages;
  constexpr int kQBuf = Shape<D, BN, kFp8>::kQBuffers;
  static_assert((BN == 64 || BN == 96) && (D == 64 || D == 128 || (D == 256 && BN == 64)), "wgmma tile shape");
  static_assert(!kFp8 || (BN == 64 && D <= 128 && STAGES >= 3), "fp8 K/V: 64-token tiles, head dims 64 and 128, "
                "three stages at least (a tile's stage is announced after the next tile's is acquired)");
  static_assert(std::is_same_v<TKV, T> || kFp8, "K/V of q's dtype, or e4m3");
  using L = Smem<D, BN, STAGES, kQBuf>;
  constexpr int kMW = L::kMW;
  extern __shared__ __align__(1024) uint8_t smem[];
  if (threadIdx.x == 0 && (cute::cast_smem_ptr_to_uint(smem) & 1023u)) __trap();  // descriptors need 1 KiB
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  uint32_t* sMask = reinterpret_cast<uint32_t*>(smem + L::kMask);
  int* sItem = reinterpret_cast<int*>(smem + L::kItem);
  int* sQuery = reinterpret_cast<int*>(smem + L::kQuery);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBar);
  uint64_t* empty = full + STAGES;
  uint64_t* q_free = empty + STAGES;
  // The CTA's units, and a guess at its first unit's record loaded alongside: CTA b runs unit b
  // first when every CTA before it runs one unit (a one-round schedule, as small trees get). A
  // right guess saves a dependent global load on the way to the first K/V gathers.
  const int cta = static_cast<int>(blockIdx.x);
  const int unit_begin = p.cta_unit_start[cta];
  const int unit_end = p.cta_unit_start[cta + 1];
  int guess[kUnitFields];
  load_record(p, kScheduleHeader + kUnitFields * (cta + 1) <= p.unit_info_len ? cta : -1, guess);
  // Unit u's record: the guess if it was u's, else loaded now.
  auto record = [&](int u, int (&rec)[kUnitFields]) {
    if (u == cta) {
      #pragma unroll
      for (int f = 0; f < kUnitFields; ++f) rec[f] = guess[f];
    } else {
      load_record(p, u, rec);
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      Barrier::init(&full[s], kProducerThreads + 1);  // async arrives + thread 0's plain one
      Barrier::init(&empty[s], 128 * kConsumers);
    }
    for (int b = 0; b < kQBuf; ++b) Barrier::init(&q_free[b], 128 * kConsumers);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;

  if (threadIdx.x < kProducerThreads) {
    // ------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<Shape<D, BN>::kProducerRegs>();
    const int tid = threadIdx.x;
    // A pass of the threads copies kCopyCols columns of kRowsPerPass rows; head dim 256 copies its two halves of
    // 128 columns (two 64-column blocks each) in turn, from the same slots.
    constexpr int kCopyCols = D > 128 ? 128 : D;
    constexpr int kHalves = D / kCopyCols;
    constexpr int kVecPerRow = kCopyCols / 8;
    constexpr int kRowsPerPass = kProducerThreads / kVecPerRow;
    constexpr int kKVPasses = BN / kRowsPerPass;
    constexpr int kQPasses = kRows / kRowsPerPass;
    static_assert(kRows == kProducerThreads, "one mask row per producer thread");
    const int cp_vec = tid % kVecPerRow;
    const int cp_row0 = tid / kVecPerRow;
    // A thread's rows of a tile are cp_row0 + pass * kRowsPerPass: as kRowsPerPass is a multiple
    // of the swizzle's 8 rows, their smem offsets differ by constants (hoisted out of the loops).
    static_assert(kRowsPerPass % 8 == 0, "rows of one pass keep their swizzle phase");
    const int kv_dst = swz128(cp_row0, cp_vec * 8, BN);
    const uint32_t kv_dst_k = cute::cast_smem_ptr_to_uint(sK + kv_dst);  // + stage and pass offsets
    const uint32_t kv_dst_v = cute::cast_smem_ptr_to_uint(sV + kv_dst);
    const uint32_t k_row_bytes = static_cast<uint32_t>(p.k_stride_s * sizeof(TKV));  // < 2^31 (binding)
    const uint32_t v_row_bytes = static_cast<uint32_t>(p.v_stride_s * sizeof(TKV));
    const T* __restrict__ q = static_cast<const T*>(p.q);
    const TKV* __restrict__ k = static_cast<const TKV*>(p.k);
    const TKV* __restrict__ v = static_cast<const TKV*>(p.v);

    int item = 0;  // items issued so far: stage item % STAGES, ring pass item / STAGES
    auto acquire = [&]() {  // the next stage, once the consumers released its previous item
      const int stage = item % STAGES;
      if (item >= STAGES) Barrier::wait(&empty[stage], ((item / STAGES) + 1) & 1);
      return stage;
    };
    // Announce the item in `stage`: every thread's arrive fires when its copies so far have
    // landed (cp.async.mbarrier.arrive.noinc), thread 0's plain arrive publishes sItem.
    auto announce = [&](int stage, int kind) {
      if (tid == 0) sItem[stage] = kind;
      cutlass::arch::cpasync_barrier_arrive_noinc(&full[stage]);
      if (tid == 0) Barrier::arrive(&full[stage]);
      ++item;
    };
    // fp8 K/V (kv_fp8.cuh): a tile's e4m3 rows are staged (buffer staged & 1) and announced once widened, after
    // the next tile's copies were issued (pending: its stage and buffer; -1: none). The thread's pieces of a tile
    // are those it copies: pass, half, its row cp_row0 + pass * kRowsPerPass and columns cp_vec * 8 + 0..7.
    using Staging = Fp8Staging<D, BN>;
    uint8_t* const sStage = smem + Staging::offset(L::kBytes);
    int staged = 0, pending_stage = -1, pending_buf = 0;
    auto widen_pending = [&](bool last) {  // widen the pending tile into its stage, announce it
      if constexpr (kFp8) {
        if (pending_stage < 0) return;
        if (last) cute::cp_async_wait<0>();
        else cute::cp_async_wait<1>();   // (the newest group: the next tile's copies, in flight)
        const uint8_t* src = sStage + pending_buf * 2 * Staging::kTileBytes;
        T* const kv[2] = {sK + pending_stage * BN * D, sV + pending_stage * BN * D};
        #pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          #pragma unroll
          for (int pass = 0; pass < kKVPasses; ++pass) {
            const int row = cp_row0 + pass * kRowsPerPass, col = h * kCopyCols + cp_vec * 8;
            #pragma unroll
            for (int t = 0; t < 2; ++t) {
              const uint2 raw = *reinterpret_cast<const uint2*>(src + t * Staging::kTileBytes + row * D + col);
              *reinterpret_cast<uint4*>(kv[t] + swz128(row, col, BN)) = widen_fp8x8<T>(raw);
            }
          }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // st.shared -> the consumers' wgmma reads
        Barrier::arrive(&full[pending_stage]);
        if (tid == 0) Barrier::arrive(&full[pending_stage]);
        pending_stage = -1;
      }
    };

    for (int u = unit_begin, local = 0; u < unit_end; ++u, ++local) {
      int info[kUnitFields];
      record(u, info);
      const int kv_head = info[1], item_entry = info[2], row_begin = info[3], row_end = info[4];
      // Live tiles: the schedule lists BN-token tiles; kFullTileFlag rides on a tile's first token
      // (tokens of a chunk stay below it) to issue_tile.
      const int tile_begin = info[5], num_tiles = info[6] - tile_begin;
      const int kv_begin = info[7], chunk_len = info[8], first_tile = info[9];
      // The thread's 16 bytes of a slot's K (V) row: k_head + slot * k_row_bytes (one IMAD.WIDE).
      const char* k_head = reinterpret_cast<const char*>(k + kv_head * p.k_stride_h + cp_vec * 8);
      const char* v_head = reinterpret_cast<const char*>(v + kv_head * p.v_stride_h + cp_vec * 8);
      const int mask_row = row_begin + tid;  // this thread copies the mask words of unit row tid
      const int mask_entry = mask_row < row_end ? item_entry + mask_row / p.group : -1;

      // Address pipeline: a tile's copies need its first token (the live list) and then its rows'
      // slots, two dependent loads. Two buffers (A: even tiles, B: odd) hold the slots two tiles
      // ahead of the copies and the first tokens four ahead, so those loads overlap earlier tiles'
      // copies instead of stalling every tile (no register copies of in-flight loads: the loop is
      // unrolled by two).
      auto tile_first = [&](int i) {  // first chunk token of live tile i, -1 past the last
        const int list_tile = i == 0 ? first_tile : p.unit_info[tile_begin + i];  // the first: in the record
        return i < num_tiles ? ((list_tile & ~kFullTileFlag) * BN) | (list_tile & kFullTileFlag) : -1;
      };
      auto load_slots = [&](int first, int (&slots)[kKVPasses]) {  // -1: no row
        #pragma unroll
        for (int pass = 0; pass < kKVPasses; ++pass) {
          const int tok = (first & ~kFullTileFlag) + cp_row0 + pass * kRowsPerPass;
          slots[pass] = first >= 0 && tok < chunk_len ? p.kv_slots[kv_begin + tok] : -1;
        }
      };
      int first_a = tile_first(0), first_b = tile_first(1), next_a = tile_first(2), next_b = tile_first(3);
      int slots_a[kKVPasses], slots_b[kKVPasses];
      load_slots(first_a, slots_a);
      load_slots(first_b, slots_b);
      if (local == 0 && tid == 0) {
        trace_stamp(p, kTraceRecord, info[7]);
        trace_stamp(p, kTraceSlots0, slots_a[0]);
      }
      const int qb = local % kQBuf;
      if (local >= kQBuf) Barrier::wait(&q_free[qb], ((local / kQBuf) + 1) & 1);  // unit local-kQBuf is done with it
      T* dQ = sQ + qb * kRows * D;
      // Each thread loads the query of unit row tid (one load, not one per Q pass), shared through
      // smem (two buffers: a thread writes unit local + 1's only after every producer thread passed
      // this barrier for unit local, i.e. finished unit local - 1's reads).
      int* q_rows = sQuery + (local & 1) * kRows;
      q_rows[tid] = mask_entry >= 0 ? p.entry_query[mask_entry] : -1;
      bar_sync(kBarProducer, kProducerThreads);
      if (local == 0) wait_for_primary();  // q, k, v come from the kernel before (pdl.cuh)
      #pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        #pragma unroll
        for (int pass = 0; pass < kQPasses; ++pass) {  // the unit's Q rows ride with its first tile
          const int r = row_begin + cp_row0 + pass * kRowsPerPass;
          const int query = q_rows[cp_row0 + pass * kRowsPerPass];
          const bool valid = query >= 0;
          const int col = h * kCopyCols + cp_vec * 8;
          const T* src = valid ? q + query * p.q_stride_q + (kv_head * p.group + r % p.group) * p.q_stride_h + col : q;
          cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
              *reinterpret_cast<const cute::uint128_t*>(src),
              *reinterpret_cast<cute::uint128_t*>(dQ + swz128(cp_row0 + pass * kRowsPerPass, col, kRows)), valid);
        }
      }

      auto issue_tile = [&](int first, const int (&slots)[kKVPasses]) {  // K, V and mask words into a free stage
        const bool full = first & kFullTileFlag;
        first &= ~kFullTileFlag;
        const int stage = acquire();
        if constexpr (kFp8) {  // the e4m3 rows into a staging buffer, 8 bytes a piece
          const uint32_t dS = cute::cast_smem_ptr_to_uint(sStage + (staged & 1) * 2 * Staging::kTileBytes) +
                              cp_row0 * D + cp_vec * 8;
          #pragma unroll
          for (int h = 0; h < kHalves; ++h) {
            #pragma unroll
            for (int pass = 0; pass < kKVPasses; ++pass) {
              const uint64_t slot = static_cast<uint32_t>(max(slots[pass], 0));
              const int bytes = (~slots[pass] >> 31) & 8;
              const int half = h * kCopyCols;   // (bytes: one a value)
              const uint32_t at = dS + pass * kRowsPerPass * D + half;
              cp_async_8(at, k_head + half + slot * k_row_bytes, bytes);
              cp_async_8(at + Staging::kTileBytes, v_head + half + slot * v_row_bytes, bytes);
            }
          }
        } else {
          const uint32_t dK = kv_dst_k + stage * (BN * D * 2);
          const uint32_t dV = kv_dst_v + stage * (BN * D * 2);
          #pragma unroll
          for (int h = 0; h < kHalves; ++h) {  // (a half: 2 column blocks of BN x 64, BN * 256 bytes)
            #pragma unroll
            for (int pass = 0; pass < kKVPasses; ++pass) {
              // 32 x 32 -> 64-bit products (one IMAD.WIDE.U32 each); -1 (no row) zero-fills
              const uint64_t slot = static_cast<uint32_t>(max(slots[pass], 0));
              const int bytes = (~slots[pass] >> 31) & 16;
              const int half = h * kCopyCols * static_cast<int>(sizeof(T));
              cp_async_16(dK + h * BN * 256 + pass * kRowsPerPass * 128, k_head + half + slot * k_row_bytes, bytes);
              cp_async_16(dV + h * BN * 256 + pass * kRowsPerPass * 128, v_head + half + slot * v_row_bytes, bytes);
            }
          }
        }
        #pragma unroll
        for (int w = 0; w < kMW && !full; ++w) {
          const int word = first / 32 + w;
          const bool valid = mask_entry >= 0 && word * 32 < chunk_len;
          const int* src = valid ? p.entry_mask + static_cast<int64_t>(mask_entry) * p.mask_stride + word : p.entry_mask;
          cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint32_t>::copy(
              *reinterpret_cast<const uint32_t*>(src), sMask[(stage * kRows + tid) * kMW + w], valid);
        }
        if constexpr (kFp8) {
          if (tid == 0) sItem[stage] = full ? kItemFullTile : kItemTile;
          cute::cp_async_fence();
          ++item;
          widen_pending(false);   // the tile before: landed under this one's copies
          pending_stage = stage;
          pending_buf = staged++ & 1;
        } else {
          announce(stage, full ? kItemFullTile : kItemTile);
        }
      };
      for (int i = 0; i < num_tiles; i += 2) {
        issue_tile(first_a, slots_a);
        if (i == 0 && local == 0 && tid == 0) trace_stamp(p, kTraceIssued0);
        first_a = next_a;
        load_slots(first_a, slots_a);
        next_a = tile_first(i + 4);
        if (i + 1 == num_tiles) break;
        issue_tile(first_b, slots_b);
        first_b = next_b;
        load_slots(first_b, slots_b);
        next_b = tile_first(i + 5);
      }
      if constexpr (kFp8) {
        widen_pending(true);   // the unit's last tile
        const int stage = acquire();
        if (tid == 0) sItem[stage] = kItemEnd;
        Barrier::arrive(&full[stage]);
        if (tid == 0) Barrier::arrive(&full[stage]);
        ++item;
      } else {
        announce(acquire(), kItemEnd);  // END of the unit: the consumers write its rows
      }
    }
    if (tid == 0) trace_stamp(p, kTraceLastEnd);
    cute::cp_async_wait<0>();  // leave no copy in flight behind an exited thread
    return;
  }

  // -------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Shape<D, BN>::kConsumerRegs>();
  // A schedule of another tile size is a host bug: stop loudly. Checked here, off the producer's path
  // to its first gathers.
  if (threadIdx.x == kProducerThreads && p.unit_info[0] != BN) __trap();
  const int c = threadIdx.x / 128 - 1;          // consumer index: rows 64 c .. 64 c + 63 of a unit
  const int warp = (threadIdx.x / 32) % 4;      // warp of the warpgroup: 16 rows each
  const int r0 = 64 * c + warp * 16 + (lane >> 2);
  const int r1 = r0 + 8;
  if (c == 1) turn_pass(1);                     // consumer 0 takes the first turn
  wait_for_primary();  // the rows' stores come after the kernel before this one (pdl.cuh)

  int item = 0;
  for (int u = unit_begin, local = 0; u < unit_end; ++u, ++local) {
    int info[kUnitFields];
    record(u, info);
    const int kv_head = info[1], item_entry = info[2], row_begin = info[3], row_end = info[4];
#if TREEDEC_KV_FP8
    // The KV head's scales (kv_fp8.cuh): K's in the softmax scale (a raw score is q . k_stored), V's on the output.
    const float unit_qk_scale = kFp8 ? p.qk_scale_log2 * p.kv_scale[kv_head] : p.qk_scale_log2;
    const float unit_v_scale = kFp8 ? p.kv_scale[p.num_qo_heads / p.group + kv_head] : 1.f;
#define TREEDEC_QK_SCALE unit_qk_scale
#else
#define TREEDEC_QK_SCALE p.qk_scale_log2
#endif
    int entry[2], query[2], head[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row_begin + (h ? r1 : r0);
      entry[h] = r < row_end ? item_entry + r / p.group : -1;
      query[h] = entry[h] >= 0 ? p.entry_query[entry[h]] : 0;
      head[h] = kv_head * p.group + r % p.group;
    }

    float acc[D / 8][4];
    #pragma unroll
    for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float s[BN / 8][4];        // S, then P, of the current tile
    uint32_t pa[BN / 16][4];   // P of the previous tile (A of its PV wgmma)
    uint32_t mw0[kMW], mw1[kMW];
    // The warp's Q rows (A fragments of S = Q K^T); head dim 256 reads Q from smem instead (issue_wgmma_qk_ss).
    constexpr bool kQInRegisters = D <= 128;
    uint32_t qa[kQInRegisters ? D / 16 : 1][4];
    bool full_tile = false;  // every row of the unit reads the whole tile (kItemFullTile: no mask words)

    // Wait for the next item; false at the unit's END. Reads the mask words of a tile that has them.
    auto next_tile = [&](int& stage) {
      stage = item % STAGES;
      Barrier::wait(&full[stage], (item / STAGES) & 1);
      if (TREEDEC_WS_TRACE && threadIdx.x == kProducerThreads && item < kTraceStored - kTraceItem0)
        trace_stamp(p, kTraceItem0 + item);
      const int kind = sItem[stage];
      if (kind == kItemEnd) return false;
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async writes -> wgmma reads
      full_tile = kind == kItemFullTile;
      const uint32_t* cMask = sMask + stage * kRows * kMW;
      #pragma unroll
      for (int w = 0; w < kMW; ++w) {  // (a full tile's words, all ones, serve the first tile's masked softmax)
        mw0[w] = full_tile ? 0xffffffffu : cMask[r0 * kMW + w];
        mw1[w] = full_tile ? 0xffffffffu : cMask[r1 * kMW + w];
      }
      return true;
    };
    auto issue_qk = [&](int stage) {  // S = Q K^T of the tile in `stage`, one commit group
      if constexpr (kQInRegisters) {
        issue_wgmma_qk_rs<T, D, BN>(qa, sK + stage * BN * D, s);
      } else {
        issue_wgmma_qk_ss<T, D, BN, kRows>(sQ + (local % kQBuf) * kRows * D + 64 * c * 64, sK + stage * BN * D, s);
      }
    };
    auto issue_pv = [&](int stage) {  // O += P V of the tile in `stage` (P in pa), one commit group
      issue_wgmma_pv<T, D, BN>(pa, sV + stage * BN * D, acc);
    };
    auto fence_s = [&]() {
      #pragma unroll
      for (int j = 0; j < BN / 8; ++j)
        for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(s[j][e]);
    };
    auto fence_acc = [&]() {
      #pragma unroll
      for (int j = 0; j < D / 8; ++j)
        for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(acc[j][e]);
    };

    // No branch may separate a wgmma from its wait (ptxas would serialize every wgmma); the
    // branches below choose whole loops or whole turns.
    int stage;
    if (row_begin + 64 * c >= row_end) {
      // Every row of this consumer is padding (a unit of <= 64 rows): keep the turns and release
      // the stages, compute nothing, so the other consumer's turns do not wait behind zeros.
      while (next_tile(stage)) {
        turn_wait(c);
        turn_pass(c);
        Barrier::arrive(&empty[stage]);
        ++item;
      }
    } else if (next_tile(stage)) {
      // First tile (its Q rows landed with it): S, softmax, P.
      if constexpr (kQInRegisters) load_q_fragments<T, D, kRows>(sQ + (local % kQBuf) * kRows * D, 64 * c + warp * 16, lane, qa);
      turn_wait(c);
      issue_qk(stage);
      turn_pass(c);
      cute::warpgroup_wait<0>();
      fence_s();
      Logits::apply(s, p);
      online_softmax<BN, true>(s, mw0, mw1, false, TREEDEC_QK_SCALE, lane, m0, m1, l0, l1);
      pack_p<T, BN>(s, pa);
      int prev = stage;
      ++item;
      // Later tiles: S of this tile and PV of the previous one in one turn.
      // One turn, straight-line from the wgmma issues to their waits (a branch in between makes
      // ptxas move the waits): FULL tiles (every row reads every token) skip the mask.
      auto later_tile = [&](auto full_c) {
        constexpr bool kFull = decltype(full_c)::value;
        turn_wait(c);
        issue_qk(stage);
        issue_pv(prev);
        turn_pass(c);
        cute::warpgroup_wait<1>();
        fence_s();
        Logits::apply(s, p);
        float2 alpha = kFull ? online_softmax<BN, false>(s, mw0, mw1, true, TREEDEC_QK_SCALE, lane, m0, m1, l0, l1)
                             : online_softmax<BN, true>(s, mw0, mw1, false, TREEDEC_QK_SCALE, lane, m0, m1, l0, l1);
        // Keeps the softmax before the PV wait in the PTX.
        fence_s();
        cute::warpgroup_fence_operand(alpha.x);
        cute::warpgroup_fence_operand(alpha.y);
        // The wait inside both arms of the rescale branch: from straight-line code ptxas hoists it
        // above the softmax, out of the branch it does not.
        if (any_rescale(alpha)) {
          cute::warpgroup_wait<0>();
          fence_acc();
          scale_o<D>(acc, alpha);
        } else {
          cute::warpgroup_wait<0>();
          fence_acc();
        }
        pack_p<T, BN>(s, pa);
        Barrier::arrive(&empty[prev]);
      };
      while (next_tile(stage)) {
        if (full_tile) later_tile(std::true_type{});
        else later_tile(std::false_type{});
        prev = stage;
        ++item;
      }
      issue_pv(prev);  // the last tile's
      cute::warpgroup_wait<0>();
      fence_acc();
      Barrier::arrive(&empty[prev]);
    }
    // END item in `stage`: release it and the Q buffer, write the unit's rows.
    Barrier::arrive(&empty[stage]);
    Barrier::arrive(&q_free[local % kQBuf]);
    ++item;
#if TREEDEC_KV_FP8
    if constexpr (kFp8) scale_o<D>(acc, make_float2(unit_v_scale, unit_v_scale));
#endif
#undef TREEDEC_QK_SCALE
    store_row<T, D>(p, acc, 0, entry[0], query[0], head[0], m0, quad_sum(l0), lane);
    store_row<T, D>(p, acc, 1, entry[1], query[1], head[1], m1, quad_sum(l1), lane);
  }
  if (threadIdx.x == kProducerThreads) trace_stamp(p, kTraceStored);
  if (c == 0) turn_wait(0);                     // consumer 1's last hand-over
}

}  // namespace ws
}  // namespace treedec
#endif  // TREEDEC_SM90A
