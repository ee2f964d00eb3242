// Synchronization and copy primitives of the warp-specialized producer/consumer pipeline: named
// barriers, the consumers' turns, mbarriers, 16-byte cp.async.
#pragma once
#if defined(TREEDEC_SM90A)
#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "ws_config.cuh"

namespace treedec {
namespace ws {

__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
using Barrier = cutlass::arch::ClusterBarrier;

// Consumer c waits for its turn / hands the turn to the other consumer: one consumer's wgmmas are
// issued at a time, so its softmax runs under the other's matmuls.
__device__ __forceinline__ void turn_wait(int c) { bar_sync(kBarTurn + c, 256); }
__device__ __forceinline__ void turn_pass(int c) { bar_arrive(kBarTurn + (1 - c), 256); }

// 16-byte cp.async (cached in L2 only) to a shared-memory address; src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

}  // namespace ws
}  // namespace treedec
#endif  // TREEDEC_SM90A
