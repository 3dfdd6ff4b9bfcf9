// The CPU reference of the FP8 recipe (docs/fp8.md; the DeepSeek-V3 recipe): E4M3 values with
// one fp32 scale per 1×128 tile of an activation row and per 128×128 block of a weight, and the GEMM
// whose per-128-K partial products are promoted to fp32 with both scales. The GPU's quantisation
// kernels are to equal quantize_tiles / quantize_blocks bit for bit; its FP8 GEMMs are checked
// against fp8_gemm within a tolerance (a tensor core's FP8 sums are not reproducible on the CPU).
//
// Scales are powers of two: the smallest 2^e with amax <= 448 · 2^e (448: E4M3's largest finite
// value). NOTES: why. Multiplying by a power of two is exact, so x / scale and q · scale round
// nowhere but in the E4M3 conversion itself, and the GPU and this reference agree bit for bit with no
// care for division or fused multiply-adds. The cost is range: the largest |q| of a tile lies in
// [224, 448] instead of at 448, and no precision is lost for values in E4M3's normal range, whose
// relative spacing (2^-3) does not depend on the scale.
#pragma once

#include <cstdint>
#include <vector>

namespace lynx::ref::fp8 {

constexpr float kE4M3Max = 448.0f;
constexpr int64_t kBlock = 128;  // the tile width and the weight block's side
// The RMS relative error of a quantised value, taken as half a spacing (2^-4 of the value) spread
// evenly, 2^-4/√3; and of a product of two quantised factors, whose errors are independent: √2 times it.
constexpr double kE4M3RmsError = 0.0625 / 1.7320508075688772;
constexpr double kQuantisedProductRmsError = 1.4142135623730951 * kE4M3RmsError;

// E4M3 ("fn": no infinities; 0x7F / 0xFF are NaN), round to nearest, ties to even, saturating: a
// finite value beyond ±448 becomes ±448. NaN (and ±inf) become NaN (0x7F, sign kept).
uint8_t to_e4m3(float x);
float from_e4m3(uint8_t q);

// The scale of a tile or block whose largest magnitude is `amax` (finite, >= 0): 1 for 0.
float pow2_scale(float amax);

// A quantised tensor: q[r][c] = to_e4m3(x[r][c] / scale of its tile or block).
struct Quantized {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> q;      // [rows, cols]
  std::vector<float> scales;   // [rows, ceil(cols / 128)] (tiles) or [ceil(rows / 128), ceil(cols / 128)] (blocks)
  bool finite = true;          // false when the input held a NaN or an infinity (q and scales then unspecified)

  float dequant(int64_t r, int64_t c, bool blocks) const;
};

// Activations: one scale per 1×128 tile of each row (the last tile of a row may be shorter: its
// missing columns count as zeros).
Quantized quantize_tiles(const float* x, int64_t rows, int64_t cols);

// Weights: one scale per 128×128 block (edge blocks may be smaller).
Quantized quantize_blocks(const float* w, int64_t rows, int64_t cols);

// out[m][n] = Σ_kb (Σ_{k in block kb} a.q[m][k] · b.q[n][k]) · a.scale[m][kb] · b.scale[n/128][kb]
// (b.scale[n][kb] with b_tiles),
// in double: a is [M, K] in tiles, b is [N, K] in blocks (the nn.Linear "out × in" layout), or in
// tiles too with `b_tiles` (scale b.scale[n][kb]: the weight-gradient GEMM's operands).
std::vector<double> fp8_gemm(const Quantized& a, const Quantized& b, bool b_tiles = false);

// 1 − 2⟨a,b⟩ / (|a|² + |b|²): 0 for equal tensors, the yardstick of the FP8 path's accuracy.
double dissimilarity(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace lynx::ref::fp8
