// Host-side interface of the treedec CUDA kernels (no torch, no CuTe): parameter structs and
// launch functions. Kernels live in partial_kernel.cuh, partial_ws_kernel.cuh and merge_kernel.cuh,
// launched from launch_template.cuh; binding.cpp calls these from torch.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

// TREEDEC_WS_TRACE=1 is the bench-only diagnostic build (bench/stage1_trace.py sets it in
// TREEDEC_CUDA_FLAGS, whose defines reach binding.cpp too): the sm_90a warp-specialized kernel stamps
// %globaltimer into PartialParams::trace (ws_trace.cuh). The default build has no trace buffer.
#ifndef TREEDEC_WS_TRACE
#define TREEDEC_WS_TRACE 0
#endif
// TREEDEC_KV_FP8=1 is the build of the variant key ("kv_fp8",) (cuda_build.py): its stage-1 kernels read K/V as
// e4m3 with a scale per KV head (PartialParams::kv_scale); the default build has no such field.
#ifndef TREEDEC_KV_FP8
#define TREEDEC_KV_FP8 0
#endif

namespace treedec {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };
constexpr int kUnitFields = 10;       // persistent_schedule.UNIT_FIELDS
constexpr int kScheduleHeader = 2;    // persistent_schedule.SCHEDULE_HEADER: {tile tokens, 0} before the records
constexpr int kListTileTokens = 64;   // persistent_schedule.TILE_TOKENS: the default tile of the live lists
constexpr int kFullTileFlag = 1 << 30;  // persistent_schedule.FULL_TILE_FLAG: every row of the item reads the whole tile

// Stage 1: partial attention of every work unit, one persistent CTA loops over its units. On sm_90a
// it is launched as a programmatic dependent of the kernel before it: it reads the plan arrays
// (which only host copies write) early, and q, k, v and its outputs only after that kernel.
//
// A unit is (chunk, KV head, a range of rows of one work item). Rows of a work item are
// r = local_entry * group + g (entry local_entry of the item, query head kv_head * group + g).
// unit_info starts with a header: unit_info[0] is the tokens per tile of the live lists (the KV tile
// the kernel runs: tile_tokens below, checked), unit_info[1] is 0. Then the records,
// unit_info[2 + 10 u ...] = {chunk, kv_head, item_entry_start, row_begin, row_end, tile_begin, tile_end,
// kv_begin, chunk_len, first_tile} (kv_begin = chunk_kv_start[chunk], chunk_len the chunk's tokens,
// first_tile = the first live tile, 0 if none: the first gathers need no other lookup):
// the unit's live tiles (tiles of the chunk some row reads, ascending; kFullTileFlag is set on those
// every row of the item reads whole) are unit_info[tile_begin .. tile_end - 1], stored after the
// records. CTA b runs the units cta_unit_start[b] .. cta_unit_start[b + 1] - 1 in order.
struct PartialParams {
  const void* q;        // [Q, Hq, D]     (strides q_stride_q, q_stride_h, 1)
  const void* k;        // [slots, Hkv, D] (k_stride_s, k_stride_h, 1)
  const void* v;        // [slots, Hkv, D]
  void* out;            // [Q, Hq, D] q's dtype: entries that are their query's only partial
  float* lse;           // [Q, Hq]
  float* o_ws;          // [E, Hq, D] fp32 partial outputs (contiguous)
  float* lse_ws;        // [E, Hq]    fp32 partial LSEs, natural log (contiguous)
  const int* kv_slots;        // [T]
  const int* chunk_kv_start;  // [C + 1]
  const int* entry_query;     // [E]
  const int* entry_mask;      // [E, mask_stride] bit t%32 of word t/32: the entry reads chunk token t
  const int* entry_direct;    // [E] 1: write out/lse directly
  const int* cta_unit_start;  // [num_ctas + 1]
  const int* unit_info;       // [U, kUnitFields] records, then the live-tile lists
  int unit_info_len;          // int32 elements readable at unit_info (records, lists, any capacity)
#if TREEDEC_WS_TRACE
  unsigned long long* trace;  // [grid][kTraceSlots] %globaltimer stamps (null: none)
#endif
#if TREEDEC_KV_FP8
  const float* kv_scale;      // [2, Hkv]: K's scales, then V's (k and v hold e4m3: value = stored * scale)
#endif
  int64_t q_stride_q, q_stride_h, k_stride_s, k_stride_h, v_stride_s, v_stride_h;
  int64_t out_stride_q, out_stride_h, lse_stride_q;
  int num_qo_heads;
  int group;            // query heads per KV head
  int mask_stride;      // int32 words per entry_mask row
  int num_ctas;
  int tile_tokens;      // tokens per listed tile: 64, or 96 where partial_takes_tile says so (= unit_info[0])
  float qk_scale_log2;  // what a score (after the variant's hook) is multiplied by, base 2: softmax scale * log2(e)
  float softcap_scale;  // the soft-cap build's hook S -> tanh(S * softcap_scale) (variants.cuh); unused otherwise
};

#if TREEDEC_WS_TRACE
// Stamps per CTA of the trace build (ws_trace.cuh names the slots).
constexpr int kTraceSlots = 16;
#endif
// Whether the kernels stamp PartialParams::trace: a TREEDEC_WS_TRACE=1 build for sm_90a.
bool trace_compiled();

// Stage 2: per (query, head), merge the query's partials in CSR order (deterministic).
// Queries with one partial were written by stage 1 and are skipped.
struct MergeParams {
  void* out;                       // [Q, Hq, D]
  float* lse;                      // [Q, Hq]
  const float* o_ws;               // [E, Hq, D]
  const float* lse_ws;             // [E, Hq]
  const int* query_entry_start;    // [Q + 1]
  const int* query_entries;        // [E]
  int64_t out_stride_q, out_stride_h, lse_stride_q;
  int num_queries;                 // rows of query_entry_start - 1 (a capacity for graphs)
  int num_qo_heads;
  int max_query_entries;           // the most partials of any query (a bound is fine): picks the merge kernel
};

// Returns a CUDA error code (cudaSuccess on success; cudaErrorInvalidValue for a head dim or tile size
// without a kernel). head_dim: 64, 128 or 256.
cudaError_t launch_partial(DType dtype, int head_dim, const PartialParams& p, cudaStream_t stream);
cudaError_t launch_merge(DType dtype, int head_dim, const MergeParams& p, cudaStream_t stream);
// Resident stage-1 CTAs per SM for this configuration (0 if it cannot launch).
int partial_ctas_per_sm(DType dtype, int head_dim);
// Rows (query x head pairs) one stage-1 unit covers (16 per warp of the CTA).
int partial_rows_per_unit(DType dtype, int head_dim);
// Whether this build's kernels soft-cap their logits (the TREEDEC_LOGITS_SOFTCAP=1 build, variants.cuh).
bool logits_softcap();
// Whether this build's kernels read e4m3 K/V (the TREEDEC_KV_FP8=1 build).
bool kv_fp8();
// Whether stage 1 of this configuration runs live-list tiles of tile_tokens tokens (64 always; 96
// with the warp-specialized sm_90a kernel, head dims 64 and 128).
bool partial_takes_tile(DType dtype, int head_dim, int tile_tokens);

}  // namespace treedec
