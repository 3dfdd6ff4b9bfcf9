#include "kernels/cublas/products.h"

#include <cstdint>

namespace lynx::blas {

KParts split_k_tail(const Gemm& g) {
  KParts p{g, g};
  const int tail = g.k % 8;
  p.body.k = g.k - tail;
  p.tail.k = tail;
  if (tail == 0) return p;
  // op(A) is [m, K]: A is stored [K, m] (rows of lda) when transposed, [m, K] otherwise; op(B) is
  // [K, n]: B is stored [n, K] when transposed, [K, n] (rows of ldb) otherwise. bf16 elements.
  const int64_t k0 = p.body.k;
  const int64_t a_step = g.trans_a ? k0 * g.lda : k0;
  const int64_t b_step = g.trans_b ? k0 : k0 * g.ldb;
  p.tail.a = static_cast<const char*>(g.a) + 2 * a_step;
  p.tail.b = static_cast<const char*>(g.b) + 2 * b_step;
  p.tail.beta = k0 > 0 ? 1.0f : g.beta;
  return p;
}

}  // namespace lynx::blas
