// The row-major product that lynx asks of cuBLAS, and how it is cut before cuBLAS sees it. Host-only
// (no CUDA headers), so that the CPU tests check the cut.
#pragma once

namespace lynx::blas {

// Row-major C[m, n] = alpha · op(A) · op(B) + beta · C, with op(X) = X or Xᵀ as stored; A and B bf16,
// C bf16 or fp32 (c_fp32). `lda`, `ldb`, `ldc` are the row lengths of the stored matrices. beta is
// 0 or 1; k == 0 is allowed (C = beta · C).
struct Gemm {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int lda = 0;
  const void* b = nullptr;
  int ldb = 0;
  void* c = nullptr;
  int ldc = 0;
  float beta = 0.0f;
};

// NOTES: cuBLAS 13.1 (130100) leaves out the last K % 8 rows of the K dimension for some bf16
// products with K of a few thousand and K % 8 in {1, 2, 3}, the weight gradients' form (op(A) = Aᵀ,
// A and B stored [K, ·]; measured at m = 64, n = 320, K = 5633-5635; m = 128, n = 512, K = 5633 and
// 8193-8195), with or without pedantic math and with a 32 MiB workspace of the handle's own; K a
// multiple of 8, the same products split at K − K % 8, and the same with no workspace at all came out
// right (bench/cublas_k_tail.cu; bench/results/2026-12-06-h100-205e984-cublas-k-tail-log.txt). No
// workspace would take split-K from every product (its cost not measured); the cut touches only
// K % 8 != 0. So every product reaches cuBLAS as its first K − K % 8 rows (`body`) and, when
// K % 8 != 0, its last K % 8 rows added onto C (`tail`, beta 1; the caller's beta when the body is
// empty). A part with k == 0 is not issued. With a bf16 C, such a product is rounded twice.
struct KParts {
  Gemm body, tail;
};
KParts split_k_tail(const Gemm& g);

}  // namespace lynx::blas
