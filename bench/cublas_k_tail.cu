// lynx-cublas-k-tail: cuBLAS's bf16 products in the weight gradients' form (row-major C[m, n] = Aᵀ·B,
// A [K, m], B [K, n], fp32 accumulation, bf16 C) against an fp64 reference at K = base + 0..7, as
// cuBLAS is called alone (fix=0), cut at K − K % 8 with the tail added by a second product (fix=1,
// what src/kernels/cublas does), and with no workspace (fix=2); layout=1 is C = A·B with A [m, K].
// A row marked WRONG is off by more than the bf16 rounding (5e-3). Its output:
// bench/results/2026-12-06-h100-205e984-cublas-k-tail-log.txt, section 3.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <library_types.h>
#include <cstdio>
#include <cmath>
#include <random>
#include <vector>
#define CK(x) do { auto e = (x); if (e != 0) { std::printf("error %d at %s:%d\n", int(e), __FILE__, __LINE__); std::exit(1);} } while (0)
int main() {
  cublasHandle_t h; CK(cublasCreate(&h));
  int v = 0; CK(cublasGetVersion(h, &v)); std::printf("cuBLAS version %d\n", v);
  std::mt19937 rng(1); std::normal_distribution<float> nd;
  const int shapes[][2] = {{64, 320}, {128, 512}};
  const int bases[] = {5632, 8192};
  for (int layout = 0; layout < 2; ++layout)   // 0: C = Aᵀ B (A [K,m], B [K,n]); 1: C = A B (A [m,K], B [K,n])
  for (int fix = 0; fix < 3; ++fix) {          // 0 none, 1 split K8 + tail, 2 no workspace
    if (layout == 1 && fix > 0) continue;
    if (fix == 2) CK(cublasSetWorkspace(h, nullptr, 0));
    for (auto& s : shapes) for (int base : bases) for (int r = 0; r < 8; ++r) {
      const int m = s[0], n = s[1], K = base + r;
      std::vector<__nv_bfloat16> A(size_t(K) * m), B(size_t(K) * n), C(size_t(m) * n);
      std::vector<double> a(A.size()), b(B.size());
      for (size_t i = 0; i < A.size(); ++i) { A[i] = __float2bfloat16(nd(rng)); a[i] = __bfloat162float(A[i]); }
      for (size_t i = 0; i < B.size(); ++i) { B[i] = __float2bfloat16(nd(rng)); b[i] = __bfloat162float(B[i]); }
      __nv_bfloat16 *dA, *dB, *dC;
      CK(cudaMalloc(&dA, A.size() * 2)); CK(cudaMalloc(&dB, B.size() * 2)); CK(cudaMalloc(&dC, C.size() * 2));
      CK(cudaMemcpy(dA, A.data(), A.size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dB, B.data(), B.size() * 2, cudaMemcpyHostToDevice));
      const float alpha = 1, zero = 0, one = 1;
      const auto run = [&](int k0, int k, const float* beta) {
        if (layout == 0)
          CK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, n, m, k, &alpha, dB + size_t(k0) * n, CUDA_R_16BF, n, dA + size_t(k0) * m,
                          CUDA_R_16BF, m, beta, dC, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        else  // row-major A [m, K] (lda K): col-major Aᶜ [K, m]; C = A·B -> Cᵀ[n,m] = Bᶜ[n,K]·Aᶜ[K,m]
          CK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &alpha, dB + size_t(k0) * n, CUDA_R_16BF, n, dA + k0,
                          CUDA_R_16BF, K, beta, dC, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      if (fix == 1 && K % 8) { run(0, K - K % 8, &zero); run(K - K % 8, K % 8, &one); } else run(0, K, &zero);
      CK(cudaMemcpy(C.data(), dC, C.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<double> ref(size_t(m) * n, 0.0);
      for (int t = 0; t < K; ++t) for (int i = 0; i < m; ++i) {
        const double ai = layout == 0 ? a[size_t(t) * m + i] : a[size_t(i) * K + t];
        const double* bt = &b[size_t(t) * n]; double* rr = &ref[size_t(i) * n];
        for (int j = 0; j < n; ++j) rr[j] += ai * bt[j];
      }
      double num = 0, den = 0;
      for (size_t q = 0; q < ref.size(); ++q) { const double g = __bfloat162float(C[q]); num += (g - ref[q]) * (g - ref[q]); den += ref[q] * ref[q]; }
      const double e = std::sqrt(num / den);
      std::printf("layout=%d fix=%d m=%d n=%d K=%d (K%%8=%d): error %.2e%s\n", layout, fix, m, n, K, r, e, e > 5e-3 ? "  <-- WRONG" : "");
      cudaFree(dA); cudaFree(dB); cudaFree(dC);
    }
  }
  return 0;
}
