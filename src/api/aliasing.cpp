#include "api/aliasing.h"

#include <cstdint>
#include <string>
#include <vector>

#include "lynx/error.h"

namespace lynx::api {
namespace {

// Bytes [begin + i·period, + length) for i < count: a contiguous view is one piece; an [E, rows, cols] view
// whose experts lie at a stride of their own (validate.cpp) is a piece an expert.
struct Span {
  const char* name;
  uintptr_t begin, length, period;
  int64_t count;
  uintptr_t end() const { return begin + uintptr_t(count - 1) * period + length; }
};

// The present views among `named`, as byte ranges (validated views: contiguous, or experts at a stride).
std::vector<Span> spans(std::initializer_list<std::pair<const char*, const TensorView*>> named) {
  std::vector<Span> out;
  for (const auto& [name, v] : named) {
    if (!v->present()) continue;
    const auto begin = reinterpret_cast<uintptr_t>(v->data);
    const auto size = uintptr_t(dtype_size(v->dtype));
    if (v->rank == 3 && v->shape[0] > 1 && !v->is_contiguous()) {
      out.push_back({name, begin, uintptr_t(v->shape[1] * v->shape[2]) * size, uintptr_t(v->strides[0]) * size,
                     v->shape[0]});
    } else {
      out.push_back({name, begin, uintptr_t(v->numel()) * size, 0, 1});
    }
  }
  return out;
}

// Empty spans overlap nothing. NOTES: two spans of pieces at one period (the halves of a concatenated
// gate_up tensor, say) overlap where their pieces' offsets within the period do; otherwise their
// extents are compared, which may see an overlap between the pieces of two strided views that have none
// (such a layout is then refused).
bool overlap(const Span& a, const Span& b) {
  if (a.length == 0 || b.length == 0 || a.count == 0 || b.count == 0) return false;
  if (!(a.begin < b.end() && b.begin < a.end())) return false;
  if (a.count > 1 && b.count > 1 && a.period == b.period && a.length <= a.period && b.length <= a.period) {
    const uintptr_t p = a.period, shift = ((b.begin % p) + p - (a.begin % p)) % p;  // b's offset after a's
    return shift < a.length || shift + b.length > p;
  }
  return true;
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

std::vector<Span> gradient_spans(const Gradients& g) {
  return spans({{"dx", &g.dx}, {"d_topk_weights", &g.d_topk_weights}, {"dw_gate", &g.dw_gate}, {"dw_up", &g.dw_up},
                {"dw_down", &g.dw_down}, {"dws_gate", &g.dws_gate}, {"dws_up", &g.dws_up}, {"dws_down", &g.dws_down}});
}

Span context_span(ContextBytes ctx) {
  const auto begin = reinterpret_cast<uintptr_t>(ctx.data);
  return {"ctx.data", begin, uintptr_t(ctx.bytes), 0, 1};
}

// What the call reads (dy absent in a forward).
std::vector<Span> input_spans(const LayerInputs& in, const TensorView& dy) {
  const ExpertWeights& w = in.weights;
  return spans({{"x", &in.x}, {"topk_ids", &in.topk_ids}, {"topk_weights", &in.topk_weights}, {"w_gate", &w.w_gate},
                {"w_up", &w.w_up}, {"w_down", &w.w_down}, {"ws_gate", &w.ws_gate}, {"ws_up", &w.ws_up},
                {"ws_down", &w.ws_down}, {"dy", &dy}});
}

// Rank r's outputs against rank s's outputs and inputs, for every r != s.
void check_across_ranks(const std::vector<std::vector<Span>>& outputs, const std::vector<std::vector<Span>>& inputs) {
  const auto rank = [](size_t r) { return " of rank " + std::to_string(r); };
  for (size_t r = 0; r < outputs.size(); ++r) {
    for (size_t s = 0; s < outputs.size(); ++s) {
      if (s == r) continue;
      for (const Span& out : outputs[r]) {
        for (const Span& other : outputs[s]) {
          if (s > r && overlap(out, other)) {
            throw Error(out.name, rank(r) + " shares memory with " + other.name + rank(s) +
                                      ": every rank's outputs need memory of their own");
          }
        }
        for (const Span& in : inputs[s]) {
          if (overlap(out, in)) {
            throw Error(out.name, rank(r) + " shares memory with the input " + in.name + rank(s) +
                                      ": the ranks run at once, so no rank may write what another reads");
          }
        }
      }
    }
  }
}

}  // namespace

void check_ranks_forward_aliasing(const std::vector<LayerInputs>& in, const std::vector<TensorView>& y) {
  std::vector<std::vector<Span>> outputs, inputs;
  for (size_t r = 0; r < in.size(); ++r) {
    outputs.push_back(spans({{"y", &y[r]}}));
    inputs.push_back(input_spans(in[r], TensorView{}));
  }
  check_across_ranks(outputs, inputs);
}

void check_ranks_backward_aliasing(const std::vector<LayerInputs>& in, const std::vector<TensorView>& dy,
                                   const std::vector<Gradients>& grads) {
  std::vector<std::vector<Span>> outputs, inputs;
  for (size_t r = 0; r < in.size(); ++r) {
    outputs.push_back(gradient_spans(grads[r]));
    inputs.push_back(input_spans(in[r], dy[r]));
  }
  check_across_ranks(outputs, inputs);
}

void check_forward_aliasing(const LayerInputs& in, const TensorView& y) {
  check(spans({{"y", &y}}), input_spans(in, TensorView{}));
}

void check_backward_aliasing(const LayerInputs& in, const TensorView& dy, const Gradients& g) {
  check(gradient_spans(g), input_spans(in, dy));
}

void check_context_written(const LayerInputs& in, const TensorView& y, ContextBytes ctx) {
  std::vector<Span> outputs = spans({{"y", &y}});
  outputs.insert(outputs.begin(), context_span(ctx));
  check(outputs, input_spans(in, TensorView{}));
}

void check_context_read(const Gradients& grads, ContextBytes ctx) { check(gradient_spans(grads), {context_span(ctx)}); }

}  // namespace lynx::api
