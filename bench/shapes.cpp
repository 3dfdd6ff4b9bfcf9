#include "shapes.h"

namespace lynx::bench {
namespace {

NamedShape make(const char* name, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k) {
  NamedShape n{name, {}};
  n.shape.tokens = T;
  n.shape.hidden = H;
  n.shape.intermediate = I;
  n.shape.num_experts = E;
  n.shape.top_k = k;
  return n;
}

}  // namespace

const std::vector<NamedShape>& benchmark_shapes() {
  static const std::vector<NamedShape> shapes = {
      make("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
      make("olmoe-1b-7b", 8192, 2048, 1024, 64, 8),
      make("mixtral-8x7b", 8192, 4096, 14336, 8, 2),
      make("deepseek-v3", 4096, 7168, 2048, 256, 8),
  };
  return shapes;
}

double forward_flops(const LayerShape& s) {
  return 6.0 * double(s.tokens * s.top_k) * double(s.hidden) * double(s.intermediate) +
         6.0 * double(s.tokens) * double(s.hidden) * double(s.shared_intermediate);
}

}  // namespace lynx::bench
