// The parameterised layer tests (Backends/Layer.*): both paths against the CPU reference, and errors.
#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu/layer_check.h"

namespace lynx::test {
namespace {

// Every test runs once per backend.
class Layer : public GpuTest, public ::testing::WithParamInterface<Backend> {
 protected:
  Config config() const {
    Config c;
    c.backend = GetParam();
    return c;
  }
};

TEST_P(Layer, MatchesReference) {
  const auto seed = fresh_seed();
  RecordProperty("seed", std::to_string(seed));
  check_against_reference({200, 128, 64, 8, 2, 64}, seed, config());
}

TEST_P(Layer, GateAndUpAsHalvesOfOneTensor) { expect_gate_up_halves_give_the_same_bits({200, 128, 64, 8, 2, 64}, config()); }

// The gate a strided half, the up weight contiguous: the two at different expert strides; and one expert
// given as a half (an [1, I, H] view whose expert stride is never stepped).
TEST_P(Layer, GateAndUpAtDifferentStrides) {
  expect_gate_up_halves_give_the_same_bits({200, 128, 64, 8, 2, 64}, config(), true);
  expect_gate_up_halves_give_the_same_bits({90, 128, 64, 1, 1, 0}, config());
}

TEST_P(Layer, NoSharedExpertAndTopOne) {
  const auto seed = fresh_seed();
  check_against_reference({130, 128, 128, 4, 1, 0}, seed, config());
}

TEST_P(Layer, LargerShape) {
  check_against_reference({700, 256, 192, 16, 4, 128}, fresh_seed(), config());
}

// Slots not routed (id -1, router weight NaN, which must not be read): every third slot, and the
// second half of the tokens entirely; each adds nothing, its d_topk_weights is exactly 0 (outputs
// poisoned first), and a token with no routed slot gets the shared expert alone.
TEST_P(Layer, UnroutedSlots) {
  Case c{400, 128, 64, 8, 4, 64};
  c.unrouted_every = 3;
  c.routed_tokens = {200};
  check_against_reference(c, fresh_seed(), config());
  check_against_reference(c, fresh_seed(), config(), true);  // the context recomputed
}

TEST_P(Layer, ExpertsWithNoRows) {
  Case c{257, 64, 64, 8, 2, 0};
  c.routing = "subset";
  check_against_reference(c, fresh_seed(), config());
}

TEST_P(Layer, EveryRowToOneExpert) {
  Case c{300, 128, 64, 8, 1, 64};
  c.routing = "one";
  check_against_reference(c, fresh_seed(), config());
}

// About 4.7 row blocks per expert: the GEMM's static order rasters in groups of 4 row blocks
// (choose_tile_order), and groups reach across expert boundaries.
TEST_P(Layer, RasterGroupsSpanExperts) { check_against_reference({600, 128, 64, 4, 4, 0}, fresh_seed(), config()); }

// Every token to every expert (E = k = 4): 2200 rows, 18 row blocks per expert: tiles claimed in order,
// groups of 16 + 2 ending at each expert; the last block's 24 rows leave warpgroup 1 idle.
TEST_P(Layer, InOrderTilesWithManyBlocksPerExpert) {
  check_against_reference({2200, 128, 64, 4, 4, 0}, fresh_seed(), config());
}

// About 130 rows per expert, as deepseek-v3: tiles claimed in order, groups ending at each expert, and
// many experts with a second, nearly empty row block.
TEST_P(Layer, InOrderTilesWithTwoBlocksPerExpert) {
  check_against_reference({520, 128, 192, 16, 4, 0}, fresh_seed(), config());
}

TEST_P(Layer, OneLocalExpert) { check_against_reference({77, 64, 64, 1, 1, 0}, fresh_seed(), config()); }

TEST_P(Layer, SmallestShape) { check_against_reference({1, 64, 64, 1, 1, 64}, fresh_seed(), config()); }

// The largest sizes the API accepts, one at a time (tests/cpu/test_validation.cpp checks the limits
// themselves): the most experts with the largest top_k (most experts get no row; the schedule's
// offsets over 4096 experts run in one block), the largest hidden size, the largest intermediate
// size. The most tokens: MaxTokensMatchesUnfused.
TEST_P(Layer, MostExpertsAndLargestTopK) {
  check_against_reference({64, 64, 64, Limits::kMaxExperts, Limits::kMaxTopK, 0}, fresh_seed(), config());
}
TEST_P(Layer, LargestHidden) { check_against_reference({16, Limits::kMaxHidden, 64, 2, 2, 0}, fresh_seed(), config()); }
TEST_P(Layer, LargestIntermediate) {
  check_against_reference({16, 64, Limits::kMaxIntermediate, 2, 2, 64}, fresh_seed(), config());
}

TEST_P(Layer, Int64IdsAndZeroRouterWeights) {
  Case c{150, 128, 64, 8, 4, 64};
  c.int64_ids = true;
  c.zero_weights = true;
  check_against_reference(c, fresh_seed(), config());
}

TEST_P(Layer, RecomputedContextMatchesReference) {
  Config c = config();
  c.save_forward_context = false;
  check_against_reference({200, 128, 64, 8, 2, 64}, fresh_seed(), c, /*recompute=*/true);
}

TEST_P(Layer, BitwiseDeterministic) {
  const Case c{513, 256, 128, 16, 4, 64};
  const HostLayer L(c, fresh_seed());
  std::mt19937_64 rng(fresh_seed());
  const std::vector<HostBf16> dy = random_bf16(rng, c.T * c.H, 1.0);
  Workspace ws(L.shape, config());
  const Outputs first = run_layer(ws, L, dy);
  for (int run = 1; run < 20; ++run) {
    ASSERT_EQ(first_difference(run_layer(ws, L, dy), first), "") << "differs in run " << run;
  }
}

// A routing error on the device is reported by the call, naming the entry, and y is not written.
void expect_forward_error(HostLayer& L, const Config& config, const std::string& needle) {
  Workspace ws(L.shape, config);
  DeviceBuffer y(L.c.T * L.c.H * 2);
  y.fill_bytes(0x7B);
  try {
    forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {L.c.T, L.c.H}), nullptr);
    ws.check(nullptr);  // the fused path reports device-side errors here, not from forward
    ADD_FAILURE() << "forward accepted bad routing; expected: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  for (HostBf16 v : to_host<HostBf16>(y, L.c.T * L.c.H)) ASSERT_EQ(v.bits, 0x7B7B) << "y was written";
  // The workspace is usable again once the routing is fixed (two experts, well inside any capacity used).
  for (int64_t i = 0; i < int64_t(L.ids.size()); ++i) L.ids[i] = (i % L.c.k) % 2 == 0 ? 0 : int32_t(L.c.E - 1);
  L.weights.assign(L.weights.size(), 0.5f);
  L.d_ids = to_device(L.ids);
  L.d_weights = to_device(L.weights);
  EXPECT_NO_THROW(forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {L.c.T, L.c.H}), nullptr));
  EXPECT_NO_THROW(ws.check(nullptr));
}

TEST_P(Layer, ExpertIdOutOfRangeIsReported) {
  HostLayer L({64, 64, 64, 8, 2, 0}, fresh_seed());
  L.ids[2 * 37 + 1] = 8;
  L.ids[2 * 50 + 0] = -3;
  L.d_ids = to_device(L.ids);
  expect_forward_error(L, config(), "topk_ids[37, 1] = 8 is out of range [0, 8)");
}

TEST_P(Layer, NonFiniteRouterWeightIsReported) {
  HostLayer L({64, 64, 64, 8, 2, 0}, fresh_seed());
  L.weights[2 * 11 + 0] = std::numeric_limits<float>::infinity();
  L.d_weights = to_device(L.weights);
  expect_forward_error(L, config(), "topk_weights[11, 0] = inf is not finite");
}

// Routing errors of successive calls on one workspace, in entries of different schedule blocks: each
// call reports its own lowest offending entry (the tracking of the call before does not leak in), and
// a call with good routing after them reports nothing.
TEST_P(Layer, SuccessiveRoutingErrorsAreEachReported) {
  HostLayer L({1500, 64, 64, 8, 4, 0}, fresh_seed());  // 6000 entries: 3 schedule blocks of 2048
  const std::vector<int32_t> good_ids = L.ids;
  const std::vector<float> good_weights = L.weights;
  Workspace ws(L.shape, config());
  DeviceBuffer y(L.c.T * L.c.H * 2);
  const TensorView y_view = make_view(y.get(), DType::kBF16, {L.c.T, L.c.H});
  auto run = [&](const std::string& needle) {
    L.d_ids = to_device(L.ids);
    L.d_weights = to_device(L.weights);
    try {
      forward(ws, L.inputs(), y_view, nullptr);
      ws.check(nullptr);
      if (!needle.empty()) ADD_FAILURE() << "forward accepted bad routing; expected: " << needle;
    } catch (const Error& e) {
      if (needle.empty()) ADD_FAILURE() << "good routing reported: " << e.what();
      else EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    L.ids = good_ids;
    L.weights = good_weights;
  };
  L.ids[1400 * 4 + 1] = 9;
  L.ids[900 * 4 + 2] = -2;  // -1 is "not routed"
  run("topk_ids[900, 2] = -2 is out of range [0, 8)");
  L.ids[1300 * 4 + 0] = 8;
  L.weights[200 * 4 + 3] = -std::numeric_limits<float>::infinity();
  run("topk_weights[200, 3] = -inf is not finite");
  L.ids[1499 * 4 + 3] = 1000;
  run("topk_ids[1499, 3] = 1000 is out of range [0, 8)");
  run("");
}

TEST_P(Layer, CapacityOverflowIsReported) {
  Case c{100, 64, 64, 8, 2, 0};
  c.routing = "cyclic";  // all 8 experts receive rows: 8 padded blocks of 128
  HostLayer L(c, fresh_seed());
  Config small = config();
  small.schedule_capacity = 256;
  expect_forward_error(L, small, "needs 1024 schedule rows but config.schedule_capacity is 256");
}

// A bad route and an overflow in one call: the routing error is the one reported, as the first.
TEST_P(Layer, RoutingErrorWinsOverCapacityOverflow) {
  Case c{100, 64, 64, 8, 2, 0};
  c.routing = "cyclic";
  HostLayer L(c, fresh_seed());
  L.ids[2 * 60 + 1] = 8;
  L.d_ids = to_device(L.ids);
  Config small = config();
  small.schedule_capacity = 256;
  expect_forward_error(L, small, "topk_ids[60, 1] = 8 is out of range [0, 8)");
}

TEST_P(Layer, BackwardWithoutContextIsAnError) {
  const Case c{64, 64, 64, 4, 2, 0};
  HostLayer L(c, fresh_seed());
  Config no_context = config();
  no_context.save_forward_context = false;
  Workspace ws(L.shape, no_context);
  OutputBuffers out(c);
  DeviceBuffer dy(c.T * c.H * 2);
  forward(ws, L.inputs(), out.y_view(), nullptr);
  try {
    backward(ws, L.inputs(), make_view(dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), nullptr);
    ADD_FAILURE() << "backward ran without a forward context";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "backward");
    EXPECT_NE(std::string(e.what()).find("recompute_forward_context"), std::string::npos) << e.what();
  }
}

// Frozen experts: a backward without the routed experts' weight gradients (or the shared expert's)
// computes the other gradients with the whole backward's bits.
TEST_P(Layer, WeightGradientsLeftOut) {
  const Case c{200, 128, 64, 8, 2, 64};
  HostLayer L(c, fresh_seed());
  Workspace ws(L.shape, config());
  expect_weight_grads_can_be_left_out(ws, L);
}

// dx may alias neither dy nor x (backward reads x again after it writes dx): named errors, nothing run.
TEST_P(Layer, DxAliasingAnInputIsAnError) {
  const Case c{64, 64, 64, 4, 2, 0};
  HostLayer L(c, fresh_seed());
  Workspace ws(L.shape, config());
  OutputBuffers out(c);
  DeviceBuffer dy(c.T * c.H * 2);
  forward(ws, L.inputs(), out.y_view(), nullptr);
  const TensorView dyv = make_view(dy.get(), DType::kBF16, {c.T, c.H});
  for (const bool onto_x : {false, true}) {
    Gradients g = out.grads();
    g.dx = onto_x ? L.inputs().x : dyv;
    try {
      backward(ws, L.inputs(), dyv, g, nullptr);
      ADD_FAILURE() << "backward accepted dx aliasing " << (onto_x ? "x" : "dy");
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "dx");
      EXPECT_NE(std::string(e.what()).find(onto_x ? "shares memory with the input x" : "shares memory with the input dy"),
                std::string::npos)
          << e.what();
    }
  }
}

// The unfused backend reads counts back to the host, which a CUDA graph cannot hold: each call on a
// stream being captured is refused with an error naming the stream, nothing queued, so the capture
// ends cleanly with an empty graph and the workspace works afterwards.
class UnfusedBackend : public GpuTest {};
TEST_F(UnfusedBackend, CaptureIsRefusedBeforeAnythingRuns) {
  const Case c{64, 64, 64, 4, 2, 0};
  HostLayer L(c, fresh_seed());
  Config config;
  config.backend = Backend::kUnfused;
  Workspace ws(L.shape, config);
  OutputBuffers out(c);
  DeviceBuffer dy(c.T * c.H * 2);
  LYNX_TEST_CUDA(cudaMemset(dy.get(), 0, c.T * c.H * 2));
  const TensorView dyv = make_view(dy.get(), DType::kBF16, {c.T, c.H});
  cudaStream_t stream;
  LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  forward(ws, L.inputs(), out.y_view(), stream);  // a context for the backward below
  LYNX_TEST_CUDA(cudaStreamSynchronize(stream));
  const auto expect_refused = [&](const char* call, auto&& f) {
    cudaGraph_t graph = nullptr;
    LYNX_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      f();
      ADD_FAILURE() << call << " was queued into a capture";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "stream") << e.what();
      EXPECT_NE(std::string(e.what()).find("captured"), std::string::npos) << e.what();
    }
    LYNX_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
    size_t nodes = 1;
    LYNX_TEST_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
    EXPECT_EQ(nodes, 0u) << call;
    LYNX_TEST_CUDA(cudaGraphDestroy(graph));
  };
  expect_refused("forward", [&] { forward(ws, L.inputs(), out.y_view(), stream); });
  expect_refused("recompute_forward_context", [&] { recompute_forward_context(ws, L.inputs(), stream); });
  expect_refused("backward", [&] { backward(ws, L.inputs(), dyv, out.grads(), stream); });
  // The context the first forward saved is still there: the backward runs eagerly.
  backward(ws, L.inputs(), dyv, out.grads(), stream);
  ws.check(stream);
  LYNX_TEST_CUDA(cudaStreamSynchronize(stream));
  LYNX_TEST_CUDA(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Backends, Layer, ::testing::Values(Backend::kUnfused, Backend::kFused),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return info.param == Backend::kFused ? std::string("fused") : std::string("unfused");
                         });

}  // namespace
}  // namespace lynx::test
