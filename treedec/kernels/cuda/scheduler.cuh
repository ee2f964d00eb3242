// The persistent schedule on the device: a unit's record (launch.h, PartialParams, gives the format).
#pragma once
#include "launch.h"

namespace treedec {

// Unit u's record (PartialParams::unit_info) into registers; zeros for u < 0.
__device__ __forceinline__ void load_record(const PartialParams& p, int u, int (&rec)[kUnitFields]) {
  #pragma unroll
  for (int f = 0; f < kUnitFields; ++f) rec[f] = u >= 0 ? p.unit_info[kScheduleHeader + kUnitFields * u + f] : 0;
}

}  // namespace treedec
