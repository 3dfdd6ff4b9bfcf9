// The SwiGLU backward of one 8-element vector of a row, and the quantisation of a 1×128 tile of
// dg | du: shared by the row kernel (glue.cu) and the block kernel of the FP8 weight gradients
// (swiglu_backward_fp8.cu), so that both give the same bits.
#pragma once

#include <cstdint>

#include "device/activation.cuh"
#include "kernels/fp8/e4m3.cuh"
#include "kernels/glue/api.h"
#include "kernels/glue/vec8.cuh"

namespace lynx::glue {

// From da, g and u (a vector of each) and the row's router weight w: dg, du and hw = w·silu(g)⊙u as
// bf16 (api.h, swiglu_backward), and da·silu(g)·u added to `dot` pair by pair, in order.
__device__ __forceinline__ void swiglu_backward_vector(const Vec8& da, const Vec8& g, const Vec8& u, float w,
                                                       float& dot, Vec8& dgv, Vec8& duv, Vec8& hwv) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float2 a = da.pair(p), gf = g.pair(p), uf = u.pair(p);
    const float sx = sigmoid(gf.x), sy = sigmoid(gf.y);
    const float silx = gf.x * sx, sily = gf.y * sy;
    dot += a.x * silx * uf.x + a.y * sily * uf.y;
    const float dhx = w * a.x, dhy = w * a.y;
    dgv.set_pair(p, dhx * uf.x * sx * (1.0f + gf.x * (1.0f - sx)), dhy * uf.y * sy * (1.0f + gf.y * (1.0f - sy)));
    duv.set_pair(p, dhx * silx, dhy * sily);
    hwv.set_pair(p, w * silx * uf.x, w * sily * uf.y);
  }
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
