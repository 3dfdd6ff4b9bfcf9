// The SwiGLU backward of one pair of a row's columns, of an 8-element vector, the quantisation of a
// 1×128 tile of dg | du, and the order of a row's d_topk_weights sum: shared by the row kernel
// (glue.cu) and the dgrad of down's epilogue (fp8/gemm/swiglu_backward_epilogue.cuh), so that both
// give the same bits.
#pragma once

#include <cstdint>

#include "device/activation.cuh"
#include "kernels/fp8/e4m3.cuh"
#include "kernels/glue/api.h"
#include "kernels/glue/vec8.cuh"

namespace lynx::glue {

// From da, g and u of two adjacent columns and the row's router weight w: dg, du and hw = w·silu(g)⊙u
// (api.h, swiglu_backward) in fp32, to be rounded to bf16, and the pair's term of d_topk_weights,
// da·silu(g)·u summed over the two.
// NOTES: every rounding spelled out (no contraction left to the compiler), so that the GEMM's epilogue
// and the row kernel, compiled apart, give the same bits.
struct SwigluPair {
  float2 dg, du, hw;
  float dot;
};
__device__ __forceinline__ SwigluPair swiglu_backward_pair(float2 a, float2 g, float2 u, float w) {
  const float sx = sigmoid(g.x), sy = sigmoid(g.y);
  const float silx = __fmul_rn(g.x, sx), sily = __fmul_rn(g.y, sy);
  const float dhx = __fmul_rn(w, a.x), dhy = __fmul_rn(w, a.y);
  SwigluPair s;
  s.dot = __fadd_rn(__fmul_rn(__fmul_rn(a.x, silx), u.x), __fmul_rn(__fmul_rn(a.y, sily), u.y));
  s.dg = make_float2(__fmul_rn(__fmul_rn(__fmul_rn(dhx, u.x), sx), __fmaf_rn(g.x, __fsub_rn(1.0f, sx), 1.0f)),
                     __fmul_rn(__fmul_rn(__fmul_rn(dhy, u.y), sy), __fmaf_rn(g.y, __fsub_rn(1.0f, sy), 1.0f)));
  s.du = make_float2(__fmul_rn(dhx, silx), __fmul_rn(dhy, sily));
  s.hw = make_float2(__fmul_rn(__fmul_rn(w, silx), u.x), __fmul_rn(__fmul_rn(w, sily), u.y));
  return s;
}

// The same over a vector of 8 columns: dg, du and hw as bf16, and each pair's term of d_topk_weights.
__device__ __forceinline__ void swiglu_backward_vector(const Vec8& da, const Vec8& g, const Vec8& u, float w,
                                                       float (&dots)[4], Vec8& dgv, Vec8& duv, Vec8& hwv) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const SwigluPair s = swiglu_backward_pair(da.pair(p), g.pair(p), u.pair(p), w);
    dots[p] = s.dot;
    dgv.set_pair(p, s.dg.x, s.dg.y);
    duv.set_pair(p, s.du.x, s.du.y);
    hwv.set_pair(p, s.hw.x, s.hw.y);
  }
}

// NOTES: a row's d_topk_weights = Σ da·silu(g)·u over its columns, summed in this order, whatever
// computes it: per 128-column chunk, term(j, p) of pair p (columns 8j + 2p, + 1) of vector j in [0, 16)
// of the chunk; s_p = the balanced tree over j ((t0 + t1) + (t2 + t3)) + ... (a shuffle butterfly over
// 16 lanes gives it, as does a tree over registers); the chunk's sum (s0 + s1) + (s2 + s3); then the
// chunks' sums added in order to 0. The row kernel holds a vector a lane, the dgrad of down's epilogue
// a pair of each vector a thread (four threads a row): both make every step's sums alike (fp32 addition
// commutes). A partial last chunk counts zeros for the columns it lacks.
__device__ __forceinline__ float chunk_sum(float s0, float s1, float s2, float s3) {
  return __fadd_rn(__fadd_rn(s0, s1), __fadd_rn(s2, s3));
}

// The 1×128 tile of dg | du that a half-warp holds, one Vec8 a lane (vector v of the row's 2·width / 8,
// v % 16 == j for lane 16h + j), quantised into codes' row `row` (QuantizedDgu, every lane of the
// half-warp calling).
__device__ __forceinline__ void store_dgu_codes(const QuantizedDgu& codes, int64_t vecs_per_row, int64_t row,
                                                int64_t v, const Vec8& value, int lane) {
  const fp8::e4m3::TileLane tile = fp8::e4m3::quantize_tile_lane({value.bits}, 0xFFFFu << (lane & 16));
  const bool first = v % 16 == 0;  // the tile's first lane
  if (!tile.finite && first) fp8::e4m3::report_nonfinite(codes.report);
  *reinterpret_cast<uint2*>(codes.q + (row * vecs_per_row + v) * 8) = tile.codes;
  if (first) codes.scales[row * (vecs_per_row / 16) + v / 16] = fp8::e4m3::scale_or_nan(tile.e, tile.finite);
}

}  // namespace lynx::glue
