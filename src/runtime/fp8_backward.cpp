// The FP8 backward (fp8_passes.h), in the fused passes' steps.
#include "kernels/fp8/api.h"
#include "kernels/glue/api.h"
#include "kernels/peer/api.h"
#include "runtime/fp8_passes.h"
#include "runtime/fp8_rows.h"
#include "runtime/fused_launch.h"
#include "runtime/stages.h"
#include "runtime/steps.h"

namespace lynx::fp8pass {
namespace {

// Where the da GEMM finds dy's tiles in schedule order: gathered into f8.xg before it
// (tiles_in_schedule_order), or, at one rank where the plan puts da's gather in the GEMM, their scales
// gathered before it and their bytes by the GEMM itself (the returned TileGather), as gate/up finds x's
// (fp8_forward.cpp). One rank's tokens' tiles are in f8.x either way, where dŷ's readers find them.
// NOTES: the plan's place for da's rows (plan.da_gather, as for the bf16 da launch) rather than gate/up's,
// though both gather rows of K = H (the same bytes a row, the same lookahead): the rule (plan/gather.h)
// weighs a row's copy against the output columns it feeds, I here against gate/up's 2I, and E4M3 halves
// both sides (a row's bytes, and its products' time at twice bf16's rate). So at qwen3-30b-a3b (I = 768)
// the kernel before the GEMM gathers dy's tiles: the GEMM's gather there made forward+backward 4.4% slower
// (docs/fp8.md, Tried).
fp8::TileGather dy_tiles_for_da(Workspace::Impl& w, const TensorView& dy, cudaStream_t s) {
  if (w.ranks() > 1 || w.plan.da_gather != plan::GatherPlace::kInGemm) {
    tiles_in_schedule_order(w, dy, Fp8Tensor::kDy, s);
    return {};
  }
  return tiles_for_gemm_gather(w, dy, Fp8Tensor::kDy, w.plan.da.gather_lookahead, s);
}

// The experts' backward (and the shared expert's), between the two barriers at R > 1.
void backward_compute(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
                      cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t H = sh.hidden, I = sh.intermediate, E = sh.local_experts(), cap = w.problem.capacity;
  const Fp8Buffers& f = w.f8;
  const int32_t* total = w.device_total_rows();
  const int32_t* slots = w.schedule.row_token_slot;
  bf16_t* dyg = w.un.rows_a;  // [cap, H]  dŷ: the dy rows as they travelled, bf16, for a bf16 dw_down
                              //            (then rows_b, the per-row dx, in the same memory)
  const bool bf16_wgrads = w.config.bf16_weight_grads;
  const bool wgrads = wants_expert_weight_grads(grads);
  // NOTES: one rank's FP8 weight gradients read dy's tiles straight from f8.x. At R > 1 those tiles are
  // other ranks' (pulled once already, into f8.xg, for the dgrad of down): dŷ's rows are dequantised
  // from f8.xg instead, as for bf16 weight gradients, rather than pulled a second time.
  const bool dy_rows = wgrads && (bf16_wgrads || w.ranks() > 1);
  // NOTES: one rank's FP8 dw_down, where a kernel gathers dy's tiles for da: that kernel's loads also
  // make dŷ's transposed tiles (transpose_gathered_tiles keeping the gathered ones), into the dy rows'
  // memory, unused at one rank with FP8 weight gradients until dx's rows fill it after dw_down; one pass
  // over dy's tiles fewer, the same bits.
  const bool dy_t_with_gather = w.ranks() == 1 && wgrads && !bf16_wgrads &&
                                w.plan.da_gather != plan::GatherPlace::kInGemm &&
                                !omitted(Stage::kDyGather, w.backward_calls) &&
                                !omitted(Stage::kWgradDown, w.backward_calls);
  uint8_t* dy_t = reinterpret_cast<uint8_t*>(dyg);                 // [H, cap] codes
  float* dy_t_scales = reinterpret_cast<float*>(dy_t + H * cap);   // [cap / 128, pitch(H)]
  bf16_t* dgu = w.fb.dgu;     // [cap, 2I] dg | du per row (zeros on padding rows)
  enqueue_shared_backward(w, in, dy, grads, s);
  fp8::TileGather dy_gather;
  if (dy_t_with_gather) {
    quantize_tokens(w, dy, Fp8Tensor::kDy, s);
    transposed_token_tiles(w, Fp8Tensor::kDy, dy_t, dy_t_scales, s, {f.xg, f.xg_scales});
  } else if (!omitted(Stage::kDyGather, w.backward_calls)) {
    dy_gather = dy_tiles_for_da(w, dy, s);
    // One rank's dŷ rows straight from its tokens' tiles in f8.x.
    if (dy_rows && w.ranks() == 1) {
      dequantized_token_rows(w, dyg, s);
    } else if (dy_rows) {
      dequantized_rows(w, dyg, s);
    }
  }
  // da = dy_row · w_down[e]: [rows, H] tiles times w_downᵀ [I, H] blocks.
  if (!omitted(Stage::kDgradDown, w.backward_calls)) {
    fp8::grouped_gemm_block_scaled(f.xg, f.xg_scales, cap, H, f.w_down_t, f.w_down_t_scales, E, I,
                                   w.schedule.expert_offset, w.un.da, w.stall_report_device, s, dy_gather,
                                   w.plan.fp8_pair_rows, half_blocks(w));
  }
  // dg | du, w · silu(g)⊙u (into h), d_topk_weights: as in bf16 (at R > 1 each row's router weight is its
  // source rank's, and its d_topk_weights stays with the row), with zeros in every padding row: the
  // quantisations below read whole 128-row blocks.
  // NOTES: where I % 128 == 0 (a tile of dg | du is then dg's or du's alone), dg | du are quantised for
  // the dgrad of gate/up as they are written, rather than read back by quantize_tiles: the same bits.
  const bool dgu_with_swiglu = I % fp8::kBlock == 0 && !omitted(Stage::kSwigluBackward, w.backward_calls) &&
                               !omitted(Stage::kDgradGateUp, w.backward_calls);
  // NOTES: one rank with FP8 weight gradients: the SwiGLU backward also writes the weight gradients'
  // transposed operands (glue::swiglu_backward_fp8, 128-row blocks), dg | du's into fb.dgu's memory,
  // and no bf16 rows of dg | du or of w·silu(g)⊙u: some 0.6 GB less memory traffic a backward at
  // qwen3-30b-a3b, by count, for the same bits.
  const bool transposed_with_swiglu = dgu_with_swiglu && w.ranks() == 1 && wgrads && !bf16_wgrads &&
                                      !omitted(Stage::kWgradDown, w.backward_calls) &&
                                      !omitted(Stage::kWgradGateUp, w.backward_calls);
  uint8_t* dgu_t = reinterpret_cast<uint8_t*>(dgu);                 // [2I, cap] codes
  float* dgu_t_scales = reinterpret_cast<float*>(dgu_t + 2 * I * cap);  // [cap / 128, pitch(2I)]
  if (!omitted(Stage::kSwigluBackward, w.backward_calls)) {
    float* d_topk = data_of<float>(grads.d_topk_weights);
    if (w.ranks() > 1) d_topk = w.in_region<float>(w.layout.d_topk_rows);
    glue::QuantizedDgu codes;
    if (dgu_with_swiglu) codes = {f.dgu, f.dgu_scales, report(w, Fp8Tensor::kDgu)};
    if (transposed_with_swiglu) {
      glue::swiglu_backward_fp8(d_topk, w.un.da, w.un.g, w.un.u, data_of<const float>(in.topk_weights), slots, total,
                                cap, I, w.gate_up_by_slot, codes,
                                {dgu_t, dgu_t_scales, report(w, Fp8Tensor::kDgu)},
                                {f.h, f.h_scales, report(w, Fp8Tensor::kH)}, s);
    } else {
      glue::swiglu_backward(dgu, dgu + I, 2 * I, w.un.h, d_topk, w.un.da, w.un.g, w.un.u,
                            data_of<const float>(in.topk_weights), slots, total, cap, I, s,
                            w.row_sources(comm::kWeights), w.gate_up_by_slot, true, codes);
    }
  }
  // dw_down, the dy rows' last use: rows_b, which dx_row fills next, is their memory (runtime/workspace.cpp).
  if (bf16_wgrads) {
    fused::weight_grad_down(w, grads, dyg, s);
  } else if (wgrads && !omitted(Stage::kWgradDown, w.backward_calls)) {  // dw_down = dŷ rowsᵀ · w·silu(g)⊙u
    // Its operands transposed and quantised in 1×128 tiles along the rows, into buffers the forward
    // and the dgrad of down are done with (each at least that large); so below for dw_gate | dw_up.
    // dŷ's straight from dy's tiles in f8.x at R = 1 (made with their gather, or here).
    uint8_t* dyq = dy_t_with_gather ? dy_t : f.xg;
    float* dyq_scales = dy_t_with_gather ? dy_t_scales : f.xg_scales;
    if (dy_rows) {
      fp8::transpose_tiles(dyg, cap, H, total, f.xg, f.xg_scales, report(w, Fp8Tensor::kDy), s);
    } else if (!dy_t_with_gather) {
      transposed_token_tiles(w, Fp8Tensor::kDy, f.xg, f.xg_scales, s);
    }
    if (!transposed_with_swiglu) {
      fp8::transpose_tiles(w.un.h, cap, I, total, f.h, f.h_scales, report(w, Fp8Tensor::kH), s);
    }
    fp8::grouped_weight_grad_block_scaled(dyq, dyq_scales, H, f.h, f.h_scales, I, cap, E, w.schedule.expert_offset,
                                          data_of<bf16_t>(grads.dw_down), nullptr, H, w.stall_report_device, s);
  }
  // dx_row = [dg | du] · [w_gate[e]; w_up[e]]: tiles over K = 2I times [w_gate; w_up]ᵀ [H, 2I] blocks.
  if (!omitted(Stage::kDgradGateUp, w.backward_calls)) {
    if (!dgu_with_swiglu) {
      fp8::quantize_tiles(dgu, cap, 2 * I, total, f.dgu, f.dgu_scales, report(w, Fp8Tensor::kDgu), s);
    }
    fp8::grouped_gemm_block_scaled(f.dgu, f.dgu_scales, cap, 2 * I, f.w_gate_up_t, f.w_gate_up_t_scales, E, H,
                                   w.schedule.expert_offset, w.un.rows_b, w.stall_report_device, s, {},
                                   w.plan.fp8_pair_rows, half_blocks(w));
  }
  if (w.ranks() == 1) {
    fused::dx_combine(w, grads, s);
    // x̂ for dw_gate and dw_up: one rank keeps no x rows from its forward, and quantises x again: into
    // f8.x (dw_down is done with dy's tiles there), whose tiles the FP8 weight gradient transposes
    // itself; for bf16 ones, gathered and dequantised into un.xg.
    if (wgrads && !omitted(Stage::kXGather, w.backward_calls)) {
      quantize_tokens(w, in.x, Fp8Tensor::kX, s);
      if (bf16_wgrads) dequantized_token_rows(w, w.un.xg, s);
    }
  }
  if (bf16_wgrads) return fused::weight_grad_gate_up(w, grads, s);
  if (wgrads && !omitted(Stage::kWgradGateUp, w.backward_calls)) {  // dw_gate | dw_up = [dg | du]ᵀ · x̂ rows
    // dg | du transposed: by the SwiGLU backward into fb.dgu's memory, or here over its row codes.
    uint8_t* dgu_q = transposed_with_swiglu ? dgu_t : f.dgu;
    float* dgu_scales = transposed_with_swiglu ? dgu_t_scales : f.dgu_scales;
    if (!transposed_with_swiglu) {
      fp8::transpose_tiles(dgu, cap, 2 * I, total, f.dgu, f.dgu_scales, report(w, Fp8Tensor::kDgu), s);
    }
    // x̂: one rank's from x's tiles; at R > 1 the context's rows (the region's token rows hold dy now).
    if (w.ranks() == 1) {
      transposed_token_tiles(w, Fp8Tensor::kX, f.xg, f.xg_scales, s);
    } else {
      fp8::transpose_tiles(w.un.xg, cap, H, total, f.xg, f.xg_scales, report(w, Fp8Tensor::kX), s);
    }
    fp8::grouped_weight_grad_block_scaled(dgu_q, dgu_scales, 2 * I, f.xg, f.xg_scales, H, cap, E,
                                          w.schedule.expert_offset, data_of<bf16_t>(grads.dw_gate),
                                          data_of<bf16_t>(grads.dw_up), I, w.stall_report_device, s,
                                          {expert_stride(grads.dw_gate), expert_stride(grads.dw_up)});
  }
}

}  // namespace

void backward(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads, cudaStream_t s,
              fused::Step step) {
  switch (step) {
    case fused::Step::kOpen:
      require_context(w, in);
      if (w.ranks() == 1) return;
      fused::restage_routing(w, in, s);
      stage_tiles(w, dy, Fp8Tensor::kDy, s);
      return peer::arrive(w.barrier_args(), false, s);
    case fused::Step::kCompute:
      fused::compute_begins(w, s);
      backward_compute(w, in, dy, grads, s);
      return fused::compute_ends(w, s);
    case fused::Step::kClose:
      return fused::backward(w, in, dy, grads, s, step);
  }
}

}  // namespace lynx::fp8pass
