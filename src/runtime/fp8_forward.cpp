// The FP8 forward and the recompute of its context (fp8_passes.h), in the fused passes' steps.
#include "kernels/fp8/api.h"
#include "kernels/peer/api.h"
#include "runtime/fp8_passes.h"
#include "runtime/fp8_rows.h"
#include "runtime/fused_launch.h"
#include "runtime/stages.h"
#include "runtime/steps.h"

namespace lynx::fp8pass {
namespace {

// The open step of a forward or recompute at R > 1: the routing and x's tiles staged; arrive.
void open_forward(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  if (w.ranks() == 1) return;
  enqueue_stage_routing(w, in, s);
  stage_tiles(w, in.x, Fp8Tensor::kX, s);
  peer::arrive(w.barrier_args(), false, s);
}

// Where the gate/up GEMM finds x's tiles in schedule order: gathered into f8.xg before it
// (tiles_in_schedule_order), or, where the plan puts gate/up's gather in the GEMM, their scales
// gathered before it and their bytes by the GEMM itself, beside its tiles (the returned TileGather).
fp8::TileGather x_tiles_for_gate_up(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  if (omitted(Stage::kGather, w.forward_calls)) return {};
  if (w.plan.gate_up_gather != plan::GatherPlace::kInGemm) {
    tiles_in_schedule_order(w, in.x, Fp8Tensor::kX, s);
    return {};
  }
  return tiles_for_gemm_gather(w, in.x, Fp8Tensor::kX, w.plan.gate_up.gather_lookahead, s);
}

// The schedule, x's tiles in schedule order and the gate/up GEMM with SwiGLU, keeping g and u by slot (by
// row at R > 1), with the schedule, as the forward context when `keep_context`, and (`down`: for the
// down GEMM) h quantised in its epilogue, into f8.h's tiles. At R > 1 the context also keeps the x rows
// as they travelled (x̂, un.xg): backward stages dy, not x.
void forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, bool keep_context, bool down) {
  const LayerShape& sh = w.shape;
  const int64_t H = sh.hidden, I = sh.intermediate, E = sh.local_experts(), cap = w.problem.capacity;
  const Fp8Buffers& f = w.f8;
  w.context_valid = false;
  enqueue_schedule(w, in, s);
  enqueue_shared_gate_up(w, in, s);
  const fp8::TileGather gather = x_tiles_for_gate_up(w, in, s);
  fp8::KeptGateUp kept;
  if (keep_context) {
    kept.gate = w.un.g;
    kept.up = w.un.u;
    kept.slot = w.gate_up_by_slot ? w.schedule.row_token_slot : w.row_numbers;
  }
  fp8::QuantizedH hq;
  if (down) hq = {f.h, f.h_scales, report(w, Fp8Tensor::kH)};
  if (!omitted(Stage::kGateUp, w.forward_calls) && (keep_context || down)) {
    fp8::grouped_swiglu_block_scaled(f.xg, f.xg_scales, cap, H, f.w_gate, f.w_gate_scales, f.w_up, f.w_up_scales, E,
                                     I, w.schedule.expert_offset, nullptr, w.stall_report_device, s, kept, hq, gather,
                                     w.plan.fp8_pair_rows, half_blocks(w));
  }
  if (w.ranks() > 1 && keep_context) dequantized_rows(w, w.un.xg, s);
  w.context = ContextKey::of(in);
}

}  // namespace

// The close steps are the bf16 passes' (the barrier, the combines of bf16 rows).
void recompute_forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, fused::Step step) {
  switch (step) {
    case fused::Step::kOpen:
      return open_forward(w, in, s);
    case fused::Step::kCompute:
      fused::compute_begins(w, s);
      forward_context(w, in, s, true, false);
      return fused::compute_ends(w, s);
    case fused::Step::kClose:
      return fused::recompute_forward_context(w, in, s, step);
  }
}

void forward(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s, fused::Step step) {
  if (step == fused::Step::kOpen) return open_forward(w, in, s);
  if (step == fused::Step::kClose) return fused::forward(w, in, y, s, step);
  const LayerShape& sh = w.shape;
  const int64_t H = sh.hidden, I = sh.intermediate, E = sh.local_experts(), cap = w.problem.capacity;
  const Fp8Buffers& f = w.f8;
  fused::compute_begins(w, s);
  forward_context(w, in, s, w.keeps_context(), true);
  if (!omitted(Stage::kDown, w.forward_calls)) {
    fp8::grouped_gemm_block_scaled(f.h, f.h_scales, cap, I, f.w_down, f.w_down_scales, E, H,
                                   w.schedule.expert_offset, w.un.rows_a, w.stall_report_device, s, {},
                                   w.plan.fp8_pair_rows, half_blocks(w));
  }
  enqueue_shared_down(w, in, s);
  fused::compute_ends(w, s);
}

}  // namespace lynx::fp8pass
