// Host-side validation: every bad argument is rejected with an error that names it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "api/aliasing.h"
#include "kernels/schedule/routing_check.h"
#include "lynx/lynx.h"

namespace lynx {
namespace {

// Distinct, 16-byte aligned fake device addresses: validation never dereferences them.
void* fake(int i) { return reinterpret_cast<void*>(uintptr_t(0x10000) * (i + 1)); }

LayerShape small_shape(int64_t shared = 64) {
  LayerShape s;
  s.tokens = 10;
  s.hidden = 128;
  s.intermediate = 64;
  s.num_experts = 8;
  s.top_k = 2;
  s.shared_intermediate = shared;
  return s;
}

// `at(i)`: the fake address of tensor i (fake, or one far enough apart for tensors to lie whole
// between them).
LayerInputs good_inputs(const LayerShape& s, void* (*at)(int) = fake) {
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, E = s.local_experts();
  LayerInputs in;
  in.x = make_view(at(0), DType::kBF16, {T, H});
  in.topk_ids = make_view(at(1), DType::kI32, {T, k});
  in.topk_weights = make_view(at(2), DType::kF32, {T, k});
  in.weights.w_gate = make_view(at(3), DType::kBF16, {E, I, H});
  in.weights.w_up = make_view(at(4), DType::kBF16, {E, I, H});
  in.weights.w_down = make_view(at(5), DType::kBF16, {E, H, I});
  if (s.shared_intermediate > 0) {
    const int64_t Is = s.shared_intermediate;
    in.weights.ws_gate = make_view(at(6), DType::kBF16, {Is, H});
    in.weights.ws_up = make_view(at(7), DType::kBF16, {Is, H});
    in.weights.ws_down = make_view(at(8), DType::kBF16, {H, Is});
  }
  return in;
}

Gradients good_gradients(const LayerShape& s, void* (*at)(int) = fake) {
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, E = s.local_experts();
  Gradients g;
  g.dx = make_view(at(10), DType::kBF16, {T, H});
  g.d_topk_weights = make_view(at(11), DType::kF32, {T, k});
  g.dw_gate = make_view(at(12), DType::kBF16, {E, I, H});
  g.dw_up = make_view(at(13), DType::kBF16, {E, I, H});
  g.dw_down = make_view(at(14), DType::kBF16, {E, H, I});
  if (s.shared_intermediate > 0) {
    const int64_t Is = s.shared_intermediate;
    g.dws_gate = make_view(at(15), DType::kBF16, {Is, H});
    g.dws_up = make_view(at(16), DType::kBF16, {Is, H});
    g.dws_down = make_view(at(17), DType::kBF16, {H, Is});
  }
  return g;
}

// Runs `f`, expects a lynx::Error whose argument() is `argument` and whose message contains `needle`.
template <class F>
void expect_error(F&& f, const std::string& argument, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(argument), std::string::npos) << e.what();
  }
}

TEST(Validation, GoodInputsPass) {
  for (int64_t shared : {0, 64}) {
    const LayerShape s = small_shape(shared);
    EXPECT_NO_THROW(validate_inputs(s, good_inputs(s)));
    EXPECT_NO_THROW(validate_output(s, make_view(fake(20), DType::kBF16, {s.tokens, s.hidden})));
    EXPECT_NO_THROW(validate_gradients(s, make_view(fake(21), DType::kBF16, {s.tokens, s.hidden}), good_gradients(s)));
  }
  LayerInputs in = good_inputs(small_shape());
  in.topk_ids.dtype = DType::kI64;  // int64 ids are accepted at the API
  EXPECT_NO_THROW(validate_inputs(small_shape(), in));
}

// Pre-quantised FP8 weights (set_quantized_weights): e4m3 values and fp32 block scales, each named when
// wrong; e4m3 routed weights pass validate_inputs (the workspace's precision decides, api/passes.h), but
// not validate_weights (bf16 ones, for quantize_weights).
TEST(Validation, Fp8WeightsNameTheArgument) {
  EXPECT_EQ(dtype_size(DType::kE4M3), 1);
  EXPECT_STREQ(dtype_name(DType::kE4M3), "e4m3");
  LayerShape s = small_shape();
  s.intermediate = 192;  // two 128-blocks of I, the last short
  const int64_t E = s.num_experts, H = s.hidden, I = s.intermediate, kbH = 1, kbI = 2;
  Fp8ExpertWeights f;
  f.w_gate = make_view(fake(30), DType::kE4M3, {E, I, H});
  f.w_up = make_view(fake(31), DType::kE4M3, {E, I, H});
  f.w_down = make_view(fake(32), DType::kE4M3, {E, H, I});
  f.w_gate_scales = make_view(fake(33), DType::kF32, {E, kbI, kbH});
  f.w_up_scales = make_view(fake(34), DType::kF32, {E, kbI, kbH});
  f.w_down_scales = make_view(fake(35), DType::kF32, {E, kbH, kbI});
  EXPECT_NO_THROW(validate_fp8_weights(s, f));
  Fp8ExpertWeights bad = f;
  bad.w_down_scales = make_view(fake(35), DType::kF32, {E, kbI, kbH});
  expect_error([&] { validate_fp8_weights(s, bad); }, "w_down_scales", "shape");
  bad = f;
  bad.w_up = make_view(fake(31), DType::kBF16, {E, I, H});
  expect_error([&] { validate_fp8_weights(s, bad); }, "w_up", "e4m3");
  bad = f;
  bad.w_gate_scales = TensorView{};
  expect_error([&] { validate_fp8_weights(s, bad); }, "w_gate_scales", "absent");
  LayerInputs in = good_inputs(s);
  in.weights.w_gate = f.w_gate;
  in.weights.w_up = f.w_up;
  in.weights.w_down = f.w_down;
  EXPECT_NO_THROW(validate_inputs(s, in));
  expect_error([&] { validate_weights(s, in.weights); }, "w_gate", "bf16");
}

TEST(Validation, WrongShapeNamesTheArgument) {
  const LayerShape s = small_shape();
  LayerInputs in = good_inputs(s);
  in.x = make_view(fake(0), DType::kBF16, {s.tokens + 1, s.hidden});
  expect_error([&] { validate_inputs(s, in); }, "x", "[10, 128]");
  in = good_inputs(s);
  in.weights.w_down = make_view(fake(5), DType::kBF16, {s.num_experts, s.intermediate, s.hidden});
  expect_error([&] { validate_inputs(s, in); }, "w_down", "shape");
  in = good_inputs(s);
  in.topk_weights = make_view(fake(2), DType::kF32, {s.tokens * s.top_k});
  expect_error([&] { validate_inputs(s, in); }, "topk_weights", "shape");
}

// A view whose rank lies outside [0, kMaxTensorRank] (an uninitialised one, say) is rejected by name,
// and its shape is never read past the end (found by the fuzz target under UBSan).
TEST(Validation, RankOutOfRangeIsRejected) {
  const LayerShape s = small_shape();
  for (const int32_t rank : {5, 1000, -1}) {
    LayerInputs in = good_inputs(s);
    in.topk_ids.rank = rank;
    expect_error([&] { validate_inputs(s, in); }, "topk_ids", "rank " + std::to_string(rank));
    EXPECT_EQ(in.topk_ids.numel(), 0);
    EXPECT_FALSE(in.topk_ids.is_contiguous());
  }
}

TEST(Validation, WrongDtypeNamesTheArgument) {
  const LayerShape s = small_shape();
  LayerInputs in = good_inputs(s);
  in.topk_ids.dtype = DType::kF32;
  expect_error([&] { validate_inputs(s, in); }, "topk_ids", "int32 or int64");
  in = good_inputs(s);
  in.topk_weights.dtype = DType::kBF16;
  expect_error([&] { validate_inputs(s, in); }, "topk_weights", "fp32");
  in = good_inputs(s);
  in.weights.ws_up.dtype = DType::kF32;
  expect_error([&] { validate_inputs(s, in); }, "ws_up", "bf16");
}

TEST(Validation, StridesAndAlignment) {
  const LayerShape s = small_shape();
  LayerInputs in = good_inputs(s);
  std::swap(in.x.strides[0], in.x.strides[1]);  // a transposed view
  expect_error([&] { validate_inputs(s, in); }, "x", "contiguous");
  in = good_inputs(s);
  in.weights.w_gate.strides[0] += 8;  // experts padded by 8 elements: not 128-byte aligned
  expect_error([&] { validate_inputs(s, in); }, "w_gate", "a multiple of 64");
  in = good_inputs(s);
  in.weights.w_gate.strides[0] += 64;  // padded by 64: every expert 128-byte aligned, as the base
  EXPECT_NO_THROW(validate_inputs(s, in));
  in = good_inputs(s);
  in.weights.w_gate.strides[0] = int64_t(1) << 38;  // beyond what a TMA stride holds
  expect_error([&] { validate_inputs(s, in); }, "w_gate", "below 2^38");
  in = good_inputs(s);
  in.weights.w_down.strides[0] += 8;  // only gate and up (and their gradients) may have an expert stride
  expect_error([&] { validate_inputs(s, in); }, "w_down", "contiguous");
  in = good_inputs(s);
  in.x.data = static_cast<char*>(in.x.data) + 2;
  expect_error([&] { validate_inputs(s, in); }, "x", "aligned");
  // x needs 16 bytes; the expert weights, read by TMA with the 128-byte swizzle, 128.
  in = good_inputs(s);
  in.x.data = static_cast<char*>(in.x.data) + 16;
  EXPECT_NO_THROW(validate_inputs(s, in));
  in = good_inputs(s);
  in.weights.w_down.data = static_cast<char*>(in.weights.w_down.data) + 64;
  expect_error([&] { validate_inputs(s, in); }, "w_down", "128-byte aligned");
  in = good_inputs(s);
  in.weights.w_gate.data = static_cast<char*>(in.weights.w_gate.data) + 128;
  EXPECT_NO_THROW(validate_inputs(s, in));
  Gradients g = good_gradients(s);
  g.dw_up.data = static_cast<char*>(g.dw_up.data) + 32;
  expect_error([&] { validate_gradients(s, make_view(fake(21), DType::kBF16, {s.tokens, s.hidden}), g); }, "dw_up",
               "128-byte aligned");
}

// The halves of one concatenated [E, 2I, H] gate_up tensor (and of its gradient), gate first.
void gate_up_halves(TensorView& gate, TensorView& up, void* base, int64_t E, int64_t I, int64_t H) {
  gate = make_view(base, DType::kBF16, {E, I, H});
  up = make_view(static_cast<char*>(base) + 2 * I * H, DType::kBF16, {E, I, H});
  gate.strides[0] = up.strides[0] = 2 * I * H;
}

TEST(Validation, GateAndUpMayBeHalvesOfOneTensor) {
  const LayerShape s = small_shape();
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, E = s.local_experts();
  const auto far = [](int i) -> void* { return reinterpret_cast<void*>((uintptr_t(i) + 1) << 24); };
  LayerInputs in = good_inputs(s, far);
  Gradients g = good_gradients(s, far);
  gate_up_halves(in.weights.w_gate, in.weights.w_up, far(3), E, I, H);
  gate_up_halves(g.dw_gate, g.dw_up, far(12), E, I, H);
  const TensorView dy = make_view(far(21), DType::kBF16, {T, H});
  EXPECT_NO_THROW(validate_inputs(s, in));
  EXPECT_NO_THROW(validate_weights(s, in.weights));
  EXPECT_NO_THROW(validate_gradients(s, dy, g));
  EXPECT_NO_THROW(api::check_forward_aliasing(in, make_view(far(20), DType::kBF16, {T, H})));
  EXPECT_NO_THROW(api::check_backward_aliasing(in, dy, g));

  // Each expert's rows must be contiguous, and its matrix may not reach the next expert's.
  LayerInputs bad = in;
  bad.weights.w_up.strides[1] = 2 * H;
  expect_error([&] { validate_inputs(s, bad); }, "w_up", "rows contiguous");
  bad = in;
  bad.weights.w_gate.strides[0] = I * H - 64;
  expect_error([&] { validate_inputs(s, bad); }, "w_gate", "at least I·H");
  // e4m3 weights (set_quantized_weights') have no expert stride.
  bad = in;
  bad.weights.w_gate.dtype = bad.weights.w_up.dtype = bad.weights.w_down.dtype = DType::kE4M3;
  expect_error([&] { validate_inputs(s, bad); }, "w_gate", "contiguous");

  // Interleaved gradients overlapping one another, or the weights they are the gradients of.
  Gradients overlapping = g;
  overlapping.dw_up.data = static_cast<char*>(g.dw_up.data) - 128;
  expect_error([&] { api::check_backward_aliasing(in, dy, overlapping); }, "dw_gate", "shares memory with dw_up");
  overlapping = g;
  gate_up_halves(overlapping.dw_gate, overlapping.dw_up, far(3), E, I, H);
  expect_error([&] { api::check_backward_aliasing(in, dy, overlapping); }, "dw_gate",
               "shares memory with the input w_gate");
}

TEST(Validation, MissingAndUnexpectedTensors) {
  const LayerShape s = small_shape();
  LayerInputs in = good_inputs(s);
  in.weights.w_up = TensorView{};
  expect_error([&] { validate_inputs(s, in); }, "w_up", "absent");
  in = good_inputs(s);
  in.weights.ws_gate = TensorView{};
  expect_error([&] { validate_inputs(s, in); }, "ws_gate", "absent");
  const LayerShape no_shared = small_shape(0);
  in = good_inputs(s);  // carries shared weights
  expect_error([&] { validate_inputs(no_shared, in); }, "ws_gate", "no shared expert");
  Gradients g = good_gradients(s);
  g.d_topk_weights = TensorView{};
  expect_error([&] { validate_gradients(s, make_view(fake(21), DType::kBF16, {s.tokens, s.hidden}), g); },
               "d_topk_weights", "absent");
  g = good_gradients(s);
  expect_error([&] { validate_gradients(s, make_view(fake(21), DType::kF32, {s.tokens, s.hidden}), g); }, "dy",
               "bf16");
}

// Weight gradients come as groups, the routed experts' three and the shared expert's three: all of a
// group or none of it (none: not computed, e.g. for frozen experts); one missing from a given group is
// an error naming it.
TEST(Validation, WeightGradientsComeAsWholeGroups) {
  const LayerShape s = small_shape();
  const TensorView dy = make_view(fake(21), DType::kBF16, {s.tokens, s.hidden});
  Gradients g = good_gradients(s);
  g.dw_gate = g.dw_up = g.dw_down = TensorView{};
  EXPECT_NO_THROW(validate_gradients(s, dy, g));
  g.dws_gate = g.dws_up = g.dws_down = TensorView{};
  EXPECT_NO_THROW(validate_gradients(s, dy, g));
  g = good_gradients(s);
  g.dws_gate = g.dws_up = g.dws_down = TensorView{};
  EXPECT_NO_THROW(validate_gradients(s, dy, g));
  g = good_gradients(s);
  g.dw_up = TensorView{};
  expect_error([&] { validate_gradients(s, dy, g); }, "dw_up", "give all three, or none");
  g = good_gradients(s);
  g.dw_gate = g.dw_up = TensorView{};
  expect_error([&] { validate_gradients(s, dy, g); }, "dw_gate", "give all three, or none");
  g = good_gradients(s);
  g.dws_down = TensorView{};
  expect_error([&] { validate_gradients(s, dy, g); }, "dws_down", "give all three, or none");
  // dx and d_topk_weights are always needed.
  g = good_gradients(s);
  g.dx = TensorView{};
  expect_error([&] { validate_gradients(s, dy, g); }, "dx", "absent");
  // A group that is given is checked as before.
  g = good_gradients(s);
  g.dw_down = make_view(fake(14), DType::kF32, {s.local_experts(), s.hidden, s.intermediate});
  expect_error([&] { validate_gradients(s, dy, g); }, "dw_down", "bf16");
}

TEST(Validation, ShapeLimits) {
  LayerShape s = small_shape();
  s.top_k = 9;
  expect_error([&] { validate_shape(s); }, "shape.top_k", "larger than the number of experts");
  s = small_shape();
  s.top_k = 0;
  expect_error([&] { validate_shape(s); }, "shape.top_k", "at least 1");
  s = small_shape();
  s.hidden = 100;
  expect_error([&] { validate_shape(s); }, "shape.hidden", "multiple of 64");
  s = small_shape();
  s.intermediate = 0;
  expect_error([&] { validate_shape(s); }, "shape.intermediate", "positive");
  s = small_shape();
  s.shared_intermediate = 32;
  expect_error([&] { validate_shape(s); }, "shape.shared_intermediate", "multiple of 64");
  s = small_shape();
  s.tokens = 0;
  expect_error([&] { validate_shape(s); }, "shape.tokens", "[1,");
  s = small_shape();
  s.num_ranks = 3;
  expect_error([&] { validate_shape(s); }, "shape.num_experts", "not divisible");
  s = small_shape();
  s.num_ranks = 2;
  s.rank = 2;
  expect_error([&] { validate_shape(s); }, "shape.rank", "[0, num_ranks");
  s = small_shape();
  s.num_experts = Limits::kMaxExperts + 1;
  expect_error([&] { validate_shape(s); }, "shape.num_experts", "[1, 4096]");
  // The largest accepted sizes pass.
  s = small_shape();
  s.tokens = Limits::kMaxTokens;
  s.hidden = Limits::kMaxHidden;
  s.intermediate = Limits::kMaxIntermediate;
  s.num_experts = Limits::kMaxExperts;
  s.top_k = Limits::kMaxTopK;
  EXPECT_NO_THROW(validate_shape(s));
  // The validation of inputs re-checks the shape first.
  s.top_k = Limits::kMaxTopK + 1;
  expect_error([&] { validate_inputs(s, good_inputs(small_shape())); }, "shape.top_k", "at most");
}

// The schedule's padded rows are int32-indexed too: a shape whose rows fit but whose padding does not
// is rejected by the shape check, whatever capacity a config gives.
TEST(Validation, ScheduleRowsBeyondInt32AreRejected) {
  LayerShape s = small_shape(0);
  s.tokens = Limits::kMaxTokens - 1;
  s.top_k = Limits::kMaxTopK;
  s.num_ranks = Limits::kMaxRanks;
  s.num_experts = Limits::kMaxExperts;
  ASSERT_LE(s.tokens * s.top_k * s.num_ranks, Limits::kMaxRoutedRows);  // the rows alone fit
  expect_error([&] { validate_shape(s); }, "shape.tokens", "indexable");
  s.num_ranks = Limits::kMaxRanks / 2;
  EXPECT_NO_THROW(validate_shape(s));
  EXPECT_LE(worst_case_schedule_rows(s), Limits::kMaxRoutedRows + 1 - kTileRows);
}

// validate_output and validate_gradients check the shape first, as validate_inputs does.
TEST(Validation, OutputAndGradientChecksCheckTheShape) {
  LayerShape s = small_shape();
  const LayerShape good = s;
  s.tokens = -5;
  expect_error([&] { validate_output(s, make_view(fake(20), DType::kBF16, {good.tokens, good.hidden})); },
               "shape.tokens", "[1,");
  s = small_shape();
  s.num_experts = 6;
  s.num_ranks = 4;
  expect_error([&] { validate_gradients(s, make_view(fake(21), DType::kBF16, {s.tokens, s.hidden}), good_gradients(good)); },
               "shape.num_experts", "not divisible");
}

// Outputs may share memory with neither each other nor the call's inputs, by byte range: views into one
// allocation are rejected where they overlap and pass where they only touch.
TEST(Validation, OutputsSharingMemoryAreErrors) {
  const LayerShape s = small_shape();
  // 16 MB apart: each tensor of the small shape lies whole before the next.
  const auto far = [](int i) -> void* { return reinterpret_cast<void*>((uintptr_t(i) + 1) << 24); };
  const auto at = [&](int i) { return static_cast<char*>(far(i)); };
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, E = s.local_experts();
  const LayerInputs in = good_inputs(s, far);
  const Gradients good = good_gradients(s, far);
  const TensorView y = make_view(far(20), DType::kBF16, {T, H}), dy = make_view(far(21), DType::kBF16, {T, H});
  EXPECT_NO_THROW(api::check_forward_aliasing(in, y));
  EXPECT_NO_THROW(api::check_backward_aliasing(in, dy, good));

  // y: over x from its second row; right after x's last byte it passes.
  expect_error([&] { api::check_forward_aliasing(in, make_view(at(0) + 2 * H, DType::kBF16, {T, H})); }, "y",
               "shares memory with the input x");
  EXPECT_NO_THROW(api::check_forward_aliasing(in, make_view(at(0) + 2 * T * H, DType::kBF16, {T, H})));
  expect_error([&] { api::check_forward_aliasing(in, make_view(at(4) + 4096, DType::kBF16, {T, H})); }, "y",
               "shares memory with the input w_up");

  Gradients g = good;
  g.dx = dy;
  expect_error([&] { api::check_backward_aliasing(in, dy, g); }, "dx", "shares memory with the input dy");
  g = good;
  g.dx = make_view(at(0) + 2 * H * (T - 1), DType::kBF16, {T, H});  // x's last row
  expect_error([&] { api::check_backward_aliasing(in, dy, g); }, "dx", "shares memory with the input x");
  g = good;
  g.d_topk_weights = make_view(at(10) + 64, DType::kF32, {T, k});  // inside dx
  expect_error([&] { api::check_backward_aliasing(in, dy, g); }, "dx", "shares memory with d_topk_weights");
  g = good;
  g.dw_up = g.dw_gate;
  expect_error([&] { api::check_backward_aliasing(in, dy, g); }, "dw_gate", "shares memory with dw_up");
  g = good;
  g.dw_down = in.weights.w_down;
  expect_error([&] { api::check_backward_aliasing(in, dy, g); }, "dw_down", "shares memory with the input w_down");
  g = good;
  g.dws_up = in.weights.ws_gate;
  expect_error([&] { api::check_backward_aliasing(in, dy, g); }, "dws_up", "shares memory with the input ws_gate");
  // Gate and up gradients side by side in one allocation pass.
  g = good;
  g.dw_up = make_view(at(12) + 2 * E * I * H, DType::kBF16, {E, I, H});
  EXPECT_NO_THROW(api::check_backward_aliasing(in, dy, g));

  // A caller's context: written by a forward or a recompute, so apart from y and every input; read by a
  // backward, so apart from every gradient; touching passes.
  const api::ContextBytes ctx{at(30), 1 << 20};
  EXPECT_NO_THROW(api::check_context_written(in, y, ctx));
  EXPECT_NO_THROW(api::check_context_written(in, TensorView{}, ctx));
  EXPECT_NO_THROW(api::check_context_read(good, ctx));
  expect_error([&] { api::check_context_written(in, make_view(at(30) + (1 << 20) - 2, DType::kBF16, {T, H}), ctx); },
               "ctx.data", "shares memory with y");
  EXPECT_NO_THROW(api::check_context_written(in, make_view(at(30) + (1 << 20), DType::kBF16, {T, H}), ctx));
  expect_error([&] { api::check_context_written(in, TensorView{}, {at(0) + 2 * H * (T - 1), 4096}); }, "ctx.data",
               "shares memory with the input x");
  expect_error([&] { api::check_context_written(in, y, {at(5), 256}); }, "ctx.data", "shares memory with the input w_down");
  g = good;
  g.dw_down = make_view(at(30) + 512, DType::kBF16, {E, H, I});
  expect_error([&] { api::check_context_read(g, ctx); }, "dw_down", "shares memory with the input ctx.data");
  g = good;
  g.dx = make_view(at(30) - 2 * T * H, DType::kBF16, {T, H});  // ends where the context starts
  EXPECT_NO_THROW(api::check_context_read(g, ctx));
}

// Rank R's fake tensors, 16 MB apart, each rank's 64 after the one before; the weights every rank shares.
template <int R>
void* rank_far(int i) {
  return reinterpret_cast<void*>((uintptr_t(64 * R + i) + 1) << 24);
}
void* shared_far(int i) { return reinterpret_cast<void*>((uintptr_t(i) + 200) << 24); }

// Across the ranks of one *_ranks call: a rank's outputs apart from every other rank's outputs and
// inputs; inputs shared between ranks (read only) pass.
TEST(Validation, RanksSharingOutputsAreErrors) {
  const LayerShape s = small_shape();
  const int64_t T = s.tokens, H = s.hidden;
  void* (*const rank_at[3])(int) = {rank_far<0>, rank_far<1>, rank_far<2>};
  std::vector<LayerInputs> in;
  std::vector<TensorView> y, dy;
  std::vector<Gradients> g;
  for (const auto at : rank_at) {
    in.push_back(good_inputs(s, at));
    in.back().weights = good_inputs(s, shared_far).weights;
    y.push_back(make_view(at(20), DType::kBF16, {T, H}));
    dy.push_back(make_view(at(21), DType::kBF16, {T, H}));
    g.push_back(good_gradients(s, at));
  }
  EXPECT_NO_THROW(api::check_ranks_forward_aliasing(in, y));  // the weights shared by every rank
  EXPECT_NO_THROW(api::check_ranks_backward_aliasing(in, dy, g));
  std::vector<TensorView> y2 = y;
  y2[2] = y[0];
  expect_error([&] { api::check_ranks_forward_aliasing(in, y2); }, "y", "of rank 0 shares memory with y of rank 2");
  y2 = y;
  y2[1] = make_view(static_cast<char*>(rank_far<0>(0)) + 2 * H, DType::kBF16, {T, H});  // over rank 0's x
  expect_error([&] { api::check_ranks_forward_aliasing(in, y2); }, "y",
               "of rank 1 shares memory with the input x of rank 0");
  std::vector<Gradients> g2 = g;
  g2[0].dw_gate = g[1].dw_gate;  // one weight gradient for two ranks
  expect_error([&] { api::check_ranks_backward_aliasing(in, dy, g2); }, "dw_gate",
               "of rank 0 shares memory with dw_gate of rank 1");
  g2 = g;
  g2[2].dx = dy[1];
  expect_error([&] { api::check_ranks_backward_aliasing(in, dy, g2); }, "dx",
               "of rank 2 shares memory with the input dy of rank 1");
  g2 = g;
  g2[1].dw_down = in[0].weights.w_down;  // the shared weights are an input of every rank
  expect_error([&] { api::check_ranks_backward_aliasing(in, dy, g2); }, "dw_down",
               "of rank 1 shares memory with the input w_down of rank 0");
}

TEST(Validation, RoutingCheckOnDeviceData) {
  auto bits = [](float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
  };
  EXPECT_EQ(check_route(0, bits(0.5f), 8), StatusCode::kOk);
  EXPECT_EQ(check_route(7, bits(0.0f), 8), StatusCode::kOk);
  EXPECT_EQ(check_route(8, bits(0.5f), 8), StatusCode::kExpertOutOfRange);
  EXPECT_EQ(check_route(-2, bits(0.5f), 8), StatusCode::kExpertOutOfRange);
  // -1: not routed, whatever its weight.
  EXPECT_EQ(check_route(-1, bits(0.5f), 8), StatusCode::kOk);
  EXPECT_EQ(check_route(-1, bits(std::numeric_limits<float>::quiet_NaN()), 8), StatusCode::kOk);
  EXPECT_EQ(check_route(int64_t(1) << 32, bits(0.5f), 8), StatusCode::kExpertOutOfRange);
  EXPECT_EQ(check_route(3, bits(std::numeric_limits<float>::quiet_NaN()), 8), StatusCode::kNonFiniteWeight);
  EXPECT_EQ(check_route(3, bits(std::numeric_limits<float>::infinity()), 8), StatusCode::kNonFiniteWeight);
  EXPECT_EQ(check_route(3, bits(-std::numeric_limits<float>::infinity()), 8), StatusCode::kNonFiniteWeight);
  EXPECT_EQ(check_route(3, bits(std::numeric_limits<float>::denorm_min()), 8), StatusCode::kOk);
}

TEST(Validation, StatusMessagesNameTheEntry) {
  DeviceStatus st{};
  EXPECT_EQ(describe_status(st, 4), "");
  st.code = int32_t(StatusCode::kExpertOutOfRange);
  st.a = 4 * 7 + 3;
  st.b = 130;
  st.c = 128;
  EXPECT_EQ(describe_status(st, 4), "topk_ids[7, 3] = 130 is out of range [0, 128) (rank 0)");
  st.code = int32_t(StatusCode::kNonFiniteWeight);
  st.a = 5;
  float nan = std::numeric_limits<float>::quiet_NaN();
  uint32_t b;
  std::memcpy(&b, &nan, sizeof b);
  st.b = b;
  EXPECT_NE(describe_status(st, 4).find("topk_weights[1, 1]"), std::string::npos);
  EXPECT_NE(describe_status(st, 4).find("not finite"), std::string::npos);
  st.code = int32_t(StatusCode::kCapacityOverflow);
  st.a = 1024;
  st.b = 512;
  EXPECT_NE(describe_status(st, 4).find("needs 1024 schedule rows but config.schedule_capacity is 512"),
            std::string::npos);
  st.code = int32_t(StatusCode::kWaitTimeout);
  st.rank = 17;
  st.a = 1;
  st.b = 42;
  EXPECT_NE(describe_status(st, 4).find("timed out in block 17: wait 1 = full stage"), std::string::npos);
  EXPECT_NE(describe_status(st, 4).find("task 42"), std::string::npos);
  st = DeviceStatus{};
  st.code = int32_t(StatusCode::kNonFiniteInput);
  st.a = int64_t(Fp8Tensor::kDown);
  EXPECT_EQ(describe_status(st, 4),
            "weights.w_down holds a NaN or an infinity, which the FP8 path cannot quantise (rank 0)");
  st.a = int64_t(Fp8Tensor::kX);
  EXPECT_EQ(describe_status(st, 4).find("x holds a NaN"), size_t(0));
  // At R > 1: found on rank 2, which holds it; a peer's report of it.
  st.rank = 2;
  EXPECT_EQ(describe_status(st, 4), "x holds a NaN or an infinity, which the FP8 path cannot quantise (rank 2)");
  st = DeviceStatus{};
  st.code = int32_t(StatusCode::kPeerFailed);
  st.rank = 0;
  st.a = 2;
  st.b = int64_t(StatusCode::kNonFiniteInput);
  EXPECT_NE(describe_status(st, 4).find("rank 2 reported an error in this pass (a NaN or an infinity in an FP8 operand"),
            std::string::npos)
      << describe_status(st, 4);
}

TEST(Validation, MakeViewRejectsTooManyDims) {
  expect_error([] { make_view(fake(0), DType::kF32, {1, 2, 3, 4, 5}); }, "make_view", "rank 5");
}

}  // namespace
}  // namespace lynx
