#include "dense_gemm.h"

#include <cublas_v2.h>

#include "random_fill.h"
#include "timing.h"
#include "kernels/cublas/api.h"

namespace lynx::bench {

DenseRate dense_gemm_rate(int n, const Protocol& p, const GpuClock* clock) {
  const size_t elems = size_t(n) * n;
  uint16_t *a = nullptr, *b = nullptr, *c = nullptr;
  LYNX_CUDA(cudaMalloc(reinterpret_cast<void**>(&a), elems * 2));
  LYNX_CUDA(cudaMalloc(reinterpret_cast<void**>(&b), elems * 2));
  LYNX_CUDA(cudaMalloc(reinterpret_cast<void**>(&c), elems * 2));
  fill_uniform_bf16(a, int64_t(elems), 101, 1.0f, nullptr);
  fill_uniform_bf16(b, int64_t(elems), 102, 1.0f, nullptr);
  cublasHandle_t handle;
  LYNX_CUBLAS(cublasCreate(&handle));
  const blas::Gemm g{false, true, n, n, n, a, n, b, n, c, n};
  const Timing t = time_pass([&] { blas::gemm(handle, g, false, nullptr); }, p, nullptr, clock);
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return {2.0 * double(n) * n * n / (t.ms * 1e-3) / 1e12, t.clocks};
}

}  // namespace lynx::bench
