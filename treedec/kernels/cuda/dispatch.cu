// Dtype dispatch of the launch functions declared in launch.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launch.h"
#include "launch_template.cuh"

namespace treedec {

extern template struct DtypeFunctions<__half>;          // instantiated in partial_fp16.cu
extern template struct DtypeFunctions<__nv_bfloat16>;   // instantiated in partial_bf16.cu

cudaError_t launch_partial(DType dtype, int head_dim, const PartialParams& p, cudaStream_t stream) {
  return dtype == DType::kFloat16 ? DtypeFunctions<__half>::launch_partial(head_dim, p, stream)
                                  : DtypeFunctions<__nv_bfloat16>::launch_partial(head_dim, p, stream);
}

cudaError_t launch_merge(DType dtype, int head_dim, const MergeParams& p, cudaStream_t stream) {
  return dtype == DType::kFloat16 ? DtypeFunctions<__half>::launch_merge(head_dim, p, stream)
                                  : DtypeFunctions<__nv_bfloat16>::launch_merge(head_dim, p, stream);
}

int partial_ctas_per_sm(DType dtype, int head_dim) {
  return dtype == DType::kFloat16 ? DtypeFunctions<__half>::ctas_per_sm(head_dim)
                                  : DtypeFunctions<__nv_bfloat16>::ctas_per_sm(head_dim);
}

bool logits_softcap() { return BuildLogits::kSoftcap; }

bool kv_fp8() { return TREEDEC_KV_FP8 != 0; }

bool trace_compiled() {
#if defined(TREEDEC_SM90A)
  return TREEDEC_WS_TRACE != 0;
#else
  return false;
#endif
}

int partial_rows_per_unit(DType dtype, int head_dim) {
  return dtype == DType::kFloat16 ? DtypeFunctions<__half>::rows_per_unit(head_dim)
                                  : DtypeFunctions<__nv_bfloat16>::rows_per_unit(head_dim);
}

bool partial_takes_tile(DType dtype, int head_dim, int tile_tokens) {
  return dtype == DType::kFloat16 ? DtypeFunctions<__half>::takes_tile(head_dim, tile_tokens)
                                  : DtypeFunctions<__nv_bfloat16>::takes_tile(head_dim, tile_tokens);
}

}  // namespace treedec
