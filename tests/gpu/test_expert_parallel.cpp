// Expert parallelism on virtual ranks (Ranks.*): R ranks on this GPU give the bits of one rank holding
// every token and every expert; errors and a missing rank are reported by every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "experiments/test_hooks.h"
#include "gpu/ranks_check.h"

namespace lynx::test {
namespace {

class Ranks : public GpuTest {};

// The routed outputs at R ranks equal R = 1's bit for bit; the shared expert's per-rank gradients sum
// to R = 1's (within the tolerance: a sum of R roundings); R = 1 itself against the reference.
void check_every_r(const Case& c, const std::vector<int32_t>& Rs, const Config& config = {}, bool recompute = false) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed));
  const HostLayer L(c, seed);
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace one(L.shape, config);
  const Outputs want = run_layer(one, L, dy, recompute);
  one.check(nullptr);
  expect_matches_reference(want, L, dy);
  expect_every_r_gives(want, L, Rs, dy, config, recompute);
}

TEST_F(Ranks, BitwiseEqualToOneRankAtEveryR) { check_every_r({512, 256, 128, 16, 4, 128}, {2, 4, 8}); }

// Small, for the sanitizers.
TEST_F(Ranks, TwoRanksSmall) { check_every_r({64, 64, 64, 4, 2, 64}, {2}); }

// Every row to expert E/2: one rank computes everything, the others receive no rows.
TEST_F(Ranks, EveryRowToOneRanksExpert) {
  Case c{256, 128, 64, 8, 1, 64};
  c.routing = "one";
  check_every_r(c, {4});
}

// Duplicate ids within a token (j even: expert 0, j odd: expert E-1) and zero router weights.
TEST_F(Ranks, DuplicateIdsAndZeroWeights) {
  Case c{200, 128, 64, 8, 4, 0};
  c.routing = "subset";
  c.zero_weights = true;
  check_every_r(c, {2, 8});
}

// The two ways rows are pulled at R > 1 (the row-major kernel, the default where ranks share a GPU as
// here; the GEMM's own gather, the default with a GPU per rank), and the in-GEMM gather held one row
// block ahead of the tiles (its throttle, with rows from every rank).
TEST_F(Ranks, EveryGatherGivesOneRanksBits) {
  const Case c{512, 128, 64, 8, 4, 64};
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed));
  const HostLayer L(c, seed);
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace one(L.shape);
  const Outputs want = run_layer(one, L, dy);
  one.check(nullptr);
  const auto run = [&](const char* what, const std::function<void(Workspace&)>& hook) {
    SCOPED_TRACE(what);
    EXPECT_EQ(first_routed_difference(run_virtual_ranks(L, 4, dy, {}, false, hook), want), "") << "differs from R = 1";
  };
  run("row-major gather kernel", [](Workspace& w) { test_hooks::set_gemm_gather(w, 0); });
  run("in-GEMM gather, lookahead 1", [](Workspace& w) {
    test_hooks::set_gemm_gather(w, 1);
    test_hooks::set_gather_lookahead(w, 1);
  });
}

// Virtual ranks share this GPU's SMs, so their plans pull gate/up's rows with the row-major kernel
// (plan/layer_plan.cpp).
TEST_F(Ranks, RanksOnOneGpuPullWithTheRowKernel) {
  const HostLayer L({512, 128, 64, 8, 4, 0}, fresh_seed());
  for (const auto& w : make_virtual_ranks(L.shape, 2)) {
    EXPECT_EQ(w->impl().plan.gate_up_gather, plan::GatherPlace::kRowKernel) << "rank " << w->shape().rank;
  }
}

// Ranks with fewer tokens than the others pad them with tokens not routed (ids -1, router weights NaN):
// rank 1 holds 32 real tokens of 64, rank 3 one. Every R bitwise equal to one rank (check_every_r), and
// the routed outputs of the real tokens (y, dx, d_topk_weights; the experts' weight gradients) bitwise
// equal to one rank holding the real tokens alone: the padding adds no row anywhere. (The shared
// expert sees the padding tokens: their y rows are its, their x and dy reach its gradients.)
TEST_F(Ranks, FewerTokensOnSomeRanks) {
  Case c{4 * 64, 128, 64, 16, 4, 64};
  c.routed_tokens = {64, 32, 64, 1};
  check_every_r(c, {2, 4});

  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed));
  const HostLayer L(c, seed);
  const std::vector<HostBf16> dy = random_dy(c);
  const Outputs padded = run_virtual_ranks(L, 4, dy);
  std::vector<int64_t> real;  // the real tokens, in order
  for (int64_t t = 0; t < c.T; ++t) {
    if (routed(c, t, 0)) real.push_back(t);
  }
  Case cr = c;
  cr.T = int64_t(real.size());
  cr.routed_tokens.clear();
  HostLayer R1(cr, seed);  // then given L's expert weights and its real tokens
  R1.w_gate = L.w_gate, R1.w_up = L.w_up, R1.w_down = L.w_down;
  R1.ws_gate = L.ws_gate, R1.ws_up = L.ws_up, R1.ws_down = L.ws_down;
  std::vector<HostBf16> dy_real;
  for (size_t i = 0; i < real.size(); ++i) {
    const int64_t t = real[i];
    std::copy_n(L.x.begin() + t * c.H, c.H, R1.x.begin() + int64_t(i) * c.H);
    std::copy_n(L.ids.begin() + t * c.k, c.k, R1.ids.begin() + int64_t(i) * c.k);
    std::copy_n(L.weights.begin() + t * c.k, c.k, R1.weights.begin() + int64_t(i) * c.k);
    dy_real.insert(dy_real.end(), dy.begin() + t * c.H, dy.begin() + (t + 1) * c.H);
  }
  R1.d_x = to_device(R1.x), R1.d_ids = to_device(R1.ids), R1.d_weights = to_device(R1.weights);
  R1.d_wg = to_device(R1.w_gate), R1.d_wu = to_device(R1.w_up), R1.d_wd = to_device(R1.w_down);
  R1.d_wsg = to_device(R1.ws_gate), R1.d_wsu = to_device(R1.ws_up), R1.d_wsd = to_device(R1.ws_down);
  Workspace one(R1.shape, Config{});
  const Outputs want = run_layer(one, R1, dy_real);
  one.check(nullptr);
  Outputs got = padded;  // its real tokens' rows
  got.y.clear(), got.dx.clear(), got.d_topk.clear();
  for (const int64_t t : real) {
    got.y.insert(got.y.end(), padded.y.begin() + t * c.H, padded.y.begin() + (t + 1) * c.H);
    got.dx.insert(got.dx.end(), padded.dx.begin() + t * c.H, padded.dx.begin() + (t + 1) * c.H);
    got.d_topk.insert(got.d_topk.end(), padded.d_topk.begin() + t * c.k, padded.d_topk.begin() + (t + 1) * c.k);
  }
  EXPECT_EQ(first_routed_difference(got, want), "") << "the padding changed a real token's bits";
  for (int64_t t = 0; t < c.T; ++t) {
    if (routed(c, t, 0)) continue;
    for (int64_t j = 0; j < c.k; ++j) ASSERT_EQ(padded.d_topk[t * c.k + j], 0.0f) << "padding token " << t;
  }
}

// Each rank's gate and up weights and their gradients as halves of one tensor (GateUpHalves: experts a
// stride apart), bf16 and FP8: R = 1's bits.
TEST_F(Ranks, GateAndUpAsHalvesOfOneTensor) {
  const Case c{256, 128, 128, 8, 2, 64};
  const int32_t R = 2;
  for (const Precision precision : {Precision::kBf16, Precision::kFp8Block}) {
    Config config;
    config.precision = precision;
    SCOPED_TRACE(precision == Precision::kBf16 ? "bf16" : "fp8");
    const HostLayer L(c, fresh_seed());
    const std::vector<HostBf16> dy = random_dy(c);
    const Outputs want = run_virtual_ranks(L, R, dy, config);
    const GateUpHalves joined(L);
    VirtualGroup g(L, R, dy, config);
    for (int32_t r = 0; r < R; ++r) {
      joined.views(r * (c.E / R), c.E / R, g.in[r].weights, g.grads[r]);
      if (precision == Precision::kFp8Block) quantize_weights(*g.ws[r], g.in[r].weights, nullptr);
    }
    g.forward(nullptr);
    g.backward(nullptr);
    g.check(nullptr);
    Outputs got = gather_outputs(L, g.global, g.slices);
    joined.expect_gradients_and_weights(got);
    EXPECT_EQ(first_routed_difference(got, want), "");
  }
}

TEST_F(Ranks, OneExpertPerRank) { check_every_r({256, 128, 128, 4, 2, 0}, {4}); }

TEST_F(Ranks, OneTokenPerRank) { check_every_r({4, 128, 64, 8, 2, 64}, {4}); }

// R not a power of two, E = 60.
TEST_F(Ranks, ThreeRanks) { check_every_r({300, 128, 128, 60, 6, 64}, {3}); }

TEST_F(Ranks, Int64IdsAndRecomputedContext) {
  Case c{256, 128, 64, 8, 2, 64};
  c.int64_ids = true;
  Config config;
  config.save_forward_context = false;
  check_every_r(c, {2}, config, true);
}

// A forward and backward of R = 4 captured in a CUDA graph, replayed with new inputs and routing in
// the same buffers: the bits of an eager R = 1 call on the new inputs.
TEST_F(Ranks, GraphReplayWithNewRouting) {
  const int32_t R = 4;
  const Case c{512, 128, 128, 16, 4, 64};
  const HostLayer A(c, fresh_seed()), B(c, fresh_seed());
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace one(B.shape);
  const Outputs want = run_layer(one, B, dy);
  one.check(nullptr);

  VirtualGroup g(A, R, dy);
  cudaStream_t stream;
  LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  g.forward(stream);  // eager first: A's routing
  g.backward(stream);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  LYNX_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  g.forward(stream);
  g.backward(stream);
  LYNX_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  LYNX_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  // B's inputs into A's buffers.
  const auto copy = [](const DeviceBuffer& to, const DeviceBuffer& from) {
    LYNX_TEST_CUDA(cudaMemcpy(to.get(), from.get(), from.bytes(), cudaMemcpyDeviceToDevice));
  };
  copy(A.d_x, B.d_x), copy(A.d_wg, B.d_wg), copy(A.d_wu, B.d_wu), copy(A.d_wd, B.d_wd);
  copy(A.d_wsg, B.d_wsg), copy(A.d_wsu, B.d_wsu), copy(A.d_wsd, B.d_wsd);
  const int64_t T = c.T / R;
  for (int32_t r = 0; r < R; ++r) {
    const std::vector<int32_t> ids(B.ids.begin() + r * T * c.k, B.ids.begin() + (r + 1) * T * c.k);
    const std::vector<float> w(B.weights.begin() + r * T * c.k, B.weights.begin() + (r + 1) * T * c.k);
    upload(g.slices[r].ids.get(), ids.data(), ids.size() * 4);
    upload(g.slices[r].weights.get(), w.data(), w.size() * 4);
    g.slices[r].d_topk.fill_bytes(0xFF);
  }
  g.global.poison();
  LYNX_TEST_CUDA(cudaGraphLaunch(exec, stream));
  LYNX_TEST_CUDA(cudaStreamSynchronize(stream));
  g.check(stream);
  const Outputs got = gather_outputs(B, g.global, g.slices);
  EXPECT_EQ(first_routed_difference(got, want), "") << "the replay differs from R = 1";
  LYNX_TEST_CUDA(cudaGraphExecDestroy(exec));
  LYNX_TEST_CUDA(cudaGraphDestroy(graph));
  LYNX_TEST_CUDA(cudaStreamDestroy(stream));
}

// One rank's bad route or schedule overflow: that rank reports it, every other rank reports that rank.
void expect_reported_by_every_rank(const HostLayer& L, int32_t R, const Config& config, int32_t bad_rank,
                                   const std::string& own_error) {
  VirtualGroup g(L, R, random_dy(L.c), config);
  std::vector<std::string> want(size_t(R), "rank " + std::to_string(bad_rank) + " reported an error");
  want[size_t(bad_rank)] = own_error;
  expect_forward_reported(g, L, want);
}

TEST_F(Ranks, BadRouteOnOneRankIsReportedByEvery) {
  HostLayer L({128, 64, 64, 8, 2, 0}, fresh_seed());
  L.ids[40 * 2 + 1] = 99;  // token 40: rank 1's token 8 (32 tokens per rank)
  expect_reported_by_every_rank(L, 4, Config{}, 1, "topk_ids[8, 1] = 99 is out of range");
}

TEST_F(Ranks, CapacityOverflowOnOneRankIsReportedByEvery) {
  Case c{256, 64, 64, 8, 1, 0};
  c.routing = "one";  // 256 rows on expert 4: rank 2 of 4
  const HostLayer L(c, fresh_seed());
  Config config;
  config.schedule_capacity = 128;
  expect_reported_by_every_rank(L, 4, config, 2, "needs 256 schedule rows");
}

// A backward_ranks call that one rank rejects (no context for its inputs) queues nothing on any rank:
// the next, correct, call still gives R = 1's bits (a rank that had arrived alone would leave the
// barrier counters out of step for good).
TEST_F(Ranks, RejectedCallQueuesNothing) {
  const Case c{256, 128, 64, 8, 2, 64};
  const HostLayer L(c, fresh_seed());
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace one(L.shape);
  const Outputs want = run_layer(one, L, dy);
  one.check(nullptr);
  VirtualGroup g(L, 4, dy);
  g.forward(nullptr);
  std::vector<LayerInputs> other = g.in;
  other[2].x = g.in[1].x;  // rank 2's x is not what its forward read
  try {
    backward_ranks(g.ws, other, g.dy, g.grads, nullptr);
    ADD_FAILURE() << "backward_ranks accepted rank 2's other x";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("of rank 2: "), std::string::npos) << e.what();  // which rank's
  }
  g.backward(nullptr);
  g.check(nullptr);
  EXPECT_EQ(first_routed_difference(gather_outputs(L, g.global, g.slices), want), "");
}

// Frozen experts at R = 4: backward_ranks without the routed experts' weight gradients gives every
// other output the bits of the whole backward (the shared expert's per-rank parts included).
TEST_F(Ranks, WeightGradientsLeftOut) {
  const Case c{256, 128, 64, 8, 2, 64};
  const HostLayer L(c, fresh_seed());
  const std::vector<HostBf16> dy = random_dy(c);
  VirtualGroup all(L, 4, dy);
  all.forward(nullptr);
  all.backward(nullptr);
  all.check(nullptr);
  const Outputs want = gather_outputs(L, all.global, all.slices);
  VirtualGroup part(L, 4, dy);
  for (Gradients& g : part.grads) g.dw_gate = g.dw_up = g.dw_down = TensorView{};
  part.forward(nullptr);
  part.backward(nullptr);
  part.check(nullptr);
  Outputs got = gather_outputs(L, part.global, part.slices);
  got.dw_gate = want.dw_gate, got.dw_up = want.dw_up, got.dw_down = want.dw_down;
  EXPECT_EQ(first_difference(got, want), "");
}

[[noreturn]] void run_without_rank_one() {
  const Case c{64, 64, 64, 4, 2, 0};
  const HostLayer L(c, 7);
  Config config;
  config.peer_timeout_ms = 500;
  auto ranks = make_virtual_ranks(L.shape, 2, config);
  OutputBuffers global(c);
  const RankSlice zero(L, global, 2, 0);
  try {
    forward(*ranks[0], zero.in, zero.y, nullptr);  // rank 1 never runs its pass
    ranks[0]->check(nullptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(3);
  }
  std::exit(0);
}

TEST_F(Ranks, MissingRankIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_without_rank_one(), ::testing::ExitedWithCode(3),
              "peer arrival .*rank 1 had not arrived \\(1 barrier\\(s\\) behind\\)");
}

TEST_F(Ranks, ConnectAndCallErrors) {
  LayerShape s{64, 64, 64, 4, 2, 0, 2, 0};
  Workspace a(s), b(s);
  EXPECT_THROW(connect_ranks({&a, &b}), Error);  // both rank 0
  const HostLayer L({128, 64, 64, 4, 2, 0}, 3);
  OutputBuffers global(L.c);
  const RankSlice zero(L, global, 2, 0);
  try {
    forward(a, zero.in, zero.y, nullptr);
    ADD_FAILURE() << "an unconnected rank ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not connected"), std::string::npos) << e.what();
  }
  s.rank = 1;
  Workspace c1(s);
  LayerShape other = s;
  other.hidden = 128;
  Workspace d1(other);
  EXPECT_THROW(connect_ranks({&a, &d1}), Error);  // another shape
  connect_ranks({&a, &c1});
  EXPECT_THROW(connect_ranks({&a, &c1}), Error);  // twice
}

}  // namespace
}  // namespace lynx::test
