// The FP8 passes' token rows as 1×128 tiles (fp8_rows.h).
#include "kernels/fp8/api.h"
#include "runtime/fp8_rows.h"
#include "runtime/steps.h"

namespace lynx::fp8pass {

fp8::NonfiniteReport report(const Workspace::Impl& w, Fp8Tensor what) {
  return fp8::NonfiniteReport{nullptr, w.status, int64_t(what), w.shape.rank};
}

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

fp8::TileGather tiles_for_gemm_gather(Workspace::Impl& w, const TensorView& rows, Fp8Tensor what, int32_t lookahead,
                                      cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t T = sh.tokens, H = sh.hidden, cap = w.problem.capacity;
  const Fp8Buffers& f = w.f8;
  const int32_t* slots = w.schedule.row_token_slot;
  fp8::TileGather g;
  g.row_token_slot = slots;
  g.top_k = sh.top_k;
  // NOTES: the plan counts row blocks of bf16 rows (plan/gather.h); E4M3 rows are half the bytes.
  g.lookahead = 2 * lookahead;
  g.sync = w.gather_sync;
  if (w.ranks() == 1) {
    quantize_tokens(w, rows, what, s);
    fp8::gather_tile_scales(f.xg_scales, f.x_scales, slots, w.device_total_rows(), cap, sh.top_k, H, s);
    g.tokens = f.x;
    return g;
  }
  const RowSources rs = w.row_sources(comm::kTokenRows);
  fp8::gather_tile_scales(f.xg_scales, nullptr, slots, w.device_total_rows(), cap, sh.top_k, H, s,
                          fp8::TileSources{rs.base, rs.row_src_rank, T}, report(w, what));
  g.sources = rs;
  return g;
}

// A weight gradient's operand from one rank's tokens' tiles (f8.x, quantize_tokens): the tile of each
// schedule row, transposed and quantised along the rows into q, scales (fp8::transpose_gathered_tiles),
// the bits transpose_tiles gives from the rows dequantised (dequantized_rows), without those [capacity,
// H] bf16 rows.
void transposed_token_tiles(const Workspace::Impl& w, Fp8Tensor what, uint8_t* q, float* scales, cudaStream_t s,
                            const fp8::GatheredTiles& kept) {
  const LayerShape& sh = w.shape;
  fp8::transpose_gathered_tiles(w.f8.x, w.f8.x_scales, w.schedule.row_token_slot, w.device_total_rows(),
                                w.problem.capacity, sh.top_k, sh.hidden, q, scales, report(w, what), s, kept);
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

}  // namespace lynx::fp8pass
