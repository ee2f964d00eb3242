// Configuration of the warp-specialized sm_90a stage-1 kernel: warpgroup roles, register split,
// ring depths, shared-memory layout.
#pragma once
#include "launch.h"  // TREEDEC_WS_TRACE
#if defined(TREEDEC_SM90A)

namespace treedec {
namespace ws {

constexpr int kProducerThreads = 128;
constexpr int kConsumers = 2;                       // consumer warpgroups, 64 rows each
constexpr int kThreads = kProducerThreads + 128 * kConsumers;
constexpr int kRows = 64 * kConsumers;              // rows of a unit
constexpr int kBarProducer = 1;                     // the producer warpgroup's own barrier
constexpr int kBarTurn = 2;                         // + c: consumer c may issue its wgmmas
constexpr int kItemEnd = 0, kItemTile = 1, kItemFullTile = 2;  // kinds of ring items (FULL: no mask words)
// Registers per thread after setmaxnreg (128 x 88 + 256 x 208 = 384 x 168): the consumers hold S, P
// and O of a tile at once (32 + 16 + 64 per thread with 64-token tiles, 64 + 32 + 64 with 128),
// the producer needs about 80 without spills.
// The CTA keeps the registers the launch gave it (384 x 168): setmaxnreg.inc waits until the
// producer's dealloc freed enough, so asking for more than that hangs the kernel (96 / 208 did).
// A TREEDEC_WS_TRACE build's producer needs 8 more (it spilled at 88), taken from the consumers.
constexpr int kProducerRegs = TREEDEC_WS_TRACE ? 96 : 88, kConsumerRegs = TREEDEC_WS_TRACE ? 200 : 208;
static_assert(kProducerThreads * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kThreads * (65536 / kThreads / 8 * 8),
              "setmaxnreg cannot hand out more registers than the launch gave the CTA");

// KV tiles (tokens) and ring depths: a kernel of 64-token tiles in a 4-deep ring and one of 96-token
// tiles in a 3-deep ring; the host launches the one the schedule names (PartialParams::tile_tokens,
// chosen by attention/backends/cuda_backend.py: choose_tile_tokens). 96-token tiles pay where units
// are long (fewer turns per token), 64 where units are short (less padding in the last tile). Two
// kernels, not one branching on the tile size: the body laid out second ran slower, whichever it was.
// Tuning knobs (TREEDEC_CUDA_FLAGS): the ring depths, and the Q buffers (2: a unit's Q rows load
// under the previous unit's tiles; 1 leaves room for another stage).
#ifndef TREEDEC_WS_STAGES
#define TREEDEC_WS_STAGES 4
#endif
#ifndef TREEDEC_WS96_STAGES  // ring depth of 96-token tiles
#define TREEDEC_WS96_STAGES 3
#endif
#ifndef TREEDEC_WS_Q_BUFFERS
#define TREEDEC_WS_Q_BUFFERS 2
#endif
constexpr int kQBuffers = TREEDEC_WS_Q_BUFFERS;
static_assert(kQBuffers == 1 || kQBuffers == 2, "one or two Q buffers");
template <int BN> struct Tile;
template <> struct Tile<64> { static constexpr int kStages = TREEDEC_WS_STAGES; };
template <> struct Tile<96> { static constexpr int kStages = TREEDEC_WS96_STAGES; };

// Ring depth and Q buffers of head dim D: head dim 256 (Gemma) has a 64 KiB Q tile and 64 KiB 64-token K/V
// stages, so one Q buffer and two stages fill the 227 KiB of an SM (its next unit's Q rows load once the
// unit is done), and it takes 64-token tiles only.
#ifndef TREEDEC_WS256_PRODUCER_REGS  // head dim 256's register split (its O takes 128 a consumer thread)
#define TREEDEC_WS256_PRODUCER_REGS 56
#endif
// An fp8 KV build's kernels (FP8, kv_fp8.cuh) stage each tile's e4m3 rows too: head dim 128 keeps three stages.
template <int D, int BN, bool FP8 = false> struct Shape {
  static constexpr int kStages = D > 128 ? 2 : FP8 && D == 128 ? 3 : Tile<BN>::kStages;
  static constexpr int kQBuffers = D > 128 ? 1 : ws::kQBuffers;
  static constexpr int kProducerRegs = D > 128 ? TREEDEC_WS256_PRODUCER_REGS : ws::kProducerRegs;
  static constexpr int kConsumerRegs = D > 128 ? (kThreads * (65536 / kThreads / 8 * 8) - kProducerThreads * kProducerRegs)
                                                     / (128 * kConsumers) / 8 * 8
                                               : ws::kConsumerRegs;
};

// Shared memory, byte offsets (Q and K/V buffers 1 KiB aligned for the swizzle atoms).
template <int D, int BN, int STAGES, int QBUFFERS = kQBuffers>
struct Smem {
  static constexpr int kMW = BN / 32;                            // mask words per row per tile
  static constexpr int kQBytes = kRows * D * 2;                  // one Q buffer
  static constexpr int kKVBytes = BN * D * 2;                    // one stage of K (or V)
  static constexpr int kQ = 0;                                   // [QBUFFERS] Q buffers
  static constexpr int kK = kQ + QBUFFERS * kQBytes;             // [STAGES]
  static constexpr int kV = kK + STAGES * kKVBytes;              // [STAGES]
  static constexpr int kMask = kV + STAGES * kKVBytes;           // u32 [STAGES][kRows][kMW]
  static constexpr int kItem = kMask + 4 * STAGES * kRows * kMW; // int [STAGES]: kItemEnd / kItemTile
  static constexpr int kQuery = kItem + 4 * STAGES;              // int [2][kRows]: a unit's query per row (-1: padding)
  static constexpr int kBar = (kQuery + 4 * 2 * kRows + 7) / 8 * 8;  // u64 full[STAGES], empty[STAGES], q_free[2]
  static constexpr int kBytes = kBar + 8 * (2 * STAGES + 2);
};

}  // namespace ws
}  // namespace treedec
#endif  // TREEDEC_SM90A
