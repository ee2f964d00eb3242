// The kernels for bf16 inputs (one translation unit per dtype: parallel builds).
#include <cuda_bf16.h>

#include "launch_template.cuh"

template struct treedec::DtypeFunctions<__nv_bfloat16>;
