// Row-major bf16 GEMMs through cuBLAS: one dense product, or many independent ones in a single
// grouped call (cublasGemmGroupedBatchedEx), all with fp32 accumulation.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/cublas/products.h"

namespace lynx::blas {

// One product, issued as split_k_tail cuts it (products.h).
void gemm(cublasHandle_t handle, const Gemm& g, bool c_fp32, cudaStream_t stream);

// The products of a batch that run() issues (m, n and k non-zero), and their mean FLOPs.
struct Batch {
  int64_t products = 0;
  double mean_flops = 0;
};
Batch batch_of(const std::vector<Gemm>& products);

// Runs many products of the same C dtype: one or two cublasGemmEx each (body, tail), or (`grouped`)
// one cublasGemmGroupedBatchedEx call for the bodies and one for the tails (plan/gemm_strategy.h
// chooses). The device array of operand pointers comes from a pool recycled by begin_pass(), to be
// called only where every grouped call issued before has finished (the unfused path calls it right
// after its stream synchronisation); when the pool runs out between two such points, run()
// synchronises the stream itself and starts over. The pool holds `parts` products as cuBLAS is given
// them: a product with K % 8 != 0 takes two (products.h).
class GroupedGemm {
 public:
  explicit GroupedGemm(int64_t parts);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  void begin_pass() { cursor_ = 0; }
  // Products with m or n == 0 are skipped; a product with k == 0 sets C to zero (beta must be 0 or 1,
  // and with beta == 1 it leaves C as it is).
  // Each product is cut as split_k_tail says: grouped, the bodies go in one call and the tails in a second.
  void run(cublasHandle_t handle, const std::vector<Gemm>& products, bool c_fp32, bool grouped,
           cudaStream_t stream);

 private:
  void issue_grouped(cublasHandle_t handle, const std::vector<Gemm>& products, bool c_fp32, cudaStream_t stream);

  int64_t capacity_;      // pointers per operand
  int64_t cursor_ = 0;    // parts used since begin_pass
  const void** host_ = nullptr;    // pinned, [3 * capacity_]
  const void** device_ = nullptr;  // [3 * capacity_]
};

}  // namespace lynx::blas
