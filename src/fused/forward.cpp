#include "fused/forward.h"

#include "api/omit.h"
#include "api/steps.h"
#include "fused/expert_gemm.h"
#include "fused/gather_plan.h"

namespace lynx::fused {

ExpertGemmArgs expert_gemm_args(const Workspace::Impl& w) {
  ExpertGemmArgs a;
  a.capacity = w.problem.capacity;
  a.experts = w.shape.local_experts();
  a.expert_offset = w.schedule.expert_offset;
  a.expert_rows = w.schedule.expert_rows;
  a.block_offset = w.schedule.block_offset;
  a.status = w.stall_report_device;
  a.tickets = w.gemm_tickets;
  a.sm_count = w.test_gemm_sm_count > 0 ? w.test_gemm_sm_count : w.sm_count;
  a.routed_rows = w.shape.tokens * w.shape.top_k;
  a.clusters = w.test_gemm_clusters;
  a.swapped = w.test_gemm_swapped;
  a.fold = w.test_gemm_fold;
  a.order = w.test_gemm_order;
  a.gather_lookahead = w.test_gather_lookahead;
  a.gather_stall_block = w.test_gather_stall_block;
  return a;
}

void gather_rows_in(ExpertGemmArgs& a, const Workspace::Impl& w, const TensorView& rows) {
  a.gather_src = data_of<const bf16_t>(rows);
  a.row_token_slot = w.schedule.row_token_slot;
  a.top_k = w.shape.top_k;
  a.gather_sync = w.gather_sync;
}

GatherPlace gather_place(const Workspace::Impl& w, int64_t products_per_row) {
  const LayerShape& sh = w.shape;
  const int forced = w.test_gather_token_major >= 0 ? w.test_gather_token_major : forced_gather_token_major();
  const bool token_major = forced >= 0 ? forced == 1
                                       : gather_token_major(sh.tokens * sh.top_k, sh.local_experts(), sh.tokens,
                                                            sh.hidden, products_per_row, w.l2_bytes);
  if (token_major) return GatherPlace::kTokenKernel;
  return gather_in_kernel() ? GatherPlace::kInGemm : GatherPlace::kRowKernel;
}

void queue_gather_kernel(GatherPlace place, const Workspace::Impl& w, const TensorView& rows, bf16_t* dst,
                         cudaStream_t s) {
  const LayerShape& sh = w.shape;
  if (place == GatherPlace::kTokenKernel) {
    unfused::scatter_token_rows(dst, data_of<const bf16_t>(rows), w.schedule.slot_row, w.schedule.row_token_slot,
                                w.device_total_rows(), w.problem.capacity, sh.tokens, sh.top_k, sh.hidden, s);
  } else if (place == GatherPlace::kRowKernel) {
    unfused::gather_rows(dst, data_of<const bf16_t>(rows), w.schedule.row_token_slot, w.device_total_rows(),
                         w.problem.capacity, sh.top_k, sh.hidden, s);
  }
}

namespace {

// Dispatch and the gate/up GEMM with SwiGLU: h, and with `keep_gate_up` everything backward needs
// (g and u saved).
void forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, bool keep_gate_up) {
  w.context_valid = false;
  const bool gather = !omitted(Stage::kGather, w.forward_calls);
  enqueue_dispatch(w, in, s, false);
  ExpertGemmArgs a = expert_gemm_args(w);
  a.a = w.un.xg;
  const GatherPlace place = gather_place(w, 2 * w.shape.intermediate);  // gate and up: 2I columns
  if (gather) queue_gather_kernel(place, w, in.x, w.un.xg, s);
  if (gather && place == GatherPlace::kInGemm) gather_rows_in(a, w, in.x);
  a.k = w.shape.hidden;
  a.b0 = data_of<const bf16_t>(in.weights.w_gate);
  a.b1 = data_of<const bf16_t>(in.weights.w_up);
  a.n = w.shape.intermediate;
  a.out = w.un.h;
  // NOTES: without a saved context the gate and up products are not stored: a third of the gate/up
  // kernel's output bytes each (forward for inference, or training that recomputes before backward).
  a.out_gate = keep_gate_up ? w.un.g : nullptr;
  a.out_up = keep_gate_up ? w.un.u : nullptr;
  a.stall_task = w.test_stall_task;
  if (!omitted(Stage::kGateUp, w.forward_calls)) expert_gemm_swiglu(a, s);
  w.context = ContextKey::of(in);
}

}  // namespace

void recompute_forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  forward_context(w, in, s, true);
  w.context_valid = true;
}

void forward(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s) {
  forward_context(w, in, s, w.config.save_forward_context);
  ExpertGemmArgs a = expert_gemm_args(w);
  a.a = w.un.h;
  a.k = w.shape.intermediate;
  a.b0 = data_of<const bf16_t>(in.weights.w_down);
  a.n = w.shape.hidden;
  a.out = w.un.rows_a;
  if (!omitted(Stage::kDown, w.forward_calls)) expert_gemm(a, s);
  enqueue_shared_and_combine(w, in, y, s);
  w.context_valid = w.config.save_forward_context;
}

}  // namespace lynx::fused
