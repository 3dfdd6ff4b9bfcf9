#include "fused/backward.h"

#include "api/steps.h"
#include "fused/expert_gemm.h"
#include "fused/transpose.h"

namespace lynx::fused {

void backward(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              cudaStream_t s) {
  require_context(w, in);
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, I = sh.intermediate, k = sh.top_k, Is = sh.shared_intermediate;
  const int64_t E = sh.local_experts(), cap = w.problem.capacity;
  const int32_t* total = w.device_total_rows();
  const int32_t* slots = w.schedule.row_token_slot;
  FusedBuffers& f = w.fb;
  bf16_t* dyg = w.un.rows_a;  // [cap, H] gathered dy rows
  bf16_t* dxe = w.un.rows_b;  // [cap, H] per-row dx

  enqueue_shared_backward(w, in, dy, grads, s);
  unfused::gather_rows(dyg, data_of<const bf16_t>(dy), slots, total, cap, k, H, s);

  ExpertGemmArgs g;
  g.capacity = cap;
  g.experts = E;
  g.expert_offset = w.schedule.expert_offset;
  g.status = w.stall_report_device;
  g.sm_count = w.sm_count;

  // da = dy_row · w_down[e]: B = w_downᵀ [E, I, H].
  transpose(f.w_down_t, H, I * H, data_of<const bf16_t>(in.weights.w_down), E, H, I, nullptr, nullptr, s);
  g.a = dyg;
  g.k = H;
  g.b0 = f.w_down_t;
  g.n = I;
  g.out = w.un.da;
  expert_gemm(g, s);

  // dg | du (one [cap, 2I] array), w·silu(g)⊙u, d_topk_weights.
  unfused::swiglu_backward(f.dgu, f.dgu + I, 2 * I, w.un.h, data_of<float>(grads.d_topk_weights), w.un.da, w.un.g,
                           w.un.u, data_of<const float>(in.topk_weights), slots, total, cap, I, s);

  // dx_row = [dg | du] · [w_gate[e]; w_up[e]]: one GEMM over K = 2I, B = [w_gateᵀ | w_upᵀ] [E, H, 2I].
  transpose(f.w_gate_up_t, 2 * I, H * 2 * I, data_of<const bf16_t>(in.weights.w_gate), E, I, H, nullptr, nullptr, s);
  transpose(f.w_gate_up_t + I, 2 * I, H * 2 * I, data_of<const bf16_t>(in.weights.w_up), E, I, H, nullptr, nullptr, s);
  g.a = f.dgu;
  g.k = 2 * I;
  g.b0 = f.w_gate_up_t;
  g.n = H;
  g.out = dxe;
  expert_gemm(g, s);
  unfused::combine(data_of<bf16_t>(grads.dx), dxe, w.schedule.slot_row, nullptr, Is > 0 ? w.un.ys : nullptr, T, k, H,
                   w.status, s);

  // Weight gradients over each expert's rows, operands transposed with zeros on padding rows.
  transpose(f.dgu_t, cap, 0, f.dgu, 1, cap, 2 * I, total, slots, s);
  transpose(f.xg_t, cap, 0, w.un.xg, 1, cap, H, total, slots, s);
  transpose(f.dyg_t, cap, 0, dyg, 1, cap, H, total, slots, s);
  transpose(f.hw_t, cap, 0, w.un.h, 1, cap, I, total, slots, s);
  WeightGradArgs wg;
  wg.capacity = cap;
  wg.experts = E;
  wg.expert_offset = w.schedule.expert_offset;
  wg.status = w.stall_report_device;
  wg.sm_count = w.sm_count;
  // dw_gate[e] = dgᵀ · x, dw_up[e] = duᵀ · x: one GEMM with M = 2I, split at I.
  wg.a_t = f.dgu_t;
  wg.m = 2 * I;
  wg.b_t = f.xg_t;
  wg.n = H;
  wg.split = I;
  wg.out = data_of<bf16_t>(grads.dw_gate);
  wg.out2 = data_of<bf16_t>(grads.dw_up);
  expert_weight_grad(wg, s);
  // dw_down[e] = dyᵀ · (w · silu(g)⊙u)
  wg.a_t = f.dyg_t;
  wg.m = H;
  wg.b_t = f.hw_t;
  wg.n = I;
  wg.split = 0;
  wg.out = data_of<bf16_t>(grads.dw_down);
  wg.out2 = nullptr;
  expert_weight_grad(wg, s);
}

}  // namespace lynx::fused
