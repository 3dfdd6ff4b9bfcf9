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

std::optional<NamedShape> parse_shape(const std::string& spec) {
  for (const NamedShape& s : benchmark_shapes()) {
    if (s.name == spec) return s;
  }
  int64_t dims[5];
  size_t at = 0;
  for (int i = 0; i < 5; ++i) {
    const size_t end = i < 4 ? spec.find(',', at) : spec.size();
    if (end == std::string::npos || end == at || end - at > 12) return std::nullopt;
    int64_t v = 0;
    for (size_t c = at; c < end; ++c) {
      if (spec[c] < '0' || spec[c] > '9') return std::nullopt;
      v = 10 * v + (spec[c] - '0');
    }
    if (v <= 0) return std::nullopt;
    dims[i] = v;
    at = end + 1;
  }
  return make(spec.c_str(), dims[0], dims[1], dims[2], dims[3], dims[4]);
}

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
