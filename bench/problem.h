// One benchmark problem: a layer's inputs, outputs and gradients in device memory, generated from
// seeds so that the host can rebuild any row of them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lynx/moe.h"
#include "shapes.h"

namespace lynx::bench {

enum class Routing { kUniform, kSkewed, kBalanced };
const char* routing_name(Routing r);

// Seeds of the generated tensors (also used by the host to rebuild rows).
struct Seeds {
  uint64_t x, dy, w_gate, w_up, w_down, ws_gate, ws_up, ws_down;
};

class Problem {
 public:
  Problem(const NamedShape& shape, Routing routing, uint64_t seed);
  ~Problem();
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  const NamedShape& named() const { return shape_; }
  const LayerShape& shape() const { return shape_.shape; }
  const Seeds& seeds() const { return seeds_; }
  float input_scale() const { return 1.0f; }
  float gate_up_scale() const;  // weights of gate/up: uniform in ±this
  float down_scale() const;
  float shared_down_scale() const;
  const std::vector<int32_t>& host_ids() const { return ids_; }
  const std::vector<float>& host_weights() const { return weights_; }

  LayerInputs inputs() const;
  TensorView y() const;
  TensorView dy() const;
  Gradients gradients() const;

 private:
  void* alloc(int64_t bytes);

  NamedShape shape_;
  Seeds seeds_;
  std::vector<int32_t> ids_;
  std::vector<float> weights_;
  std::vector<void*> allocations_;
  void *x_, *ids_d_, *weights_d_, *wg_, *wu_, *wd_, *wsg_ = nullptr, *wsu_ = nullptr, *wsd_ = nullptr;
  void *y_, *dy_, *dx_, *dtk_, *dwg_, *dwu_, *dwd_, *dwsg_ = nullptr, *dwsu_ = nullptr, *dwsd_ = nullptr;
};

}  // namespace lynx::bench
