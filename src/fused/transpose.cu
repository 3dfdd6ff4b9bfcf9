#include <cuda_bf16.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "fused/transpose.h"

namespace lynx::fused {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;

// One block per [64 rows, 64 cols] tile of one batch: grid (col tiles, row tiles, batches).
// NOTES: the +2 padding (one 4-byte bank) keeps the column-wise reads of the tile conflict-free.
__global__ void __launch_bounds__(kThreads) transpose_kernel(uint16_t* __restrict__ dst, int64_t dst_row_pitch,
                                                             int64_t dst_batch_stride, const uint16_t* __restrict__ src,
                                                             int64_t rows, int64_t cols, const int32_t* rows_total,
                                                             const int32_t* row_token_slot) {
  __shared__ uint16_t tile[kTile][kTile + 2];  // [64 rows, 64 cols] bf16 bits
  const int64_t live_rows = rows_total ? std::min<int64_t>(*rows_total, rows) : rows;
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  if (r0 >= live_rows) return;
  const uint16_t* s = src + int64_t(blockIdx.z) * rows * cols;
  uint16_t* d = dst + int64_t(blockIdx.z) * dst_batch_stride;
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    const int tr = i / kTile, tc = i % kTile;
    const int64_t r = r0 + tr, c = c0 + tc;
    uint16_t v = 0;
    if (r < live_rows && c < cols && (!row_token_slot || row_token_slot[r] >= 0)) v = s[r * cols + c];
    tile[tr][tc] = v;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    const int tc = i / kTile, tr = i % kTile;
    const int64_t r = r0 + tr, c = c0 + tc;
    if (r < live_rows && c < cols) d[c * dst_row_pitch + r] = tile[tr][tc];
  }
}

}  // namespace

void transpose(bf16_t* dst, int64_t dst_row_pitch, int64_t dst_batch_stride, const bf16_t* src, int64_t batches,
               int64_t rows, int64_t cols, const int32_t* rows_total, const int32_t* row_token_slot,
               cudaStream_t stream) {
  if (batches == 0 || rows == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile),
                  static_cast<unsigned>(batches));
  transpose_kernel<<<grid, kThreads, 0, stream>>>(dst, dst_row_pitch, dst_batch_stride, src, rows, cols, rows_total,
                                                  row_token_slot);
  LYNX_CHECK_LAUNCH();
}

}  // namespace lynx::fused
