// Tile shapes of the single-role stage-1 kernel per head dim and MMA kind, which MMA the build
// uses, and the shared memory a shape takes.
#pragma once

namespace treedec {

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

}  // namespace treedec
