#include "common/cuda_check.h"
#include "kernels/glue/api.h"
#include "runtime/fused_launch.h"
#include "runtime/fused_passes.h"
#include "runtime/stages.h"
#include "runtime/steps.h"

namespace lynx::fused {

gemm::ExpertGemmArgs expert_gemm_args(const Workspace::Impl& w, const gemm::RowLaunch& launch) {
  gemm::ExpertGemmArgs a;
  a.capacity = w.problem.capacity;
  a.experts = w.shape.local_experts();
  a.expert_offset = w.schedule.expert_offset;
  a.expert_rows = w.schedule.expert_rows;
  a.block_offset = w.schedule.block_offset;
  a.status = w.stall_report_device;
  a.tickets = w.gemm_tickets;
  a.sm_count = w.plan.gemm_sm_count;
  a.launch = launch;
#if LYNX_EXPERIMENTS
  a.gather_stall_block = w.test_gather_stall_block;
#endif
  return a;
}

void gather_rows_in(gemm::ExpertGemmArgs& a, const Workspace::Impl& w, const TensorView& rows) {
  a.gather_src = data_of<const bf16_t>(rows);
  a.row_token_slot = w.schedule.row_token_slot;
  a.top_k = w.shape.top_k;
  a.gather_sync = w.gather_sync;
  a.gather_sources = w.row_sources(comm::kTokenRows);
}

void queue_gather_kernel(plan::GatherPlace place, const Workspace::Impl& w, const TensorView& rows, bf16_t* dst,
                         cudaStream_t s) {
  const LayerShape& sh = w.shape;
  if (place == plan::GatherPlace::kTokenKernel) {
    glue::scatter_token_rows(dst, data_of<const bf16_t>(rows), w.schedule.slot_row, w.schedule.row_token_slot,
                             w.device_total_rows(), w.problem.capacity, sh.tokens, sh.top_k, sh.hidden, s);
  } else if (place == plan::GatherPlace::kRowKernel) {
    glue::gather_rows(dst, data_of<const bf16_t>(rows), w.schedule.row_token_slot, w.device_total_rows(),
                      w.problem.capacity, sh.top_k, sh.hidden, s, w.row_sources(comm::kTokenRows));
  }
}

namespace {

// Dispatch and the gate/up GEMM with SwiGLU: h, and with `keep_gate_up` everything backward needs
// (g and u saved).
void forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, bool keep_gate_up) {
  w.context_valid = false;
  const bool gather = !omitted(Stage::kGather, w.forward_calls);
  enqueue_schedule(w, in, s);
  enqueue_shared_gate_up(w, in, s);
  gemm::ExpertGemmArgs a = expert_gemm_args(w, w.plan.gate_up);
  a.a = w.un.xg;
  const plan::GatherPlace place = w.plan.gate_up_gather;
  if (gather) queue_gather_kernel(place, w, in.x, w.un.xg, s);
  if (gather && place == plan::GatherPlace::kInGemm) gather_rows_in(a, w, in.x);
  a.k = w.shape.hidden;
  a.b0 = data_of<const bf16_t>(in.weights.w_gate);
  a.b1 = data_of<const bf16_t>(in.weights.w_up);
  a.b0_stride = expert_stride(in.weights.w_gate);
  a.b1_stride = expert_stride(in.weights.w_up);
  a.n = w.shape.intermediate;
  a.out = w.un.h;
  // NOTES: without a saved context the gate and up products are not stored: a third of the gate/up
  // kernel's output bytes each (forward for inference, or training that recomputes before backward).
  a.out_gate = keep_gate_up ? w.un.g : nullptr;
  a.out_up = keep_gate_up ? w.un.u : nullptr;
  a.gate_up_slot = w.gate_up_by_slot ? w.schedule.row_token_slot : w.row_numbers;
#if LYNX_EXPERIMENTS
  a.stall_task = w.test_stall_task;
#endif
  if (!omitted(Stage::kGateUp, w.forward_calls)) gemm::expert_gemm_swiglu(a, s);
  w.context = ContextKey::of(in);
}

// The barriers of a pass at R > 1 (none at R = 1).
void open(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  if (w.ranks() == 1) return;
  enqueue_stage_inputs(w, in, s);
  peer::arrive(w.barrier_args(), false, s);
}
// After the closing barrier every rank has written this rank's slot_row (the region's, at R > 1): a
// caller's context keeps a copy, since the next forward's schedules write the region's again.
void close(const Workspace::Impl& w, cudaStream_t s) {
  if (w.ranks() == 1) return;
  peer::wait(w.barrier_args(), true, s);
  if (w.config.caller_context) {
    LYNX_CUDA(cudaMemcpyAsync(w.schedule.slot_row, w.in_region<int32_t>(w.layout.slot_row),
                              sizeof(int32_t) * size_t(w.shape.tokens * w.shape.top_k), cudaMemcpyDeviceToDevice, s));
  }
}

}  // namespace

void compute_begins(const Workspace::Impl& w, cudaStream_t s) {
  if (w.ranks() > 1) peer::wait(w.barrier_args(), false, s);
}
void compute_ends(const Workspace::Impl& w, cudaStream_t s) {
  if (w.ranks() > 1) peer::arrive(w.barrier_args(), true, s);
}

void recompute_forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, Step step) {
  switch (step) {
    case Step::kOpen:
      open(w, in, s);
      break;
    case Step::kCompute:
      compute_begins(w, s);
      forward_context(w, in, s, true);
      compute_ends(w, s);
      break;
    case Step::kClose:
      close(w, s);
      w.context_valid = true;
      break;
  }
}

void forward(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s, Step step) {
  switch (step) {
    case Step::kOpen:
      open(w, in, s);
      break;
    case Step::kCompute: {
      compute_begins(w, s);
      forward_context(w, in, s, w.keeps_context());
      gemm::ExpertGemmArgs a = expert_gemm_args(w, w.plan.down);
      a.a = w.un.h;
      a.k = w.shape.intermediate;
      a.b0 = data_of<const bf16_t>(in.weights.w_down);
      a.n = w.shape.hidden;
      a.out = w.un.rows_a;
      if (!omitted(Stage::kDown, w.forward_calls)) gemm::expert_gemm(a, s);
      enqueue_shared_down(w, in, s);
      compute_ends(w, s);
      break;
    }
    case Step::kClose:
      close(w, s);
      enqueue_combine(w, in, y, s);
      w.context_valid = w.keeps_context();
      break;
  }
}

}  // namespace lynx::fused
