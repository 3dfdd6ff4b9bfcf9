// transpose_tiles and transpose_gathered_tiles (api.h): one thread's column of a 128×128 block staged in
// shared memory, quantised as one 1×128 tile along the rows.
#include <cuda_bf16.h>

#include <algorithm>
#include <string>

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

// transpose_tiles' codes in shared memory, q's rows [c0, c0 + 128) of the block: rows 16-byte aligned,
// and padded so that 8 lanes storing 16 bytes each into rows t .. t + 7 hit 8 different bank quads.
constexpr int kCodesStride = int(kBlock) + 16;
static_assert(kBlock * kCodesStride <= kBlock * kBlock * 2, "the codes fit in the staged block's memory");

// transpose_tiles' rows. A CTA first finds each of its 128 rows' source (`source`, for its column block
// at c0), thread t that of row r0 + t, into shared memory; `load4` then reads four values of a row from
// its source, from column c (c % 4 == 0, zeros past cols), and `bf16x4` turns what it read into the bits
// of four bf16 values in one 8-byte word.
// NOTES: load4 reads through __ldg: its pointer comes from shared memory, and a generic load could alias
// the staging stores.
// bf16 rows: a row's source is where it starts; what load4 reads, the bits themselves.
struct Bf16Rows {
  const __nv_bfloat16* x;
  bool vector;  // cols % 4 == 0 and x 8-byte aligned: one 8-byte load

  using Source = const __nv_bfloat16*;
  using Loaded = uint2;

  __device__ __forceinline__ Source source(int64_t r, int64_t, int64_t cols) const { return x + r * cols; }

  __device__ __forceinline__ Loaded load4(Source row, int64_t c, int64_t cols) const {
    if (vector && c < cols) return __ldg(reinterpret_cast<const uint2*>(row + c));
    uint32_t part[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) part[i] = c + i < cols ? __ldg(reinterpret_cast<const uint16_t*>(row + c + i)) : 0u;
    return make_uint2(part[0] | part[1] << 16, part[2] | part[3] << 16);
  }

  __device__ __forceinline__ static uint2 bf16x4(Loaded v) { return v; }
  __device__ __forceinline__ void keep_scale(int64_t, int64_t, int64_t, const Source&, int32_t) const {}
  __device__ __forceinline__ void keep(int64_t, int64_t, int64_t, const Loaded&, int32_t) const {}
};

// The same from token rows in 1×128 E4M3 tiles, gathered into schedule order on the way: schedule row r
// is token row_token_slot[r] / top_k's codes times its tile's scale, rounded to bf16 as dequantize_tiles
// rounds them (zeros for a padding row): what gather_tiles then dequantize_tiles put in a bf16 buffer.
// A row's source is its token's codes and the scale of its tile in the CTA's column block, found once
// for the 32 loads of the row.
struct GatheredTileRows {
  const uint8_t* src;
  const float* src_scales;
  const int32_t* row_token_slot;
  uint32_t top_k;
  bool vector;  // cols % 4 == 0 and src (and kept.q) 4-byte aligned: one 4-byte load (and store)
  GatheredTiles kept;  // where the gathered tiles go too, as gather_tiles writes them (none: null)

  struct __align__(16) Source {
    const uint8_t* row;  // null: a padding row
    float scale;
  };
  // Four codes and their scale; a scale of 0 gives zeros (a padding row, columns past cols), whatever the
  // tile's scale (a NaN one times 0 would not be).
  struct Loaded {
    uint32_t codes;
    float scale;
  };

  __device__ __forceinline__ Source source(int64_t r, int64_t c0, int64_t cols) const {
    const int32_t slot = row_token_slot[r];
    if (slot < 0) return {nullptr, 0.0f};
    const int64_t token = uint32_t(slot) / top_k;  // 32-bit: a slot is an int32
    return {src + token * cols, src_scales[token * blocks_of(cols) + c0 / kBlock]};
  }

  __device__ __forceinline__ Loaded load4(const Source& s, int64_t c, int64_t cols) const {
    if (s.row == nullptr || c >= cols) return {0, 0.0f};
    if (vector) return {__ldg(reinterpret_cast<const uint32_t*>(s.row + c)), s.scale};
    uint32_t codes = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (c + i < cols) codes |= uint32_t(__ldg(s.row + c + i)) << (8 * i);
    }
    return {codes, s.scale};
  }

  __device__ __forceinline__ static uint2 bf16x4(Loaded v) {
    const float2 v01 = from_e4m3x2(uint16_t(v.codes)), v23 = from_e4m3x2(uint16_t(v.codes >> 16));
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v01.x * v.scale, v01.y * v.scale);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(v23.x * v.scale, v23.y * v.scale);
    return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  }

  // Row r's scale of the column block at c0 into kept (1 for a padding row, as gather_tiles); kept's rows
  // from the schedule's total on are not written.
  __device__ __forceinline__ void keep_scale(int64_t r, int64_t c0, int64_t cols, const Source& s,
                                             int32_t total) const {
    if (kept.q == nullptr || r >= total) return;
    kept.scales[r * blocks_of(cols) + c0 / kBlock] = s.row == nullptr ? 1.0f : s.scale;
  }
  // Row r's codes of columns c .. c + 3 below cols into kept (zeros for a padding row).
  __device__ __forceinline__ void keep(int64_t r, int64_t c, int64_t cols, const Loaded& v, int32_t total) const {
    if (kept.q == nullptr || r >= total || c >= cols) return;
    uint8_t* d = kept.q + r * cols + c;
    if (vector) {
      *reinterpret_cast<uint32_t*>(d) = v.codes;
      return;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (c + i < cols) d[i] = uint8_t(v.codes >> (8 * i));
    }
  }
};

// One CTA of 128 threads per 128 rows × 128 columns of x. The block is staged in shared memory (thread t
// finds row r0 + t's source, then warp w loads rows w, w + 4, ..., a lane 4 adjacent values: one 8-byte
// load where `vector`); thread t reads back column c0 + t, quantises its 128 rows as one tile and puts
// the codes (q's row c0 + t, columns r0 .. r0 + 127) in shared memory over the block; the CTA then
// writes those rows 8 lanes a row, 16 bytes each, so that a warp's store covers four whole 128-byte rows.
template <class Rows>
__global__ void __launch_bounds__(kBlock)
    transpose_tiles_kernel(Rows x, int64_t capacity, int64_t cols, const int32_t* __restrict__ total_rows,
                           uint8_t* __restrict__ q, float* __restrict__ scales, NonfiniteReport report) {
  __shared__ __align__(16) uint8_t staged[kBlock * kBlock * 2];
  __shared__ typename Rows::Source sources[kBlock];
  auto block = reinterpret_cast<__nv_bfloat16(*)[kBlock]>(staged);  // [128 rows, 128 columns] of x
  auto codes = reinterpret_cast<uint8_t(*)[kCodesStride]>(staged);  // [128 columns, 128 rows] of codes
  const uint32_t kb = uint32_t(blocks_of(cols));  // below the grid's size
  const int64_t r0 = int64_t(blockIdx.x / kb) * kBlock, c0 = int64_t(blockIdx.x % kb) * kBlock;
  const int32_t total = *total_rows;
  if (total > capacity || r0 >= total) return;  // every thread alike: no row here was placed
  const int t = int(threadIdx.x), warp = t / 32, lane = t % 32;
  sources[t] = x.source(r0 + t, c0, cols);
  x.keep_scale(r0 + t, c0, cols, sources[t], total);
  __syncthreads();
  // NOTES: a group's loads all issued before the first is staged: that many in flight a thread.
  constexpr int kLoadsAtOnce = 16;
  for (int i0 = 0; i0 < int(kBlock) / 4; i0 += kLoadsAtOnce) {
    typename Rows::Loaded v[kLoadsAtOnce];
#pragma unroll
    for (int i = 0; i < kLoadsAtOnce; ++i) v[i] = x.load4(sources[warp + 4 * (i0 + i)], c0 + 4 * lane, cols);
#pragma unroll
    for (int i = 0; i < kLoadsAtOnce; ++i) {
      x.keep(r0 + warp + 4 * (i0 + i), c0 + 4 * lane, cols, v[i], total);
      *reinterpret_cast<uint2*>(&block[warp + 4 * (i0 + i)][4 * lane]) = Rows::bf16x4(v[i]);
    }
  }
  __syncthreads();
  const int64_t c = c0 + t;
  const uint32_t m = column_magnitude_bits(block, t);
  const bool finite = m < kInfBits;
  if (!finite) report_nonfinite(report);  // the columns past cols hold zeros
  const int e = finite ? scale_exponent(amax_of_bits(m)) : 0;
  const float inv = pow2(-e);
  uint4 mine[int(kBlock) / 16];
  column_codes(block, t, inv, mine);
  __syncthreads();  // every column read: the block's memory takes the codes
#pragma unroll
  for (int j = 0; j < int(kBlock) / 16; ++j) *reinterpret_cast<uint4*>(&codes[t][16 * j]) = mine[j];
  if (c < cols) scales[(r0 / kBlock) * scale_pitch(cols) + c] = scale_or_nan(e, finite);
  __syncthreads();
  constexpr int kCodeRowsAtOnce = int(kBlock) / 8;  // 8 lanes a row
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = t / 8 + kCodeRowsAtOnce * i;
    if (c0 + row < cols) {
      *reinterpret_cast<uint4*>(q + (c0 + row) * capacity + r0 + 16 * (t % 8)) =
          *reinterpret_cast<const uint4*>(&codes[row][16 * (t % 8)]);
    }
  }
}

template <class Rows>
void launch_transpose_tiles(const Rows& rows, int64_t capacity, int64_t cols, const int32_t* total_rows, uint8_t* q,
                            float* scales, NonfiniteReport report, cudaStream_t stream) {
  if (capacity % kBlock != 0) throw Error("capacity", "must be a multiple of 128, got " + std::to_string(capacity));
  const int64_t blocks = (capacity / kBlock) * blocks_of(cols);
  if (blocks == 0) return;
  if (!aligned(q, 16)) throw Error("q", "must be 16-byte aligned");
  if (!aligned(scales, 16)) throw Error("scales", "must be 16-byte aligned");
  transpose_tiles_kernel<<<grid_of(blocks), kBlock, 0, stream>>>(rows, capacity, cols, total_rows, q, scales, report);
  LYNX_CHECK_LAUNCH();
}

}  // namespace

void transpose_tiles(const bf16_t* x, int64_t capacity, int64_t cols, const int32_t* total_rows, uint8_t* q,
                     float* scales, NonfiniteReport report, cudaStream_t stream) {
  const Bf16Rows rows{reinterpret_cast<const __nv_bfloat16*>(x), cols % 4 == 0 && aligned(x, 8)};
  launch_transpose_tiles(rows, capacity, cols, total_rows, q, scales, report, stream);
}

void transpose_gathered_tiles(const uint8_t* src, const float* src_scales, const int32_t* row_token_slot,
                              const int32_t* total_rows, int64_t capacity, int64_t top_k, int64_t cols, uint8_t* q,
                              float* scales, NonfiniteReport report, cudaStream_t stream, const GatheredTiles& kept) {
  if (src == nullptr || src_scales == nullptr || row_token_slot == nullptr || top_k <= 0) {
    throw Error("src", "its scales, the row slots and a positive top_k are needed");
  }
  if ((kept.q == nullptr) != (kept.scales == nullptr)) throw Error("kept", "its bytes and its scales, or neither");
  // Slots are int32s: a top_k of 2^31 or more puts every slot in token 0, as 2^31 does.
  const uint32_t k = uint32_t(std::min<int64_t>(top_k, int64_t(1) << 31));
  const bool vector = cols % 4 == 0 && aligned(src, 4) && aligned(kept.q, 4);
  const GatheredTileRows rows{src, src_scales, row_token_slot, k, vector, kept};
  launch_transpose_tiles(rows, capacity, cols, total_rows, q, scales, report, stream);
}

void load_transpose_tiles_module() {
  load_module_of(reinterpret_cast<const void*>(&transpose_tiles_kernel<Bf16Rows>));
}

}  // namespace lynx::fp8
