#include "api/aliasing.h"

#include <cstdint>
#include <string>
#include <vector>

#include "lynx/error.h"

namespace lynx::api {
namespace {

struct Span {
  const char* name;
  uintptr_t begin, end;  // bytes [begin, end)
};

// The present views among `named`, as byte ranges (contiguous views: numel · dtype size).
std::vector<Span> spans(std::initializer_list<std::pair<const char*, const TensorView*>> named) {
  std::vector<Span> out;
  for (const auto& [name, v] : named) {
    if (!v->present()) continue;
    const auto begin = reinterpret_cast<uintptr_t>(v->data);
    out.push_back({name, begin, begin + uintptr_t(v->numel() * dtype_size(v->dtype))});
  }
  return out;
}

// Empty spans overlap nothing.
bool overlap(const Span& a, const Span& b) {
  return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end;
}

void check(const std::vector<Span>& outputs, const std::vector<Span>& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t j = i + 1; j < outputs.size(); ++j) {
      if (overlap(outputs[i], outputs[j])) {
        throw Error(outputs[i].name, std::string("shares memory with ") + outputs[j].name +
                                         ": every output needs memory of its own");
      }
    }
    for (const Span& in : inputs) {
      if (overlap(outputs[i], in)) {
        throw Error(outputs[i].name, std::string("shares memory with the input ") + in.name +
                                         ": an output must not overlap what the call reads");
      }
    }
  }
}

// What the call reads (dy absent in a forward).
std::vector<Span> input_spans(const LayerInputs& in, const TensorView& dy) {
  const ExpertWeights& w = in.weights;
  return spans({{"x", &in.x}, {"topk_ids", &in.topk_ids}, {"topk_weights", &in.topk_weights}, {"w_gate", &w.w_gate},
                {"w_up", &w.w_up}, {"w_down", &w.w_down}, {"ws_gate", &w.ws_gate}, {"ws_up", &w.ws_up},
                {"ws_down", &w.ws_down}, {"dy", &dy}});
}

}  // namespace

void check_forward_aliasing(const LayerInputs& in, const TensorView& y) {
  check(spans({{"y", &y}}), input_spans(in, TensorView{}));
}

void check_backward_aliasing(const LayerInputs& in, const TensorView& dy, const Gradients& g) {
  check(spans({{"dx", &g.dx}, {"d_topk_weights", &g.d_topk_weights}, {"dw_gate", &g.dw_gate}, {"dw_up", &g.dw_up},
               {"dw_down", &g.dw_down}, {"dws_gate", &g.dws_gate}, {"dws_up", &g.dws_up}, {"dws_down", &g.dws_down}}),
        input_spans(in, dy));
}

}  // namespace lynx::api
