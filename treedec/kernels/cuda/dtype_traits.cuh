// Per-dtype traits (fp16, bf16): the mma.sync atom and the fp32 -> 16-bit packing that every
// kernel uses to feed the tensor cores and to write its outputs.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include <cute/arch/mma_sm80.hpp>

namespace treedec {

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

}  // namespace treedec
