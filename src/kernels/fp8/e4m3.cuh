// The E4M3 codes and power-of-two scales of the block-scaled recipe (api.h), on the device: what the
// quantisation kernels (quantize_tiles.cu, quantize_blocks.cu, transpose_tiles.cu, tile_rows.cu) and
// the gate/up GEMM's quantising epilogue (gemm/epilogue.cuh) share, so that both give
// src/reference/fp8.h's bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/status.h"
#include "kernels/fp8/api.h"
#include "kernels/fp8/scale_exponent.h"

namespace lynx::fp8::e4m3 {

// 2^e as a float, for e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __uint_as_float(uint32_t(e + 127) << 23); }

// The exponent e of the smallest power of two 2^e with amax <= 448 · 2^e, at least -126 (reference:
// pow2_scale); 0 for amax = 0. With amax = m · 2^p, m in [0.5, 1) (frexp), 448 = 0.875 · 2^9: e = p - 9
// when m <= 0.875, else p - 8. amax is finite here (a tile with a NaN or an infinity is reported).
__device__ __forceinline__ int scale_exponent(float amax) {
  if (!(amax > 0.0f)) return 0;
  const uint32_t bits = __float_as_uint(amax);
  const int biased = int(bits >> 23) & 0xFF;
  if (biased == 0) return kMinScaleExponent;  // subnormal: e far below -126
  const int p = biased - 126;
  const bool low = (bits & 0x7FFFFF) <= 0x600000;  // m <= 0.875, i.e. 1 + fraction <= 1.75
  const int e = low ? p - 9 : p - 8;
  return e < kMinScaleExponent ? kMinScaleExponent : e;
}

// The scale of a tile or block with exponent e: 2^e, or NaN where it is not finite, so that whatever
// reads it is NaN, never finite and wrong (E4M3 saturates an infinity to 448).
__device__ __forceinline__ float scale_or_nan(int e, bool finite) {
  return finite ? pow2(e) : __int_as_float(0x7fc00000);
}

// Round to nearest even, saturating to ±448 (cvt.rn.satfinite.e4m3x2.f32).
__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Two values at once, the first in the low byte: the same instruction as to_e4m3, which converts a pair
// with a zero.
__device__ __forceinline__ uint16_t to_e4m3x2(float first, float second) {
  return __nv_cvt_float2_to_fp8x2(make_float2(first, second), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float from_e4m3(uint8_t q) {
  __nv_fp8_e4m3 f;
  f.__x = q;
  return static_cast<float>(f);
}

// The values of two codes, the low byte's first (from_e4m3's conversion, also made in pairs).
__device__ __forceinline__ float2 from_e4m3x2(uint16_t q) {
  __nv_fp8x2_e4m3 f;
  f.__x = q;
  return static_cast<float2>(f);
}

// A bf16 value's magnitude bits: b & kMagnitudeBits orders as |value| does, as an unsigned integer,
// with infinity 0x7F80 and the NaNs above it.
constexpr uint32_t kMagnitudeBits = 0x7FFFu;

// A magnitude as its fp32 bits: |v|'s bits order as |v| does, as unsigned integers, with infinity
// kInfFloatBits and the NaNs above it.
constexpr uint32_t kInfFloatBits = 0x7F800000u;

// E4M3(v · inv) of a word's two bf16 values (bits), the first (low half) in the low byte.
__device__ __forceinline__ uint32_t pack2_bits(uint32_t word, float inv) {
  return to_e4m3x2(__uint_as_float(word << 16) * inv, __uint_as_float(word & 0xFFFF0000u) * inv);
}

// A tile's largest magnitude from its values' bf16 bits b: b & kMagnitudeBits orders as |value| does,
// as an unsigned integer, with infinity kInfBits and the NaNs above it, so the largest of a tile's is
// amax's bits where the tile is finite (amax_of_bits: the value fmaxf over the values gives), and at
// least kInfBits where it holds a NaN or an infinity.
constexpr uint32_t kInfBits = 0x7F80u;
__device__ __forceinline__ float amax_of_bits(uint32_t bits) { return __uint_as_float(bits << 16); }

// E4M3(v · inv) of four values, packed with the first in the lowest byte.
__device__ __forceinline__ uint32_t pack4(const float (&v)[4], float inv) {
  return uint32_t(to_e4m3x2(v[0] * inv, v[1] * inv)) | uint32_t(to_e4m3x2(v[2] * inv, v[3] * inv)) << 16;
}

// A column c of a [128 rows, 128] bf16 block in shared memory (transpose_tiles' staged block; a step of
// the one-pass SwiGLU backward), quantised as one 128-row tile: its largest magnitude as bf16 bits
// (above), then, with inv = 2^-e of its scale, its codes, rows 16q .. 16q + 15 in codes[q], the first in
// the lowest byte.
using ColumnBlock = const __nv_bfloat16 (*)[kBlock];
__device__ __forceinline__ uint32_t column_magnitude_bits(ColumnBlock block, int c) {
  uint32_t m = 0;
  for (int r = 0; r < int(kBlock); ++r) m = max(m, __bfloat16_as_ushort(block[r][c]) & kMagnitudeBits);
  return m;
}
__device__ __forceinline__ void column_codes(ColumnBlock block, int c, float inv, uint4 (&codes)[kBlock / 16]) {
#pragma unroll
  for (int q = 0; q < int(kBlock) / 16; ++q) {
    uint32_t word[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = __bfloat162float(block[16 * q + 4 * w + i][c]);
      word[w] = pack4(v, inv);
    }
    codes[q] = make_uint4(word[0], word[1], word[2], word[3]);
    // NOTES: keeps the loads of later rows after this group's (no shared memory access crosses it):
    // hoisted all ahead, the pairwise conversions' codes held 128 registers a thread, against 80 without.
    __syncwarp();
  }
}

// Eight adjacent bf16 values of a row as their bits, the first in the low half of .x.
struct Bf16x8 {
  uint4 bits;

  // The largest magnitude's fp32 bits (kInfFloatBits or above where a value is not finite).
  __device__ __forceinline__ uint32_t magnitude() const {
    constexpr uint32_t kPair = kMagnitudeBits << 16 | kMagnitudeBits;
    const uint32_t m2 = __vmaxu2(__vmaxu2(bits.x & kPair, bits.y & kPair), __vmaxu2(bits.z & kPair, bits.w & kPair));
    return max(m2 & 0xFFFFu, m2 >> 16) << 16;
  }

  // E4M3(v · inv) of the eight, the first in the lowest byte.
  __device__ __forceinline__ uint2 codes(float inv) const {
    return make_uint2(pack2_bits(bits.x, inv) | pack2_bits(bits.y, inv) << 16,
                      pack2_bits(bits.z, inv) | pack2_bits(bits.w, inv) << 16);
  }
};

// A lane's part of a 1×128 tile that a half-warp holds, eight values a lane (lane 16h + j: columns 8j
// .. 8j + 7; zeros past the row's end), quantised: the tile's largest magnitude taken on the bf16 bits
// over the half-warp, its scale's exponent (0 where it is not finite) and the lane's eight codes.
// `mask`: the lanes that call, whole half-warps (the shuffles stay within a half).
struct TileLane {
  uint2 codes;
  int e;
  bool finite;
};
__device__ __forceinline__ TileLane quantize_tile_lane(const Bf16x8& v, uint32_t mask) {
  uint32_t m = v.magnitude();
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(mask, m, o));
  const bool finite = m < kInfFloatBits;
  const int e = finite ? scale_exponent(__uint_as_float(m)) : 0;
  return {v.codes(pow2(-e)), e, finite};  // x · 2^-e is exact: a code rounds only in the conversion
}

// NOTES: the first error wins the status word (common/status.h); the flag is the kernels' own report.
__device__ __forceinline__ void report_nonfinite(const NonfiniteReport& r) {
  if (r.flag != nullptr) atomicOr(r.flag, 1);
  if (r.status != nullptr &&
      atomicCAS(&r.status->code, int32_t(StatusCode::kOk), int32_t(StatusCode::kNonFiniteInput)) ==
          int32_t(StatusCode::kOk)) {
    r.status->a = r.what;
    r.status->rank = r.rank;
  }
}

}  // namespace lynx::fp8::e4m3
