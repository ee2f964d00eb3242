// Programmatic dependent launch, device side: where a kernel lets the next one start and where it
// waits for the memory of the one before.
#pragma once

namespace treedec {

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

}  // namespace treedec
