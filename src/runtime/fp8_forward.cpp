#include "kernels/fp8/api.h"
#include "kernels/glue/api.h"
#include "runtime/fp8_passes.h"
#include "runtime/fused_launch.h"
#include "runtime/stages.h"
#include "runtime/steps.h"

namespace lynx::fp8pass {
namespace {

fp8::NonfiniteReport report(const Workspace::Impl& w, Fp8Tensor what) {
  return fp8::NonfiniteReport{nullptr, w.status, int64_t(what)};
}

}  // namespace

void quantize_weights(Workspace::Impl& w, const ExpertWeights& weights, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t E = sh.local_experts(), H = sh.hidden, I = sh.intermediate;
  Fp8Buffers& f = w.f8;
  w.quantized_weights.valid = false;  // until every copy is queued
  fp8::quantize_blocks(data_of<const bf16_t>(weights.w_gate), E, I, H, f.w_gate, f.w_gate_scales,
                       report(w, Fp8Tensor::kGate), s);
  fp8::quantize_blocks(data_of<const bf16_t>(weights.w_up), E, I, H, f.w_up, f.w_up_scales, report(w, Fp8Tensor::kUp),
                       s);
  fp8::quantize_blocks(data_of<const bf16_t>(weights.w_down), E, H, I, f.w_down, f.w_down_scales,
                       report(w, Fp8Tensor::kDown), s);
  fp8::quantize_blocks_transposed(data_of<const bf16_t>(weights.w_down), H, nullptr, 0, E, I, f.w_down_t,
                                  f.w_down_t_scales, report(w, Fp8Tensor::kDown), s);
  fp8::quantize_blocks_transposed(data_of<const bf16_t>(weights.w_gate), I, data_of<const bf16_t>(weights.w_up), I,
                                  E, H, f.w_gate_up_t, f.w_gate_up_t_scales, report(w, Fp8Tensor::kGate), s);
  w.quantized_weights = {weights.w_gate.data, weights.w_up.data, weights.w_down.data, true};
}

namespace {

// The schedule, x's tiles in schedule order and the gate/up GEMM with SwiGLU (h), keeping g and u by
// slot, with the schedule, as the forward context when `keep_gate_up`.
void forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, bool keep_gate_up) {
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, I = sh.intermediate, E = sh.local_experts(), cap = w.problem.capacity;
  const Fp8Buffers& f = w.f8;
  w.context_valid = false;
  enqueue_schedule(w, in, s);
  enqueue_shared_gate_up(w, in, s);
  if (!omitted(Stage::kGather, w.forward_calls)) {
    fp8::quantize_tiles(data_of<const bf16_t>(in.x), T, H, nullptr, f.x, f.x_scales, report(w, Fp8Tensor::kX), s);
    fp8::gather_tiles(f.xg, f.xg_scales, f.x, f.x_scales, w.schedule.row_token_slot, w.device_total_rows(), cap,
                      sh.top_k, H, s);
  }
  fp8::KeptGateUp kept;
  if (keep_gate_up) {
    kept.gate = w.un.g;
    kept.up = w.un.u;
    kept.slot = w.gate_up_by_slot ? w.schedule.row_token_slot : w.row_numbers;
  }
  if (!omitted(Stage::kGateUp, w.forward_calls)) {
    fp8::grouped_swiglu_block_scaled(f.xg, f.xg_scales, cap, H, f.w_gate, f.w_gate_scales, f.w_up, f.w_up_scales, E,
                                     I, w.schedule.expert_offset, w.un.h, w.stall_report_device, s, kept);
  }
  w.context = ContextKey::of(in);
}

}  // namespace

void recompute_forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  forward_context(w, in, s, true);
  w.context_valid = true;
}

void forward(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t H = sh.hidden, I = sh.intermediate, E = sh.local_experts(), cap = w.problem.capacity;
  const Fp8Buffers& f = w.f8;
  forward_context(w, in, s, w.config.save_forward_context);
  if (!omitted(Stage::kDown, w.forward_calls)) {
    fp8::quantize_tiles(w.un.h, cap, I, w.device_total_rows(), f.h, f.h_scales, report(w, Fp8Tensor::kH), s);
    fp8::grouped_gemm_block_scaled(f.h, f.h_scales, cap, I, f.w_down, f.w_down_scales, E, H,
                                   w.schedule.expert_offset, w.un.rows_a, w.stall_report_device, s);
  }
  enqueue_shared_down(w, in, s);
  enqueue_combine(w, in, y, s);
  w.context_valid = w.config.save_forward_context;
}

void backward(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads, cudaStream_t s) {
  require_context(w, in);
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, I = sh.intermediate, E = sh.local_experts(), cap = w.problem.capacity;
  const Fp8Buffers& f = w.f8;
  const int32_t* total = w.device_total_rows();
  const int32_t* slots = w.schedule.row_token_slot;
  bf16_t* dyg = w.un.rows_a;  // [cap, H]  gathered dy rows, bf16, for dw_down
  bf16_t* dgu = w.fb.dgu;     // [cap, 2I] dg | du per row (zeros on padding rows)
  enqueue_shared_backward(w, in, dy, grads, s);
  if (!omitted(Stage::kDyGather, w.backward_calls)) {
    fused::queue_gather_kernel(plan::GatherPlace::kRowKernel, w, dy, dyg, s);
    fp8::quantize_tiles(data_of<const bf16_t>(dy), T, H, nullptr, f.x, f.x_scales, report(w, Fp8Tensor::kDy), s);
    fp8::gather_tiles(f.xg, f.xg_scales, f.x, f.x_scales, slots, total, cap, sh.top_k, H, s);
  }
  // da = dy_row · w_down[e]: [rows, H] tiles times w_downᵀ [I, H] blocks.
  if (!omitted(Stage::kDgradDown, w.backward_calls)) {
    fp8::grouped_gemm_block_scaled(f.xg, f.xg_scales, cap, H, f.w_down_t, f.w_down_t_scales, E, I,
                                   w.schedule.expert_offset, w.un.da, w.stall_report_device, s);
  }
  // dg | du, w · silu(g)⊙u (into h), d_topk_weights: as in bf16.
  if (!omitted(Stage::kSwigluBackward, w.backward_calls)) {
    glue::swiglu_backward(dgu, dgu + I, 2 * I, w.un.h, data_of<float>(grads.d_topk_weights), w.un.da, w.un.g, w.un.u,
                          data_of<const float>(in.topk_weights), slots, total, cap, I, s, RowSources{},
                          w.gate_up_by_slot);
  }
  // dx_row = [dg | du] · [w_gate[e]; w_up[e]]: tiles over K = 2I times [w_gate; w_up]ᵀ [H, 2I] blocks.
  if (!omitted(Stage::kDgradGateUp, w.backward_calls)) {
    fp8::quantize_tiles(dgu, cap, 2 * I, total, f.dgu, f.dgu_scales, report(w, Fp8Tensor::kDgu), s);
    fp8::grouped_gemm_block_scaled(f.dgu, f.dgu_scales, cap, 2 * I, f.w_gate_up_t, f.w_gate_up_t_scales, E, H,
                                   w.schedule.expert_offset, w.un.rows_b, w.stall_report_device, s);
  }
  fused::dx_combine(w, grads, s);
  if (!omitted(Stage::kXGather, w.backward_calls)) {
    fused::queue_gather_kernel(plan::GatherPlace::kRowKernel, w, in.x, w.un.xg, s);
  }
  if (w.config.bf16_weight_grads) return fused::weight_grads(w, grads, dyg, s);
  // The weight gradients sum over each expert's rows: their operands transposed and quantised in 1×128
  // tiles along the rows, into the buffers the dgrads are done with (each at least that large).
  if (!omitted(Stage::kWgradGateUp, w.backward_calls)) {  // dw_gate | dw_up = [dg | du]ᵀ · x rows
    fp8::transpose_tiles(dgu, cap, 2 * I, total, f.dgu, f.dgu_scales, report(w, Fp8Tensor::kDgu), s);
    fp8::transpose_tiles(w.un.xg, cap, H, total, f.xg, f.xg_scales, report(w, Fp8Tensor::kX), s);
    fp8::grouped_weight_grad_block_scaled(f.dgu, f.dgu_scales, 2 * I, f.xg, f.xg_scales, H, cap, E,
                                          w.schedule.expert_offset, data_of<bf16_t>(grads.dw_gate),
                                          data_of<bf16_t>(grads.dw_up), I, w.stall_report_device, s);
  }
  if (!omitted(Stage::kWgradDown, w.backward_calls)) {  // dw_down = dy rowsᵀ · w·silu(g)⊙u
    fp8::transpose_tiles(dyg, cap, H, total, f.xg, f.xg_scales, report(w, Fp8Tensor::kDy), s);
    fp8::transpose_tiles(w.un.h, cap, I, total, f.h, f.h_scales, report(w, Fp8Tensor::kH), s);
    fp8::grouped_weight_grad_block_scaled(f.xg, f.xg_scales, H, f.h, f.h_scales, I, cap, E, w.schedule.expert_offset,
                                          data_of<bf16_t>(grads.dw_down), nullptr, H, w.stall_report_device, s);
  }
}

}  // namespace lynx::fp8pass
