// Expert parallelism across GPUs in one process (PeerAccess.*: connect_ranks over workspaces on R
// devices, the peer-access transport): R = the GPUs there are (2, 4 or 8 of them), each rank's inputs on
// its own device, its one-rank calls on a stream of that device; outputs equal one rank's bit for bit,
// an imbalanced routing too, and a rank that never runs its pass is reported. Skipped with fewer than
// two GPUs (the processes across GPUs are in test_rank_processes.cpp).
#include <gtest/gtest.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "gpu/rank_process_io.h"

namespace lynx::test {
namespace {

class PeerAccess : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    if (peer_group_gpus() == 0) GTEST_SKIP() << "needs two or more GPUs with peer access to each other";
  }
};

// Rank r of the group on device r: the global layer drawn again there (same seed: the same values), its
// slice, outputs, dy and workspace, all on that device.
struct GpuRank {
  int32_t device;
  std::unique_ptr<HostLayer> L;
  std::unique_ptr<OutputBuffers> global;
  std::unique_ptr<RankSlice> slice;
  DeviceBuffer d_dy;
  TensorView dy;
  std::unique_ptr<Workspace> ws;
  cudaStream_t stream = nullptr;

  GpuRank(const Case& c, uint64_t seed, const std::vector<HostBf16>& dy_host, int32_t R, int32_t r,
          const Config& config)
      : device(r) {
    LYNX_TEST_CUDA(cudaSetDevice(device));
    L = std::make_unique<HostLayer>(c, seed);
    global = std::make_unique<OutputBuffers>(c);
    global->poison();
    slice = std::make_unique<RankSlice>(*L, *global, R, r);
    d_dy = to_device(dy_host);
    const int64_t T = c.T / R;
    dy = make_view(static_cast<char*>(d_dy.get()) + 2 * r * T * c.H, DType::kBF16, {T, c.H});
    ws = std::make_unique<Workspace>(slice->shape, config);
    if (config.precision == Precision::kFp8Block) quantize_weights(*ws, slice->in.weights, nullptr);
    LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // The copies, poison and weight copies (legacy stream) done before a pass on `stream` reads them.
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    LYNX_TEST_CUDA(cudaSetDevice(0));
  }
  ~GpuRank() {
    cudaSetDevice(device);
    if (stream) cudaStreamDestroy(stream);
    ws.reset();
    slice.reset();
    global.reset();
    L.reset();
    d_dy = DeviceBuffer();
    cudaSetDevice(0);
  }
};

// Forward and backward of case c at R ranks, one per GPU, against one rank on GPU 0.
// NOTES: a short peer timeout: a failure that leaves some ranks' passes unqueued then ends their
// peers' waits (a trap that loses the context) in seconds rather than half a minute.
void expect_gpus_give_one_ranks_bits(const Case& c, Config config) {
  const int32_t R = peer_group_gpus();
  config.peer_timeout_ms = 10'000;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " on " + std::to_string(R) + " GPUs, seed " + std::to_string(seed));
  const std::vector<HostBf16> dy = process_dy(c, seed);
  Outputs want;
  {
    const HostLayer L(c, seed);
    Workspace one(L.shape, config);
    if (config.precision == Precision::kFp8Block) quantize_weights(one, L.inputs().weights, nullptr);
    want = run_layer(one, L, dy);
    one.check(nullptr);
  }
  std::vector<std::unique_ptr<GpuRank>> ranks;
  std::vector<Workspace*> ws;
  for (int32_t r = 0; r < R; ++r) {
    ranks.push_back(std::make_unique<GpuRank>(c, seed, dy, R, r, config));
    ws.push_back(ranks.back()->ws.get());
  }
  connect_ranks(ws);
  for (auto& g : ranks) {
    LYNX_TEST_CUDA(cudaSetDevice(g->device));
    forward(*g->ws, g->slice->in, g->slice->y, g->stream);
  }
  for (auto& g : ranks) {
    LYNX_TEST_CUDA(cudaSetDevice(g->device));
    backward(*g->ws, g->slice->in, g->dy, g->slice->grads, g->stream);
  }
  Outputs got = want;
  SharedSums shared;
  for (auto& g : ranks) {
    LYNX_TEST_CUDA(cudaSetDevice(g->device));
    g->ws->check(g->stream);
    decode_rank_outputs(c, R, g->device, encode_rank_outputs(*g->L, *g->global, *g->slice, R, g->device), got,
                        &shared);
  }
  LYNX_TEST_CUDA(cudaSetDevice(0));
  EXPECT_EQ(first_routed_difference(got, want), "") << "R GPUs differ from one rank";
  expect_shared_sums_near(shared, want);
}

TEST_F(PeerAccess, BitwiseEqualToOneRank) { expect_gpus_give_one_ranks_bits({1024, 256, 256, 16, 4, 128}, {}); }

TEST_F(PeerAccess, EveryRowToOneRanksExpert) {
  Case c{512, 128, 128, 16, 2, 0};
  c.routing = "one";
  expect_gpus_give_one_ranks_bits(c, {});
}

TEST_F(PeerAccess, Fp8BitwiseEqualToOneRank) {
  Config config;
  config.precision = Precision::kFp8Block;
  expect_gpus_give_one_ranks_bits({1024, 256, 256, 16, 4, 128}, config);
}

// Rank 1 of two GPUs never runs its pass: rank 0 reports it and stops.
[[noreturn]] void run_without_rank_one() {
  const Case c{128, 64, 64, 4, 2, 0};
  Config config;
  config.peer_timeout_ms = 500;
  const std::vector<HostBf16> dy = process_dy(c, 7);
  GpuRank zero(c, 7, dy, 2, 0, config), one(c, 7, dy, 2, 1, config);
  connect_ranks({zero.ws.get(), one.ws.get()});
  try {
    LYNX_TEST_CUDA(cudaSetDevice(0));
    forward(*zero.ws, zero.slice->in, zero.slice->y, zero.stream);
    zero.ws->check(zero.stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(3);
  }
  std::exit(0);
}

TEST_F(PeerAccess, MissingRankIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_without_rank_one(), ::testing::ExitedWithCode(3),
              "peer arrival .*rank 1 had not arrived \\(1 barrier\\(s\\) behind\\)");
}

}  // namespace
}  // namespace lynx::test
