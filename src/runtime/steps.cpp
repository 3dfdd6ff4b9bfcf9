#include "runtime/steps.h"

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/cuda_check.h"
#include "kernels/glue/api.h"
#include "lynx/allocator.h"
#include "plan/context_layout.h"
#include "plan/shared_load_block.h"
#include "runtime/scratch.h"
#include "runtime/stages.h"

namespace lynx {
namespace {

int to_int(int64_t v) { return static_cast<int>(v); }

}  // namespace

void enqueue_schedule(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  w.counts_on_host = false;
  w.schedule_built = true;
  sched::DeviceRouting routing{};
  sched::DeviceBuffers buffers = w.schedule;
  if (w.ranks() == 1) {
    sched::OwnRouting own;
    own.topk_ids = in.topk_ids.data;
    own.ids_int64 = in.topk_ids.dtype == DType::kI64;
    own.topk_weights = data_of<const float>(in.topk_weights);
    own.ids32 = w.ids32;
    routing.topk_ids[0] = w.ids32;
    sched::build_schedule_device(w.problem, w.plan.schedule, routing, buffers, s, &own);
    return;
  }
  for (int32_t r = 0; r < w.ranks(); ++r) routing.topk_ids[r] = reinterpret_cast<const int32_t*>(w.peer_bases[r] + w.layout.ids32);
  buffers.peer_slot_row = w.table<int32_t>(comm::kSlotRow);
  sched::build_schedule_device(w.problem, w.plan.schedule, routing, buffers, s);
}

void enqueue_stage_routing(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  sched::OwnRouting own;
  own.topk_ids = in.topk_ids.data;
  own.ids_int64 = in.topk_ids.dtype == DType::kI64;
  own.topk_weights = data_of<const float>(in.topk_weights);
  own.ids32 = w.ids32;
  sched::stage_routing(own, w.in_region<float>(w.layout.weights), sh.tokens * sh.top_k, sh.num_experts, sh.rank,
                       w.status, s);
}

void enqueue_stage_inputs(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  enqueue_stage_routing(w, in, s);
  LYNX_CUDA(cudaMemcpyAsync(w.in_region<void>(w.layout.token_rows), in.x.data, size_t(2 * sh.tokens * sh.hidden),
                            cudaMemcpyDeviceToDevice, s));
}

void enqueue_shared_gate_up(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, Is = sh.shared_intermediate;
  if (Is == 0 || omitted(Stage::kSharedForward, w.forward_calls)) return;
  blas::gemm(w.cublas, {false, true, to_int(T), to_int(Is), to_int(H), in.x.data, to_int(H),
                           in.weights.ws_gate.data, to_int(H), w.un.gs, to_int(Is)}, false, s);
  blas::gemm(w.cublas, {false, true, to_int(T), to_int(Is), to_int(H), in.x.data, to_int(H),
                           in.weights.ws_up.data, to_int(H), w.un.us, to_int(Is)}, false, s);
}

void enqueue_shared_down(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, Is = sh.shared_intermediate;
  if (Is == 0 || omitted(Stage::kSharedForward, w.forward_calls)) return;
  glue::swiglu_forward(w.un.hs, w.un.gs, w.un.us, nullptr, nullptr, T, Is, s);
  blas::gemm(w.cublas, {false, true, to_int(T), to_int(H), to_int(Is), w.un.hs, to_int(Is),
                           in.weights.ws_down.data, to_int(Is), w.un.ys, to_int(H)}, true, s);
}

void load_shared_expert_kernels(Workspace::Impl& w) {
  const LayerShape& sh = w.shape;
  if (sh.shared_intermediate == 0) return;
  const int64_t T = sh.tokens, H = sh.hidden, Is = sh.shared_intermediate;
  ScratchAllocator* allocator = w.config.scratch_allocator;
  // x and the weights, then the intermediates the workspace lends (plan/shared_load_block.h); the
  // others are the workspace's own.
  const plan::SharedLoadBlock layout = plan::shared_load_block(sh, allocator != nullptr, w.config.caller_context);
  const int64_t bytes = layout.total();
  const cudaStream_t s = nullptr;
  char* block = nullptr;
  if (allocator) {
    block = allocate_block(*allocator, bytes, s);
  } else {
    const cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&block), size_t(bytes));
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw Error("", "cannot allocate " + std::to_string(bytes) +
                          " bytes of device memory to load the shared expert's cuBLAS kernels: " + cudaGetErrorString(err));
    }
  }
  UnfusedBuffers& un = w.un;
  const UnfusedBuffers kept = un;
  const auto give_back = [&] {
    un = kept;
    cudaStreamSynchronize(s);
    if (allocator) {
      deallocate_block(*allocator, block, bytes, s);
    } else {
      cudaFree(block);
    }
  };
  try {
    LYNX_CUDA(cudaMemsetAsync(block, 0, size_t(layout.x + layout.weights), s));
    LayerInputs in{};
    in.x.data = block;
    in.weights.ws_gate.data = in.weights.ws_up.data = in.weights.ws_down.data = block + layout.x;
    Gradients grads{};
    grads.dws_gate.data = grads.dws_up.data = grads.dws_down.data = block + layout.x;
    char* at = block + layout.x + layout.weights;
    const auto place = [&](auto*& field, int64_t n) {
      field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(at);
      at += plan::lent_bytes(n);
    };
    if (layout.scratch > 0) {
      for (bf16_t** field : {&un.hs, &un.dhs, &un.dgs, &un.dus}) place(*field, 2 * T * Is);
      place(un.ys, 4 * T * H);
    }
    if (layout.context > 0) {
      place(un.gs, 2 * T * Is);
      place(un.us, 2 * T * Is);
    }
    enqueue_shared_gate_up(w, in, s);
    enqueue_shared_down(w, in, s);
    enqueue_shared_backward(w, in, in.x, grads, s);
    LYNX_CUDA(cudaStreamSynchronize(s));
  } catch (...) {
    give_back();
    throw;
  }
  give_back();
}

void enqueue_combine(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  if (omitted(Stage::kCombine, w.forward_calls)) return;
  glue::combine(data_of<bf16_t>(y), w.un.rows_a, w.schedule.slot_row, data_of<const float>(in.topk_weights),
                sh.shared_intermediate > 0 ? w.un.ys : nullptr, sh.tokens, sh.top_k, sh.hidden, w.status, s,
                w.combine_sources(comm::kRowsA));
}

void enqueue_dispatch(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, bool gather_rows) {
  const LayerShape& sh = w.shape;
  enqueue_schedule(w, in, s);
  if (gather_rows && !omitted(Stage::kGather, w.forward_calls)) {
    glue::gather_rows(w.un.xg, data_of<const bf16_t>(in.x), w.schedule.row_token_slot, w.device_total_rows(),
                      w.problem.capacity, sh.top_k, sh.hidden, s);
  }
  enqueue_shared_gate_up(w, in, s);
}

void enqueue_shared_and_combine(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s) {
  enqueue_shared_down(w, in, s);
  enqueue_combine(w, in, y, s);
}

void fetch_counts(Workspace::Impl& w, cudaStream_t s) {
  const int64_t E_loc = w.problem.local_experts();
  LYNX_CUDA(cudaMemcpyAsync(w.counts_host, w.schedule.expert_offset, sizeof(int32_t) * (E_loc + 1),
                            cudaMemcpyDeviceToHost, s));
  LYNX_CUDA(cudaMemcpyAsync(w.counts_host + E_loc + 1, w.schedule.expert_rows, sizeof(int32_t) * E_loc,
                            cudaMemcpyDeviceToHost, s));
  LYNX_CUDA(cudaMemcpyAsync(w.status_host, w.status, sizeof(DeviceStatus), cudaMemcpyDeviceToHost, s));
  LYNX_CUDA(cudaEventRecord(w.counts_ready, s));
  LYNX_CUDA(cudaEventSynchronize(w.counts_ready));
  w.throw_if_status_error(s);
  w.grouped->begin_pass();
  w.counts_on_host = true;
}

void require_context(const Workspace::Impl& w, const LayerInputs& in) {
  if (!w.context_valid) {
    throw Error("backward", "no forward context in the workspace: run forward with config.save_forward_context = "
                            "true, or recompute_forward_context, on the same inputs first");
  }
  if (!(w.context == ContextKey::of(in))) {
    throw Error("backward", "the workspace's forward context was built for other x / topk_ids / topk_weights / "
                            "gate / up tensors");
  }
}

void enqueue_shared_backward(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
                             cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int T = to_int(sh.tokens), H = to_int(sh.hidden), Is = to_int(sh.shared_intermediate);
  if (Is == 0 || omitted(Stage::kSharedBackward, w.backward_calls)) return;
  using blas::gemm;
  const void* dyp = dy.data;
  // dhs = dy · ws_down; SwiGLU backward (router weight 1); dx_s = dgs · ws_gate + dus · ws_up (fp32)
  gemm(w.cublas, {false, false, T, Is, H, dyp, H, in.weights.ws_down.data, Is, w.un.dhs, Is}, false, s);
  glue::swiglu_backward(w.un.dgs, w.un.dus, Is, w.un.hs, nullptr, w.un.dhs, w.un.gs, w.un.us, nullptr, nullptr,
                           nullptr, T, Is, s);
  gemm(w.cublas, {false, false, T, H, Is, w.un.dgs, Is, in.weights.ws_gate.data, H, w.un.ys, H, 0.0f}, true, s);
  gemm(w.cublas, {false, false, T, H, Is, w.un.dus, Is, in.weights.ws_up.data, H, w.un.ys, H, 1.0f}, true, s);
  // Weight gradients, K = T: dyᵀ · hs, dgsᵀ · x, dusᵀ · x
  if (!wants_shared_weight_grads(grads)) return;
  gemm(w.cublas, {true, false, H, Is, T, dyp, H, w.un.hs, Is, grads.dws_down.data, Is}, false, s);
  gemm(w.cublas, {true, false, Is, H, T, w.un.dgs, Is, in.x.data, H, grads.dws_gate.data, H}, false, s);
  gemm(w.cublas, {true, false, Is, H, T, w.un.dus, Is, in.x.data, H, grads.dws_up.data, H}, false, s);
}

}  // namespace lynx
