// Forward contexts held by the caller (CallerContext.*, Config::caller_context): several forwards in
// flight before their backwards give the bits of one forward and its backward at a time; a context
// is rejected for other inputs, unfilled, too small, filled by a workspace of another layout, or on a
// workspace that keeps its own; a forward given none keeps none, lent only the context's start.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/layer_check.h"
#include "gpu/poisoning_allocator.h"
#include "plan/context_layout.h"

namespace lynx::test {
namespace {

class CallerContext : public GpuTest {};

Config config_of(Backend b, bool caller_context) {
  Config c;
  c.backend = b;
  c.caller_context = caller_context;
  return c;
}

// A context's block, poisoned (0xFF) so that a buffer forward leaves unwritten cannot pass.
struct ContextBlock {
  DeviceBuffer buf;
  ForwardContext ctx;
  explicit ContextBlock(const Workspace& ws) : buf(size_t(ws.forward_context_bytes())) {
    buf.fill_bytes(0xFF);
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    ctx.data = buf.get();
    ctx.bytes = ws.forward_context_bytes();
  }
};

template <class F>
void expect_error(F&& f, const std::string& argument) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

// kLayers forwards of one workspace (different inputs of one shape), each into its own context, then
// the backwards in reverse order; each layer's outputs against a workspace that keeps its own context.
void expect_forwards_in_flight(Backend b) {
  constexpr int kLayers = 3;
  const Case c{300, 128, 1024, 8, 2, 64};
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const LayerStack stack = layers_with_outputs(c, kLayers, rng, config_of(b, false), false);
  const auto& [L, dy, want] = stack;
  Workspace ws(L[0]->shape, config_of(b, true));
  const Workspace own(L[0]->shape, config_of(b, false));
  EXPECT_EQ(ws.forward_context_bytes(), forward_context_bytes(L[0]->shape, config_of(b, true)));
  EXPECT_EQ(own.forward_context_bytes(), 0);
  EXPECT_LE(ws.device_bytes() + ws.forward_context_bytes(), own.device_bytes() + 16 * 1024);
  std::vector<std::unique_ptr<ContextBlock>> ctx;
  std::vector<std::unique_ptr<OutputBuffers>> out;
  std::vector<DeviceBuffer> d_dy;
  for (int i = 0; i < kLayers; ++i) {
    ctx.push_back(std::make_unique<ContextBlock>(ws));
    out.push_back(std::make_unique<OutputBuffers>(c));
    out[i]->poison();
    d_dy.push_back(to_device(dy[i]));
  }
  for (int i = 0; i < kLayers; ++i) {
    forward(ws, L[i]->inputs(), out[i]->y_view(), ctx[i]->ctx, nullptr);
    EXPECT_TRUE(ctx[i]->ctx.valid);
  }
  for (int i = kLayers - 1; i >= 0; --i) {
    backward(ws, L[i]->inputs(), make_view(d_dy[i].get(), DType::kBF16, {c.T, c.H}), out[i]->grads(), ctx[i]->ctx,
             nullptr);
  }
  ws.check(nullptr);
  for (int i = 0; i < kLayers; ++i) {
    EXPECT_EQ(first_difference(out[i]->to_host_outputs(), want[i]), "") << "layer " << i;
  }
}

TEST_F(CallerContext, ForwardsInFlightFused) { expect_forwards_in_flight(Backend::kFused); }
TEST_F(CallerContext, ForwardsInFlightUnfused) { expect_forwards_in_flight(Backend::kUnfused); }

// A context recomputed into a fresh block serves the backward as the forward's would.
TEST_F(CallerContext, RecomputedContext) {
  const Case c{200, 128, 128, 8, 2, 64};
  HostLayer L(c, fresh_seed());
  std::mt19937_64 rng(fresh_seed());
  const std::vector<HostBf16> dy = random_bf16(rng, c.T * c.H, 1.0);
  Workspace own(L.shape, config_of(Backend::kFused, false));
  const Outputs want = run_layer(own, L, dy);
  Workspace ws(L.shape, config_of(Backend::kFused, true));
  ContextBlock first(ws), second(ws);
  OutputBuffers out(c);
  out.poison();
  DeviceBuffer d_dy = to_device(dy);
  forward(ws, L.inputs(), out.y_view(), first.ctx, nullptr);
  recompute_forward_context(ws, L.inputs(), second.ctx, nullptr);
  backward(ws, L.inputs(), make_view(d_dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), second.ctx, nullptr);
  ws.check(nullptr);
  EXPECT_EQ(first_difference(out.to_host_outputs(), want), "");
}

// A forward given no context keeps none: y has the bits of a forward that keeps its context. With an
// allocator it takes, after its scratch, exactly the context's start (the schedule and the shared
// expert's products: not g and u, which the fused forward then does not write; the unfused forward
// writes every buffer, so the whole block) and gives both back; without one it takes a pool's.
// Then a forward filling a context and its backward give the bits of a workspace that keeps its own, and
// recompute_forward_context and backward without a context are still errors.
void expect_forward_keeping_none(Backend b, Precision p) {
  const Case c{300, 128, 1024, 8, 2, 64};
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed));
  HostLayer L(c, seed);
  std::mt19937_64 rng(fresh_seed());
  const std::vector<HostBf16> dy = random_bf16(rng, c.T * c.H, 1.0);
  Config own_config = config_of(b, false);
  own_config.precision = p;
  Workspace own(L.shape, own_config);
  const bool fp8 = p == Precision::kFp8Block;
  if (fp8) quantize_weights(own, L.inputs().weights, nullptr);
  const Outputs want = run_layer(own, L, dy);

  PoisoningAllocator alloc;
  Config lent = own_config;
  lent.caller_context = true;
  lent.scratch_allocator = &alloc;
  Config bare = own_config;
  bare.caller_context = true;
  Workspace ws(L.shape, lent), ws_bare(L.shape, bare);
  if (fp8) {
    quantize_weights(ws, L.inputs().weights, nullptr);
    quantize_weights(ws_bare, L.inputs().weights, nullptr);
  }
  // g and u by slot ([T·k, I] bf16 each) at one rank on the fused backend.
  const int64_t gate_up = 2 * plan::lent_bytes(2 * c.T * c.k * c.I);
  const int64_t expected = b == Backend::kUnfused ? ws.forward_context_bytes() : ws.forward_context_bytes() - gate_up;
  OutputBuffers out(c), out_bare(c);
  out.poison();
  out_bare.poison();
  const int before = alloc.allocations;
  forward(ws, L.inputs(), out.y_view(), nullptr);
  EXPECT_EQ(alloc.allocations - before, 2) << "the scratch and the context's start";
  EXPECT_EQ(alloc.last_bytes, size_t(expected));
  EXPECT_EQ(alloc.outstanding, 0);
  forward(ws_bare, L.inputs(), out_bare.y_view(), nullptr);
  ws.check(nullptr);
  ws_bare.check(nullptr);
  EXPECT_EQ(ws.schedule().row_token_slot, nullptr) << "the workspace points into the block it gave back";
  Outputs y, y_bare, want_y;
  y.y = out.to_host_outputs().y;
  y_bare.y = out_bare.to_host_outputs().y;
  want_y.y = want.y;
  EXPECT_EQ(first_difference(y, want_y), "") << "with an allocator";
  EXPECT_EQ(first_difference(y_bare, want_y), "") << "without one";

  ContextBlock ctx(ws);
  OutputBuffers full(c);
  full.poison();
  DeviceBuffer d_dy = to_device(dy);
  const TensorView dyv = make_view(d_dy.get(), DType::kBF16, {c.T, c.H});
  expect_error([&] { recompute_forward_context(ws, L.inputs(), nullptr); }, "ctx");
  expect_error([&] { backward(ws, L.inputs(), dyv, full.grads(), nullptr); }, "ctx");
  forward(ws, L.inputs(), full.y_view(), ctx.ctx, nullptr);
  out.poison();
  forward(ws, L.inputs(), out.y_view(), nullptr);  // between a forward and its backward
  backward(ws, L.inputs(), dyv, full.grads(), ctx.ctx, nullptr);
  ws.check(nullptr);
  EXPECT_EQ(first_difference(full.to_host_outputs(), want), "");
  y.y = out.to_host_outputs().y;
  EXPECT_EQ(first_difference(y, want_y), "") << "between a forward and its backward";
  EXPECT_EQ(alloc.outstanding, 0);
}

TEST_F(CallerContext, ForwardKeepingNoneFused) { expect_forward_keeping_none(Backend::kFused, Precision::kBf16); }
TEST_F(CallerContext, ForwardKeepingNoneUnfused) { expect_forward_keeping_none(Backend::kUnfused, Precision::kBf16); }
TEST_F(CallerContext, ForwardKeepingNoneFp8) { expect_forward_keeping_none(Backend::kFused, Precision::kFp8Block); }

TEST_F(CallerContext, MisuseIsReportedByName) {
  const Case c{64, 64, 64, 4, 2, 0};
  HostLayer L(c, fresh_seed()), other(c, fresh_seed());
  Workspace ws(L.shape, config_of(Backend::kFused, true));
  Workspace own(L.shape, config_of(Backend::kFused, false));
  OutputBuffers out(c);
  DeviceBuffer d_dy = to_device(std::vector<HostBf16>(c.T * c.H, float_to_bf16(1.0f)));
  const TensorView dyv = make_view(d_dy.get(), DType::kBF16, {c.T, c.H});
  ContextBlock ctx(ws);
  expect_error([&] { backward(ws, L.inputs(), dyv, out.grads(), ctx.ctx, nullptr); }, "ctx");  // not filled
  expect_error([&] { recompute_forward_context(ws, L.inputs(), nullptr); }, "ctx");
  expect_error([&] { forward(own, L.inputs(), out.y_view(), ctx.ctx, nullptr); }, "ctx");
  ForwardContext small = ctx.ctx;
  small.bytes -= 1;
  expect_error([&] { forward(ws, L.inputs(), out.y_view(), small, nullptr); }, "ctx.bytes");
  forward(ws, other.inputs(), out.y_view(), ctx.ctx, nullptr);
  expect_error([&] { backward(ws, L.inputs(), dyv, out.grads(), ctx.ctx, nullptr); }, "ctx");  // other inputs
  backward(ws, other.inputs(), dyv, out.grads(), ctx.ctx, nullptr);
  ws.check(nullptr);
  // A context filled by a workspace of another layout (the unfused backend's, in a block large enough
  // for either), then one filled by a workspace of ws's layout.
  Workspace unfused(L.shape, config_of(Backend::kUnfused, true)), twin(L.shape, config_of(Backend::kFused, true));
  EXPECT_NE(unfused.context_layout(), ws.context_layout());
  EXPECT_EQ(twin.context_layout(), ws.context_layout());
  const int64_t bytes = std::max(ws.forward_context_bytes(), unfused.forward_context_bytes());
  DeviceBuffer block(static_cast<size_t>(bytes));
  ForwardContext foreign;
  foreign.data = block.get();
  foreign.bytes = bytes;
  forward(unfused, L.inputs(), out.y_view(), foreign, nullptr);
  expect_error([&] { backward(ws, L.inputs(), dyv, out.grads(), foreign, nullptr); }, "ctx");
  forward(twin, L.inputs(), out.y_view(), ctx.ctx, nullptr);
  backward(ws, L.inputs(), dyv, out.grads(), ctx.ctx, nullptr);
  ws.check(nullptr);
  twin.check(nullptr);
  unfused.check(nullptr);
}

}  // namespace
}  // namespace lynx::test
