// The fp8 (e4m3) KV cache of the TREEDEC_KV_FP8=1 build (the variant key ("kv_fp8",), FlashInfer's dtype_kv): the
// KV element type the kernels are instantiated with, the staging of a tile's e4m3 rows in shared memory and their
// conversion to the 16-bit tile wgmma reads. The default build includes this header and uses none of it but
// BuildKV<T> = T.
//
// The warp-specialized producer gathers a tile's e4m3 rows with 8-byte cp.async into a staging buffer (two, by
// tile parity), the same (row, 8 columns) pieces each thread copies of a 16-bit tile; once they land (the next
// tile's copies are in flight by then) each thread widens its own pieces to T (exact: every e4m3 value is a bf16
// and an fp16 value) into the stage's 128-byte-swizzled K/V buffers and arrives on the stage's barrier. The K
// scale of a unit's KV head is folded into the softmax scale, the V scale into the output.
#pragma once
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "launch.h"

namespace treedec {

// The element type of K/V in this build's caches.
template <typename T>
using BuildKV = std::conditional_t<TREEDEC_KV_FP8 != 0, __nv_fp8_e4m3, T>;

template <typename TKV>
constexpr bool kIsFp8 = std::is_same_v<TKV, __nv_fp8_e4m3>;

// 8 e4m3 values (little-endian in a uint2) as 8 T values (a uint4), exactly.
template <typename T>
__device__ __forceinline__ uint4 widen_fp8x8(uint2 x) {
  const uint32_t in[2] = {x.x, x.y};
  uint32_t out[4];
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>((in[i >> 1] >> (16 * (i & 1))) & 0xffffu);
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    if constexpr (std::is_same_v<T, __half>) {
      out[i] = static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
      out[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// 8-byte cp.async (through L1: .cg takes 16 bytes only) to a shared-memory address; src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async_8(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

#if defined(TREEDEC_SM90A)
namespace ws {

// The staging buffers past a kernel's shared memory of kBytes: [2 tiles][K, V][BN][D] e4m3 bytes, row-major.
template <int D, int BN>
struct Fp8Staging {
  static constexpr int kTileBytes = BN * D;   // one tile of K (or V)
  static constexpr int offset(int bytes) { return (bytes + 127) / 128 * 128; }
  static constexpr int bytes(int kernel_bytes) { return offset(kernel_bytes) + 2 * 2 * kTileBytes; }
};

}  // namespace ws
#endif

}  // namespace treedec
