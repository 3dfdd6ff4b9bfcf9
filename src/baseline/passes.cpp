#include "baseline/passes.h"

#include "common/cuda_check.h"
#include "kernels/glue/api.h"
#include "plan/layer_plan.h"
#include "runtime/steps.h"

namespace lynx::baseline {
namespace {

int to_int(int64_t v) { return static_cast<int>(v); }

// Issues a batch of products one call each or grouped, as the plan says for its size.
void run_products(Workspace::Impl& w, const std::vector<blas::Gemm>& products, cudaStream_t s) {
  const blas::Batch batch = blas::batch_of(products);
  const bool grouped =
      plan::baseline_gemm_strategy(w.plan, batch.products, batch.mean_flops) == plan::GemmStrategy::kGrouped;
  w.grouped->run(w.cublas, products, false, grouped, s);
}

// Everything backward needs: the dispatch steps, then (after the one synchronisation that reads the
// per-expert counts) the routed gate/up GEMMs.
void forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t H = sh.hidden, I = sh.intermediate;
  const int64_t E_loc = sh.local_experts();
  w.context_valid = false;
  enqueue_dispatch(w, in, s);
  fetch_counts(w, s);

  const int32_t* offset = w.host_expert_offset();
  const int32_t* rows = w.host_expert_rows();
  std::vector<blas::Gemm> products;
  for (int64_t e = 0; e < E_loc; ++e) {
    const int64_t o = offset[e];
    const auto* wg = data_of<const bf16_t>(in.weights.w_gate) + e * expert_stride(in.weights.w_gate);
    const auto* wu = data_of<const bf16_t>(in.weights.w_up) + e * expert_stride(in.weights.w_up);
    // [rows_e, H] · [I, H]ᵀ -> [rows_e, I]
    products.push_back({false, true, rows[e], to_int(I), to_int(H), w.un.xg + o * H, to_int(H), wg, to_int(H),
                        w.un.g + o * I, to_int(I)});
    products.push_back({false, true, rows[e], to_int(I), to_int(H), w.un.xg + o * H, to_int(H), wu, to_int(H),
                        w.un.u + o * I, to_int(I)});
  }
  run_products(w, products, s);
  w.context = ContextKey::of(in);
  w.context_valid = true;
}

}  // namespace

void recompute_forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) { forward_context(w, in, s); }

void forward(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s) {
  forward_context(w, in, s);
  const LayerShape& sh = w.shape;
  const int64_t H = sh.hidden, I = sh.intermediate;
  const int64_t E_loc = sh.local_experts(), cap = w.problem.capacity;
  const int32_t* offset = w.host_expert_offset();
  const int32_t* rows = w.host_expert_rows();

  glue::swiglu_forward(w.un.h, w.un.g, w.un.u, w.schedule.row_token_slot, w.device_total_rows(), cap, I, s);
  std::vector<blas::Gemm> products;
  for (int64_t e = 0; e < E_loc; ++e) {
    const int64_t o = offset[e];
    // [rows_e, I] · [H, I]ᵀ -> [rows_e, H]
    products.push_back({false, true, rows[e], to_int(H), to_int(I), w.un.h + o * I, to_int(I),
                        data_of<const bf16_t>(in.weights.w_down) + e * H * I, to_int(I), w.un.rows_a + o * H, to_int(H)});
  }
  run_products(w, products, s);

  enqueue_shared_and_combine(w, in, y, s);
  w.context_valid = w.keeps_context();
}

void backward(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads, cudaStream_t s) {
  require_context(w, in);
  // A context built by the fused forward has its counts on the device only.
  if (!w.counts_on_host) fetch_counts(w, s);
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, I = sh.intermediate, k = sh.top_k, Is = sh.shared_intermediate;
  const int64_t E_loc = sh.local_experts(), cap = w.problem.capacity;
  const int32_t* offset = w.host_expert_offset();
  const int32_t* rows = w.host_expert_rows();
  const auto* dyp = data_of<const bf16_t>(dy);
  const auto* wg = data_of<const bf16_t>(in.weights.w_gate);
  const auto* wu = data_of<const bf16_t>(in.weights.w_up);
  const auto* wd = data_of<const bf16_t>(in.weights.w_down);

  enqueue_shared_backward(w, in, dy, grads, s);

  // Routed experts: dgrad.
  bf16_t* dyg = w.un.rows_a;
  bf16_t* dxe = w.un.rows_b;
  glue::gather_rows(dyg, dyp, w.schedule.row_token_slot, w.device_total_rows(), cap, k, H, s);
  std::vector<blas::Gemm> da, dx_gate, dx_up, wgrad;
  for (int64_t e = 0; e < E_loc; ++e) {
    const int64_t o = offset[e];
    const int n = rows[e];
    // [n, H] · [H, I] -> [n, I]
    da.push_back({false, false, n, to_int(I), to_int(H), dyg + o * H, to_int(H), wd + e * H * I, to_int(I),
                  w.un.da + o * I, to_int(I)});
    const bf16_t* wg_e = wg + e * expert_stride(in.weights.w_gate);
    const bf16_t* wu_e = wu + e * expert_stride(in.weights.w_up);
    // [n, I] · [I, H] -> [n, H], the up term accumulated onto the gate term
    dx_gate.push_back({false, false, n, to_int(H), to_int(I), w.un.dg + o * I, to_int(I), wg_e, to_int(H),
                       dxe + o * H, to_int(H), 0.0f});
    dx_up.push_back({false, false, n, to_int(H), to_int(I), w.un.du + o * I, to_int(I), wu_e, to_int(H),
                     dxe + o * H, to_int(H), 1.0f});
    // Weight gradients, K = n rows of the expert: [I, n] · [n, H], [I, n] · [n, H], [H, n] · [n, I]
    if (!wants_expert_weight_grads(grads)) continue;
    wgrad.push_back({true, false, to_int(I), to_int(H), n, w.un.dg + o * I, to_int(I), w.un.xg + o * H, to_int(H),
                     data_of<bf16_t>(grads.dw_gate) + e * expert_stride(grads.dw_gate), to_int(H)});
    wgrad.push_back({true, false, to_int(I), to_int(H), n, w.un.du + o * I, to_int(I), w.un.xg + o * H, to_int(H),
                     data_of<bf16_t>(grads.dw_up) + e * expert_stride(grads.dw_up), to_int(H)});
    wgrad.push_back({true, false, to_int(H), to_int(I), n, dyg + o * H, to_int(H), w.un.h + o * I, to_int(I),
                     data_of<bf16_t>(grads.dw_down) + e * H * I, to_int(I)});
  }
  run_products(w, da, s);
  glue::swiglu_backward(w.un.dg, w.un.du, I, w.un.h, data_of<float>(grads.d_topk_weights), w.un.da, w.un.g, w.un.u,
                  data_of<const float>(in.topk_weights), w.schedule.row_token_slot, w.device_total_rows(), cap, I, s);
  run_products(w, dx_gate, s);
  run_products(w, dx_up, s);
  CombineSources unrouted;  // the slots not routed get d_topk_weights 0
  unrouted.d_topk_weights = data_of<float>(grads.d_topk_weights);
  glue::combine(data_of<bf16_t>(grads.dx), dxe, w.schedule.slot_row, nullptr, Is > 0 ? w.un.ys : nullptr, T, k, H,
                w.status, s, unrouted);
  if (!wants_expert_weight_grads(grads)) return;
  // The forward's x rows are not kept (plan/context_layout.cpp): gathered again.
  glue::gather_rows(w.un.xg, data_of<const bf16_t>(in.x), w.schedule.row_token_slot, w.device_total_rows(), cap, k, H,
                    s);
  run_products(w, wgrad, s);
}

}  // namespace lynx::baseline
