// lynx-bench's --shape argument (bench/shapes.cpp): benchmark names and T,H,I,E,k dimensions.
#include <gtest/gtest.h>

#include "shapes.h"

namespace lynx::bench {
namespace {

TEST(BenchShapes, NamesGiveTheBenchmarkShapes) {
  for (const NamedShape& s : benchmark_shapes()) {
    const auto parsed = parse_shape(s.name);
    ASSERT_TRUE(parsed) << s.name;
    EXPECT_EQ(parsed->name, s.name);
    EXPECT_EQ(parsed->shape.tokens, s.shape.tokens);
    EXPECT_EQ(parsed->shape.hidden, s.shape.hidden);
    EXPECT_EQ(parsed->shape.intermediate, s.shape.intermediate);
    EXPECT_EQ(parsed->shape.num_experts, s.shape.num_experts);
    EXPECT_EQ(parsed->shape.top_k, s.shape.top_k);
  }
}

TEST(BenchShapes, DimensionsGiveThatShape) {
  const auto s = parse_shape("8192,7168,2048,256,8");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->name, "8192,7168,2048,256,8");
  EXPECT_EQ(s->shape.tokens, 8192);
  EXPECT_EQ(s->shape.hidden, 7168);
  EXPECT_EQ(s->shape.intermediate, 2048);
  EXPECT_EQ(s->shape.num_experts, 256);
  EXPECT_EQ(s->shape.top_k, 8);
  EXPECT_EQ(s->shape.shared_intermediate, 0);
  EXPECT_EQ(s->shape.num_ranks, 1);
}

TEST(BenchShapes, AnythingElseIsRejected) {
  for (const char* bad : {"", "qwen3", "all", "8192,2048,768,128", "8192,2048,768,128,8,1", "8192,2048,,128,8",
                          "8192,2048,768,128,0", "-8192,2048,768,128,8", "8192,2048,768,128,8,", "8192 ,2048,768,128,8",
                          "8192,2048,768,128,x", "1234567890123,2048,768,128,8"}) {
    EXPECT_FALSE(parse_shape(bad)) << '"' << bad << '"';
  }
}

}  // namespace
}  // namespace lynx::bench
