// quantize_tiles (api.h): a 1×128 tile is one half-warp (8 values a lane), a warp taking a row's tiles
// two at a time.
#include <cuda_bf16.h>

#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "kernels/fp8/api.h"
#include "kernels/fp8/e4m3.cuh"
#include "kernels/fp8/quantize_modules.h"
#include "kernels/fp8/row_access.cuh"
#include "lynx/error.h"

namespace lynx::fp8 {
namespace {

using namespace e4m3;

constexpr int kTileWarps = 8;  // rows (a warp each) per CTA of quantize_tiles
constexpr int kTilePairs = 2;  // pairs of tiles a warp loads before quantising them

// One warp per row r, its tiles two at a time: half-warp h takes tile 2i + h (columns [c0, c0 + 128)),
// its lane j columns c0 + 8j .. c0 + 8j + 7, read as one 16-byte load and written as one 8-byte store
// where `vector`; kTilePairs pairs loaded at once, so that each lane has as many loads in flight. The
// tile's largest magnitude is taken on the bf16 bits (Bf16x8, as the block kernels take theirs), then
// over the half-warp.
// NOTES: the maximum is alike in a half-warp, so each half takes its own branch on it without a vote;
// the shuffles stay outside every branch, each half's lanes reading only their own half.
__global__ void __launch_bounds__(kTileWarps * 32)
    quantize_tiles_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols,
                          const int32_t* __restrict__ row_limit, uint8_t* __restrict__ q,
                          float* __restrict__ scales, NonfiniteReport report, bool vector) {
  const int64_t r = int64_t(blockIdx.x) * kTileWarps + threadIdx.x / 32;
  if (r >= rows) return;
  // A limit past the rows (a schedule over capacity) quantises nothing: those rows were never placed.
  if (row_limit != nullptr && (r >= *row_limit || *row_limit > rows)) return;
  const int lane = threadIdx.x % 32, half = lane / 16, j = lane % 16;
  const __nv_bfloat16* xr = x + r * cols;
  uint8_t* qr = q + r * cols;
  float* sr = scales + r * blocks_of(cols);
  for (int64_t at = 0; at < cols; at += kTilePairs * 2 * kBlock) {
    uint4 w[kTilePairs];
#pragma unroll
    for (int p = 0; p < kTilePairs; ++p) w[p] = load8_bits(xr, at + (2 * p + half) * kBlock + 8 * j, cols, vector);
#pragma unroll
    for (int p = 0; p < kTilePairs; ++p) {
      const int64_t c0 = at + (2 * p + half) * kBlock, c = c0 + 8 * j;  // past cols: zeros, nothing stored
      const TileLane tile = quantize_tile_lane(Bf16x8{w[p]}, 0xffffffffu);
      if (!tile.finite && j == 0) report_nonfinite(report);
      store_codes(qr, c, cols, vector, tile.codes);
      if (j == 0 && c0 < cols) sr[c0 / kBlock] = scale_or_nan(tile.e, tile.finite);
    }
  }
}

}  // namespace

void quantize_tiles(const bf16_t* x, int64_t rows, int64_t cols, const int32_t* row_limit, uint8_t* q, float* scales,
                    NonfiniteReport report, cudaStream_t stream) {
  if (rows * cols == 0) return;
  const bool vector = cols % 8 == 0 && aligned(x, 16) && aligned(q, 8);
  quantize_tiles_kernel<<<grid_of((rows + kTileWarps - 1) / kTileWarps), kTileWarps * 32, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x), rows, cols, row_limit, q, scales, report, vector);
  LYNX_CHECK_LAUNCH();
}

void quantize_tiles(const bf16_t* x, int64_t rows, int64_t cols, uint8_t* q, float* scales, int32_t* nonfinite,
                    cudaStream_t stream) {
  quantize_tiles(x, rows, cols, nullptr, q, scales, NonfiniteReport{nonfinite, nullptr, 0}, stream);
}

void load_quantize_kernels() {
  load_module_of(reinterpret_cast<const void*>(&quantize_tiles_kernel));
  load_quantize_blocks_module();
  load_transpose_tiles_module();
  load_tile_rows_module();
}

}  // namespace lynx::fp8
