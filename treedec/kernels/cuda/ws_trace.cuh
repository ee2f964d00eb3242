// %globaltimer stamps of the warp-specialized kernel in the bench-only TREEDEC_WS_TRACE=1 build:
// where a CTA's time goes (bench/stage1_trace.py reads them). In the default build a stamp is nothing.
#pragma once
#if defined(TREEDEC_SM90A)
#include <cstdint>

#include "launch.h"
#include "ws_config.cuh"

namespace treedec {
namespace ws {

// Trace slots (PartialParams::trace[CTA][kTraceSlots] of the trace build, in ns):
enum TraceSlot : int {
  kTraceStart = 0,        // the CTA began (thread 0)
  kTraceRecord = 1,       // producer: the first unit's record arrived
  kTraceSlots0 = 2,       // producer: the first tile's slot indices arrived
  kTraceIssued0 = 3,      // producer: the first tile's copies were issued
  kTraceLastEnd = 4,      // producer: the last unit's END was announced
  kTraceItem0 = 5,        // consumer 0: items 0 .. 9 (tiles and ENDs, across units) landed: slots 5 .. 14
  kTraceStored = 15,      // consumer 0: its last unit's rows were stored
};
#if TREEDEC_WS_TRACE
static_assert(kTraceStored < kTraceSlots, "trace slots");
// Stamp `slot` of this CTA's trace row once `after` (a loaded value) has arrived: the branch on it
// makes the stamp wait for the load.
__device__ __forceinline__ void trace_stamp(const PartialParams& p, int slot, int after = 0) {
  if (after == 0x7fffffff) asm volatile("trap;");
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (p.trace) p.trace[blockIdx.x * kTraceSlots + slot] = t;
}
#else
__device__ __forceinline__ void trace_stamp(const PartialParams&, int, int = 0) {}
#endif

}  // namespace ws
}  // namespace treedec
#endif  // TREEDEC_SM90A
