// The small kernels of the unfused path: routing validation, gather, SwiGLU, combine.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/bf16.h"
#include "common/peers.h"
#include "common/status.h"
#include "kernels/fp8/api.h"

namespace lynx::glue {


// Loads the glue kernels into the current context (common/kernel_loading.h says why). A workspace
// calls this when it is made.
void load_kernels();

// dst[row, :] = src[row_token_slot[row] / k, :] for the rows below *total_rows; padding rows get zeros.
// With remote `sources` (R > 1), a row is read from its source rank's copy instead of src.
void gather_rows(bf16_t* dst, const bf16_t* src, const int32_t* row_token_slot, const int32_t* total_rows,
                 int64_t capacity, int64_t top_k, int64_t width, cudaStream_t stream,
                 const RowSources& sources = {});

// The same rows as gather_rows, token-major: dst[slot_row[t*k + j], :] = src[t, :] for every slot of a
// local expert (slot_row >= 0), each src row read once; the padding rows below *total_rows that a row
// GEMM's tile reads (sched::core::padding_row_read) get zeros, the others are not written. Writes
// nothing when *total_rows exceeds capacity. The fused path's gather; the unfused path keeps
// gather_rows (zeros in every padding row).
void scatter_token_rows(bf16_t* dst, const bf16_t* src, const int32_t* slot_row, const int32_t* row_token_slot,
                        const int32_t* total_rows, int64_t capacity, int64_t tokens, int64_t top_k, int64_t width,
                        cudaStream_t stream);

// h = silu(g) ⊙ u over [rows, width]; rows that are padding (row_token_slot < 0) or at/after
// *total_rows are skipped. row_token_slot and total_rows may be null: every row is valid.
void swiglu_forward(bf16_t* h, const bf16_t* g, const bf16_t* u, const int32_t* row_token_slot,
                    const int32_t* total_rows, int64_t rows, int64_t width, cudaStream_t stream);

// Per valid row with router weight w (topk_weights[row_token_slot[row]], or 1 when topk_weights is
// null), from da = dL/d(unweighted expert hidden) and the saved g, u:
//   d_topk_weights[slot] = <da, silu(g) ⊙ u>   (fixed-order fp32 sum; skipped when null)
//   dg = w·da ⊙ u ⊙ silu'(g),  du = w·da ⊙ silu(g),  hw = w · silu(g) ⊙ u   (hw skipped when null)
// Padding rows (row_token_slot < 0) below *total_rows get zeros in dg, du and hw, except those in a 64-row
// half without rows, which no bf16 GEMM reads (sched::core::in_rowless_half); with `every_padding_row`
// those too (the FP8 passes quantise whole 128-row blocks).
// dg and du rows are `out_pitch` elements apart (width for separate arrays; 2·width when dg and du
// are the two halves of one [rows, 2·width] array); the other arrays are [rows, width]. hw may be da
// (written in place); no other output may overlap an input.
// With remote `weight_sources` (R > 1) a row's weight is read from its source rank's copy of the
// weights (topk_weights is ignored), and d_topk_weights is per row: d_topk_weights[row] (the source
// pulls it in its combine). With `gate_up_by_slot` (one rank) g and u are [T·k, width], a row's at its
// slot (the fused forward's context: no padding rows), not at the row.
// With `codes` on (the FP8 backward; dg and du the halves of one [rows, 2·width] array, width % 128 ==
// 0, every_padding_row): dg | du also quantised in 1×128 tiles, the bits fp8::quantize_tiles gives from
// the bf16 dg | du below *total_rows, a tile that is not finite reported through codes.report.
struct QuantizedDgu {
  uint8_t* q = nullptr;      // [rows, 2·width] E4M3
  float* scales = nullptr;  // [rows, 2·width / 128]
  fp8::NonfiniteReport report;

  bool on() const { return q != nullptr; }
};
void swiglu_backward(bf16_t* dg, bf16_t* du, int64_t out_pitch, bf16_t* hw, float* d_topk_weights, const bf16_t* da,
                     const bf16_t* g, const bf16_t* u, const float* topk_weights, const int32_t* row_token_slot,
                     const int32_t* total_rows, int64_t rows, int64_t width, cudaStream_t stream,
                     const RowSources& weight_sources = {}, bool gate_up_by_slot = false,
                     bool every_padding_row = false, const QuantizedDgu& codes = {});

// d_topk_weights[slot] of each row of the schedule (row_token_slot, *total_rows; padding rows left out)
// from its 128-column chunks' sums chunk_sums [capacity, chunks] (the dgrad of down's FP8 epilogue,
// fp8::SwiGLUBackwardOutputs), added in swiglu_backward's order (swiglu_backward.cuh): its bits.
void sum_row_chunks(float* d_topk_weights, const float* chunk_sums, int64_t chunks, const int32_t* row_token_slot,
                    const int32_t* total_rows, int64_t capacity, cudaStream_t stream);

// out[t, :] = base[t, :] + Σ_{j=0..k-1} w[t, j] · rows[slot_row[t*k + j], :], in this order, in fp32.
// base may be null (zero); topk_weights may be null (w = 1); slot_row entries of -1 are skipped.
// Writes nothing when `status` reports an error (the schedule behind slot_row is then not valid).
// With `peers.rows` (R > 1) the row of (t, j) is read from the rows of the rank owning its expert
// (`rows` is ignored), and with `peers.d_topk_weights` that rank's per-row d_topk_weights are copied too.
void combine(bf16_t* out, const bf16_t* rows, const int32_t* slot_row, const float* topk_weights, const float* base,
             int64_t tokens, int64_t top_k, int64_t width, const DeviceStatus* status, cudaStream_t stream,
             const CombineSources& peers = {});

}  // namespace lynx::glue
