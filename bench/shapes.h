// The benchmark shapes of ARCHITECTURE.md §9.
#pragma once

#include <string>
#include <vector>

#include "lynx/config.h"

namespace lynx::bench {

struct NamedShape {
  std::string name;
  LayerShape shape;
};

const std::vector<NamedShape>& benchmark_shapes();
constexpr const char* kDefaultShape = "qwen3-30b-a3b";

// Forward FLOPs: 6 · rows · H · I for the routed experts (rows = T·k), plus 6 · T · H · I_s.
double forward_flops(const LayerShape& s);

}  // namespace lynx::bench
