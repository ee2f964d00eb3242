// Stage-1 and merge kernels for fp16 inputs (one translation unit per dtype: parallel builds).
#include "tree_attention.cuh"

namespace treedec {

cudaError_t launch_partial_fp16(int head_dim, const PartialParams& p, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch_partial_typed<__half, 64>(p, stream);
    case 128: return launch_partial_typed<__half, 128>(p, stream);
    case 256: return launch_partial_typed<__half, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_merge_fp16(int head_dim, const MergeParams& p, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch_merge_typed<__half, 64>(p, stream);
    case 128: return launch_merge_typed<__half, 128>(p, stream);
    case 256: return launch_merge_typed<__half, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

int partial_ctas_per_sm_fp16(int head_dim) {
  switch (head_dim) {
    case 64: return partial_ctas_per_sm_typed<__half, 64>();
    case 128: return partial_ctas_per_sm_typed<__half, 128>();
    case 256: return partial_ctas_per_sm_typed<__half, 256>();
    default: return 0;
  }
}

int rows_per_unit_fp16(int head_dim) {
  switch (head_dim) {
    case 64: return rows_per_unit<64>();
    case 128: return rows_per_unit<128>();
    case 256: return rows_per_unit<256>();
    default: return 0;
  }
}

}  // namespace treedec
