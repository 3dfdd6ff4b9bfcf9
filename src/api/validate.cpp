// Host-side checks of every tensor argument: presence, dtype, shape, strides, alignment.
#include <string>

#include "lynx/error.h"
#include "lynx/moe.h"

namespace lynx {
namespace {

std::string shape_str(const TensorView& v) {
  std::string s = "[";
  for (int d = 0; d < v.rank; ++d) s += (d ? ", " : "") + std::to_string(v.shape[d]);
  return s + "]";
}

std::string shape_str(std::initializer_list<int64_t> shape) {
  std::string s = "[";
  bool first = true;
  for (int64_t d : shape) {
    s += (first ? "" : ", ") + std::to_string(d);
    first = false;
  }
  return s + "]";
}

// NOTES: 16 bytes is what 128-bit vector loads need. The expert weights and their gradients are
// read and written by TMA with the 128-byte swizzle, which needs 128-byte aligned global addresses
// (CUDA Programming Guide, "Using TMA", swizzle requirements). Every allocator gives both; a view
// into a larger tensor may not.
constexpr uintptr_t kAlignment = 16;
constexpr uintptr_t kTmaAlignment = 128;

// NOTES: the routed experts' bf16 gate and up weights and their gradients may also lie with their experts
// at a stride of their own (rows contiguous within an expert): the two halves of a concatenated
// [E, 2I, H] gate_up tensor, as Hugging Face's experts hold them, without copies. A stride of at least
// I·H elements keeps the experts apart; a multiple of 64 (128 bytes) keeps each expert's matrix as aligned
// as the base must be (TMA's global strides are 16-byte multiples below 2^40 bytes).
constexpr int64_t kExpertStrideMultiple = 64;
constexpr int64_t kMaxExpertStride = int64_t(1) << 38;

bool expert_strided(const TensorView& v) {
  if (v.rank != 3 || v.dtype != DType::kBF16 || v.shape[0] < 2) return false;
  const int64_t rows = v.shape[1], cols = v.shape[2];
  return (cols == 1 || v.strides[2] == 1) && (rows == 1 || v.strides[1] == cols) && v.strides[0] >= rows * cols &&
         v.strides[0] % kExpertStrideMultiple == 0 && v.strides[0] < kMaxExpertStride;
}

enum class Layout { kContiguous, kExpertStrided };

void check_tensor(const TensorView& v, const std::string& name, std::initializer_list<DType> dtypes,
                  std::initializer_list<int64_t> shape, uintptr_t alignment = kAlignment,
                  Layout layout = Layout::kContiguous) {
  if (!v.present()) throw Error(name, "is required but absent (null data pointer)");
  bool dtype_ok = false;
  std::string expected_dtypes;
  for (DType t : dtypes) {
    dtype_ok |= v.dtype == t;
    expected_dtypes += (expected_dtypes.empty() ? "" : " or ") + std::string(dtype_name(t));
  }
  if (!dtype_ok) throw Error(name, "dtype must be " + expected_dtypes + ", got " + dtype_name(v.dtype));
  if (v.rank != static_cast<int32_t>(shape.size())) {
    throw Error(name, "shape must be " + shape_str(shape) + ", got a view of rank " + std::to_string(v.rank));
  }
  bool shape_ok = v.rank == static_cast<int32_t>(shape.size());
  int d = 0;
  for (int64_t s : shape) shape_ok = shape_ok && v.shape[d++] == s;
  if (!shape_ok) throw Error(name, "shape must be " + shape_str(shape) + ", got " + shape_str(v));
  if (layout == Layout::kExpertStrided && v.dtype == DType::kBF16) {
    if (!v.is_contiguous() && !expert_strided(v)) {
      throw Error(name, "must be contiguous row-major, or its experts at a stride of their own (a multiple of 64 "
                        "elements, at least I·H, below 2^38) with each expert's rows contiguous, got strides [" +
                            std::to_string(v.strides[0]) + ", " + std::to_string(v.strides[1]) + ", " +
                            std::to_string(v.strides[2]) + "]");
    }
  } else if (!v.is_contiguous()) {
    throw Error(name, "must be contiguous row-major (innermost stride 1, no padding)");
  }
  if (reinterpret_cast<uintptr_t>(v.data) % alignment != 0) {
    throw Error(name, "data pointer must be " + std::to_string(alignment) + "-byte aligned");
  }
}

// Whether a group of weight gradients (the routed experts' three, or the shared expert's) is given: all
// of it, or none (those weight gradients are then not computed); one missing from a given group is an error.
bool gradient_group_given(std::initializer_list<std::pair<const TensorView*, const char*>> group) {
  bool any = false;
  std::string names;
  size_t i = 0;
  for (const auto& [v, name] : group) {
    any = any || v->present();
    if (i > 0) names += i + 1 == group.size() ? " and " : ", ";
    names += name;
    ++i;
  }
  if (!any) return false;
  for (const auto& [v, name] : group) {
    if (!v->present()) {
      throw Error(name, "is absent while others of " + names + " are given: give all three, or none (then those "
                        "weight gradients are not computed)");
    }
  }
  return true;
}

void check_absent(const TensorView& v, const std::string& name) {
  if (v.present()) throw Error(name, "must be absent: the layer has no shared expert (shape.shared_intermediate == 0)");
}

// The routed weights in one of `routed` dtypes, and the shared expert's (bf16).
void check_weights(const LayerShape& s, const ExpertWeights& w, std::initializer_list<DType> routed) {
  validate_shape(s);
  const int64_t H = s.hidden, I = s.intermediate, E_loc = s.local_experts();
  check_tensor(w.w_gate, "w_gate", routed, {E_loc, I, H}, kTmaAlignment, Layout::kExpertStrided);
  check_tensor(w.w_up, "w_up", routed, {E_loc, I, H}, kTmaAlignment, Layout::kExpertStrided);
  check_tensor(w.w_down, "w_down", routed, {E_loc, H, I}, kTmaAlignment);
  if (s.shared_intermediate > 0) {
    const int64_t Is = s.shared_intermediate;
    check_tensor(w.ws_gate, "ws_gate", {DType::kBF16}, {Is, H});
    check_tensor(w.ws_up, "ws_up", {DType::kBF16}, {Is, H});
    check_tensor(w.ws_down, "ws_down", {DType::kBF16}, {H, Is});
  } else {
    check_absent(w.ws_gate, "ws_gate");
    check_absent(w.ws_up, "ws_up");
    check_absent(w.ws_down, "ws_down");
  }
}

}  // namespace

// The routed weights' dtype against the workspace's precision: api/passes.h (require_quantized_weights).
void validate_inputs(const LayerShape& s, const LayerInputs& in) {
  validate_shape(s);
  const int64_t T = s.tokens, H = s.hidden, k = s.top_k;
  check_tensor(in.x, "x", {DType::kBF16}, {T, H});
  check_tensor(in.topk_ids, "topk_ids", {DType::kI32, DType::kI64}, {T, k});
  check_tensor(in.topk_weights, "topk_weights", {DType::kF32}, {T, k});
  check_weights(s, in.weights, {DType::kBF16, DType::kE4M3});
}

void validate_weights(const LayerShape& s, const ExpertWeights& weights) { check_weights(s, weights, {DType::kBF16}); }

void validate_fp8_weights(const LayerShape& s, const Fp8ExpertWeights& w) {
  validate_shape(s);
  const int64_t H = s.hidden, I = s.intermediate, E_loc = s.local_experts();
  const int64_t kbH = (H + 127) / 128, kbI = (I + 127) / 128;
  // 128-byte aligned, as validate_inputs wants the routed weights that forward is then given.
  check_tensor(w.w_gate, "w_gate", {DType::kE4M3}, {E_loc, I, H}, kTmaAlignment);
  check_tensor(w.w_up, "w_up", {DType::kE4M3}, {E_loc, I, H}, kTmaAlignment);
  check_tensor(w.w_down, "w_down", {DType::kE4M3}, {E_loc, H, I}, kTmaAlignment);
  check_tensor(w.w_gate_scales, "w_gate_scales", {DType::kF32}, {E_loc, kbI, kbH});
  check_tensor(w.w_up_scales, "w_up_scales", {DType::kF32}, {E_loc, kbI, kbH});
  check_tensor(w.w_down_scales, "w_down_scales", {DType::kF32}, {E_loc, kbH, kbI});
}

void validate_output(const LayerShape& s, const TensorView& y) {
  validate_shape(s);
  check_tensor(y, "y", {DType::kBF16}, {s.tokens, s.hidden});
}

void validate_gradients(const LayerShape& s, const TensorView& dy, const Gradients& g) {
  validate_shape(s);
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, E_loc = s.local_experts();
  check_tensor(dy, "dy", {DType::kBF16}, {T, H});
  check_tensor(g.dx, "dx", {DType::kBF16}, {T, H});
  check_tensor(g.d_topk_weights, "d_topk_weights", {DType::kF32}, {T, k});
  if (gradient_group_given({{&g.dw_gate, "dw_gate"}, {&g.dw_up, "dw_up"}, {&g.dw_down, "dw_down"}})) {
    check_tensor(g.dw_gate, "dw_gate", {DType::kBF16}, {E_loc, I, H}, kTmaAlignment, Layout::kExpertStrided);
    check_tensor(g.dw_up, "dw_up", {DType::kBF16}, {E_loc, I, H}, kTmaAlignment, Layout::kExpertStrided);
    check_tensor(g.dw_down, "dw_down", {DType::kBF16}, {E_loc, H, I}, kTmaAlignment);
  }
  if (s.shared_intermediate > 0) {
    const int64_t Is = s.shared_intermediate;
    if (gradient_group_given({{&g.dws_gate, "dws_gate"}, {&g.dws_up, "dws_up"}, {&g.dws_down, "dws_down"}})) {
      check_tensor(g.dws_gate, "dws_gate", {DType::kBF16}, {Is, H});
      check_tensor(g.dws_up, "dws_up", {DType::kBF16}, {Is, H});
      check_tensor(g.dws_down, "dws_down", {DType::kBF16}, {H, Is});
    }
  } else {
    check_absent(g.dws_gate, "dws_gate");
    check_absent(g.dws_up, "dws_up");
    check_absent(g.dws_down, "dws_down");
  }
}

}  // namespace lynx
