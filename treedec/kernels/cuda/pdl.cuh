// Programmatic dependent launch, device side: where a kernel lets the next one start and where it
// waits for the memory of the one before.
#pragma once

namespace treedec {

// Programmatic dependent launch (sm_90; no-ops before): stage 1 lets the merge kernel launch at
// once, and the merge lets the next stage 1 launch as soon as all of its blocks run. Each kernel
// reads its plan arrays before wait_for_primary() and q, k, v, the partials and every output
// after it: plan arrays are written by host copies (plan()), never by a kernel, so reading them
// early is safe, and inside CUDA graphs a call's stage 1 so starts while the previous merge drains.
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
