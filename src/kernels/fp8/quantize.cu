// FP8 quantisation kernels (api.h). A 1×128 tile is one half-warp (8 values a lane), a warp taking a
// row's tiles two at a time, and in transpose_tiles one thread's column of a 128×128 block staged in
// shared memory; a 128×128 weight block is one CTA of 8 warps, a half-warp reading a 128-element row (8
// values a lane), its codes of a transposed block written back through shared memory, 16 bytes a store.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "device/remote.cuh"
#include "kernels/fp8/api.h"
#include "kernels/fp8/e4m3.cuh"
#include "lynx/error.h"

namespace lynx::fp8 {
namespace {

using namespace e4m3;


constexpr int kTileWarps = 8;  // rows (a warp each) per CTA of quantize_tiles
constexpr int kTilePairs = 2;  // pairs of tiles a warp loads before quantising them

// Eight adjacent values of a row of n from column c (c % 8 == 0) as bf16 bits, the first in the low half
// of .x, zeros past n: one 16-byte load where `vector` (n % 8 == 0 and the row 16-byte aligned).
__device__ __forceinline__ uint4 load8_bits(const __nv_bfloat16* row, int64_t c, int64_t n, bool vector) {
  if (vector) return c < n ? *reinterpret_cast<const uint4*>(row + c) : make_uint4(0, 0, 0, 0);
  uint32_t part[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) part[i] = c + i < n ? __bfloat16_as_ushort(row[c + i]) : 0u;
  return make_uint4(part[0] | part[1] << 16, part[2] | part[3] << 16, part[4] | part[5] << 16, part[6] | part[7] << 16);
}

// Stores the codes of `packed` (uint2: 8, uint4: 16; the first in the lowest byte) at columns c .. of a
// row of n: one store where `vector` (n a multiple of their count and the row aligned to their bytes),
// else those below n one at a time.
template <class Packed>
__device__ __forceinline__ void store_codes(uint8_t* row, int64_t c, int64_t n, bool vector, Packed packed) {
  constexpr int kCodes = int(sizeof(Packed));
  if (c >= n) return;
  if (vector) {
    *reinterpret_cast<Packed*>(row + c) = packed;
    return;
  }
  const uint32_t* word = reinterpret_cast<const uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < kCodes; ++i) {
    if (c + i < n) row[c + i] = uint8_t(word[i / 4] >> (8 * (i % 4)));
  }
}

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

// The 128×128 block kernels: one CTA of 8 warps per block, half-warp h reading rows h, h + 16, ... of
// it, a lane 8 adjacent values of each (one 16-byte load of bf16 where `vector`), so that every load
// instruction reads two whole rows; each thread keeps its 8 × 8 values as loaded (bf16 bits or E4M3
// codes, packed) between the block's maximum and the codes.
// NOTES: packed, not as fp32 (64 registers of values alone), so that 4 CTAs fit an SM: with the 2 that
// fit otherwise, each CTA's load, maximum and store phases in turn left the SM waiting on memory. The
// launch bounds' 4 CTAs an SM cap a thread at 64 registers (72 to 80 uncapped; no spills capped).
constexpr int kBlockWarps = 8;
constexpr int kBlockThreads = kBlockWarps * 32;
constexpr int kBlocksPerSm = 4;
constexpr int kRowsAtOnce = kBlockThreads / 16;            // 16 rows, a half-warp each
constexpr int kRowsPerThread = int(kBlock) / kRowsAtOnce;  // 8

// Eight adjacent E4M3 codes of a row (the first in the lowest byte) and their block's scale: the values
// code · scale in fp32 (rounded where the scale is not a power of two), the same products for the
// block's maximum and for the codes.
struct E4m3x8 {
  uint2 code;
  float scale;

  // Values 2k and 2k + 1.
  __device__ __forceinline__ float2 values(int k) const {
    const float2 v = from_e4m3x2(uint16_t((k < 2 ? code.x : code.y) >> (16 * (k % 2))));
    return make_float2(v.x * scale, v.y * scale);
  }

  __device__ __forceinline__ uint32_t magnitude() const {
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 v = values(k);
      m = max(m, max(__float_as_uint(v.x) & 0x7FFFFFFFu, __float_as_uint(v.y) & 0x7FFFFFFFu));
    }
    return m;
  }

  __device__ __forceinline__ uint2 codes(float inv) const {
    uint32_t pair[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 v = values(k);
      pair[k] = to_e4m3x2(v.x * inv, v.y * inv);
    }
    return make_uint2(pair[0] | pair[1] << 16, pair[2] | pair[3] << 16);
  }
};

// Eight adjacent codes of a row of n from column c (c % 8 == 0), zeros past n: one 8-byte load where
// `vector` (n % 8 == 0 and the row 8-byte aligned), else one at a time.
__device__ __forceinline__ uint2 load8_codes(const uint8_t* row, int64_t c, int64_t n, bool vector) {
  if (vector) return c < n ? *reinterpret_cast<const uint2*>(row + c) : make_uint2(0, 0);
  uint32_t part[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (c + i < n) part[i / 4] |= uint32_t(row[c + i]) << (8 * (i % 4));
  }
  return make_uint2(part[0], part[1]);
}

// Each m[k], the largest over the CTA's threads (warp_max: shared memory), into every thread's m[k].
template <int kValues>
__device__ __forceinline__ void block_max(uint32_t (&m)[kValues], uint32_t (&warp_max)[kValues][kBlockWarps]) {
#pragma unroll
  for (int k = 0; k < kValues; ++k) {
    m[k] = __reduce_max_sync(0xffffffffu, m[k]);
    if (threadIdx.x % 32 == 0) warp_max[k][threadIdx.x / 32] = m[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kValues; ++k) {
    m[k] = 0;
#pragma unroll
    for (int w = 0; w < kBlockWarps; ++w) m[k] = max(m[k], warp_max[k][w]);
  }
}

// One CTA per block (rows [r0, r0 + 128), columns [c0, c0 + 128)) of matrix blockIdx.y; half-warp h's
// lane j holds columns c0 + 8j .. c0 + 8j + 7 of rows r0 + h + 16i (i < 8), their codes written back as
// one 8-byte store each. `vector`: cols % 8 == 0, w 16-byte and q 8-byte aligned.
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm)
    quantize_blocks_kernel(const __nv_bfloat16* __restrict__ w, int64_t rows, int64_t cols, uint8_t* __restrict__ q,
                           float* __restrict__ scales, NonfiniteReport report, bool vector) {
  __shared__ uint32_t warp_max[1][kBlockWarps];
  const int64_t kb = blocks_of(cols);
  const int64_t matrix = blockIdx.y;
  w += matrix * rows * cols;
  q += matrix * rows * cols;
  scales += matrix * blocks_of(rows) * kb;
  const int h = int(threadIdx.x) / 16;
  const int64_t r0 = int64_t(blockIdx.x / kb) * kBlock, c = int64_t(blockIdx.x % kb) * kBlock + 8 * (threadIdx.x % 16);
  Bf16x8 v[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = r0 + h + kRowsAtOnce * i;
    v[i].bits = r < rows ? load8_bits(w + r * cols, c, cols, vector) : make_uint4(0, 0, 0, 0);
  }
  uint32_t m[1] = {0};
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) m[0] = max(m[0], v[i].magnitude());
  block_max(m, warp_max);
  const bool finite = m[0] < kInfFloatBits;
  if (threadIdx.x == 0 && !finite) report_nonfinite(report);
  const int e = finite ? scale_exponent(__uint_as_float(m[0])) : 0;
  const float inv = pow2(-e);
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = r0 + h + kRowsAtOnce * i;
    if (r < rows) store_codes(q + r * cols, c, cols, vector, v[i].codes(inv));
  }
  if (threadIdx.x == 0) scales[blockIdx.x] = scale_or_nan(e, finite);
}

// The source matrices of quantize_blocks_transposed: bf16 values, or E4M3 values with a scale per
// 128×128 block (value · scale; no scales for bf16).
template <class T>
struct BlockSource {
  const T* m0;
  const float* scales0;
  const T* m1;
  const float* scales1;
};
using Bf16Source = BlockSource<__nv_bfloat16>;
using Fp8Source = BlockSource<uint8_t>;

// quantize_blocks_and_transposed's straight copies: each source's own 128×128 blocks, as quantize_blocks
// makes them (q0 [batch, n0, rows], scales0 [batch, blocks_of(n0), blocks_of(rows)]; likewise q1).
struct StraightCopies {
  uint8_t* q0;
  float* scales0;
  uint8_t* q1;
  float* scales1;
  bool vector;  // rows % 8 == 0 and q0, q1 8-byte aligned: one 8-byte store a row
};

// One CTA per 128×128 block (rows [r0, r0 + 128), columns [c0, c0 + 128)) of the transposed matrix of
// matrix blockIdx.y, its codes between the two halves in shared memory: codes[c][a ^ 4 (c / 16)] holds
// output rows r0 + 4a .. r0 + 4a + 3 (a byte each, the first lowest) of output column c0 + c.
// Half 1: half-warp h's lane j reads source rows c0 + h + 16i (i < 8), their values r0 + 8j .. r0 + 8j
// + 7 (contiguous in the source), and after the block's maximum writes their codes, 8 bytes a row.
// Half 2: lane l of warp w takes output rows 4a .. 4a + 3 (a = 4w + l / 8) of columns 16g .. 16g + 15
// (g = l % 8): 16 words of shared memory, transposed 4 × 4 bytes at a time (byte permutes) into 16 bytes
// of each of its 4 rows, one store each, so that a store instruction writes 4 whole 128-byte rows.
// `vector`: rows % 8 == 0 and both sources' rows aligned to 8 values; `vector_out`: cols % 16 == 0 and
// q 16-byte aligned.
// NOTES: the XOR keeps both halves free of bank conflicts: in half 1 a half-warp writes all 32 words of
// one row, and at each load of half 2 a warp's lanes read words a ^ 4g = 4 (w ^ g) + l / 8 of their
// rows: 32 different banks.
// NOTES: an E4M3 row's values past `rows` are code 0 times the row's scale, not 0: the same where the
// scale is finite, and where it is not, that row's own values are not finite either (the same source).
// kStraight (bf16 sources, n0 % 128 == 0 where n1 > 0): half 1 also stores its codes, 8 bytes a source
// row, into the straight copies, and the block's scale as the source block's. A source block's values
// are the transposed block's, so its maximum, scale and codes are quantize_blocks' of that block.
template <class Source, bool kStraight>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm)
    quantize_blocks_transposed_kernel(Source src, int64_t n0, int64_t n1, int64_t rows, uint8_t* __restrict__ q,
                                      float* __restrict__ scales, NonfiniteReport report0, NonfiniteReport report1,
                                      bool vector, bool vector_out, StraightCopies straight) {
  constexpr bool kFp8 = std::is_same_v<Source, Fp8Source>;
  static_assert(!(kFp8 && kStraight), "straight copies are quantize_blocks' of bf16 sources");
  __shared__ uint32_t warp_max[2][kBlockWarps];
  __shared__ __align__(16) uint32_t codes[kBlock][kBlock / 4];
  const int64_t cols = n0 + n1, kb = blocks_of(cols);
  const int64_t matrix = blockIdx.y;
  const int64_t r0 = int64_t(blockIdx.x / kb) * kBlock, c0 = int64_t(blockIdx.x % kb) * kBlock;
  const int h = int(threadIdx.x) / 16, j = int(threadIdx.x) % 16;
  const int64_t r = r0 + 8 * j;
  // Source row c0 + h + 16i: its values r .. r + 7 (zero past the rows or the columns).
  std::conditional_t<kFp8, E4m3x8, Bf16x8> v[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t c = c0 + h + kRowsAtOnce * i;
    const bool second = c >= n0;
    const int64_t n = second ? n1 : n0, at = second ? c - n0 : c;
    if constexpr (kFp8) {
      v[i] = {make_uint2(0, 0), 0.0f};
      if (c < cols) {
        const float* s = second ? src.scales1 : src.scales0;
        v[i].code = load8_codes((second ? src.m1 : src.m0) + (matrix * n + at) * rows, r, rows, vector);
        v[i].scale = s[(matrix * blocks_of(n) + at / kBlock) * blocks_of(rows) + r0 / kBlock];
      }
    } else {
      v[i].bits = c < cols ? load8_bits((second ? src.m1 : src.m0) + (matrix * n + at) * rows, r, rows, vector)
                           : make_uint4(0, 0, 0, 0);
    }
  }
  // Each source's own largest magnitude (a block may straddle them), for its own report.
  uint32_t m[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const uint32_t mi = v[i].magnitude();
    if (c0 + h + kRowsAtOnce * i >= n0) {
      m[1] = max(m[1], mi);
    } else {
      m[0] = max(m[0], mi);
    }
  }
  block_max(m, warp_max);
  const bool bad0 = m[0] >= kInfFloatBits, bad1 = m[1] >= kInfFloatBits;
  if (threadIdx.x == 0 && bad0) report_nonfinite(report0);
  if (threadIdx.x == 0 && bad1) report_nonfinite(report1);
  const bool block_finite = !bad0 && !bad1;
  const int e = block_finite ? scale_exponent(__uint_as_float(max(m[0], m[1]))) : 0;
  const float inv = pow2(-e);
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const uint2 packed = v[i].codes(inv);
    *reinterpret_cast<uint2*>(&codes[h + kRowsAtOnce * i][(2 * j) ^ (4 * i)]) = packed;
    if constexpr (kStraight) {  // source row c's values r .. r + 7
      const int64_t c = c0 + h + kRowsAtOnce * i;
      if (c < cols) {
        const bool second = c >= n0;
        const int64_t n = second ? n1 : n0, at = second ? c - n0 : c;
        store_codes((second ? straight.q1 : straight.q0) + (matrix * n + at) * rows, r, rows, straight.vector, packed);
      }
    }
  }
  if (kStraight && threadIdx.x == 0) {  // the block is one source's (n0 % 128 == 0)
    const bool second = c0 >= n0;
    const int64_t n = second ? n1 : n0, at = second ? c0 - n0 : c0;
    (second ? straight.scales1 : straight.scales0)[(matrix * blocks_of(n) + at / kBlock) * blocks_of(rows) +
                                                   r0 / kBlock] = scale_or_nan(e, block_finite);
  }
  __syncthreads();
  const int lane = int(threadIdx.x) % 32, g = lane % 8, a = 4 * (int(threadIdx.x) / 32) + lane / 8;
  uint32_t out_words[4][4];  // [output row 4a + n][columns 16g + 4k .. 16g + 4k + 3]
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t col[4];  // output column 16g + 4k + i: rows 4a .. 4a + 3
#pragma unroll
    for (int i = 0; i < 4; ++i) col[i] = codes[16 * g + 4 * k + i][a ^ (4 * g)];
    const uint32_t lo01 = __byte_perm(col[0], col[1], 0x5140), lo23 = __byte_perm(col[2], col[3], 0x5140);
    const uint32_t hi01 = __byte_perm(col[0], col[1], 0x7362), hi23 = __byte_perm(col[2], col[3], 0x7362);
    out_words[0][k] = __byte_perm(lo01, lo23, 0x5410);
    out_words[1][k] = __byte_perm(lo01, lo23, 0x7632);
    out_words[2][k] = __byte_perm(hi01, hi23, 0x5410);
    out_words[3][k] = __byte_perm(hi01, hi23, 0x7632);
  }
  uint8_t* out = q + matrix * rows * cols;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int64_t rr = r0 + 4 * a + n;
    if (rr < rows) {
      store_codes(out + rr * cols, c0 + 16 * g, cols, vector_out,
              make_uint4(out_words[n][0], out_words[n][1], out_words[n][2], out_words[n][3]));
    }
  }
  if (threadIdx.x == 0) {
    scales[matrix * blocks_of(rows) * kb + blockIdx.x] = scale_or_nan(e, block_finite);
  }
}

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
  bool vector;  // cols % 4 == 0 and src 4-byte aligned: one 4-byte load

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
  __syncthreads();
  // NOTES: a group's loads all issued before the first is staged: that many in flight a thread.
  constexpr int kLoadsAtOnce = 16;
  for (int i0 = 0; i0 < int(kBlock) / 4; i0 += kLoadsAtOnce) {
    typename Rows::Loaded v[kLoadsAtOnce];
#pragma unroll
    for (int i = 0; i < kLoadsAtOnce; ++i) v[i] = x.load4(sources[warp + 4 * (i0 + i)], c0 + 4 * lane, cols);
#pragma unroll
    for (int i = 0; i < kLoadsAtOnce; ++i) {
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

constexpr int kGatherWarps = 8;  // schedule rows per CTA of gather_tiles

// One warp per schedule row: its bytes in 16-byte pieces where cols % 16 == 0 (every layer shape), then
// its scales (only its scales without `bytes`). kRemote (R > 1): from the row's source rank's staged
// tiles (TileSources), not from src.
// NOTES: a template parameter, as the bf16 gathers' (glue.cu): the one-rank loads keep their read-only
// path.
template <bool kRemote>
__global__ void gather_tiles_kernel(uint8_t* __restrict__ dst, float* __restrict__ dst_scales,
                                    const uint8_t* __restrict__ src, const float* __restrict__ src_scales,
                                    const int32_t* __restrict__ row_token_slot, const int32_t* __restrict__ total_rows,
                                    int64_t capacity, int64_t top_k, int64_t cols, TileSources sources,
                                    NonfiniteReport report, bool bytes) {
  const int64_t row = int64_t(blockIdx.x) * kGatherWarps + threadIdx.x / 32;
  // A schedule over capacity placed no rows (its row arrays hold another schedule's): nothing to gather.
  const int32_t total = *total_rows;
  if (total > capacity || row >= total) return;
  const int lane = threadIdx.x % 32;
  const int32_t slot = row_token_slot[row];
  const int64_t kb = blocks_of(cols);
  uint8_t* d = bytes ? dst + row * cols : nullptr;
  float* ds = dst_scales + row * kb;
  if (slot < 0) {
    for (int64_t c = lane; c < cols && bytes; c += 32) d[c] = 0;
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
  if (bytes) {
    const uint8_t* s = src + token * cols;
    if (cols % 16 == 0) {
      for (int64_t c = 16 * lane; c < cols; c += 16 * 32) {
        *reinterpret_cast<uint4*>(d + c) = remote::load(reinterpret_cast<const uint4*>(s + c));
      }
    } else {
      for (int64_t c = lane; c < cols; c += 32) d[c] = remote::load(s + c);
    }
  }
  for (int64_t b = lane; b < kb; b += 32) {
    const float scale = remote::load(src_scales + token * kb + b);
    ds[b] = scale;
    // A tile its source found not finite (a NaN scale): reported here too, naming the source rank, before
    // this rank's later quantisations meet the NaNs it spreads.
    if constexpr (kRemote) {
      if (!isfinite(scale)) {
        NonfiniteReport r = report;
        r.rank = source;
        report_nonfinite(r);
      }
    }
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

int grid_of(int64_t n) { return static_cast<int>(n); }

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

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

void quantize_blocks(const bf16_t* w, int64_t batch, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                     NonfiniteReport report, cudaStream_t stream) {
  const int64_t blocks = blocks_of(rows) * blocks_of(cols);
  if (blocks == 0 || batch == 0) return;
  if (batch > 65535) throw Error("batch", "at most 65535 matrices (the grid's y), got " + std::to_string(batch));
  const bool vector = cols % 8 == 0 && aligned(w, 16) && aligned(q, 8);
  quantize_blocks_kernel<<<dim3(unsigned(blocks), unsigned(batch)), kBlockThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(w), rows, cols, q, scales, report, vector);
  LYNX_CHECK_LAUNCH();
}

void quantize_blocks(const bf16_t* w, int64_t rows, int64_t cols, uint8_t* q, float* scales, int32_t* nonfinite,
                     cudaStream_t stream) {
  quantize_blocks(w, 1, rows, cols, q, scales, NonfiniteReport{nonfinite, nullptr, 0}, stream);
}

namespace {

template <bool kStraight = false, class Source>
void launch_blocks_transposed(const Source& src, int64_t n0, int64_t n1, int64_t batch, int64_t rows, uint8_t* q,
                              float* scales, NonfiniteReport report, cudaStream_t stream,
                              const NonfiniteReport* report1, StraightCopies straight = {}) {
  const int64_t blocks = blocks_of(rows) * blocks_of(n0 + n1);
  if (blocks == 0 || batch == 0) return;
  if (batch > 65535) throw Error("batch", "at most 65535 matrices (the grid's y), got " + std::to_string(batch));
  if (n1 > 0 && src.m1 == nullptr) throw Error("src1", "is null with n1 > 0");
  // Rows of 8-value multiples start aligned to 8 values where both sources do; likewise q's rows.
  constexpr uintptr_t kVector = 8 * sizeof(*src.m0);
  const bool vector = rows % 8 == 0 && aligned(src.m0, kVector) && aligned(src.m1, kVector);
  const bool vector_out = (n0 + n1) % 16 == 0 && aligned(q, 16);
  quantize_blocks_transposed_kernel<Source, kStraight><<<dim3(unsigned(blocks), unsigned(batch)), kBlockThreads, 0, stream>>>(
      src, n0, n1, rows, q, scales, report, report1 ? *report1 : report, vector, vector_out, straight);
  LYNX_CHECK_LAUNCH();
}

}  // namespace

void quantize_blocks_transposed(const bf16_t* src0, int64_t n0, const bf16_t* src1, int64_t n1, int64_t batch,
                                int64_t rows, uint8_t* q, float* scales, NonfiniteReport report, cudaStream_t stream,
                                const NonfiniteReport* report1) {
  const Bf16Source src{reinterpret_cast<const __nv_bfloat16*>(src0), nullptr,
                       reinterpret_cast<const __nv_bfloat16*>(src1), nullptr};
  launch_blocks_transposed(src, n0, n1, batch, rows, q, scales, report, stream, report1);
}

void quantize_blocks_and_transposed(const bf16_t* src0, int64_t n0, const bf16_t* src1, int64_t n1, int64_t batch,
                                    int64_t rows, uint8_t* q0, float* scales0, uint8_t* q1, float* scales1,
                                    uint8_t* qt, float* scales_t, NonfiniteReport report, cudaStream_t stream,
                                    const NonfiniteReport* report1) {
  if (n1 > 0 && n0 % kBlock != 0) {
    throw Error("n0", "must be a multiple of 128 with a second source (a block would straddle them), got " +
                          std::to_string(n0));
  }
  if (q0 == nullptr || scales0 == nullptr || (n1 > 0 && (q1 == nullptr || scales1 == nullptr))) {
    throw Error("q0", "each source's straight copy and scales must be given");
  }
  const Bf16Source src{reinterpret_cast<const __nv_bfloat16*>(src0), nullptr,
                       reinterpret_cast<const __nv_bfloat16*>(src1), nullptr};
  const StraightCopies straight{q0, scales0, q1, scales1, rows % 8 == 0 && aligned(q0, 8) && aligned(q1, 8)};
  launch_blocks_transposed<true>(src, n0, n1, batch, rows, qt, scales_t, report, stream, report1, straight);
}

void quantize_blocks_transposed_fp8(const uint8_t* src0, const float* scales0, int64_t n0, const uint8_t* src1,
                                    const float* scales1, int64_t n1, int64_t batch, int64_t rows, uint8_t* q,
                                    float* scales, NonfiniteReport report, cudaStream_t stream,
                                    const NonfiniteReport* report1) {
  if (n1 > 0 && scales1 == nullptr) throw Error("scales1", "is null with n1 > 0");
  launch_blocks_transposed(Fp8Source{src0, scales0, src1, scales1}, n0, n1, batch, rows, q, scales, report, stream,
                           report1);
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

void transpose_tiles(const bf16_t* x, int64_t capacity, int64_t cols, const int32_t* total_rows, uint8_t* q,
                     float* scales, NonfiniteReport report, cudaStream_t stream) {
  const Bf16Rows rows{reinterpret_cast<const __nv_bfloat16*>(x), cols % 4 == 0 && aligned(x, 8)};
  launch_transpose_tiles(rows, capacity, cols, total_rows, q, scales, report, stream);
}

void transpose_gathered_tiles(const uint8_t* src, const float* src_scales, const int32_t* row_token_slot,
                              const int32_t* total_rows, int64_t capacity, int64_t top_k, int64_t cols, uint8_t* q,
                              float* scales, NonfiniteReport report, cudaStream_t stream) {
  if (src == nullptr || src_scales == nullptr || row_token_slot == nullptr || top_k <= 0) {
    throw Error("src", "its scales, the row slots and a positive top_k are needed");
  }
  // Slots are int32s: a top_k of 2^31 or more puts every slot in token 0, as 2^31 does.
  const uint32_t k = uint32_t(std::min<int64_t>(top_k, int64_t(1) << 31));
  const GatheredTileRows rows{src, src_scales, row_token_slot, k, cols % 4 == 0 && aligned(src, 4)};
  launch_transpose_tiles(rows, capacity, cols, total_rows, q, scales, report, stream);
}

void gather_tiles(uint8_t* dst, float* dst_scales, const uint8_t* src, const float* src_scales,
                  const int32_t* row_token_slot, const int32_t* total_rows, int64_t capacity, int64_t top_k,
                  int64_t cols, cudaStream_t stream, const TileSources& sources, NonfiniteReport report) {
  if (capacity == 0 || cols == 0) return;
  if (sources.remote() && (sources.row_src_rank == nullptr || sources.tokens <= 0)) {
    throw Error("sources", "internal: remote tiles need the rows' source ranks and the ranks' token count");
  }
  const auto kernel = sources.remote() ? gather_tiles_kernel<true> : gather_tiles_kernel<false>;
  kernel<<<grid_of((capacity + kGatherWarps - 1) / kGatherWarps), kGatherWarps * 32, 0, stream>>>(
      dst, dst_scales, src, src_scales, row_token_slot, total_rows, capacity, top_k, cols, sources, report,
      dst != nullptr);
  LYNX_CHECK_LAUNCH();
}

void gather_tile_scales(float* dst_scales, const float* src_scales, const int32_t* row_token_slot,
                        const int32_t* total_rows, int64_t capacity, int64_t top_k, int64_t cols, cudaStream_t stream,
                        const TileSources& sources, NonfiniteReport report) {
  gather_tiles(nullptr, dst_scales, nullptr, src_scales, row_token_slot, total_rows, capacity, top_k, cols, stream,
               sources, report);
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

void load_quantize_kernels() { load_module_of(reinterpret_cast<const void*>(&dequantize_kernel)); }

}  // namespace lynx::fp8
