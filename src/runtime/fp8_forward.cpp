#include "common/cuda_check.h"
#include "kernels/fp8/api.h"
#include "kernels/glue/api.h"
#include "kernels/peer/api.h"
#include "runtime/fp8_passes.h"
#include "runtime/fused_launch.h"
#include "runtime/stages.h"
#include "runtime/steps.h"

namespace lynx::fp8pass {
namespace {

fp8::NonfiniteReport report(const Workspace::Impl& w, Fp8Tensor what) {
  return fp8::NonfiniteReport{nullptr, w.status, int64_t(what), w.shape.rank};
}

}  // namespace

void quantize_weights(Workspace::Impl& w, const ExpertWeights& weights, Fp8Copies copies, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t E = sh.local_experts(), H = sh.hidden, I = sh.intermediate;
  Fp8Buffers& f = w.f8;
  const QuantizedWeightsKey made{weights.w_gate.data, weights.w_up.data, weights.w_down.data, DType::kBF16, true};
  const bool forward = copies != Fp8Copies::kBackward, backward = copies != Fp8Copies::kForward;
  Fp8WeightStore& store = *w.fp8_store;
  if (forward) store.forward.valid = false;  // until every copy is queued
  if (backward) store.backward.valid = false;
  const auto gate = data_of<const bf16_t>(weights.w_gate), up = data_of<const bf16_t>(weights.w_up),
             down = data_of<const bf16_t>(weights.w_down);
  const fp8::NonfiniteReport up_report = report(w, Fp8Tensor::kUp);
  // NOTES: both copies of a matrix from one read of it where each block of the transposed matrix is the
  // transpose of one block (always for w_down; for [w_gate; w_up]ᵀ where I % 128 == 0), the same bits:
  // a third less memory traffic than reading the bf16 weights once for each copy. w_gate and w_up before
  // w_down, as before: the status names the first non-finite tensor reported.
  if (forward && backward && I % fp8::kBlock == 0) {
    fp8::quantize_blocks_and_transposed(gate, I, up, I, E, H, f.w_gate, f.w_gate_scales, f.w_up, f.w_up_scales,
                                        f.w_gate_up_t, f.w_gate_up_t_scales, report(w, Fp8Tensor::kGate), s,
                                        &up_report);
  } else {
    if (forward) {
      fp8::quantize_blocks(gate, E, I, H, f.w_gate, f.w_gate_scales, report(w, Fp8Tensor::kGate), s);
      fp8::quantize_blocks(up, E, I, H, f.w_up, f.w_up_scales, up_report, s);
    }
    if (backward) {
      fp8::quantize_blocks_transposed(gate, I, up, I, E, H, f.w_gate_up_t, f.w_gate_up_t_scales,
                                      report(w, Fp8Tensor::kGate), s, &up_report);
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

namespace {

// R > 1, the open step: this rank's tokens of `rows` (x, or dy) quantised once per token in 1×128 tiles
// into its shared region's token rows (bytes [T, H], then scales [T, H/128↑]), where the ranks whose
// experts need them pull them; a NaN or an infinity is reported by this rank, which holds it, and by
// every rank that pulls a tile of it (naming this rank).
void stage_tiles(Workspace::Impl& w, const TensorView& rows, Fp8Tensor what, cudaStream_t s) {
  const int64_t T = w.shape.tokens, H = w.shape.hidden;
  uint8_t* q = w.in_region<uint8_t>(w.layout.token_rows);
  fp8::quantize_tiles(data_of<const bf16_t>(rows), T, H, nullptr, q, reinterpret_cast<float*>(q + T * H),
                      report(w, what), s);
}

// One rank's tokens of `rows` (x, or dy) quantised once per token in 1×128 tiles, into f8.x.
void quantize_tokens(Workspace::Impl& w, const TensorView& rows, Fp8Tensor what, cudaStream_t s) {
  fp8::quantize_tiles(data_of<const bf16_t>(rows), w.shape.tokens, w.shape.hidden, nullptr, w.f8.x, w.f8.x_scales,
                      report(w, what), s);
}

// The 1×128 tiles of `rows`' tokens (x, or dy) in schedule order, into f8.xg: one rank quantises its
// tokens once and gathers their tiles; at R > 1 each row's tile is pulled from its source rank's
// staged tiles (stage_tiles): one byte an element, and a scale per 128.
void tiles_in_schedule_order(Workspace::Impl& w, const TensorView& rows, Fp8Tensor what, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, cap = w.problem.capacity;
  const Fp8Buffers& f = w.f8;
  const int32_t* slots = w.schedule.row_token_slot;
  if (w.ranks() == 1) {
    quantize_tokens(w, rows, what, s);
    fp8::gather_tiles(f.xg, f.xg_scales, f.x, f.x_scales, slots, w.device_total_rows(), cap, sh.top_k, H, s);
    return;
  }
  const RowSources rs = w.row_sources(comm::kTokenRows);
  fp8::gather_tiles(f.xg, f.xg_scales, nullptr, nullptr, slots, w.device_total_rows(), cap, sh.top_k, H, s,
                    fp8::TileSources{rs.base, rs.row_src_rank, T}, report(w, what));
}

// A weight gradient's operand from one rank's tokens' tiles (f8.x, quantize_tokens): the tile of each
// schedule row, transposed and quantised along the rows into q, scales (fp8::transpose_gathered_tiles),
// the bits transpose_tiles gives from the rows dequantised (dequantized_rows), without those [capacity,
// H] bf16 rows.
void transposed_token_tiles(const Workspace::Impl& w, Fp8Tensor what, uint8_t* q, float* scales, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  fp8::transpose_gathered_tiles(w.f8.x, w.f8.x_scales, w.schedule.row_token_slot, w.device_total_rows(),
                                w.problem.capacity, sh.top_k, sh.hidden, q, scales, report(w, what), s);
}

// f8.xg's rows as bf16, into `out`: x̂ or dŷ, the rows as they travelled, which the weight gradients
// read (so that every R gives one rank's bits; docs/fp8.md).
void dequantized_rows(const Workspace::Impl& w, bf16_t* out, cudaStream_t s) {
  fp8::dequantize_tiles(w.f8.xg, w.f8.xg_scales, w.problem.capacity, w.shape.hidden, w.device_total_rows(), out, s);
}

// One rank's x̂ or dŷ rows in schedule order into `out` from its tokens' tiles in f8.x (quantize_tokens),
// gathered and dequantised in one pass (zeros in padding rows): the bits of dequantized_rows on the
// gathered tiles.
void dequantized_token_rows(const Workspace::Impl& w, bf16_t* out, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  fp8::gather_dequantized_tiles(w.f8.x, w.f8.x_scales, w.schedule.row_token_slot, w.device_total_rows(),
                                w.problem.capacity, sh.top_k, sh.hidden, out, s);
}

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
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, cap = w.problem.capacity;
  const Fp8Buffers& f = w.f8;
  const int32_t* slots = w.schedule.row_token_slot;
  fp8::TileGather g;
  g.row_token_slot = slots;
  g.top_k = sh.top_k;
  // NOTES: the plan counts row blocks of bf16 rows (plan/gather.h); E4M3 rows are half the bytes.
  g.lookahead = 2 * w.plan.gate_up.gather_lookahead;
  g.sync = w.gather_sync;
  if (w.ranks() == 1) {
    quantize_tokens(w, in.x, Fp8Tensor::kX, s);
    fp8::gather_tile_scales(f.xg_scales, f.x_scales, slots, w.device_total_rows(), cap, sh.top_k, H, s);
    g.tokens = f.x;
    return g;
  }
  const RowSources rs = w.row_sources(comm::kTokenRows);
  fp8::gather_tile_scales(f.xg_scales, nullptr, slots, w.device_total_rows(), cap, sh.top_k, H, s,
                          fp8::TileSources{rs.base, rs.row_src_rank, T}, report(w, Fp8Tensor::kX));
  g.sources = rs;
  return g;
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
                                     w.plan.fp8_pair_rows);
  }
  if (w.ranks() > 1 && keep_context) dequantized_rows(w, w.un.xg, s);
  w.context = ContextKey::of(in);
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
  bf16_t* dgu = w.fb.dgu;     // [cap, 2I] dg | du per row (zeros on padding rows)
  enqueue_shared_backward(w, in, dy, grads, s);
  if (!omitted(Stage::kDyGather, w.backward_calls)) {
    tiles_in_schedule_order(w, dy, Fp8Tensor::kDy, s);
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
                                   w.schedule.expert_offset, w.un.da, w.stall_report_device, s, w.plan.fp8_pair_rows);
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
    // dŷ's straight from dy's tiles in f8.x at R = 1.
    if (dy_rows) {
      fp8::transpose_tiles(dyg, cap, H, total, f.xg, f.xg_scales, report(w, Fp8Tensor::kDy), s);
    } else {
      transposed_token_tiles(w, Fp8Tensor::kDy, f.xg, f.xg_scales, s);
    }
    if (!transposed_with_swiglu) {
      fp8::transpose_tiles(w.un.h, cap, I, total, f.h, f.h_scales, report(w, Fp8Tensor::kH), s);
    }
    fp8::grouped_weight_grad_block_scaled(f.xg, f.xg_scales, H, f.h, f.h_scales, I, cap, E, w.schedule.expert_offset,
                                          data_of<bf16_t>(grads.dw_down), nullptr, H, w.stall_report_device, s);
  }
  // dx_row = [dg | du] · [w_gate[e]; w_up[e]]: tiles over K = 2I times [w_gate; w_up]ᵀ [H, 2I] blocks.
  if (!omitted(Stage::kDgradGateUp, w.backward_calls)) {
    if (!dgu_with_swiglu) {
      fp8::quantize_tiles(dgu, cap, 2 * I, total, f.dgu, f.dgu_scales, report(w, Fp8Tensor::kDgu), s);
    }
    fp8::grouped_gemm_block_scaled(f.dgu, f.dgu_scales, cap, 2 * I, f.w_gate_up_t, f.w_gate_up_t_scales, E, H,
                                   w.schedule.expert_offset, w.un.rows_b, w.stall_report_device, s, w.plan.fp8_pair_rows);
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
                                          data_of<bf16_t>(grads.dw_up), I, w.stall_report_device, s);
  }
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
  forward_context(w, in, s, w.config.save_forward_context, true);
  if (!omitted(Stage::kDown, w.forward_calls)) {
    fp8::grouped_gemm_block_scaled(f.h, f.h_scales, cap, I, f.w_down, f.w_down_scales, E, H,
                                   w.schedule.expert_offset, w.un.rows_a, w.stall_report_device, s, w.plan.fp8_pair_rows);
  }
  enqueue_shared_down(w, in, s);
  fused::compute_ends(w, s);
}

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
