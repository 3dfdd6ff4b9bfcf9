// The dense bf16 GEMM rate of this GPU, measured in the same run as the layer.
#pragma once

namespace lynx::bench {

// Median TFLOP/s of an n×n×n bf16 cuBLAS product (fp32 accumulation) on random data.
double dense_gemm_tflops(int n, int warmup, int iters);

}  // namespace lynx::bench
