// Dtype dispatch of the launch functions declared in launch.h.
#include "launch.h"

namespace treedec {

cudaError_t launch_partial_fp16(int head_dim, const PartialParams& p, cudaStream_t stream);
cudaError_t launch_partial_bf16(int head_dim, const PartialParams& p, cudaStream_t stream);
cudaError_t launch_merge_fp16(int head_dim, const MergeParams& p, cudaStream_t stream);
cudaError_t launch_merge_bf16(int head_dim, const MergeParams& p, cudaStream_t stream);
int partial_ctas_per_sm_fp16(int head_dim);
int partial_ctas_per_sm_bf16(int head_dim);
int rows_per_unit_fp16(int head_dim);
int rows_per_unit_bf16(int head_dim);

cudaError_t launch_partial(DType dtype, int head_dim, const PartialParams& p, cudaStream_t stream) {
  return dtype == DType::kFloat16 ? launch_partial_fp16(head_dim, p, stream) : launch_partial_bf16(head_dim, p, stream);
}

cudaError_t launch_merge(DType dtype, int head_dim, const MergeParams& p, cudaStream_t stream) {
  return dtype == DType::kFloat16 ? launch_merge_fp16(head_dim, p, stream) : launch_merge_bf16(head_dim, p, stream);
}

int partial_ctas_per_sm(DType dtype, int head_dim) {
  return dtype == DType::kFloat16 ? partial_ctas_per_sm_fp16(head_dim) : partial_ctas_per_sm_bf16(head_dim);
}

int partial_rows_per_unit(DType dtype, int head_dim) {
  return dtype == DType::kFloat16 ? rows_per_unit_fp16(head_dim) : rows_per_unit_bf16(head_dim);
}

}  // namespace treedec
