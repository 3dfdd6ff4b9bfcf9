// Expert parallelism's tests: one global problem (a HostLayer of R·T tokens and E experts) cut into R
// ranks (rank r: tokens [r·T, (r+1)·T), experts [r·E/R, (r+1)·E/R)), run on virtual ranks or in R
// processes, and its outputs put back together in the global layout for a bitwise comparison with
// one rank.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "gpu/layer_check.h"
#include "lynx/ranks.h"

namespace lynx::test {

// Rank r's share of global layer L at R ranks: inputs (expert weights point into L's), outputs
// (views into `global` for everything but d_topk_weights and the shared expert's gradients, which
// are per rank).
struct RankSlice {
  LayerShape shape;
  DeviceBuffer ids, weights, d_topk, dws_gate, dws_up, dws_down;
  LayerInputs in;
  Gradients grads;
  TensorView y;

  RankSlice(const HostLayer& L, const OutputBuffers& global, int32_t R, int32_t r);
};

// The outputs of R ranks, in the global layout; the shared expert's gradients summed over the ranks
// (in double, rounded to bf16: they are per-rank partial sums by design).
Outputs gather_outputs(const HostLayer& L, const OutputBuffers& global, const std::vector<RankSlice>& slices);

// The first routed output (y, dx, d_topk_weights, dw_*) whose bits differ, "" when none.
std::string first_routed_difference(const Outputs& a, const Outputs& b);

// The R ranks of a group on the current device (virtual ranks), connected.
std::vector<std::unique_ptr<Workspace>> make_virtual_ranks(const LayerShape& global, int32_t R, const Config& config = {});
std::vector<Workspace*> pointers(const std::vector<std::unique_ptr<Workspace>>& ranks);

// R connected virtual ranks of global layer L with their shares: poisoned outputs in `global`, dy from
// the global `dy`; in FP8 (config.precision) each rank's weights quantised.
struct VirtualGroup {
  std::vector<std::unique_ptr<Workspace>> owned;
  std::vector<Workspace*> ws;
  OutputBuffers global;
  DeviceBuffer d_dy;
  std::vector<RankSlice> slices;
  std::vector<LayerInputs> in;
  std::vector<TensorView> y, dy;
  std::vector<Gradients> grads;

  VirtualGroup(const HostLayer& L, int32_t R, const std::vector<HostBf16>& dy, const Config& config = {});
  void forward(cudaStream_t s) { forward_ranks(ws, in, y, s); }
  void backward(cudaStream_t s) { backward_ranks(ws, in, dy, grads, s); }
  // Waits and throws as Workspace::check, rank by rank.
  void check(cudaStream_t s) const;
};

// A forward of every rank of g (whose inputs make it fail): each rank's check() throws a message holding
// want[r], and no rank writes y.
void expect_forward_reported(VirtualGroup& g, const HostLayer& L, const std::vector<std::string>& want);

// For each R of Rs: forward, then backward with `dy`, on R virtual ranks give the routed outputs of `want`
// (one rank's) bit for bit, and shared expert gradients whose per-rank parts sum to want's (within
// kTolerance: a sum of R roundings).
void expect_every_r_gives(const Outputs& want, const HostLayer& L, const std::vector<int32_t>& Rs,
                          const std::vector<HostBf16>& dy, const Config& config, bool recompute);

// Forward, then backward with `dy`, on R virtual ranks (poisoned outputs), outputs gathered; `hook`, if
// given, is applied to every rank's workspace first (a test hook).
Outputs run_virtual_ranks(const HostLayer& L, int32_t R, const std::vector<HostBf16>& dy, const Config& config = {},
                          bool recompute = false, const std::function<void(Workspace&)>& hook = {});

}  // namespace lynx::test
