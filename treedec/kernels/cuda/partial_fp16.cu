// The kernels for fp16 inputs (one translation unit per dtype: parallel builds).
#include <cuda_fp16.h>

#include "launch_template.cuh"

template struct treedec::DtypeFunctions<__half>;
