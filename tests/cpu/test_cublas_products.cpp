// How a product is cut before cuBLAS sees it (src/kernels/cublas/products.h): the body's K a multiple
// of 8, the tail's operands at the body's end, its beta 1 after a body and the caller's without one.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/cublas/products.h"

namespace lynx::blas {
namespace {

const char* at(const void* p, int64_t elements) { return static_cast<const char*>(p) + 2 * elements; }

// Room for every operand the tests cut (pointers into it stay inside one object).
char* arena() {
  static std::vector<char> bytes(size_t(16) << 20);
  return bytes.data();
}
char* const a = arena();
char* const b = arena() + (size_t(6) << 20);
char* const c = arena() + (size_t(12) << 20);

// A weight gradient's form: op(A) = Aᵀ with A [K, m] and B [K, n], C [m, n].
Gemm weight_grad(int k, float beta) {
  return Gemm{true, false, 64, 320, k, a, 64, b, 320, c, 320, beta};
}

TEST(CublasProducts, KMultipleOfEightIsOneBody) {
  for (const int k : {8, 16, 5632}) {
    const KParts p = split_k_tail(weight_grad(k, 0.0f));
    EXPECT_EQ(p.body.k, k);
    EXPECT_EQ(p.tail.k, 0);
    EXPECT_EQ(p.body.a, weight_grad(k, 0.0f).a);
    EXPECT_EQ(p.body.beta, 0.0f);
  }
}

TEST(CublasProducts, TailStartsAtTheBodysEndAndAddsOntoIt) {
  for (const float beta : {0.0f, 1.0f}) {
    const Gemm g = weight_grad(5634, beta);
    const KParts p = split_k_tail(g);
    EXPECT_EQ(p.body.k, 5632);
    EXPECT_EQ(p.body.beta, beta);
    EXPECT_EQ(p.body.a, g.a);
    EXPECT_EQ(p.body.b, g.b);
    EXPECT_EQ(p.tail.k, 2);
    EXPECT_EQ(p.tail.a, at(g.a, int64_t(5632) * g.lda));  // rows 5632.. of A [K, m]
    EXPECT_EQ(p.tail.b, at(g.b, int64_t(5632) * g.ldb));  // rows 5632.. of B [K, n]
    EXPECT_EQ(p.tail.beta, 1.0f);
    for (const Gemm* part : {&p.body, &p.tail}) {
      EXPECT_EQ(part->c, g.c);
      EXPECT_EQ(part->m, g.m);
      EXPECT_EQ(part->n, g.n);
      EXPECT_EQ(part->lda, g.lda);
      EXPECT_EQ(part->ldb, g.ldb);
      EXPECT_EQ(part->ldc, g.ldc);
    }
  }
}

TEST(CublasProducts, KBelowEightIsOneTailWithTheCallersBeta) {
  for (const float beta : {0.0f, 1.0f}) {
    const Gemm g = weight_grad(5, beta);
    const KParts p = split_k_tail(g);
    EXPECT_EQ(p.body.k, 0);
    EXPECT_EQ(p.tail.k, 5);
    EXPECT_EQ(p.tail.a, g.a);
    EXPECT_EQ(p.tail.b, g.b);
    EXPECT_EQ(p.tail.beta, beta);
  }
}

TEST(CublasProducts, TailOffsetsFollowEachOperandsLayout) {
  // op(A) = A stored [m, K] (K along a row); op(B) = Bᵀ with B stored [n, K]: both step by K elements.
  const Gemm g{false, true, 100, 48, 4099, a, 4200, b, 4100, c, 48, 0.0f};
  const KParts p = split_k_tail(g);
  EXPECT_EQ(p.body.k, 4096);
  EXPECT_EQ(p.tail.k, 3);
  EXPECT_EQ(p.tail.a, at(a, 4096));
  EXPECT_EQ(p.tail.b, at(b, 4096));
  // op(A) = A [m, K], op(B) = B [K, n]: A steps along its row, B by rows of ldb.
  const Gemm h{false, false, 100, 48, 17, a, 40, b, 56, c, 48, 1.0f};
  const KParts q = split_k_tail(h);
  EXPECT_EQ(q.body.k, 16);
  EXPECT_EQ(q.tail.k, 1);
  EXPECT_EQ(q.tail.a, at(a, 16));
  EXPECT_EQ(q.tail.b, at(b, 16 * 56));
  EXPECT_EQ(q.tail.beta, 1.0f);
}

}  // namespace
}  // namespace lynx::blas
