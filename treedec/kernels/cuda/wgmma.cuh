// wgmma (sm_90a) building blocks of the warp-specialized mainloop: shared-memory descriptors, the
// atoms per dtype and width, and a warpgroup's S = Q K^T and O += P V issues.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/util.hpp>
#include <cute/numeric/int.hpp>

#include "swizzle.cuh"

namespace treedec {

// wgmma shared-memory descriptor, 128-byte swizzle: 8-row (K-major) or 8-token (MN-major)
// groups 1024 bytes apart; `lbo_bytes` apart are the 64-column blocks of an MN-major operand.
__device__ __forceinline__ uint64_t gmma_desc(const void* smem, uint32_t lbo_bytes) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem) >> 4);
  desc.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo_bytes >> 4);
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::B128);
  return desc.desc_;
}

// The descriptor of the operand `bytes` further on (16-byte aligned, inside the same smem
// window): the start address is the low field, so this is one add, not a rebuild.
__device__ __forceinline__ uint64_t gmma_desc_add(uint64_t desc, int bytes) {
  // a 32-bit add on the low word (no carry into the high word: addresses < 256 KiB)
  const uint32_t lo = static_cast<uint32_t>(desc) + static_cast<uint32_t>(bytes >> 4);
  return (desc & 0xffffffff00000000ull) | lo;
}

namespace gmma = cute::SM90::GMMA;
template <typename T> struct Gmma;
// The wgmma atom of width N (64, 96, 128 or 256) among the four given.
template <int N, class A64, class A96, class A128, class A256 = void>
using GmmaOfWidth = std::conditional_t<N == 64, A64, std::conditional_t<N == 96, A96,
                                       std::conditional_t<N == 128, A128, A256>>>;
template <> struct Gmma<__half> {
  template <int N> using RS = GmmaOfWidth<N,
      gmma::MMA_64x64x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x96x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x128x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x256x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>>;  // O += P V of head dim 256
  template <int N> using RSK = GmmaOfWidth<N,  // B K-major (S = Q K^T, Q in registers)
      gmma::MMA_64x64x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x96x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x128x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>>;
  template <int N> using SSK = GmmaOfWidth<N,  // A and B K-major in smem (S = Q K^T, Q in smem: head dim 256)
      gmma::MMA_64x64x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x96x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x128x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>>;
};
template <> struct Gmma<__nv_bfloat16> {
  template <int N> using RS = GmmaOfWidth<N,
      gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x96x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x256x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>>;
  template <int N> using RSK = GmmaOfWidth<N,
      gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x96x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>>;
  template <int N> using SSK = GmmaOfWidth<N,
      gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x96x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>,
      gmma::MMA_64x128x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>>;
};

// C[64 x N] (+)= A (registers: the mma.sync A layout, 16 x 16 per warp) B (descriptor); acc[N/8][4]:
// O += P V, or S = Q K^T with Q in registers.
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t db, float (&acc)[N / 8][4],
                                        std::index_sequence<I...>, bool accumulate = true) {
  Atom::fma(a[0], a[1], a[2], a[3], db, acc[I / 4][I % 4]..., accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}

// Issue S[64 x BN] = Q K^T for a warpgroup as one wgmma commit group (no wait), its Q rows in
// registers (qa: per 16-column step the mma.sync A fragment, load_q_fragments) and cK a [BN][D] K
// tile in 128-byte-swizzled smem (swz128): the wgmma reads only K from smem.
template <typename T, int D, int BN = 64>
__device__ __forceinline__ void issue_wgmma_qk_rs(const uint32_t (&qa)[D / 16][4], const T* cK, float (&s)[BN / 8][4]) {
  #pragma unroll
  for (int j = 0; j < BN / 8; ++j)
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(s[j][e]);
  const uint64_t dk = gmma_desc(cK, 16);
  cute::warpgroup_arrive();
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    gmma_rs<typename Gmma<T>::template RSK<BN>, BN>(qa[kk], gmma_desc_add(dk, ((kk / 4) * (BN * 64) + (kk % 4) * 16) * 2),
                                                    s, std::make_index_sequence<BN / 2>{}, kk > 0);
  cute::warpgroup_commit_batch();
}

// C[64 x N] (+)= A B, both operands by descriptor (K-major, 128-byte swizzle).
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float (&acc)[N / 8][4], std::index_sequence<I...>,
                                        bool accumulate) {
  Atom::fma(da, db, acc[I / 4][I % 4]..., accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}

// Issue S[64 x BN] = Q K^T for a warpgroup as one wgmma commit group (no wait), Q and K from smem: sQ the
// warpgroup's first Q row in a [ROWS][D] 128-byte-swizzled tile (swz128), cK a [BN][D] K tile likewise. For head
// dim 256, whose Q rows in registers (64 a thread) would not fit beside O (128) and S.
template <typename T, int D, int BN, int ROWS>
__device__ __forceinline__ void issue_wgmma_qk_ss(const T* sQ, const T* cK, float (&s)[BN / 8][4]) {
  #pragma unroll
  for (int j = 0; j < BN / 8; ++j)
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(s[j][e]);
  const uint64_t dq = gmma_desc(sQ, 16);
  const uint64_t dk = gmma_desc(cK, 16);
  cute::warpgroup_arrive();
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    gmma_ss<typename Gmma<T>::template SSK<BN>, BN>(gmma_desc_add(dq, ((kk / 4) * (ROWS * 64) + (kk % 4) * 16) * 2),
                                                    gmma_desc_add(dk, ((kk / 4) * (BN * 64) + (kk % 4) * 16) * 2),
                                                    s, std::make_index_sequence<BN / 2>{}, kk > 0);
  cute::warpgroup_commit_batch();
}

// A warp's 16 Q rows (row0 ..) of a [ROWS][D] 128-byte-swizzled smem tile (swz128) as the A fragments
// of issue_wgmma_qk_rs, through ldmatrix.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_q_fragments(const T* sQ, int row0, int lane, uint32_t (&qa)[D / 16][4]) {
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    cute::SM75_U32x4_LDSM_N::copy(
        *reinterpret_cast<const cute::uint128_t*>(sQ + swz128(row0 + (lane & 15), kk * 16 + (lane >> 4) * 8, ROWS)),
        qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]);
}

// Issue O[64 x D] += P[64 x BN] V[BN x D] for a warpgroup as one wgmma commit group (no wait):
// P in registers (pack_p), V an MN-major operand in 128-byte-swizzled smem at cV.
template <typename T, int D, int BN>
__device__ __forceinline__ void issue_wgmma_pv(const uint32_t (&pa)[BN / 16][4], const T* cV, float (&acc)[D / 8][4]) {
  #pragma unroll
  for (int j = 0; j < D / 8; ++j)
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(acc[j][e]);
  const uint64_t dv = gmma_desc(cV, BN * 128);
  cute::warpgroup_arrive();
  #pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    gmma_rs<typename Gmma<T>::template RS<D>, D>(pa[kk], gmma_desc_add(dv, kk * 16 * 64 * 2), acc,
                                                 std::make_index_sequence<D / 2>{});
  cute::warpgroup_commit_batch();
}

}  // namespace treedec
