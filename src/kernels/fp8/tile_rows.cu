// Rows of 1×128 tiles moved and dequantised (api.h): gather_tiles and gather_tile_scales (into
// schedule order), dequantize_tiles, gather_dequantized_tiles (both at once), and dequantize.
#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "device/remote.cuh"
#include "kernels/fp8/api.h"
#include "kernels/fp8/e4m3.cuh"
#include "kernels/fp8/quantize_modules.h"
#include "kernels/fp8/row_access.cuh"
#include "lynx/error.h"

namespace lynx::fp8 {
namespace {

using namespace e4m3;

constexpr int kGatherWarps = 8;  // schedule rows per CTA of gather_tiles

// A pulled tile whose source found it not finite (a NaN scale): reported here too, naming the source rank,
// before this rank's later quantisations meet the NaNs it spreads.
__device__ __forceinline__ void report_pulled_scale(float scale, const NonfiniteReport& report, int32_t source) {
  if (!isfinite(scale)) {
    NonfiniteReport r = report;
    r.rank = source;
    report_nonfinite(r);
  }
}

// One warp per schedule row: its bytes in 16-byte pieces where cols % 16 == 0 (every layer shape), then
// its scales. kRemote (R > 1): from the row's source rank's staged tiles (TileSources), not from src.
// NOTES: a template parameter, as the bf16 gathers' (glue.cu): the one-rank loads keep their read-only
// path.
template <bool kRemote>
__global__ void gather_tiles_kernel(uint8_t* __restrict__ dst, float* __restrict__ dst_scales,
                                    const uint8_t* __restrict__ src, const float* __restrict__ src_scales,
                                    const int32_t* __restrict__ row_token_slot, const int32_t* __restrict__ total_rows,
                                    int64_t capacity, int64_t top_k, int64_t cols, TileSources sources,
                                    NonfiniteReport report) {
  const int64_t row = int64_t(blockIdx.x) * kGatherWarps + threadIdx.x / 32;
  // A schedule over capacity placed no rows (its row arrays hold another schedule's): nothing to gather.
  const int32_t total = *total_rows;
  if (total > capacity || row >= total) return;
  const int lane = threadIdx.x % 32;
  const int32_t slot = row_token_slot[row];
  const int64_t kb = blocks_of(cols);
  uint8_t* d = dst + row * cols;
  float* ds = dst_scales + row * kb;
  if (slot < 0) {
    for (int64_t c = lane; c < cols; c += 32) d[c] = 0;
    for (int64_t b = lane; b < kb; b += 32) ds[b] = 1.0f;
    return;
  }
  const int64_t token = slot / top_k;
  int32_t source = 0;
  if constexpr (kRemote) {
    source = sources.row_src_rank[row];
    const uint8_t* base = static_cast<const uint8_t*>(sources.base[source]);
    src = base;
    src_scales = reinterpret_cast<const float*>(base + sources.tokens * cols);
  }
  const uint8_t* s = src + token * cols;
  if (cols % 16 == 0) {
    for (int64_t c = 16 * lane; c < cols; c += 16 * 32) {
      *reinterpret_cast<uint4*>(d + c) = remote::load(reinterpret_cast<const uint4*>(s + c));
    }
  } else {
    for (int64_t c = lane; c < cols; c += 32) d[c] = remote::load(s + c);
  }
  for (int64_t b = lane; b < kb; b += 32) {
    const float scale = remote::load(src_scales + token * kb + b);
    ds[b] = scale;
    if constexpr (kRemote) report_pulled_scale(scale, report, source);
  }
}

constexpr int64_t kGatherScaleCtas = 4096;  // of 256 threads: gather_tile_scales' grid at most

// gather_tile_scales: a thread per scale (a row's blocks_of(cols) scales by consecutive threads, grid-
// stride), so that a warp's loads and stores are contiguous and every row's loads are in flight at once.
// NOTES: gather_tiles' warp per row, 16 of its lanes busy at H = 2048, took 13.7 µs of the FP8 forward at
// qwen3-30b-a3b under Nsight Compute (H100, 2026-12-06): a dependent load of the row's slot, then of its
// scales, for each of ~9 k warps a wave.
template <bool kRemote>
__global__ void gather_tile_scales_kernel(float* __restrict__ dst_scales, const float* __restrict__ src_scales,
                                          const int32_t* __restrict__ row_token_slot,
                                          const int32_t* __restrict__ total_rows, int64_t capacity, int64_t top_k,
                                          int64_t cols, TileSources sources, NonfiniteReport report) {
  const int32_t total = *total_rows;
  if (total > capacity) return;  // a schedule over capacity placed no rows
  const int64_t kb = blocks_of(cols), n = int64_t(total) * kb;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / kb, b = i - row * kb;
    const int32_t slot = row_token_slot[row];
    if (slot < 0) {
      dst_scales[i] = 1.0f;
      continue;
    }
    const int64_t token = slot / top_k;
    const float* scales = src_scales;
    int32_t source = 0;
    if constexpr (kRemote) {
      source = sources.row_src_rank[row];
      scales = reinterpret_cast<const float*>(static_cast<const uint8_t*>(sources.base[source]) + sources.tokens * cols);
    }
    const float scale = remote::load(scales + token * kb + b);
    dst_scales[i] = scale;
    if constexpr (kRemote) report_pulled_scale(scale, report, source);
  }
}

constexpr int kDequantWarps = 8;  // rows per CTA of dequantize_tiles at a time

// Eight codes of one tile (`bytes`, the first in its lowest byte) times its scale, as eight bf16 values:
// exact in bf16 (an E4M3 value has 4 significant bits, a power-of-two scale none).
__device__ __forceinline__ uint4 dequantize8(uint2 bytes, float s) {
  __nv_bfloat162 v[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t word = p < 2 ? bytes.x : bytes.y;
    const int shift = 16 * (p % 2);
    v[p] = __floats2bfloat162_rn(from_e4m3(uint8_t(word >> shift)) * s, from_e4m3(uint8_t(word >> (shift + 8))) * s);
  }
  return *reinterpret_cast<const uint4*>(v);
}

// One warp per row below *row_limit (every row where null; grid-stride), a lane 8 values at a time.
__global__ void dequantize_tiles_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales,
                                        int64_t capacity, int64_t cols, const int32_t* __restrict__ row_limit,
                                        __nv_bfloat16* __restrict__ out) {
  const int64_t limit = row_limit != nullptr ? *row_limit : capacity;
  if (limit > capacity) return;  // a schedule over capacity: its rows hold nothing
  const int64_t kb = blocks_of(cols);
  const int lane = threadIdx.x % 32;
  for (int64_t r = int64_t(blockIdx.x) * kDequantWarps + threadIdx.x / 32; r < limit;
       r += int64_t(gridDim.x) * kDequantWarps) {
    for (int64_t c = 8 * lane; c < cols; c += 8 * 32) {
      const uint2 bytes = *reinterpret_cast<const uint2*>(q + r * cols + c);
      *reinterpret_cast<uint4*>(out + r * cols + c) = dequantize8(bytes, scales[r * kb + c / kBlock]);
    }
  }
}

// gather_dequantized_tiles: one warp per schedule row (grid-stride), a lane 8 values a step, a row's
// codes and scales for kGatherDequantSteps steps loaded before any is converted. A token's codes are
// read once per slot, mostly from L2 (T · cols bytes, against the 2 · T · k · cols bytes of bf16 rows
// written), and no bf16 copy of the tokens is written and read back.
constexpr int kGatherDequantSteps = 4;

__global__ void gather_dequantized_tiles_kernel(const uint8_t* __restrict__ src, const float* __restrict__ src_scales,
                                                const int32_t* __restrict__ row_token_slot,
                                                const int32_t* __restrict__ total_rows, int64_t capacity,
                                                uint32_t top_k, int64_t cols, __nv_bfloat16* __restrict__ out) {
  const int32_t total = *total_rows;
  if (total > capacity) return;  // a schedule over capacity placed no rows: its row arrays hold nothing
  const int64_t kb = blocks_of(cols);
  const int lane = threadIdx.x % 32;
  constexpr int64_t kStride = 8 * 32;  // columns a warp covers in one step
  for (int64_t r = int64_t(blockIdx.x) * kDequantWarps + threadIdx.x / 32; r < total;
       r += int64_t(gridDim.x) * kDequantWarps) {
    const int32_t slot = row_token_slot[r];
    __nv_bfloat16* row = out + r * cols;
    if (slot < 0) {
      for (int64_t c = 8 * lane; c < cols; c += kStride) *reinterpret_cast<uint4*>(row + c) = make_uint4(0, 0, 0, 0);
      continue;
    }
    const int64_t token = uint32_t(slot) / top_k;  // 32-bit: a slot is an int32
    const uint8_t* codes = src + token * cols;
    const float* scales = src_scales + token * kb;
    for (int64_t c0 = 8 * lane; c0 < cols; c0 += kStride * kGatherDequantSteps) {
      uint2 bytes[kGatherDequantSteps];
      float s[kGatherDequantSteps];
#pragma unroll
      for (int i = 0; i < kGatherDequantSteps; ++i) {
        const int64_t c = c0 + kStride * i;
        if (c < cols) {
          bytes[i] = __ldg(reinterpret_cast<const uint2*>(codes + c));
          s[i] = __ldg(scales + c / kBlock);
        }
      }
#pragma unroll
      for (int i = 0; i < kGatherDequantSteps; ++i) {
        const int64_t c = c0 + kStride * i;
        if (c < cols) *reinterpret_cast<uint4*>(row + c) = dequantize8(bytes[i], s[i]);
      }
    }
  }
}

__global__ void dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales, int64_t rows,
                                  int64_t cols, bool blocks, float* __restrict__ x) {
  const int64_t kb = blocks_of(cols);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float s = blocks ? scales[(r / kBlock) * kb + c / kBlock] : scales[r * kb + c / kBlock];
    x[i] = from_e4m3(q[i]) * s;
  }
}

void check_sources(const TileSources& sources) {
  if (sources.remote() && (sources.row_src_rank == nullptr || sources.tokens <= 0)) {
    throw Error("sources", "internal: remote tiles need the rows' source ranks and the ranks' token count");
  }
}

}  // namespace

void gather_tiles(uint8_t* dst, float* dst_scales, const uint8_t* src, const float* src_scales,
                  const int32_t* row_token_slot, const int32_t* total_rows, int64_t capacity, int64_t top_k,
                  int64_t cols, cudaStream_t stream, const TileSources& sources, NonfiniteReport report) {
  if (capacity == 0 || cols == 0) return;
  if (dst == nullptr) throw Error("dst", "internal: null (gather_tile_scales gathers the scales alone)");
  check_sources(sources);
  const auto kernel = sources.remote() ? gather_tiles_kernel<true> : gather_tiles_kernel<false>;
  kernel<<<grid_of((capacity + kGatherWarps - 1) / kGatherWarps), kGatherWarps * 32, 0, stream>>>(
      dst, dst_scales, src, src_scales, row_token_slot, total_rows, capacity, top_k, cols, sources, report);
  LYNX_CHECK_LAUNCH();
}

void gather_tile_scales(float* dst_scales, const float* src_scales, const int32_t* row_token_slot,
                        const int32_t* total_rows, int64_t capacity, int64_t top_k, int64_t cols, cudaStream_t stream,
                        const TileSources& sources, NonfiniteReport report) {
  if (capacity == 0 || cols == 0) return;
  check_sources(sources);
  constexpr int64_t kThreads = 256;
  // NOTES: at most kGatherScaleCtas CTAs, ~4 waves of an H100's resident threads; a larger schedule's
  // threads take several scales each (qwen3-30b-a3b's full capacity: 1.3 M scales).
  const int64_t grid =
      std::min<int64_t>((capacity * blocks_of(cols) + kThreads - 1) / kThreads, kGatherScaleCtas);
  const auto kernel = sources.remote() ? gather_tile_scales_kernel<true> : gather_tile_scales_kernel<false>;
  kernel<<<grid_of(grid), kThreads, 0, stream>>>(dst_scales, src_scales, row_token_slot, total_rows, capacity, top_k,
                                                 cols, sources, report);
  LYNX_CHECK_LAUNCH();
}

void dequantize_tiles(const uint8_t* q, const float* scales, int64_t capacity, int64_t cols, const int32_t* row_limit,
                      bf16_t* out, cudaStream_t stream) {
  if (cols % 8 != 0) throw Error("cols", "must be a multiple of 8, got " + std::to_string(cols));
  if (capacity == 0 || cols == 0) return;
  const int64_t grid = std::min<int64_t>((capacity + kDequantWarps - 1) / kDequantWarps, 65536);
  dequantize_tiles_kernel<<<grid_of(grid), kDequantWarps * 32, 0, stream>>>(q, scales, capacity, cols, row_limit,
                                                                           reinterpret_cast<__nv_bfloat16*>(out));
  LYNX_CHECK_LAUNCH();
}

void gather_dequantized_tiles(const uint8_t* src, const float* src_scales, const int32_t* row_token_slot,
                              const int32_t* total_rows, int64_t capacity, int64_t top_k, int64_t cols, bf16_t* out,
                              cudaStream_t stream) {
  if (cols % 8 != 0) throw Error("cols", "must be a multiple of 8, got " + std::to_string(cols));
  if (!aligned(src, 8) || !aligned(out, 16)) throw Error("src", "internal: tiles 8-byte and rows 16-byte aligned");
  if (capacity == 0 || cols == 0) return;
  const int64_t grid = std::min<int64_t>((capacity + kDequantWarps - 1) / kDequantWarps, 65536);
  gather_dequantized_tiles_kernel<<<grid_of(grid), kDequantWarps * 32, 0, stream>>>(
      src, src_scales, row_token_slot, total_rows, capacity, uint32_t(top_k), cols,
      reinterpret_cast<__nv_bfloat16*>(out));
  LYNX_CHECK_LAUNCH();
}

void dequantize(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, bool blocks, float* x,
                cudaStream_t stream) {
  if (rows * cols == 0) return;
  const int64_t threads = 256, grid = std::min<int64_t>((rows * cols + threads - 1) / threads, 65536);
  dequantize_kernel<<<grid_of(grid), threads, 0, stream>>>(q, scales, rows, cols, blocks, x);
  LYNX_CHECK_LAUNCH();
}

void load_tile_rows_module() { load_module_of(reinterpret_cast<const void*>(&dequantize_kernel)); }

}  // namespace lynx::fp8
