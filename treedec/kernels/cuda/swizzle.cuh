// Shared-memory tile layouts: the XOR swizzles under which ldmatrix (mma.sync) and wgmma read
// 16-bit tiles without bank conflicts.
#pragma once

namespace treedec {

// Element offset of (row, col) in a [rows][D] 16-bit tile whose 16-byte vectors are XOR-swizzled
// by the row (so that ldmatrix's 8 row addresses hit 8 different bank groups).
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Offset of (row, col) in a [rows][D] tile stored the way wgmma reads a 128-byte-swizzled
// operand: D/64 column blocks of [rows][64], each 8-row x 128-byte atom XOR-swizzled
// (16-byte chunk c of row r at c ^ (r % 8)). Buffers start 1024-byte aligned.
__device__ __forceinline__ int swz128(int row, int col, int rows) {
  return (col >> 6) * (rows * 64) + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

}  // namespace treedec
