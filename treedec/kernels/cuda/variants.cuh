// Logit variants of the stage-1 kernels (FlashInfer's variant functors): a hook every kernel applies to a
// tile of raw scores S = Q K^T before the online softmax, chosen at compile time. A build holds the kernels
// of one variant key (cuda_build.py: one extension per key, built only when a layer uses it); the plain key
// builds the kernels without any hook, whose code is that of kernels written without this header.
//
//   TREEDEC_LOGITS_SOFTCAP=1: Gemma 2's soft-cap, S -> tanh(S * softcap_scale), the cap and the softmax scale
//   folded into PartialParams::qk_scale_log2 (AttentionVariant.logit_args).
#pragma once
#include <type_traits>

#include "launch.h"

#ifndef TREEDEC_LOGITS_SOFTCAP
#define TREEDEC_LOGITS_SOFTCAP 0
#endif

namespace treedec {

// No hook: the plain kernel.
struct PlainLogits {
  static constexpr bool kSoftcap = false;
  template <int N>
  __device__ __forceinline__ static void apply(float (&)[N][4], const PartialParams&) {}
};

// tanh(S * softcap_scale), with the hardware's tanh.approx.f32 (sm_75+; FlashInfer's and FlashAttention's
// soft-cap use it too): one MUFU op per score, beside the softmax's exp2.
struct SoftcapLogits {
  static constexpr bool kSoftcap = true;
  template <int N>
  __device__ __forceinline__ static void apply(float (&s)[N][4], const PartialParams& p) {
    const float scale = p.softcap_scale;
    #pragma unroll
    for (int j = 0; j < N; ++j) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        float t;
        asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(s[j][e] * scale));
        s[j][e] = t;
      }
    }
  }
};

// The variant this build's kernels are instantiated with.
using BuildLogits = std::conditional_t<TREEDEC_LOGITS_SOFTCAP != 0, SoftcapLogits, PlainLogits>;

}  // namespace treedec
