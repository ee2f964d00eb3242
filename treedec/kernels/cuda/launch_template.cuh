// Host side of the kernels: which stage-1 kernel a (dtype, head dim, tile) runs, programmatic
// launches, the merge kernel's choice, and the per-dtype entry points partial_<dtype>.cu instantiates.
#pragma once
#include <cuda_runtime.h>
#include <cstddef>

#include "kv_fp8.cuh"
#include "launch.h"
#include "merge_kernel.cuh"
#include "partial_kernel.cuh"
#include "partial_ws_kernel.cuh"
#include "pdl.cuh"
#include "tile_sizes.cuh"
#include "variants.cuh"
#include "ws_config.cuh"

namespace treedec {

// The stage-1 kernel of (T, D) for list tiles of TILE tokens on the build's arch, of the build's logit
// variant (BuildLogits): the warp-specialized wgmma kernel of that tile on sm_90a (tiles of 64 or 96 tokens;
// 64 for head dim 256), else tree_attn_partial_kernel with PartialConfig's shape (tiles of kListTileTokens).
// kTakes: whether such a kernel exists.
#if defined(TREEDEC_SM90A)
constexpr bool kWarpSpecialized = true;   // built for sm_90a (cuda_build passes -DTREEDEC_SM90A)
#else
constexpr bool kWarpSpecialized = false;
#if TREEDEC_KV_FP8
#error "the fp8 KV kernels (TREEDEC_KV_FP8=1) are the warp-specialized sm_90a ones"
#endif
#endif
template <typename T, int D, int TILE, bool WS = kWarpSpecialized>
struct Stage1 {
  using C = PartialConfig<D>;
  static constexpr bool kTakes = TILE == kListTileTokens;
  static constexpr int kThreads = C::kWarps * 32;
  static constexpr int kRows = C::kWarps * 16;
  static constexpr int kSmem = SmemLayout<D, C::kBN, C::kStages, C::kWarps>::kBytes;
  static constexpr auto kernel() {
    return tree_attn_partial_kernel<T, D, C::kBN, C::kStages, C::kWarps, C::kMinBlocks, BuildLogits>;
  }
};
#if defined(TREEDEC_SM90A)
// An fp8 KV build (kv_fp8.cuh) takes 64-token tiles of head dims 64 and 128; what it does not take keeps a kernel of
// q's K/V dtype to name (never launched: kTakes is false).
template <typename T, int D, int TILE>
struct Stage1<T, D, TILE, true> {
  static constexpr bool kFp8 = kIsFp8<BuildKV<T>>;
  static constexpr bool kTakes = kFp8 ? TILE == 64 && D <= 128 : TILE == 64 || (TILE == 96 && D <= 128);
  static constexpr int kBN = kTakes ? TILE : 64;
  static constexpr int kThreads = ws::kThreads;
  static constexpr int kRows = ws::kRows;
  using KV = std::conditional_t<kTakes, BuildKV<T>, T>;
  using Shape = ws::Shape<D, kBN, kIsFp8<KV>>;
  static constexpr int kKernelSmem = ws::Smem<D, kBN, Shape::kStages, Shape::kQBuffers>::kBytes;
  static constexpr int kSmem = kIsFp8<KV> ? ws::Fp8Staging<D, kBN>::bytes(kKernelSmem) : kKernelSmem;
  static constexpr auto kernel() { return ws::tree_attn_partial_ws_kernel<T, KV, D, kBN, BuildLogits>; }
};
#endif

// Programmatic dependent launches need sm_90 (the sm_90a build); elsewhere kernels launch in plain order.
// Stage 1 launches so except in trace builds (their first stamps are written before the wait).
#if defined(TREEDEC_SM90A)
constexpr bool kProgrammaticLaunch = true;
constexpr bool kProgrammaticStage1 = !TREEDEC_WS_TRACE;
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
// registers a thread (head dim 128), and for a merge of many pairs the resident warps count more.
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
