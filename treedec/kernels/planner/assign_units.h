// Greedy longest-processing-time assignment of units to CTAs: persistent_schedule.assign_units.
#pragma once

#include "common.h"

namespace treedec::planner {

struct Assignment {
  Vec order;                 // units, heaviest first (stable): the assignment order
  Vec cta_of_unit;           // [U]
  std::vector<double> loads; // [num_ctas] summed costs
};

// In rounds of num_ctas units, the heaviest remaining units go to the least-loaded CTAs (each
// round's CTA order is a stable sort of the loads, as numpy's argsort(kind="stable")).
inline Assignment assign_units(const std::vector<double>& cost, i64 num_ctas) {
  const i64 n = static_cast<i64>(cost.size());
  Assignment a;
  a.order = stable_order(n, [&](i64 x, i64 y) { return cost[x] > cost[y]; });
  a.cta_of_unit.assign(n, 0);
  a.loads.assign(num_ctas, 0.0);
  Vec ctas(num_ctas);
  for (i64 start = 0; start < n; start += num_ctas) {
    std::iota(ctas.begin(), ctas.end(), i64(0));
    std::stable_sort(ctas.begin(), ctas.end(), [&](i64 x, i64 y) { return a.loads[x] < a.loads[y]; });
    const i64 end = std::min(n, start + num_ctas);
    for (i64 k = start; k < end; ++k) {
      const i64 unit = a.order[k], cta = ctas[k - start];
      a.cta_of_unit[unit] = cta;
      a.loads[cta] += cost[unit];
    }
  }
  return a;
}

}  // namespace treedec::planner
