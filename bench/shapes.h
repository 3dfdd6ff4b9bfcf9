// The benchmark shapes: four released MoE models' layers (docs/performance.md).
#pragma once

#include <optional>
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

// The shape `spec` names: a benchmark shape's name, or its dimensions as "T,H,I,E,k" (five positive
// integers, the name then being the spec itself); nullopt for anything else. Whether the layer accepts
// the dimensions is lynx::validate_shape's to say.
std::optional<NamedShape> parse_shape(const std::string& spec);

// Forward FLOPs: 6 · rows · H · I for the routed experts (rows = T·k), plus 6 · T · H · I_s.
double forward_flops(const LayerShape& s);

}  // namespace lynx::bench
