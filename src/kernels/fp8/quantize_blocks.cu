// The 128×128 block kernels (api.h: quantize_blocks, quantize_blocks_transposed and their forms): a
// block is one CTA of 8 warps, a half-warp reading a 128-element row (8 values a lane), the codes of a
// transposed block written back through shared memory, 16 bytes a store.
#include <cuda_bf16.h>

#include <string>
#include <type_traits>

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
    quantize_blocks_kernel(const __nv_bfloat16* __restrict__ w, int64_t w_stride, int64_t rows, int64_t cols,
                           uint8_t* __restrict__ q, float* __restrict__ scales, NonfiniteReport report, bool vector) {
  __shared__ uint32_t warp_max[1][kBlockWarps];
  const int64_t kb = blocks_of(cols);
  const int64_t matrix = blockIdx.y;
  w += matrix * w_stride;
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
// 128×128 block (value · scale; no scales for bf16); stride0, stride1: elements from one matrix of the
// batch to the next.
template <class T>
struct BlockSource {
  const T* m0;
  const float* scales0;
  const T* m1;
  const float* scales1;
  int64_t stride0 = 0, stride1 = 0;
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
        v[i].code = load8_codes((second ? src.m1 : src.m0) + matrix * (second ? src.stride1 : src.stride0) + at * rows,
                                r, rows, vector);
        v[i].scale = s[(matrix * blocks_of(n) + at / kBlock) * blocks_of(rows) + r0 / kBlock];
      }
    } else {
      v[i].bits = c < cols ? load8_bits((second ? src.m1 : src.m0) + matrix * (second ? src.stride1 : src.stride0) +
                                            at * rows,
                                        r, rows, vector)
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


}  // namespace

void quantize_blocks(const bf16_t* w, int64_t batch, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                     NonfiniteReport report, cudaStream_t stream, int64_t batch_stride) {
  const int64_t blocks = blocks_of(rows) * blocks_of(cols);
  if (blocks == 0 || batch == 0) return;
  if (batch > 65535) throw Error("batch", "at most 65535 matrices (the grid's y), got " + std::to_string(batch));
  const int64_t stride = batch_stride > 0 ? batch_stride : rows * cols;
  const bool vector = cols % 8 == 0 && stride % 8 == 0 && aligned(w, 16) && aligned(q, 8);
  quantize_blocks_kernel<<<dim3(unsigned(blocks), unsigned(batch)), kBlockThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(w), stride, rows, cols, q, scales, report, vector);
  LYNX_CHECK_LAUNCH();
}

void quantize_blocks(const bf16_t* w, int64_t rows, int64_t cols, uint8_t* q, float* scales, int32_t* nonfinite,
                     cudaStream_t stream) {
  quantize_blocks(w, 1, rows, cols, q, scales, NonfiniteReport{nonfinite, nullptr, 0}, stream);
}

namespace {

// src's strides: the given ones, 0 meaning its matrices one after another.
template <bool kStraight = false, class Source>
void launch_blocks_transposed(Source src, int64_t n0, int64_t n1, int64_t batch, int64_t rows, uint8_t* q,
                              float* scales, NonfiniteReport report, cudaStream_t stream,
                              const NonfiniteReport* report1, StraightCopies straight = {}) {
  const int64_t blocks = blocks_of(rows) * blocks_of(n0 + n1);
  if (blocks == 0 || batch == 0) return;
  if (batch > 65535) throw Error("batch", "at most 65535 matrices (the grid's y), got " + std::to_string(batch));
  if (n1 > 0 && src.m1 == nullptr) throw Error("src1", "is null with n1 > 0");
  if (src.stride0 <= 0) src.stride0 = n0 * rows;
  if (src.stride1 <= 0) src.stride1 = n1 * rows;
  // Rows of 8-value multiples start aligned to 8 values where both sources' matrices do; likewise q's rows.
  constexpr uintptr_t kVector = 8 * sizeof(*src.m0);
  const bool vector = rows % 8 == 0 && src.stride0 % 8 == 0 && src.stride1 % 8 == 0 && aligned(src.m0, kVector) &&
                      aligned(src.m1, kVector);
  const bool vector_out = (n0 + n1) % 16 == 0 && aligned(q, 16);
  quantize_blocks_transposed_kernel<Source, kStraight><<<dim3(unsigned(blocks), unsigned(batch)), kBlockThreads, 0, stream>>>(
      src, n0, n1, rows, q, scales, report, report1 ? *report1 : report, vector, vector_out, straight);
  LYNX_CHECK_LAUNCH();
}

}  // namespace

void quantize_blocks_transposed(const bf16_t* src0, int64_t n0, const bf16_t* src1, int64_t n1, int64_t batch,
                                int64_t rows, uint8_t* q, float* scales, NonfiniteReport report, cudaStream_t stream,
                                const NonfiniteReport* report1, BatchStrides strides) {
  const Bf16Source src{reinterpret_cast<const __nv_bfloat16*>(src0), nullptr,
                       reinterpret_cast<const __nv_bfloat16*>(src1), nullptr, strides.src0, strides.src1};
  launch_blocks_transposed(src, n0, n1, batch, rows, q, scales, report, stream, report1);
}

void quantize_blocks_and_transposed(const bf16_t* src0, int64_t n0, const bf16_t* src1, int64_t n1, int64_t batch,
                                    int64_t rows, uint8_t* q0, float* scales0, uint8_t* q1, float* scales1,
                                    uint8_t* qt, float* scales_t, NonfiniteReport report, cudaStream_t stream,
                                    const NonfiniteReport* report1, BatchStrides strides) {
  if (n1 > 0 && n0 % kBlock != 0) {
    throw Error("n0", "must be a multiple of 128 with a second source (a block would straddle them), got " +
                          std::to_string(n0));
  }
  if (q0 == nullptr || scales0 == nullptr || (n1 > 0 && (q1 == nullptr || scales1 == nullptr))) {
    throw Error("q0", "each source's straight copy and scales must be given");
  }
  const Bf16Source src{reinterpret_cast<const __nv_bfloat16*>(src0), nullptr,
                       reinterpret_cast<const __nv_bfloat16*>(src1), nullptr, strides.src0, strides.src1};
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

void load_quantize_blocks_module() { load_module_of(reinterpret_cast<const void*>(&quantize_blocks_kernel)); }

}  // namespace lynx::fp8
