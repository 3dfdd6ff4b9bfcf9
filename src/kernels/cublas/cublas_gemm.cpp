#include <string>

#include "common/cuda_check.h"
#include "kernels/cublas/api.h"

namespace lynx::blas {
namespace {

// NOTES: cuBLAS is column-major. A row-major X[r, c] is the column-major Xᵀ, so the row-major
// C = op(A)·op(B) is computed as the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands, keep each
// operand's transpose flag, and swap m and n.
cublasOperation_t op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

void check_beta(float beta) {
  if (beta != 0.0f && beta != 1.0f) throw Error("", "internal: GEMM beta must be 0 or 1, got " + std::to_string(beta));
}

// C = beta · C for a product with k == 0.
void empty_k(const Gemm& g, bool c_fp32, cudaStream_t stream) {
  if (g.beta == 1.0f) return;
  const size_t elem = c_fp32 ? 4 : 2;
  LYNX_CUDA(cudaMemset2DAsync(g.c, size_t(g.ldc) * elem, 0, size_t(g.n) * elem, size_t(g.m), stream));
}

// One product as cuBLAS is given it (k > 0).
void issue(cublasHandle_t handle, const Gemm& g, bool c_fp32) {
  const float alpha = 1.0f;
  LYNX_CUBLAS(cublasGemmEx(handle, op(g.trans_b), op(g.trans_a), g.n, g.m, g.k, &alpha, g.b, CUDA_R_16BF, g.ldb, g.a,
                           CUDA_R_16BF, g.lda, &g.beta, g.c, c_fp32 ? CUDA_R_32F : CUDA_R_16BF, g.ldc,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void gemm(cublasHandle_t handle, const Gemm& g, bool c_fp32, cudaStream_t stream) {
  check_beta(g.beta);
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) return empty_k(g, c_fp32, stream);
  LYNX_CUBLAS(cublasSetStream(handle, stream));
  const KParts parts = split_k_tail(g);
  if (parts.body.k > 0) issue(handle, parts.body, c_fp32);
  if (parts.tail.k > 0) issue(handle, parts.tail, c_fp32);
}

GroupedGemm::GroupedGemm(int64_t parts) : capacity_(parts) {
  LYNX_CUDA(cudaMallocHost(reinterpret_cast<void**>(&host_), sizeof(void*) * 3 * capacity_));
  LYNX_CUDA(cudaMalloc(reinterpret_cast<void**>(&device_), sizeof(void*) * 3 * capacity_));
}

GroupedGemm::~GroupedGemm() {
  cudaFreeHost(host_);
  cudaFree(device_);
}

Batch batch_of(const std::vector<Gemm>& products) {
  Batch b;
  double flops = 0;
  for (const Gemm& g : products) {
    if (g.m == 0 || g.n == 0 || g.k == 0) continue;
    ++b.products;
    flops += 2.0 * g.m * g.n * g.k;
  }
  b.mean_flops = b.products > 0 ? flops / double(b.products) : 0.0;
  return b;
}

void GroupedGemm::run(cublasHandle_t handle, const std::vector<Gemm>& products, bool c_fp32, bool grouped,
                      cudaStream_t stream) {
  std::vector<const Gemm*> live;
  for (const Gemm& g : products) {
    check_beta(g.beta);
    if (g.m == 0 || g.n == 0) continue;
    if (g.k == 0) {
      empty_k(g, c_fp32, stream);
      continue;
    }
    live.push_back(&g);
  }
  if (live.empty()) return;
  if (!grouped) {
    for (const Gemm* g : live) gemm(handle, *g, c_fp32, stream);
    return;
  }
  std::vector<Gemm> bodies, tails;
  for (const Gemm* g : live) {
    const KParts parts = split_k_tail(*g);
    if (parts.body.k > 0) bodies.push_back(parts.body);
    if (parts.tail.k > 0) tails.push_back(parts.tail);
  }
  issue_grouped(handle, bodies, c_fp32, stream);
  issue_grouped(handle, tails, c_fp32, stream);
}

void GroupedGemm::issue_grouped(cublasHandle_t handle, const std::vector<Gemm>& products, bool c_fp32,
                                cudaStream_t stream) {
  const int64_t count = static_cast<int64_t>(products.size());
  if (count == 0) return;
  if (count > capacity_) {
    throw Error("", "internal: " + std::to_string(count) + " grouped products exceed the pool of " +
                        std::to_string(capacity_));
  }
  if (cursor_ + count > capacity_) {
    // The pool is recycled only once every earlier grouped call has read its pointers.
    LYNX_CUDA(cudaStreamSynchronize(stream));
    cursor_ = 0;
  }
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size(count, 1);
  std::vector<float> alpha(count, 1.0f), beta;
  const int64_t first = cursor_;
  for (const Gemm& g : products) {
    // Swapped operands, as in issue(): cuBLAS's A is our B.
    host_[cursor_] = g.b;
    host_[capacity_ + cursor_] = g.a;
    host_[2 * capacity_ + cursor_] = g.c;
    ++cursor_;
    ta.push_back(op(g.trans_b));
    tb.push_back(op(g.trans_a));
    m.push_back(g.n);
    n.push_back(g.m);
    k.push_back(g.k);
    lda.push_back(g.ldb);
    ldb.push_back(g.lda);
    ldc.push_back(g.ldc);
    beta.push_back(g.beta);
  }
  for (int operand = 0; operand < 3; ++operand) {
    const int64_t at = operand * capacity_ + first;
    LYNX_CUDA(cudaMemcpyAsync(device_ + at, host_ + at, sizeof(void*) * count, cudaMemcpyHostToDevice, stream));
  }
  LYNX_CUBLAS(cublasSetStream(handle, stream));
  LYNX_CUBLAS(cublasGemmGroupedBatchedEx(
      handle, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), device_ + first, CUDA_R_16BF, lda.data(),
      device_ + capacity_ + first, CUDA_R_16BF, ldb.data(), beta.data(),
      const_cast<void* const*>(device_ + 2 * capacity_ + first), c_fp32 ? CUDA_R_32F : CUDA_R_16BF, ldc.data(),
      static_cast<int>(count), group_size.data(), CUBLAS_COMPUTE_32F));
}

}  // namespace lynx::blas
