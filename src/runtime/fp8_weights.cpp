// The routed experts' E4M3 weight copies (fp8_passes.h): quantised from bf16, or given already quantised.
#include "common/cuda_check.h"
#include "kernels/fp8/api.h"
#include "runtime/fp8_passes.h"
#include "runtime/fp8_rows.h"
#include "runtime/steps.h"

namespace lynx::fp8pass {

void quantize_weights(Workspace::Impl& w, const ExpertWeights& weights, Fp8Copies copies, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t E = sh.local_experts(), H = sh.hidden, I = sh.intermediate;
  Fp8Buffers& f = w.f8;
  const QuantizedWeightsKey made = QuantizedWeightsKey::of(weights, DType::kBF16);
  const bool forward = copies != Fp8Copies::kBackward, backward = copies != Fp8Copies::kForward;
  Fp8WeightStore& store = *w.fp8_store;
  if (forward) store.forward.valid = false;  // until every copy is queued
  if (backward) store.backward.valid = false;
  const auto gate = data_of<const bf16_t>(weights.w_gate), up = data_of<const bf16_t>(weights.w_up),
             down = data_of<const bf16_t>(weights.w_down);
  const fp8::NonfiniteReport up_report = report(w, Fp8Tensor::kUp);
  const fp8::BatchStrides gate_up_strides{expert_stride(weights.w_gate), expert_stride(weights.w_up)};
  // NOTES: both copies of a matrix from one read of it where each block of the transposed matrix is the
  // transpose of one block (always for w_down; for [w_gate; w_up]ᵀ where I % 128 == 0), the same bits:
  // a third less memory traffic than reading the bf16 weights once for each copy. w_gate and w_up before
  // w_down, as before: the status names the first non-finite tensor reported.
  if (forward && backward && I % fp8::kBlock == 0) {
    fp8::quantize_blocks_and_transposed(gate, I, up, I, E, H, f.w_gate, f.w_gate_scales, f.w_up, f.w_up_scales,
                                        f.w_gate_up_t, f.w_gate_up_t_scales, report(w, Fp8Tensor::kGate), s,
                                        &up_report, gate_up_strides);
  } else {
    if (forward) {
      fp8::quantize_blocks(gate, E, I, H, f.w_gate, f.w_gate_scales, report(w, Fp8Tensor::kGate), s,
                           gate_up_strides.src0);
      fp8::quantize_blocks(up, E, I, H, f.w_up, f.w_up_scales, up_report, s, gate_up_strides.src1);
    }
    if (backward) {
      fp8::quantize_blocks_transposed(gate, I, up, I, E, H, f.w_gate_up_t, f.w_gate_up_t_scales,
                                      report(w, Fp8Tensor::kGate), s, &up_report, gate_up_strides);
    }
  }
  if (forward && backward) {
    fp8::quantize_blocks_and_transposed(down, H, nullptr, 0, E, I, f.w_down, f.w_down_scales, nullptr, nullptr,
                                        f.w_down_t, f.w_down_t_scales, report(w, Fp8Tensor::kDown), s);
  } else if (forward) {
    fp8::quantize_blocks(down, E, H, I, f.w_down, f.w_down_scales, report(w, Fp8Tensor::kDown), s);
  } else {
    fp8::quantize_blocks_transposed(down, H, nullptr, 0, E, I, f.w_down_t, f.w_down_t_scales,
                                    report(w, Fp8Tensor::kDown), s);
  }
  if (forward) store.forward = made;
  if (backward) store.backward = made;
}

void set_quantized_weights(Workspace::Impl& w, const Fp8ExpertWeights& weights, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t E = sh.local_experts(), H = sh.hidden, I = sh.intermediate;
  const int64_t kbH = fp8::blocks_of(H), kbI = fp8::blocks_of(I);
  Fp8Buffers& f = w.f8;
  Fp8WeightStore& store = *w.fp8_store;
  store.forward.valid = store.backward.valid = false;  // until every copy is queued
  const auto copy = [&](void* dst, const TensorView& src, int64_t bytes) {
    LYNX_CUDA(cudaMemcpyAsync(dst, src.data, size_t(bytes), cudaMemcpyDeviceToDevice, s));
  };
  copy(f.w_gate, weights.w_gate, E * I * H);
  copy(f.w_up, weights.w_up, E * I * H);
  copy(f.w_down, weights.w_down, E * H * I);
  copy(f.w_gate_scales, weights.w_gate_scales, 4 * E * kbI * kbH);
  copy(f.w_up_scales, weights.w_up_scales, 4 * E * kbI * kbH);
  copy(f.w_down_scales, weights.w_down_scales, 4 * E * kbH * kbI);
  // The transposed copies from the values (e4m3 · scale), read from the workspace's own copies.
  fp8::quantize_blocks_transposed_fp8(f.w_down, f.w_down_scales, H, nullptr, nullptr, 0, E, I, f.w_down_t,
                                      f.w_down_t_scales, report(w, Fp8Tensor::kDown), s);
  const fp8::NonfiniteReport up = report(w, Fp8Tensor::kUp);
  fp8::quantize_blocks_transposed_fp8(f.w_gate, f.w_gate_scales, I, f.w_up, f.w_up_scales, I, E, H, f.w_gate_up_t,
                                      f.w_gate_up_t_scales, report(w, Fp8Tensor::kGate), s, &up);
  store.forward = store.backward = {weights.w_gate.data, weights.w_up.data, weights.w_down.data, DType::kE4M3, true};
}

}  // namespace lynx::fp8pass
