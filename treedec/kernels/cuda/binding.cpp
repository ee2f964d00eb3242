// torch binding of the treedec CUDA kernels. Python (treedec/kernels/cuda_tree_attention.py)
// validates user inputs; the checks here guard the kernels' own assumptions.
#include <algorithm>
#include <cstdint>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "launch.h"

namespace {

treedec::DType dtype_of(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kHalf) return treedec::DType::kFloat16;
  if (t.scalar_type() == torch::kBFloat16) return treedec::DType::kBFloat16;
  TORCH_CHECK(false, "treedec cuda kernels take float16 or bfloat16, got ", t.scalar_type());
}

void check_rows(const torch::Tensor& t, const char* name, int64_t head_dim) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 3 && t.size(2) == head_dim && t.stride(2) == 1, name,
              " must be [rows, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0,
              name, " rows must be 16-byte aligned (data pointer and strides multiples of 8 elements)");
}

void check_index(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kInt && t.is_contiguous(), name,
              " must be a contiguous int32 CUDA tensor");
}

const int* iptr(const torch::Tensor& t) { return t.data_ptr<int>(); }

#if TREEDEC_WS_TRACE
// The stamp buffer of the bench-only trace build (bench/stage1_trace.py); undefined: no stamps.
torch::Tensor g_trace;

void set_trace(c10::optional<torch::Tensor> trace) {
  if (!trace.has_value()) {
    g_trace = torch::Tensor();
    return;
  }
  TORCH_CHECK(treedec::trace_compiled(), "the kernels stamp a trace only in the sm_90a build");
  TORCH_CHECK(trace->is_cuda() && trace->scalar_type() == torch::kLong && trace->is_contiguous() && trace->dim() == 2 &&
              trace->size(1) == treedec::kTraceSlots, "trace must be a contiguous int64 CUDA tensor [CTAs, ",
              treedec::kTraceSlots, "]");
  g_trace = *trace;
}
#endif

// Stage 1 (and stage 2 when `merge`) in one call: no host time between the two launches (the
// merge is launched programmatically behind stage 1 on sm_90). max_query_entries: the most partials
// of any query, or a bound on it (it picks the merge kernel; any value gives the same result).
void attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, torch::Tensor lse,
            torch::Tensor o_ws, torch::Tensor lse_ws, torch::Tensor kv_slots, torch::Tensor chunk_kv_start,
            torch::Tensor entry_query, torch::Tensor entry_mask, torch::Tensor entry_direct,
            torch::Tensor query_entry_start, torch::Tensor query_entries, torch::Tensor cta_unit_start,
            torch::Tensor unit_info, int64_t group, int64_t mask_stride, double qk_scale_log2, double softcap_scale,
            bool merge, int64_t tile_tokens, int64_t max_query_entries, c10::optional<torch::Tensor> kv_scale) {
  const int64_t d = q.size(2);
  check_rows(q, "q", d);
  check_rows(k, "k", d);
  check_rows(v, "v", d);
  check_rows(out, "out", d);
  // The ("kv_fp8",) build's kernels read e4m3 K/V with the layer's scales [2, Hkv]; the others K/V of q's dtype.
  const auto kv_type = treedec::kv_fp8() ? torch::kFloat8_e4m3fn : q.scalar_type();
  TORCH_CHECK(k.scalar_type() == kv_type && v.scalar_type() == kv_type && out.scalar_type() == q.scalar_type(),
              treedec::kv_fp8() ? "this build's kernels read float8_e4m3fn k and v, and write out of q's dtype"
                                : "q, k, v and out must share a dtype");
  TORCH_CHECK(kv_scale.has_value() == treedec::kv_fp8(), treedec::kv_fp8()
              ? "this build's kernels read fp8 K/V: kv_scale [2, Hkv] float32 is required"
              : "kv_scale is for the fp8 KV build (the variant key ('kv_fp8',)); this build's K/V are q's dtype");
  if (kv_scale.has_value())
    TORCH_CHECK(kv_scale->is_cuda() && kv_scale->scalar_type() == torch::kFloat && kv_scale->is_contiguous() &&
                kv_scale->dim() == 2 && kv_scale->size(0) == 2 && kv_scale->size(1) == k.size(1),
                "kv_scale must be a contiguous float32 CUDA tensor [2, Hkv]");
  TORCH_CHECK(lse.scalar_type() == torch::kFloat && lse.stride(1) == 1, "lse must be float32 [Q, Hq]");
  TORCH_CHECK(o_ws.scalar_type() == torch::kFloat && o_ws.is_contiguous() && lse_ws.scalar_type() == torch::kFloat &&
              lse_ws.is_contiguous(), "o_ws and lse_ws must be contiguous float32");
  TORCH_CHECK(o_ws.dim() == 3 && o_ws.size(1) == q.size(1) && o_ws.size(2) == d, "o_ws must be [E, Hq, D]");
  for (auto* t : {&kv_slots, &chunk_kv_start, &entry_query, &entry_mask, &entry_direct, &query_entry_start,
                  &query_entries, &cta_unit_start, &unit_info})
    check_index(*t, "plan arrays");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(1) / k.size(1) == group, "group must be Hq / Hkv");
  TORCH_CHECK(k.stride(0) * k.element_size() < (int64_t{1} << 31) && v.stride(0) * v.element_size() < (int64_t{1} << 31),
              "k and v rows (slots) must be less than 2 GiB apart");
  TORCH_CHECK(treedec::partial_takes_tile(dtype_of(q), static_cast<int>(d), static_cast<int>(tile_tokens)),
              "no stage-1 kernel of ", tile_tokens, "-token tiles for this dtype and head_dim ", d, " on this build");
  TORCH_CHECK((softcap_scale > 0) == treedec::logits_softcap(), "this build's kernels are ",
              treedec::logits_softcap() ? "the soft-capped ones (softcap_scale must be > 0)" : "the plain ones (softcap_scale must be 0)",
              ", got softcap_scale ", softcap_scale);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  treedec::PartialParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.o_ws = o_ws.data_ptr<float>();
  p.lse_ws = lse_ws.data_ptr<float>();
  p.kv_slots = iptr(kv_slots);
  p.chunk_kv_start = iptr(chunk_kv_start);
  p.entry_query = iptr(entry_query);
  p.entry_mask = iptr(entry_mask);
  p.entry_direct = iptr(entry_direct);
  p.cta_unit_start = iptr(cta_unit_start);
  p.unit_info = iptr(unit_info);
  TORCH_CHECK(unit_info.numel() < (int64_t{1} << 31), "unit_info must have fewer than 2^31 elements");
  p.unit_info_len = static_cast<int>(unit_info.numel());
#if TREEDEC_KV_FP8
  p.kv_scale = kv_scale->data_ptr<float>();
#endif
#if TREEDEC_WS_TRACE
  if (g_trace.defined()) {
    TORCH_CHECK(g_trace.device() == q.device() && g_trace.size(0) >= cta_unit_start.numel() - 1,
                "the trace buffer needs a row per CTA (", cta_unit_start.numel() - 1, ") on q's device");
    p.trace = reinterpret_cast<unsigned long long*>(g_trace.data_ptr<int64_t>());
  }
#endif
  p.q_stride_q = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_stride_s = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.v_stride_s = v.stride(0);
  p.v_stride_h = v.stride(1);
  p.out_stride_q = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.lse_stride_q = lse.stride(0);
  p.num_qo_heads = static_cast<int>(q.size(1));
  p.group = static_cast<int>(group);
  p.mask_stride = static_cast<int>(mask_stride);
  p.num_ctas = static_cast<int>(cta_unit_start.numel() - 1);
  p.tile_tokens = static_cast<int>(tile_tokens);
  p.qk_scale_log2 = static_cast<float>(qk_scale_log2);
  p.softcap_scale = static_cast<float>(softcap_scale);
  cudaError_t err = treedec::launch_partial(dtype_of(q), static_cast<int>(d), p, stream);
  TORCH_CHECK(err == cudaSuccess, "treedec partial-attention launch failed: ", cudaGetErrorString(err));
  if (!merge) return;
  treedec::MergeParams m{};
  m.out = p.out;
  m.lse = p.lse;
  m.o_ws = p.o_ws;
  m.lse_ws = p.lse_ws;
  m.query_entry_start = iptr(query_entry_start);
  m.query_entries = iptr(query_entries);
  m.out_stride_q = p.out_stride_q;
  m.out_stride_h = p.out_stride_h;
  m.lse_stride_q = p.lse_stride_q;
  m.num_queries = static_cast<int>(query_entry_start.numel() - 1);
  m.num_qo_heads = p.num_qo_heads;
  TORCH_CHECK(max_query_entries >= 0, "max_query_entries must be >= 0, got ", max_query_entries);
  m.max_query_entries = static_cast<int>(std::min<int64_t>(max_query_entries, INT32_MAX));
  err = treedec::launch_merge(dtype_of(q), static_cast<int>(d), m, stream);
  TORCH_CHECK(err == cudaSuccess, "treedec merge launch failed: ", cudaGetErrorString(err));
}

int64_t ctas_per_sm(bool bf16, int64_t head_dim) {
  return treedec::partial_ctas_per_sm(bf16 ? treedec::DType::kBFloat16 : treedec::DType::kFloat16,
                                      static_cast<int>(head_dim));
}

int64_t rows_per_unit(bool bf16, int64_t head_dim) {
  return treedec::partial_rows_per_unit(bf16 ? treedec::DType::kBFloat16 : treedec::DType::kFloat16,
                                        static_cast<int>(head_dim));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "stage 1 (partial tree attention over the persistent schedule), then, with merge, "
        "stage 2 (deterministic per-query merge of the partial states)");
  m.def("takes_tile", [](bool bf16, int64_t head_dim, int64_t tile_tokens) {
          return treedec::partial_takes_tile(bf16 ? treedec::DType::kBFloat16 : treedec::DType::kFloat16,
                                             static_cast<int>(head_dim), static_cast<int>(tile_tokens));
        }, "whether stage 1 (bf16, head_dim) runs schedules whose live lists have tiles of tile_tokens tokens");
  m.def("default_tile_tokens", []() { return int64_t{treedec::kListTileTokens}; },
        "tokens per tile every stage-1 kernel takes (persistent_schedule.TILE_TOKENS)");
  m.def("schedule_header", []() { return int64_t{treedec::kScheduleHeader}; },
        "int32 words before the unit records (persistent_schedule.SCHEDULE_HEADER)");
#if TREEDEC_WS_TRACE
  m.def("set_trace", &set_trace, py::arg("trace"),
        "stamp %globaltimer into trace [CTAs, trace_slots()] int64 on every later call (None: stop)");
  m.def("trace_slots", []() { return int64_t{treedec::kTraceSlots}; }, "stamps per CTA of a trace");
#endif
  m.def("kv_fp8", &treedec::kv_fp8, "whether this build's kernels read fp8 (e4m3) K/V (the variant key ('kv_fp8',))");
  m.def("logits_softcap", &treedec::logits_softcap,
        "whether this build's kernels soft-cap their logits (the variant key ('softcap',), variants.cuh)");
  m.def("trace_compiled", &treedec::trace_compiled,
        "whether the kernels stamp a trace: the bench-only TREEDEC_WS_TRACE=1 build (set_trace) for sm_90a");
  m.def("full_tile_flag", []() { return int64_t{treedec::kFullTileFlag}; },
        "bit of a live-tile entry: every row of the item reads the whole tile (persistent_schedule.FULL_TILE_FLAG)");
  m.def("unit_fields", []() { return int64_t{treedec::kUnitFields}; },
        "int32 fields per unit record (persistent_schedule.UNIT_FIELDS)");
  m.def("ctas_per_sm", &ctas_per_sm, "resident stage-1 CTAs per SM (bf16, head_dim)");
  m.def("rows_per_unit", &rows_per_unit, "rows of one stage-1 unit (bf16, head_dim)");
}
