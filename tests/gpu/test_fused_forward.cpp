// The fused path's host side (FusedForward.*): graph replay, first calls not waiting, stalls reported, counters.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "experiments/test_hooks.h"
#include "gpu/layer_check.h"
#include "gpu/spin_kernel.h"

namespace lynx::test {
namespace {

// The fused forward has no host synchronisation: captured once in a CUDA graph, it is replayed with
// new routing written into the same buffers, and every replay matches the reference.
class FusedForward : public GpuTest {};

void capture_and_replay(const Case& c, int32_t clusters = -1) {
  HostLayer L(c, fresh_seed());
  Config config;
  config.backend = Backend::kFused;
  Workspace ws(L.shape, config);
  test_hooks::set_gemm_clusters(ws, clusters);
  DeviceBuffer y(c.T * c.H * 2);
  const TensorView yv = make_view(y.get(), DType::kBF16, {c.T, c.H});
  // NOTES: a blocking stream, so that the synchronous-looking cudaMemcpy / cudaMemset of new routing
  // and poison (legacy default stream) are ordered before each replay.
  cudaStream_t stream;
  LYNX_TEST_CUDA(cudaStreamCreate(&stream));
  forward(ws, L.inputs(), yv, stream);  // first call: one-time kernel setup stays out of the capture
  ws.check(stream);
  cudaGraph_t graph;
  LYNX_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  forward(ws, L.inputs(), yv, stream);
  LYNX_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  LYNX_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  std::mt19937_64 rng(fresh_seed());
  for (int replay = 0; replay < 3; ++replay) {
    const HostLayer fresh(c, rng());  // new routing and router weights; same x and weights buffers
    L.ids = fresh.ids;
    L.weights = fresh.weights;
    upload(L.d_ids.get(), L.ids.data(), L.ids.size() * 4);
    upload(L.d_weights.get(), L.weights.data(), L.weights.size() * 4);
    y.fill_bytes(0xFF);
    LYNX_TEST_CUDA(cudaGraphLaunch(exec, stream));
    ws.check(stream);
    const std::vector<double> w = L.weights_double();
    EXPECT_LT(rel_error(to_host<HostBf16>(y, c.T * c.H), ref::forward(L.reference(w)), "y"), kTolerance)
        << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_F(FusedForward, GraphReplayWithNewRouting) { capture_and_replay({300, 128, 192, 8, 2, 0}); }

TEST_F(FusedForward, GraphReplayWithSharedExpert) { capture_and_replay({200, 128, 64, 8, 2, 64}); }

TEST_F(FusedForward, GraphReplayInClusterUnits) { capture_and_replay({300, 128, 192, 8, 2, 0}, 1); }

// Backward after a forward whose schedule overflowed capacity, before the error is reported: the
// routed outputs (dx, d_topk_weights) stay unwritten, the weight gradients are exact zeros (no rows
// were placed), nothing is read from unplaced row slots (memcheck), and check() names the overflow.
TEST_F(FusedForward, BackwardAfterCapacityOverflowWritesNoRoutedOutputs) {
  Case c{100, 64, 64, 8, 2, 0};
  c.routing = "cyclic";  // all 8 experts receive rows: 8 padded blocks of 128
  HostLayer L(c, fresh_seed());
  Config config;
  config.backend = Backend::kFused;
  config.schedule_capacity = 256;
  Workspace ws(L.shape, config);
  OutputBuffers out(c);
  out.poison();
  DeviceBuffer dy = to_device(std::vector<HostBf16>(c.T * c.H, float_to_bf16(1.0f)));
  forward(ws, L.inputs(), out.y_view(), nullptr);
  backward(ws, L.inputs(), make_view(dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), nullptr);
  try {
    ws.check(nullptr);
    ADD_FAILURE() << "the overflow was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.schedule_capacity is 256"), std::string::npos) << e.what();
  }
  const Outputs o = out.to_host_outputs();
  for (HostBf16 v : o.dx) ASSERT_EQ(v.bits, 0xFFFF) << "dx was written";
  for (float v : o.d_topk) ASSERT_TRUE(std::isnan(v)) << "d_topk_weights was written";
  for (const auto* dw : {&o.dw_gate, &o.dw_up, &o.dw_down}) {
    for (HostBf16 v : *dw) ASSERT_EQ(v.bits & 0x7FFF, 0) << "a weight gradient is not zero";
  }
}

// A workspace destroyed right after queueing a call: its destructor waits for the device, so the
// queued kernels never touch freed memory (memcheck runs this test) and the output is complete.
TEST_F(FusedForward, DestroyingAWorkspaceWaitsForItsKernels) {
  const Case c{300, 128, 128, 8, 2, 64};
  HostLayer L(c, fresh_seed());
  DeviceBuffer y(c.T * c.H * 2);
  y.fill_bytes(0xFF);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());  // the poison lands before the non-blocking stream starts
  cudaStream_t stream;
  LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    Config config;
    config.backend = Backend::kFused;
    Workspace ws(L.shape, config);
    forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {c.T, c.H}), stream);
  }
  LYNX_TEST_CUDA(cudaStreamSynchronize(stream));
  LYNX_TEST_CUDA(cudaStreamDestroy(stream));
  const std::vector<double> w = L.weights_double();
  EXPECT_LT(rel_error(to_host<HostBf16>(y, c.T * c.H), ref::forward(L.reference(w)), "y"), kTolerance);
}

// Shapes too large for the CPU reference: the fused forward against the unfused one.
void expect_fused_forward_matches_unfused(const Case& c) {
  const HostLayer L(c, fresh_seed());
  std::vector<std::vector<HostBf16>> ys;
  for (Backend b : {Backend::kUnfused, Backend::kFused}) {
    Config config;
    config.backend = b;
    Workspace ws(L.shape, config);
    DeviceBuffer y(c.T * c.H * 2);
    y.fill_bytes(0xFF);
    forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {c.T, c.H}), nullptr);
    ws.check(nullptr);
    ys.push_back(to_host<HostBf16>(y, c.T * c.H));
  }
  EXPECT_LT(rel_error(ys[1], to_double_vec(ys[0]), "y (fused vs unfused)"), kTolerance);
}

TEST_F(FusedForward, MatchesUnfusedOnALargerShape) {
  expect_fused_forward_matches_unfused({4096, 1024, 512, 32, 4, 256});
}

// The most tokens the API accepts (2^20, k = 2: 2 Mi entries, 128 schedule blocks of 8 rounds each);
// a CPU reference at this size would take minutes.
TEST_F(FusedForward, MaxTokensMatchesUnfused) {
  expect_fused_forward_matches_unfused({Limits::kMaxTokens, 64, 64, 8, 2, 0});
}

// What the kernels' last blocks set back is at rest after every call: a forward and backward (the
// in-kernel gathers of x and dy), a call with a routing error, a call over the schedule's capacity
// (the GEMMs have no tiles), and a good call after them; in cluster units and on single CTAs.
TEST_F(FusedForward, CountersAreAtRestBetweenCalls) {
  for (int32_t clusters : {0, 1}) {
    SCOPED_TRACE("clusters=" + std::to_string(clusters));
    const Case c{600, 128, 192, 8, 2, 64};
    HostLayer L(c, fresh_seed());
    std::mt19937_64 rng(fresh_seed());
    const std::vector<HostBf16> dy = random_bf16(rng, c.T * c.H, 1.0);
    Config config;
    config.backend = Backend::kFused;
    Workspace ws(L.shape, config);
    test_hooks::set_gemm_clusters(ws, clusters);
    EXPECT_EQ(test_hooks::counters_not_at_rest(ws), "") << "new workspace";
    run_layer(ws, L, dy);
    EXPECT_EQ(test_hooks::counters_not_at_rest(ws), "") << "after forward and backward";
    OutputBuffers out(c);
    const std::vector<int32_t> good = L.ids;
    L.ids[5 * c.k + 1] = int32_t(c.E);
    L.d_ids = to_device(L.ids);
    EXPECT_THROW({ forward(ws, L.inputs(), out.y_view(), nullptr); ws.check(nullptr); }, Error);
    EXPECT_EQ(test_hooks::counters_not_at_rest(ws), "") << "after a routing error";
    L.ids = good;
    L.d_ids = to_device(L.ids);
    Config small = config;
    small.schedule_capacity = 128;  // 8 experts with rows need 8 blocks
    Workspace over(L.shape, small);
    EXPECT_THROW({ forward(over, L.inputs(), out.y_view(), nullptr); over.check(nullptr); }, Error);
    EXPECT_EQ(test_hooks::counters_not_at_rest(over), "") << "after a capacity overflow";
    EXPECT_EQ(first_difference(run_layer(ws, L, dy), run_layer(ws, L, dy)), "");
    EXPECT_EQ(test_hooks::counters_not_at_rest(ws), "") << "after good calls";
  }
}

// Forward and backward of the fused path captured together in one CUDA graph, replayed with new
// routing: every gradient matches the reference on every replay.
TEST_F(FusedForward, GraphReplayOfForwardAndBackward) {
  HostLayer L({250, 128, 128, 8, 2, 64}, fresh_seed());
  Config config;
  config.backend = Backend::kFused;
  Workspace ws(L.shape, config);
  expect_graph_replays_match_reference(ws, L, true);
}

// A forced stall (run_stalled_forward, layer_check.h): tile 0's loads are never issued.
[[noreturn]] void run_stalled_tile(int32_t clusters) {
  run_stalled_forward([clusters](Workspace& ws) {
    test_hooks::set_stall_task(ws, 0);
    test_hooks::set_gemm_clusters(ws, clusters);
  });
}

TEST_F(FusedForward, ForcedStallIsReportedNotHung) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_stalled_tile(0), ::testing::ExitedWithCode(3), "timed out in block [0-9]+: wait [12] = (full|empty) stage.*\\[context lost\\]");
}

// The same in cluster units with in-order claims: rank 0 of the cluster that claims unit 0 stops; its
// consumers, its partner's producer (stages or the unit mailbox) or its partner's consumers time out.
TEST_F(FusedForward, ForcedStallInAClusterIsReportedNotHung) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_stalled_tile(1), ::testing::ExitedWithCode(3),
              "timed out in block [0-9]+: wait [1-4] = (full stage|empty stage|unit posted|unit taken).*\\[context lost\\]");
}

// A schedule block never arrives at the builder's first grid barrier (test hook): the bounded wait
// of the blocks there reports it, naming the wait.
[[noreturn]] void run_stalled_schedule() {
  run_stalled_forward([](Workspace& ws) { test_hooks::set_schedule_stall_block(ws, 0); });
}

TEST_F(FusedForward, StalledScheduleIsReportedNotHung) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_stalled_schedule(), ::testing::ExitedWithCode(3),
              "timed out in block [0-9]+: wait 7 = schedule blocks.*barrier 1.*\\[context lost\\]");
}

// A workspace's first forward and backward only queue work: behind a kernel that keeps the GPU busy
// for 500 ms, both host calls return long before it ends. In a child process, so that no kernel is
// loaded yet: lazy module loading loads a kernel at its first launch, cuBLAS a kernel at its first
// product of a shape, and a load waits for the kernels running (common/kernel_loading.h). With a
// shared expert (cuBLAS), in bf16 and in FP8 (whose weights are quantised before the busy kernel).
[[noreturn]] void run_first_calls_behind_a_busy_gpu(Precision precision) {
  const Case c{300, 128, 128, 4, 2, 64};
  const HostLayer L(c, 7);
  Config config;
  config.backend = Backend::kFused;
  config.precision = precision;
  Workspace ws(L.shape, config);
  OutputBuffers out(c);
  const DeviceBuffer dy = to_device(std::vector<HostBf16>(c.T * c.H, float_to_bf16(1.0f)));
  cudaStream_t stream;
  LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (precision == Precision::kFp8Block) quantize_weights(ws, L.inputs().weights, stream);
  spin_on_stream(stream, 500'000'000);
  const auto t0 = std::chrono::steady_clock::now();
  forward(ws, L.inputs(), out.y_view(), stream);
  backward(ws, L.inputs(), make_view(dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), stream);
  const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ws.check(stream);
  std::fprintf(stderr, "host %.1f ms\n", host_ms);
  std::exit(host_ms < 100 ? 0 : 4);
}

TEST_F(FusedForward, FirstCallsDoNotWaitForTheGpu) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_first_calls_behind_a_busy_gpu(Precision::kBf16), ::testing::ExitedWithCode(0), "host [0-9.]+ ms");
}

TEST_F(FusedForward, FirstFp8CallsDoNotWaitForTheGpu) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_first_calls_behind_a_busy_gpu(Precision::kFp8Block), ::testing::ExitedWithCode(0),
              "host [0-9.]+ ms");
}

// A workspace's calls on two streams run in the order they were queued (lynx/moe.h): behind a kernel
// that keeps stream a busy for 300 ms, a forward on a and its backward on stream b give the bits of the
// two on one stream (another workspace's), where the workspace held another layer's context before (the
// backward, unordered, would read that one); a check on b after a forward on a with an expert id out of
// range, queued behind the busy kernel, reports it (it would read the status before the forward wrote it).
TEST_F(FusedForward, CallsOnTwoStreamsRunInTheOrderQueued) {
  const Case c{300, 128, 128, 4, 2, 64};
  const uint64_t seed = fresh_seed();
  HostLayer L(c, seed);
  const HostLayer other(c, seed + 1);
  Config config;
  config.backend = Backend::kFused;
  const std::vector<HostBf16> dy = random_dy(c);
  Outputs want;
  {
    Workspace one_stream(L.shape, config);
    want = run_layer(one_stream, L, dy);
  }
  Workspace ws(L.shape, config);
  const Outputs stale = run_layer(ws, other, dy);
  ASSERT_NE(first_difference(stale, want), "");
  cudaStream_t a, b;
  LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  OutputBuffers out(c);
  out.poison();
  const DeviceBuffer d_dy = to_device(dy);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  spin_on_stream(a, 300'000'000);
  forward(ws, L.inputs(), out.y_view(), a);
  backward(ws, L.inputs(), make_view(d_dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), b);
  ws.check(b);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(first_difference(out.to_host_outputs(), want), "");

  L.ids[7 * c.k + 1] = int32_t(c.E);
  L.d_ids = to_device(L.ids);
  spin_on_stream(a, 300'000'000);
  forward(ws, L.inputs(), out.y_view(), a);
  try {
    ws.check(b);
    ADD_FAILURE() << "check on another stream than the forward's reported nothing";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("topk_ids[7, 1] = 4 is out of range [0, 4)"), std::string::npos) << e.what();
  }
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

}  // namespace
}  // namespace lynx::test
