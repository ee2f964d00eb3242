// The kernels for fp16 inputs (one translation unit per dtype: parallel builds).
#include "tree_attention.cuh"

template struct treedec::DtypeFunctions<__half>;
