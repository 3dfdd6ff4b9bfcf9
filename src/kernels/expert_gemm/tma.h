// Host-side creation of TMA tensor maps (bf16, or bytes for FP8; 128-byte swizzle) through the driver entry point, so
// the library does not link libcuda directly.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace lynx::gemm {

// What the L2 fetches from DRAM for each 128-byte line a load misses (CUtensorMapL2promotion): the
// line alone, or the 256-byte block that holds it. make_tma_2d and make_tma_2d_chunks always fetch
// 256-byte blocks; make_tma_3d takes the choice.
enum class L2Fetch { kLine, k256B };

// A row-major [rows, cols] bf16 matrix (row stride = cols), loaded in [box_rows, box_cols] boxes.
// box_cols * 2 bytes must be 128 (one swizzle atom row).
CUtensorMap make_tma_2d(const void* base, int64_t rows, int64_t cols, int box_rows, int box_cols);

// A row-major [rows, cols] matrix of bytes (FP8; cols % 16 == 0, the row stride's alignment), loaded in
// [box_rows, 128] boxes: one 128-byte swizzle row per box row. Columns and rows past the matrix read as
// zero.
CUtensorMap make_tma_2d_bytes(const void* base, int64_t rows, int64_t cols, int box_rows);

// The same for [batches, rows, cols] bytes, loaded in [1, box_rows, 128] boxes; rows past `rows` inside a
// box read as zero (never the next batch's rows).
CUtensorMap make_tma_3d_bytes(const void* base, int64_t batches, int64_t rows, int64_t cols, int box_rows);

// A row-major [rows, cols] bf16 matrix (cols % 64 == 0) loaded `chunks` column blocks at a time: one
// load at coordinates (0, row, c) brings columns [64c, 64(c + chunks)) of rows [row, row + box_rows)
// as `chunks` [box_rows, 64] blocks one after another, as that many [box_rows, 64] loads of a
// make_tma_2d map would lay them out. Blocks past the last column read as zero.
CUtensorMap make_tma_2d_chunks(const void* base, int64_t rows, int64_t cols, int box_rows, int chunks);

// A row-major [batches, rows, cols] bf16 tensor, loaded in [1, box_rows, box_cols] boxes; rows past
// `rows` inside a box read as zero (never the next batch's rows). batch_stride: elements from one batch's
// matrix to the next (0: rows · cols; else a multiple of 8).
CUtensorMap make_tma_3d(const void* base, int64_t batches, int64_t rows, int64_t cols, int box_rows, int box_cols,
                        L2Fetch fetch = L2Fetch::k256B, int64_t batch_stride = 0);

}  // namespace lynx::gemm
