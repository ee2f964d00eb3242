// Tile shapes of the single-role (mma.sync) stage-1 kernel per head dim, and the shared memory a
// shape takes.
#pragma once

namespace treedec {

// Tile shape per head dim: KV tokens per tile, pipeline stages, warps (16 rows each), and
// resident CTAs per SM asked of the compiler (2: 16 warps per SM to hide latency).
template <int D> struct PartialConfig;
template <> struct PartialConfig<64> { static constexpr int kBN = 32, kStages = 4, kWarps = 8, kMinBlocks = 2; };
template <> struct PartialConfig<128> { static constexpr int kBN = 32, kStages = 3, kWarps = 8, kMinBlocks = 2; };
template <> struct PartialConfig<256> { static constexpr int kBN = 32, kStages = 5, kWarps = 4, kMinBlocks = 1; };

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
