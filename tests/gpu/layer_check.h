// Shared by the layer test files: random layer inputs, calls on poisoned outputs, checks against the reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/bf16.h"
#include "gpu/gpu_test.h"
#include "lynx/lynx.h"
#include "reference/reference.h"

namespace lynx::test {

struct Case {
  int64_t T, H, I, E, k, Is;
  // random | subset (j even: expert 0, j odd: expert E-1) | one (every row to expert E/2) |
  // cyclic (expert (t + j) % E)
  std::string routing = "random";
  bool int64_ids = false;
  bool zero_weights = false;       // every third router weight is exactly 0
  // Slots not routed (id -1, router weight NaN: it must not be read): every unrouted_every-th slot
  // (t·k + j ≡ 1 mod unrouted_every; 0: none), and, when routed_tokens is not empty, the tokens past
  // routed_tokens[b] in each of its routed_tokens.size() equal blocks of tokens (a rank's share each:
  // a rank with fewer tokens than the others).
  int64_t unrouted_every = 0;
  std::vector<int64_t> routed_tokens = {};
};

// Whether slot (t, j) of case c is routed.
bool routed(const Case& c, int64_t t, int64_t j);

// body(i) for i in [0, n) on every hardware thread; the first exception is rethrown.
void parallel_for(int64_t n, const std::function<void(int64_t)>& body);

// n values scale·N(0, 1) rounded to bf16, from one draw of rng: the same values at any thread count.
std::vector<HostBf16> random_bf16(std::mt19937_64& rng, int64_t n, double scale);

std::vector<double> to_double_vec(const std::vector<HostBf16>& v);

// A layer's host inputs and their device copies.
struct HostLayer {
  Case c;
  LayerShape shape;
  std::vector<HostBf16> x, w_gate, w_up, w_down, ws_gate, ws_up, ws_down;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  DeviceBuffer d_x, d_ids, d_weights, d_wg, d_wu, d_wd, d_wsg, d_wsu, d_wsd;

  explicit HostLayer(const Case& cs, uint64_t seed);

  LayerInputs inputs() const;

  std::vector<double> weights_double() const;

  ref::Layer<HostBf16> reference(const std::vector<double>& w) const;
};

// ‖got − want‖ / ‖want‖ (Frobenius); got must be all finite.
template <class T>
double rel_error(const std::vector<T>& got, const std::vector<double>& want, const char* what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double g;
    if constexpr (std::is_same_v<T, HostBf16>) {
      g = to_double(got[i]);
    } else {
      g = got[i];
    }
    if (!std::isfinite(g)) {
      ADD_FAILURE() << what << "[" << i << "] is not finite (" << g << "): not written or NaN";
      return INFINITY;
    }
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline constexpr double kTolerance = 1e-2;  // bf16 operands, fp32 accumulation (docs/testing.md)

struct Outputs {
  std::vector<HostBf16> y, dx, dw_gate, dw_up, dw_down, dws_gate, dws_up, dws_down;
  std::vector<float> d_topk;
};

// The first output whose bits differ between a and b ("" when every output is the same).
std::string first_difference(const Outputs& a, const Outputs& b);

// Device buffers of every output of a layer call, with their views.
struct OutputBuffers {
  const Case c;
  DeviceBuffer y, dx, dtk, dwg, dwu, dwd, dwsg, dwsu, dwsd;

  explicit OutputBuffers(const Case& cs);

  // NaN in every float, so that an unwritten element cannot pass.
  void poison();
  TensorView y_view() const;
  Gradients grads() const;
  Outputs to_host_outputs() const;
};

// Runs forward and backward on poisoned outputs and copies everything back.
Outputs run_layer(Workspace& ws, const HostLayer& L, const std::vector<HostBf16>& dy, bool recompute = false);
// The same with other inputs than L's (its routing and shapes; other weight tensors, say).
Outputs run_layer(Workspace& ws, const HostLayer& L, const LayerInputs& in, const std::vector<HostBf16>& dy,
                  bool recompute = false);

// A layer's gate and up weights as the halves of one [E, 2I + kGap, H]-like device tensor: expert e's
// gate rows at e · stride, its up rows right after, then a gap of kGap elements (-3); and a poisoned
// tensor of the same layout for their gradients.
struct GateUpHalves {
  static constexpr int64_t kGap = 64;
  const Case c;
  const int64_t n, stride;  // an expert's matrix; from one expert's gate rows to the next's
  std::vector<HostBf16> host;
  DeviceBuffer weights, grads;

  explicit GateUpHalves(const HostLayer& L);
  // Experts [e0, e0 + E) as w's w_gate and g's dw_gate, and, with `up_too`, as w's w_up and g's dw_up
  // (else those stay as given: contiguous, another stride than the gate's).
  void views(int64_t e0, int64_t E, ExpertWeights& w, Gradients& g, bool up_too = true) const;
  // got's dw_gate (and, with `up_too`, dw_up) from the gradients' halves (contiguous), after checking
  // that nothing was written into the gaps (nor, without `up_too`, into the up halves) and that the
  // weights are unchanged.
  void expect_gradients_and_weights(Outputs& got, bool up_too = true) const;
};

// The layer's gate and up weights given as the halves of one [E, 2I, H] tensor whose experts lie 64
// elements apart (gate rows, up rows, a gap), and its gate and up gradients likewise into a poisoned
// tensor: forward and backward (after quantize_weights from the halves, where `config` is FP8) give the
// bits of contiguous weights and gradients, and leave the gaps and the weights untouched. With
// `gate_only`, only the gate and its gradient are such halves, the up weight and gradient contiguous:
// the two at different expert strides.
void expect_gate_up_halves_give_the_same_bits(const Case& c, const Config& config, bool gate_only = false);

// A backward with a weight-gradient group left out (the routed experts' three, the shared expert's, or
// both) gives every other output the bits of the whole backward
// (which other tests check against the reference). The workspace's FP8 copies, if any, must be made
// already.
void expect_weight_grads_can_be_left_out(Workspace& ws, const HostLayer& L);

// n layers of case c, each with its inputs and dy drawn from rng, and its outputs as a workspace of
// `config` that owns its buffers gives them (what tests of lent scratch or contexts compare with).
struct LayerStack {
  std::vector<std::unique_ptr<HostLayer>> layers;
  std::vector<std::vector<HostBf16>> dy;
  std::vector<Outputs> want;
};
LayerStack layers_with_outputs(const Case& c, int n, std::mt19937_64& rng, const Config& config, bool recompute);

// Every d_topk_weights value within `tolerance` · scale[i] of the reference (fatal on the first miss).
// The scale: the magnitude of its terms (g.d_topk_magnitude), where a cancelled dot product's error
// scales with its terms, not with its value; or, for the FP8 path, whose operands' errors come from sums
// over H that may cancel too, the root-sum-square of its terms' error scales (g.d_topk_term_rss;
// random_case.h, kFp8Bounds).
void expect_d_topk_values_near(const std::vector<float>& got, const ref::Gradients& g,
                               const std::vector<double>& scale, double tolerance);

// Every row of a [rows, width] output (y, dx) near the reference's row: within 0.1 of that row's norm or,
// for rows under a quarter of the rows' rms norm (a cancelled sum), of that quarter. NOTES: a wrong
// term (one of a token's k rows stale or never written: the per-row buffers share memory, so such a
// row holds another stage's finite values, not the poison) moves its row by ~1/√k of its norm, which
// the tensor's Frobenius error spreads over every row; bf16 rounding moves a row by a few 2⁻⁹. Looser
// than the random cases' per-row bound (random_case.h), which divides by each row's terms.
void expect_rows_near(const std::vector<HostBf16>& got, const std::vector<double>& want, int64_t width,
                      const char* what);

// Every output against the reference for these inputs and dy.
void expect_matches_reference(const Outputs& o, const HostLayer& L, const std::vector<HostBf16>& dy);

// Forward and backward of `ws` on L captured together in one CUDA graph (after an eager pair when
// `eager_first`), replayed twice with new routing (L's ids and weights replaced): every output matches
// the reference on every replay.
void expect_graph_replays_match_reference(Workspace& ws, HostLayer& L, bool eager_first);

// A case's sizes and routing, for test traces.
std::string case_name(const Case& c);

// `clusters`: test_hooks::set_gemm_clusters (-1: the rule); `gemm_sm_count`: set_gemm_sm_count;
// `gather_lookahead`: set_gather_lookahead (0: the rule).
void check_against_reference(const Case& c, uint64_t seed, const Config& config, bool recompute = false,
                             int32_t clusters = -1, int32_t gemm_sm_count = 0, int32_t gather_lookahead = 0,
                             int32_t order = -1);

std::random_device::result_type fresh_seed();

// A fresh random dy for case `c`.
std::vector<HostBf16> random_dy(const Case& c);

// Every padding row of the 64-row halves that hold rows is an exact zero in g and u (gate/up, when kept
// by row), w·silu(g)⊙u (the SwiGLU backward's, which dw_down reads: written over da in place) and the
// per-row dx (the dgrad of gate/up, over the dy rows, whose padding rows the gather zeroed); stops at
// the first that is not. After a whole backward the GEMMs' own zeros are no longer there to see (da's
// lie under w·silu(g)⊙u, the dy rows under the dx rows): no reader needs them (the SwiGLU backward and
// the combine skip padding rows); expect_forward_padding_rows_zero sees the forward GEMMs'.
void expect_padding_rows_zero(Workspace& ws, const Case& c);

// The row buffers of `ws` poisoned with NaN, then a forward of L alone: every padding row of the 64-row
// halves that hold rows is an exact zero in h (the gate/up GEMM's output) and in the down GEMM's rows
// (rows_a), as the GEMMs wrote them.
void expect_forward_padding_rows_zero(Workspace& ws, const HostLayer& L);

// The fixture of the fused-only tests (PairedTiles, KernelGather).
class FusedOnlyTest : public GpuTest {
 protected:
  static Config fused();
};

// A forced stall (a test hook set by `stall`) ends in a diagnostic naming the wait, not a hang, and in
// a trap: the consumers that time out record the stall and leave, and their producer thread traps for
// them. The trap kills the CUDA context (printed after the diagnostic: "[context lost]"), so it runs
// in a child process.
template <class Stall>
[[noreturn]] void run_stalled_forward(Stall stall) {
  const Case c{300, 128, 128, 4, 2, 0};
  const HostLayer L(c, 7);
  Config config;
  config.backend = Backend::kFused;
  Workspace ws(L.shape, config);
  stall(ws);
  DeviceBuffer y(c.T * c.H * 2);
  try {
    forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {c.T, c.H}), nullptr);
    ws.check(nullptr);
  } catch (const std::exception& e) {
    const bool lost = cudaDeviceSynchronize() != cudaSuccess;
    std::fprintf(stderr, "%s [%s]\n", e.what(), lost ? "context lost" : "the grid ended without a trap");
    std::exit(3);
  }
  std::exit(0);
}

}  // namespace lynx::test
