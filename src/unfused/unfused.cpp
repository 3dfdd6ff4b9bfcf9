#include "unfused/unfused.h"

#include "common/cuda_check.h"

namespace lynx::unfused {
namespace {

template <class T>
T* ptr(const TensorView& v) {
  return static_cast<T*>(v.data);
}

int to_int(int64_t v) { return static_cast<int>(v); }

// Validates the routing, builds the schedule, gathers x rows, runs the shared expert's gate/up and the
// routed gate/up GEMMs: everything backward needs. Synchronises once, to read the per-expert counts.
void forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, I = sh.intermediate, k = sh.top_k, Is = sh.shared_intermediate;
  const int64_t E_loc = sh.local_experts(), cap = w.problem.capacity;
  w.context_valid = false;

  reset_status(w.status, s);
  validate_routing(in.topk_ids.data, in.topk_ids.dtype, ptr<const float>(in.topk_weights), T * k, sh.num_experts,
                   sh.rank, w.ids32, w.status, s);
  sched::DeviceRouting routing{};
  routing.topk_ids[0] = w.ids32;
  sched::build_schedule_device(w.problem, routing, w.schedule, s);
  LYNX_CUDA(cudaMemcpyAsync(w.counts_host, w.schedule.expert_offset, sizeof(int32_t) * (E_loc + 1),
                            cudaMemcpyDeviceToHost, s));
  LYNX_CUDA(cudaMemcpyAsync(w.counts_host + E_loc + 1, w.schedule.expert_rows, sizeof(int32_t) * E_loc,
                            cudaMemcpyDeviceToHost, s));
  LYNX_CUDA(cudaMemcpyAsync(w.status_host, w.status, sizeof(DeviceStatus), cudaMemcpyDeviceToHost, s));
  LYNX_CUDA(cudaEventRecord(w.counts_ready, s));

  // Work that needs no counts is queued before the wait.
  gather_rows(w.un.xg, ptr<const bf16_t>(in.x), w.schedule.row_token_slot, w.device_total_rows(), cap, k, H, s);
  if (Is > 0) {
    gemm(w.cublas, {false, true, to_int(T), to_int(Is), to_int(H), in.x.data, to_int(H), in.weights.ws_gate.data,
                    to_int(H), w.un.gs, to_int(Is)}, false, s);
    gemm(w.cublas, {false, true, to_int(T), to_int(Is), to_int(H), in.x.data, to_int(H), in.weights.ws_up.data,
                    to_int(H), w.un.us, to_int(Is)}, false, s);
  }

  LYNX_CUDA(cudaEventSynchronize(w.counts_ready));
  w.throw_if_status_error();
  w.grouped->begin_pass();

  const int32_t* offset = w.host_expert_offset();
  const int32_t* rows = w.host_expert_rows();
  std::vector<Gemm> products;
  for (int64_t e = 0; e < E_loc; ++e) {
    const int64_t o = offset[e];
    const auto* wg = ptr<const bf16_t>(in.weights.w_gate) + e * I * H;
    const auto* wu = ptr<const bf16_t>(in.weights.w_up) + e * I * H;
    // [rows_e, H] · [I, H]ᵀ -> [rows_e, I]
    products.push_back({false, true, rows[e], to_int(I), to_int(H), w.un.xg + o * H, to_int(H), wg, to_int(H),
                        w.un.g + o * I, to_int(I)});
    products.push_back({false, true, rows[e], to_int(I), to_int(H), w.un.xg + o * H, to_int(H), wu, to_int(H),
                        w.un.u + o * I, to_int(I)});
  }
  w.grouped->run(w.cublas, products, false, s);
  w.context = ContextKey{in.x.data, in.topk_ids.data, in.topk_weights.data};
  w.context_valid = true;
}

}  // namespace

void recompute_forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) { forward_context(w, in, s); }

void forward(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s) {
  forward_context(w, in, s);
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, I = sh.intermediate, k = sh.top_k, Is = sh.shared_intermediate;
  const int64_t E_loc = sh.local_experts(), cap = w.problem.capacity;
  const int32_t* offset = w.host_expert_offset();
  const int32_t* rows = w.host_expert_rows();

  swiglu_forward(w.un.h, w.un.g, w.un.u, w.schedule.row_token_slot, w.device_total_rows(), cap, I, s);
  std::vector<Gemm> products;
  for (int64_t e = 0; e < E_loc; ++e) {
    const int64_t o = offset[e];
    // [rows_e, I] · [H, I]ᵀ -> [rows_e, H]
    products.push_back({false, true, rows[e], to_int(H), to_int(I), w.un.h + o * I, to_int(I),
                        ptr<const bf16_t>(in.weights.w_down) + e * H * I, to_int(I), w.un.rows_a + o * H, to_int(H)});
  }
  w.grouped->run(w.cublas, products, false, s);

  if (Is > 0) {
    swiglu_forward(w.un.hs, w.un.gs, w.un.us, nullptr, nullptr, T, Is, s);
    gemm(w.cublas, {false, true, to_int(T), to_int(H), to_int(Is), w.un.hs, to_int(Is), in.weights.ws_down.data,
                    to_int(Is), w.un.ys, to_int(H)}, true, s);
  }
  combine(ptr<bf16_t>(y), w.un.rows_a, w.schedule.slot_row, ptr<const float>(in.topk_weights), Is > 0 ? w.un.ys : nullptr,
          T, k, H, s);
  w.context_valid = w.config.save_forward_context;
}

void backward(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads, cudaStream_t s) {
  if (!w.context_valid) {
    throw Error("backward", "no forward context in the workspace: run forward with config.save_forward_context = "
                            "true, or recompute_forward_context, on the same inputs first");
  }
  if (!(w.context == ContextKey{in.x.data, in.topk_ids.data, in.topk_weights.data})) {
    throw Error("backward", "the workspace's forward context was built for other x / topk_ids / topk_weights tensors");
  }
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, I = sh.intermediate, k = sh.top_k, Is = sh.shared_intermediate;
  const int64_t E_loc = sh.local_experts(), cap = w.problem.capacity;
  const int32_t* offset = w.host_expert_offset();
  const int32_t* rows = w.host_expert_rows();
  const auto* dyp = ptr<const bf16_t>(dy);
  const auto* wg = ptr<const bf16_t>(in.weights.w_gate);
  const auto* wu = ptr<const bf16_t>(in.weights.w_up);
  const auto* wd = ptr<const bf16_t>(in.weights.w_down);

  // Shared expert: dx_s (fp32) and its weight gradients.
  if (Is > 0) {
    gemm(w.cublas, {false, false, to_int(T), to_int(Is), to_int(H), dyp, to_int(H), in.weights.ws_down.data,
                    to_int(Is), w.un.dhs, to_int(Is)}, false, s);
    swiglu_backward(w.un.dgs, w.un.dus, w.un.hs, nullptr, w.un.dhs, w.un.gs, w.un.us, nullptr, nullptr, nullptr, T, Is,
                    s);
    gemm(w.cublas, {false, false, to_int(T), to_int(H), to_int(Is), w.un.dgs, to_int(Is), in.weights.ws_gate.data,
                    to_int(H), w.un.ys, to_int(H), 0.0f}, true, s);
    gemm(w.cublas, {false, false, to_int(T), to_int(H), to_int(Is), w.un.dus, to_int(Is), in.weights.ws_up.data,
                    to_int(H), w.un.ys, to_int(H), 1.0f}, true, s);
    gemm(w.cublas, {true, false, to_int(H), to_int(Is), to_int(T), dyp, to_int(H), w.un.hs, to_int(Is),
                    grads.dws_down.data, to_int(Is)}, false, s);
    gemm(w.cublas, {true, false, to_int(Is), to_int(H), to_int(T), w.un.dgs, to_int(Is), in.x.data, to_int(H),
                    grads.dws_gate.data, to_int(H)}, false, s);
    gemm(w.cublas, {true, false, to_int(Is), to_int(H), to_int(T), w.un.dus, to_int(Is), in.x.data, to_int(H),
                    grads.dws_up.data, to_int(H)}, false, s);
  }

  // Routed experts: dgrad.
  bf16_t* dyg = w.un.rows_a;
  bf16_t* dxe = w.un.rows_b;
  gather_rows(dyg, dyp, w.schedule.row_token_slot, w.device_total_rows(), cap, k, H, s);
  std::vector<Gemm> da, dx_gate, dx_up, wgrad;
  for (int64_t e = 0; e < E_loc; ++e) {
    const int64_t o = offset[e];
    const int n = rows[e];
    // [n, H] · [H, I] -> [n, I]
    da.push_back({false, false, n, to_int(I), to_int(H), dyg + o * H, to_int(H), wd + e * H * I, to_int(I),
                  w.un.da + o * I, to_int(I)});
    // [n, I] · [I, H] -> [n, H], the up term accumulated onto the gate term
    dx_gate.push_back({false, false, n, to_int(H), to_int(I), w.un.dg + o * I, to_int(I), wg + e * I * H, to_int(H),
                       dxe + o * H, to_int(H), 0.0f});
    dx_up.push_back({false, false, n, to_int(H), to_int(I), w.un.du + o * I, to_int(I), wu + e * I * H, to_int(H),
                     dxe + o * H, to_int(H), 1.0f});
    // Weight gradients, K = n rows of the expert: [I, n] · [n, H], [I, n] · [n, H], [H, n] · [n, I]
    wgrad.push_back({true, false, to_int(I), to_int(H), n, w.un.dg + o * I, to_int(I), w.un.xg + o * H, to_int(H),
                     ptr<bf16_t>(grads.dw_gate) + e * I * H, to_int(H)});
    wgrad.push_back({true, false, to_int(I), to_int(H), n, w.un.du + o * I, to_int(I), w.un.xg + o * H, to_int(H),
                     ptr<bf16_t>(grads.dw_up) + e * I * H, to_int(H)});
    wgrad.push_back({true, false, to_int(H), to_int(I), n, dyg + o * H, to_int(H), w.un.h + o * I, to_int(I),
                     ptr<bf16_t>(grads.dw_down) + e * H * I, to_int(I)});
  }
  w.grouped->run(w.cublas, da, false, s);
  swiglu_backward(w.un.dg, w.un.du, w.un.h, ptr<float>(grads.d_topk_weights), w.un.da, w.un.g, w.un.u,
                  ptr<const float>(in.topk_weights), w.schedule.row_token_slot, w.device_total_rows(), cap, I, s);
  w.grouped->run(w.cublas, dx_gate, false, s);
  w.grouped->run(w.cublas, dx_up, false, s);
  combine(ptr<bf16_t>(grads.dx), dxe, w.schedule.slot_row, nullptr, Is > 0 ? w.un.ys : nullptr, T, k, H, s);
  w.grouped->run(w.cublas, wgrad, false, s);
}

}  // namespace lynx::unfused
