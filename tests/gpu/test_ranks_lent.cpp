// Expert-parallel workspaces that keep no forward context and own no scratch (RanksLent.*:
// Config::caller_context and Config::scratch_allocator at R > 1, as the PyTorch binding makes them):
// several forwards of one group in flight before their backwards, each rank's calls on a stream of its
// own, give every layer the routed bits of one rank holding every token and expert; a forward keeping
// no context among them too.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/poisoning_allocator.h"
#include "gpu/ranks_check.h"
#include "plan/context_layout.h"

namespace lynx::test {
namespace {

class RanksLent : public GpuTest {};

// One layer of the stack on the group: its rank slices (outputs into `global`), dy views and contexts.
struct GroupLayer {
  OutputBuffers global;
  DeviceBuffer d_dy;
  std::vector<RankSlice> slices;
  std::vector<TensorView> dy;
  std::vector<DeviceBuffer> ctx_memory;
  std::vector<ForwardContext> ctx;

  GroupLayer(const HostLayer& L, const std::vector<HostBf16>& dy_host, const std::vector<Workspace*>& ws)
      : global(L.c), d_dy(to_device(dy_host)) {
    global.poison();
    const int32_t R = int32_t(ws.size());
    const int64_t T = L.c.T / R;
    slices.reserve(R);
    ctx_memory.reserve(R);
    for (int32_t r = 0; r < R; ++r) {
      slices.emplace_back(L, global, R, r);
      dy.push_back(make_view(static_cast<char*>(d_dy.get()) + 2 * r * T * L.c.H, DType::kBF16, {T, L.c.H}));
      ctx_memory.emplace_back(size_t(ws[r]->forward_context_bytes()));
      ctx_memory.back().fill_bytes(0xFF);
      ForwardContext c;
      c.data = ctx_memory.back().get();
      c.bytes = ws[r]->forward_context_bytes();
      ctx.push_back(c);
    }
  }
};

// kLayers layers of case c on R virtual ranks: every forward, then every backward in reverse order; then
// each layer on one rank (so that, in a fresh process, the ranks' passes are the first to run).
void expect_forwards_in_flight(const Case& c, int32_t R, Precision precision) {
  constexpr int kLayers = 3;
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " R = " + std::to_string(R) + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Config one;
  one.precision = precision;
  std::vector<std::unique_ptr<HostLayer>> L;
  std::vector<std::vector<HostBf16>> dy;
  for (int i = 0; i < kLayers; ++i) {
    L.push_back(std::make_unique<HostLayer>(c, rng()));
    dy.push_back(random_bf16(rng, c.T * c.H, 1.0));
  }

  PoisoningAllocator scratch;
  Config lent = one;
  lent.caller_context = true;
  lent.scratch_allocator = &scratch;
  const auto owned = make_virtual_ranks(L[0]->shape, R, lent);
  const std::vector<Workspace*> ws = pointers(owned);
  {
    LayerShape s = ws[0]->shape();
    const Workspace owning(s, one);
    EXPECT_LT(ws[0]->device_bytes() + ws[0]->scratch_bytes() + ws[0]->forward_context_bytes(),
              owning.device_bytes() + 64 * 1024)
        << "what a rank lends and keeps is what it would own";
    EXPECT_LT(ws[0]->device_bytes(), owning.device_bytes() - ws[0]->forward_context_bytes());
  }
  std::vector<std::unique_ptr<GroupLayer>> layers;
  for (int i = 0; i < kLayers; ++i) layers.push_back(std::make_unique<GroupLayer>(*L[i], dy[i], ws));
  std::vector<cudaStream_t> streams(R);
  for (cudaStream_t& s : streams) LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // FP8: a rank's weight copies are its workspace's, so each pass first makes those of its layer.
  const auto weights_of = [&](int i, int32_t r) {
    if (precision == Precision::kFp8Block) quantize_weights(*ws[r], layers[i]->slices[r].in.weights, streams[r]);
  };
  for (int i = 0; i < kLayers; ++i) {
    for (int32_t r = 0; r < R; ++r) {
      weights_of(i, r);
      GroupLayer& g = *layers[i];
      forward(*ws[r], g.slices[r].in, g.slices[r].y, g.ctx[r], streams[r]);
      EXPECT_TRUE(g.ctx[r].valid);
    }
  }
  for (int i = kLayers - 1; i >= 0; --i) {
    for (int32_t r = 0; r < R; ++r) {
      weights_of(i, r);
      GroupLayer& g = *layers[i];
      backward(*ws[r], g.slices[r].in, g.dy[r], g.slices[r].grads, g.ctx[r], streams[r]);
    }
  }
  for (int32_t r = 0; r < R; ++r) ws[r]->check(streams[r]);
  for (cudaStream_t s : streams) LYNX_TEST_CUDA(cudaStreamDestroy(s));
  EXPECT_EQ(scratch.outstanding, 0) << "every call gives its scratch back";
  for (int i = 0; i < kLayers; ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    Workspace single(L[i]->shape, one);
    if (precision == Precision::kFp8Block) quantize_weights(single, L[i]->inputs().weights, nullptr);
    const Outputs want = run_layer(single, *L[i], dy[i]);
    const Outputs got = gather_outputs(*L[i], layers[i]->global, layers[i]->slices);
    EXPECT_EQ(first_routed_difference(got, want), "") << "differs from R = 1";
    if (c.Is > 0) {
      EXPECT_LT(rel_error(got.dws_gate, to_double_vec(want.dws_gate), "dws_gate"), kTolerance);
      EXPECT_LT(rel_error(got.dws_up, to_double_vec(want.dws_up), "dws_up"), kTolerance);
      EXPECT_LT(rel_error(got.dws_down, to_double_vec(want.dws_down), "dws_down"), kTolerance);
    }
  }
}

TEST_F(RanksLent, ForwardsInFlightAtTwoRanks) {
  expect_forwards_in_flight({384, 128, 128, 12, 2, 64}, 2, Precision::kBf16);
}
TEST_F(RanksLent, ForwardsInFlightAtThreeRanks) {
  expect_forwards_in_flight({384, 192, 128, 12, 4, 0}, 3, Precision::kBf16);
}
TEST_F(RanksLent, ForwardsInFlightAtTwoRanksFp8) {
  expect_forwards_in_flight({384, 256, 192, 8, 2, 64}, 2, Precision::kFp8Block);
}

// The same in a process of its own, where no kernel is loaded yet. The ranks' passes are called rank
// by rank from one thread, so a pass that loaded a kernel at its first launch (cuBLAS's for the shared
// expert, at its first product of a shape) while its own barrier waited for the next rank, whose pass
// is not queued yet, would wait for itself until the barrier's time limit (common/kernel_loading.h).
[[noreturn]] void run_first_forwards_in_flight() {
  expect_forwards_in_flight({384, 256, 192, 8, 2, 64}, 2, Precision::kFp8Block);
  std::exit(::testing::Test::HasFailure() ? 1 : 0);
}

TEST_F(RanksLent, FirstForwardsInFlightOfAProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_first_forwards_in_flight(), ::testing::ExitedWithCode(0), "");
}

// A context recomputed into a fresh block, after another layer's forward, serves the backward: the
// first forward's blocks are poisoned before it.
TEST_F(RanksLent, RecomputedContextAtTwoRanks) {
  constexpr int32_t R = 2;
  const Case c{256, 128, 128, 8, 2, 64};
  const HostLayer L0(c, fresh_seed()), L1(c, fresh_seed());
  const std::vector<HostBf16> dy0 = random_dy(c), dy1 = random_dy(c);
  Workspace one(L0.shape);
  const Outputs want0 = run_layer(one, L0, dy0), want1 = run_layer(one, L1, dy1);
  PoisoningAllocator scratch;
  Config lent;
  lent.caller_context = true;
  lent.scratch_allocator = &scratch;
  const auto owned = make_virtual_ranks(L0.shape, R, lent);
  const std::vector<Workspace*> ws = pointers(owned);
  GroupLayer g0(L0, dy0, ws), g1(L1, dy1, ws), again(L0, dy0, ws);
  std::vector<cudaStream_t> streams(R);
  for (cudaStream_t& s : streams) LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int32_t r = 0; r < R; ++r) forward(*ws[r], g0.slices[r].in, g0.slices[r].y, g0.ctx[r], streams[r]);
  for (int32_t r = 0; r < R; ++r) forward(*ws[r], g1.slices[r].in, g1.slices[r].y, g1.ctx[r], streams[r]);
  for (int32_t r = 0; r < R; ++r) recompute_forward_context(*ws[r], g0.slices[r].in, again.ctx[r], streams[r]);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  for (DeviceBuffer& b : g0.ctx_memory) b.fill_bytes(0xFF);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  for (int32_t r = 0; r < R; ++r) {
    backward(*ws[r], g1.slices[r].in, g1.dy[r], g1.slices[r].grads, g1.ctx[r], streams[r]);
  }
  for (int32_t r = 0; r < R; ++r) {
    backward(*ws[r], g0.slices[r].in, g0.dy[r], g0.slices[r].grads, again.ctx[r], streams[r]);
  }
  for (int32_t r = 0; r < R; ++r) ws[r]->check(streams[r]);
  for (cudaStream_t s : streams) LYNX_TEST_CUDA(cudaStreamDestroy(s));
  EXPECT_EQ(first_routed_difference(gather_outputs(L0, g0.global, g0.slices), want0), "") << "layer 0";
  EXPECT_EQ(first_routed_difference(gather_outputs(L1, g1.global, g1.slices), want1), "") << "layer 1";
}

// The *_ranks calls take each rank's scratch from the allocator too (a caller's context needs the
// one-rank calls, which take it).
TEST_F(RanksLent, VirtualRankCallsLendScratch) {
  const Case c{256, 128, 128, 8, 2, 64};
  const HostLayer L(c, fresh_seed());
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace one(L.shape);
  const Outputs want = run_layer(one, L, dy);
  PoisoningAllocator scratch;
  Config lent;
  lent.scratch_allocator = &scratch;
  const Outputs got = run_virtual_ranks(L, 4, dy, lent);
  EXPECT_EQ(first_routed_difference(got, want), "") << "differs from R = 1";
  EXPECT_EQ(scratch.outstanding, 0);
  lent.caller_context = true;
  VirtualGroup g(L, 2, dy, lent);
  try {
    g.forward(nullptr);
    ADD_FAILURE() << "forward_ranks took ranks that keep no context";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "ranks") << e.what();
  }
}

// A forward keeping no context (no ForwardContext given) at R ranks, between another layer's forward and
// its backward: each rank takes, after its scratch, exactly its context's start (the schedule, the shared
// expert's products and, in bf16, the x rows its gate/up GEMM reads; not g and u, [capacity, I] each by
// row at R > 1); y, and the other layer's outputs, have one rank's bits. Without an allocator (scratch
// owned, the context's start from the workspace's pool) the same bits.
void expect_forward_keeping_none(const Case& c, int32_t R, Precision precision, bool allocator = true) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " R = " + std::to_string(R) + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const HostLayer L0(c, rng()), L1(c, rng());
  const std::vector<HostBf16> dy0 = random_bf16(rng, c.T * c.H, 1.0), dy1 = random_bf16(rng, c.T * c.H, 1.0);
  const bool fp8 = precision == Precision::kFp8Block;
  Config one;
  one.precision = precision;
  Workspace single(L0.shape, one);
  if (fp8) quantize_weights(single, L0.inputs().weights, nullptr);
  const Outputs want0 = run_layer(single, L0, dy0);
  if (fp8) quantize_weights(single, L1.inputs().weights, nullptr);
  Outputs want1;
  want1.y = run_layer(single, L1, dy1).y;

  PoisoningAllocator scratch;
  Config lent = one;
  lent.caller_context = true;
  lent.scratch_allocator = allocator ? &scratch : nullptr;
  const auto owned = make_virtual_ranks(L0.shape, R, lent);
  const std::vector<Workspace*> ws = pointers(owned);
  GroupLayer g0(L0, dy0, ws), g1(L1, dy1, ws);
  std::vector<cudaStream_t> streams(R);
  for (cudaStream_t& s : streams) LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const auto weights_of = [&](GroupLayer& g, int32_t r) {
    if (fp8) quantize_weights(*ws[r], g.slices[r].in.weights, streams[r]);
  };
  for (int32_t r = 0; r < R; ++r) {
    weights_of(g0, r);
    forward(*ws[r], g0.slices[r].in, g0.slices[r].y, g0.ctx[r], streams[r]);
  }
  for (int32_t r = 0; r < R; ++r) {
    weights_of(g1, r);
    const int64_t cap = ws[r]->schedule().capacity, I = c.I, H = c.H;
    const int64_t not_lent = 2 * plan::lent_bytes(2 * cap * I) + (fp8 ? plan::lent_bytes(2 * cap * H) : 0);
    const int before = scratch.allocations;
    forward(*ws[r], g1.slices[r].in, g1.slices[r].y, streams[r]);
    if (!allocator) continue;
    EXPECT_EQ(scratch.allocations - before, 2) << "rank " << r << ": the scratch and the context's start";
    EXPECT_EQ(scratch.last_bytes, size_t(ws[r]->forward_context_bytes() - not_lent)) << "rank " << r;
  }
  for (int32_t r = 0; r < R; ++r) {
    weights_of(g0, r);
    backward(*ws[r], g0.slices[r].in, g0.dy[r], g0.slices[r].grads, g0.ctx[r], streams[r]);
  }
  for (int32_t r = 0; r < R; ++r) ws[r]->check(streams[r]);
  for (cudaStream_t s : streams) LYNX_TEST_CUDA(cudaStreamDestroy(s));
  EXPECT_EQ(scratch.outstanding, 0) << "every call gives its blocks back";
  Outputs got1;
  got1.y = gather_outputs(L1, g1.global, g1.slices).y;
  EXPECT_EQ(first_difference(got1, want1), "") << "the forward keeping none differs from R = 1";
  EXPECT_EQ(first_routed_difference(gather_outputs(L0, g0.global, g0.slices), want0), "") << "the other layer";
}

TEST_F(RanksLent, ForwardKeepingNoneAtTwoRanks) {
  expect_forward_keeping_none({256, 128, 128, 8, 2, 64}, 2, Precision::kBf16);
}
TEST_F(RanksLent, ForwardKeepingNoneAtTwoRanksWithoutAllocator) {
  expect_forward_keeping_none({256, 128, 128, 8, 2, 64}, 2, Precision::kBf16, false);
}
TEST_F(RanksLent, ForwardKeepingNoneAtThreeRanksFp8) {
  expect_forward_keeping_none({384, 256, 192, 12, 2, 64}, 3, Precision::kFp8Block);
}

}  // namespace
}  // namespace lynx::test
