// FP8 (E4M3) quantisation of the block-scaled recipe (docs/fp8.md): activations with one scale per
// 1×128 tile of a row, weights with one per 128×128 block, scales powers of two. Each kernel equals
// src/reference/fp8.h (quantize_tiles, quantize_blocks, Quantized::dequant) bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/bf16.h"
#include "common/hd.h"
#include "common/peers.h"
#include "common/status.h"

namespace lynx::fp8 {

constexpr int64_t kBlock = 128;  // the tile width and the weight block's side

LYNX_HD int64_t blocks_of(int64_t n) { return (n + kBlock - 1) / kBlock; }

// Where a quantisation kernel reports a NaN or an infinity in its input: *flag set to 1 (when given),
// and the status word's code set to StatusCode::kNonFiniteInput with a = what (when given; the first
// error wins, common/status.h).
struct NonfiniteReport {
  int32_t* flag = nullptr;
  DeviceStatus* status = nullptr;
  int64_t what = 0;
  int32_t rank = 0;  // the rank the status names
};

// q[r, c] = E4M3(x[r, c] / scale), scale = the smallest power of two 2^e >= amax / 448 (2^-126 at
// least; 1 for an all-zero tile) of the 1×128 tile (r, c / 128): scales [rows, blocks_of(cols)].
// A row's last tile may be shorter. Sets *nonfinite to 1 (and leaves it otherwise) when x holds a NaN
// or an infinity; that tile's q is then unspecified and its scale NaN (so is a block's below).
// No alignment needed: where cols % 8 == 0 and x is 16-byte, q 8-byte aligned, 8 values move at once.
void quantize_tiles(const bf16_t* x, int64_t rows, int64_t cols, uint8_t* q, float* scales, int32_t* nonfinite,
                    cudaStream_t stream);

// The same over the rows below *row_limit (device; rows past it are not read or written, and a limit
// above `rows`, a schedule over capacity, quantises nothing), reporting
// a non-finite input through `report`: the layer's form, whose row count lives on the device.
void quantize_tiles(const bf16_t* x, int64_t rows, int64_t cols, const int32_t* row_limit, uint8_t* q, float* scales,
                    NonfiniteReport report, cudaStream_t stream);

// The same with one scale per 128×128 block: scales [blocks_of(rows), blocks_of(cols)].
void quantize_blocks(const bf16_t* w, int64_t rows, int64_t cols, uint8_t* q, float* scales, int32_t* nonfinite,
                     cudaStream_t stream);

// quantize_blocks of each of `batch` matrices [rows, cols] stored one after another (the experts'
// weights [E, rows, cols]), or batch_stride elements apart: q [batch, rows, cols], scales [batch,
// blocks_of(rows), blocks_of(cols)].
void quantize_blocks(const bf16_t* w, int64_t batch, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                     NonfiniteReport report, cudaStream_t stream, int64_t batch_stride = 0);

// Elements from one matrix of a batch to the next in each bf16 source of the functions below (0: its
// matrices one after another), e.g. the halves of a concatenated [E, 2I, H] gate_up tensor.
struct BatchStrides {
  int64_t src0 = 0, src1 = 0;
};

// The transposed operand of a dgrad GEMM, quantised in 128×128 blocks of the transposed matrix: per
// matrix m of `batch`, q[m][r][c] = E4M3(src(c, r) / scale) with src(c, r) = src0[m][c][r] for c < n0,
// src1[m][c − n0][r] otherwise (src0 [batch, n0, rows], src1 [batch, n1, rows] bf16; n1 = 0: src0 only):
// q [batch, rows, n0 + n1], scales [batch, blocks_of(rows), blocks_of(n0 + n1)]. w_downᵀ is (w_down, n1 =
// 0); [w_gate; w_up]ᵀ, the dgrad of gate/up's K = 2I operand, is (w_gate, w_up). Equals quantize_blocks of
// the transposed matrix bit for bit. A value that is not finite is reported through `report`, or, in
// src1 and with `report1` given, through *report1.
void quantize_blocks_transposed(const bf16_t* src0, int64_t n0, const bf16_t* src1, int64_t n1, int64_t batch,
                                int64_t rows, uint8_t* q, float* scales, NonfiniteReport report, cudaStream_t stream,
                                const NonfiniteReport* report1 = nullptr, BatchStrides strides = {});

// quantize_blocks of each source and quantize_blocks_transposed of the pair from one read of the
// sources: q0, scales0 as quantize_blocks(src0, batch, n0, rows) makes them, q1, scales1 likewise of src1
// (where n1 > 0), qt, scales_t as quantize_blocks_transposed, bit for bit, non-finite values reported as
// those report them. Needs n0 % 128 == 0 where n1 > 0, so that every block of the transposed matrix is
// the transpose of one source block (Error otherwise): the weights' forward and backward copies at once.
void quantize_blocks_and_transposed(const bf16_t* src0, int64_t n0, const bf16_t* src1, int64_t n1, int64_t batch,
                                    int64_t rows, uint8_t* q0, float* scales0, uint8_t* q1, float* scales1,
                                    uint8_t* qt, float* scales_t, NonfiniteReport report, cudaStream_t stream,
                                    const NonfiniteReport* report1 = nullptr, BatchStrides strides = {});

// The same from E4M3 sources with a scale per 128×128 block (quantize_blocks' layout: src0 [batch, n0,
// rows] with scales0 [batch, blocks_of(n0), blocks_of(rows)], likewise src1): src(c, r) = value(c, r) ·
// its block's scale, in fp32 (exact where the scales are powers of two: then equal to the bf16 form on
// the dequantised matrices, bit for bit).
void quantize_blocks_transposed_fp8(const uint8_t* src0, const float* scales0, int64_t n0, const uint8_t* src1,
                                    const float* scales1, int64_t n1, int64_t batch, int64_t rows, uint8_t* q,
                                    float* scales, NonfiniteReport report, cudaStream_t stream,
                                    const NonfiniteReport* report1 = nullptr);

// The weight-gradient GEMM's operands: rows [capacity, cols] bf16 (schedule order, the rows below
// *total_rows, whole 128-row blocks of experts, padding rows zeros) transposed and quantised in 1×128
// tiles along the rows: q [cols, capacity] with q[c, r] = E4M3(x[r, c] / scale of (c, r / 128)), scales
// [capacity / 128, scale_pitch(cols)] (a row block's scales contiguous, each row 16-byte aligned: the
// weight-gradient GEMM copies a K block's scales of 128 rows or columns into shared memory at once;
// those past cols are not written). Columns r from *total_rows on are not written; nothing when
// *total_rows > capacity (a schedule over capacity). q and scales 16-byte aligned (Error otherwise).
// Equals quantize_tiles of the transposed matrix bit for bit.
LYNX_HD int64_t scale_pitch(int64_t cols) { return (cols + 3) / 4 * 4; }
void transpose_tiles(const bf16_t* x, int64_t capacity, int64_t cols, const int32_t* total_rows, uint8_t* q,
                     float* scales, NonfiniteReport report, cudaStream_t stream);

// Where gather_tiles finds each schedule row's token at R > 1: rank q's tiles of its tokens, staged at
// base[q] (device addresses of every rank's, as this rank reaches them): bytes [tokens, cols], then
// their scales [tokens, blocks_of(cols)] right after.
struct TileSources {
  const void* const* base = nullptr;      // [R] device
  const int32_t* row_src_rank = nullptr;  // [capacity] device: the schedule's
  int64_t tokens = 0;                     // every rank's T

  LYNX_HD bool remote() const { return base != nullptr; }
};

// The 1×128 tiles of token rows in schedule order: for each schedule row r below *total_rows, dst row r
// = src row row_token_slot[r] / top_k (bytes [cols] and scales [blocks_of(cols)]); a padding row
// (row_token_slot < 0) gets zero bytes and scales of 1. Rows from *total_rows on are not written. The
// quantised form of the bf16 gather (glue::gather_rows): quantising then gathering equals gathering
// then quantising, a tile being one row's. *total_rows above the capacity (a schedule over capacity,
// which placed no rows) gathers nothing. dst and src 16-byte aligned where cols % 16 == 0. With remote
// `sources` (R > 1) each row comes from its source rank's staged tiles, and src, src_scales are unused;
// a pulled tile whose scale is not finite (its source found a NaN or an infinity) is reported through
// `report`, naming the source rank.
void gather_tiles(uint8_t* dst, float* dst_scales, const uint8_t* src, const float* src_scales,
                  const int32_t* row_token_slot, const int32_t* total_rows, int64_t capacity, int64_t top_k,
                  int64_t cols, cudaStream_t stream, const TileSources& sources = {}, NonfiniteReport report = {});

// Gathered tiles in schedule order: bytes [capacity, cols], scales [capacity, blocks_of(cols)].
struct GatheredTiles {
  uint8_t* q = nullptr;
  float* scales = nullptr;
};

// transpose_tiles from one rank's token rows in 1×128 tiles (src [T, cols] bytes, scales [T,
// blocks_of(cols)]: gather_tiles' local source), gathered into schedule order on the way: the bits of
// gather_tiles, dequantize_tiles and transpose_tiles in turn, without their two [capacity, cols]
// buffers. It reads whole 128-row blocks below *total_rows: every row there holds a slot or -1 (the
// schedule's padding rows do). With `kept` it also writes the gathered tiles there, gather_tiles' bytes
// and scales (its dst and dst_scales), from the same loads: a grouped GEMM's A in schedule order.
void transpose_gathered_tiles(const uint8_t* src, const float* src_scales, const int32_t* row_token_slot,
                              const int32_t* total_rows, int64_t capacity, int64_t top_k, int64_t cols, uint8_t* q,
                              float* scales, NonfiniteReport report, cudaStream_t stream,
                              const GatheredTiles& kept = {});

// gather_tiles' scales alone (a grouped GEMM gathers the bytes itself: TileGather below).
void gather_tile_scales(float* dst_scales, const float* src_scales, const int32_t* row_token_slot,
                        const int32_t* total_rows, int64_t capacity, int64_t top_k, int64_t cols, cudaStream_t stream,
                        const TileSources& sources = {}, NonfiniteReport report = {});

// The rows below *row_limit of tiles q [capacity, cols] (scales [capacity, blocks_of(cols)]) as bf16:
// out[r, c] = value(q[r, c]) · scale of its tile, exact (an E4M3 value has 4 significant bits; only a
// value below bf16's smallest subnormal would round). Nothing when *row_limit > capacity; row_limit null:
// every row. cols % 8 == 0; q 8-byte and out 16-byte aligned.
void dequantize_tiles(const uint8_t* q, const float* scales, int64_t capacity, int64_t cols, const int32_t* row_limit,
                      bf16_t* out, cudaStream_t stream);

// dequantize_tiles from one rank's token rows in 1×128 tiles (src [T, cols] bytes, scales [T,
// blocks_of(cols)]: gather_tiles' local source), gathered into schedule order on the way: for each
// schedule row r below *total_rows, out row r = token row_token_slot[r] / top_k dequantised, zeros for a
// padding row (row_token_slot < 0); rows from *total_rows on are not written, and nothing is where
// *total_rows is above the capacity. The bits of dequantize_tiles on the tokens then glue::gather_rows,
// in one pass and without the tokens' bf16 rows. cols % 8 == 0; src 8-byte and out 16-byte aligned.
void gather_dequantized_tiles(const uint8_t* src, const float* src_scales, const int32_t* row_token_slot,
                              const int32_t* total_rows, int64_t capacity, int64_t top_k, int64_t cols, bf16_t* out,
                              cudaStream_t stream);

// x[r, c] = value(q[r, c]) · scale of its tile (`blocks`: of its 128×128 block), in fp32 (exact).
void dequantize(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, bool blocks, float* x,
                cudaStream_t stream);

// A grouped form's A gathered by the kernel itself, beside its tiles (the bf16 expert GEMM's in-kernel
// gather): schedule row r of `a` (then written by the kernel) = the tile bytes of token row_token_slot[r]
// / top_k of `tokens` ([T, K] bytes), or at R > 1 (sources.remote(); the gate/up form only) of its
// source rank's staged tiles (sources.base[row_src_rank[r]]: bytes [T, K] first), zeros for padding
// rows; rows up to the schedule's total. The rows' scales must already be in a_scales
// (gather_tile_scales). sync: [gather_sync_ints(capacity)] ints (expert_gemm/api.h), zero before the
// launch, which leaves them zero. Neither tokens nor remote sources: no gather, `a` is in place.
struct TileGather {
  const uint8_t* tokens = nullptr;         // [T, K] device (R = 1)
  const int32_t* row_token_slot = nullptr;  // [capacity] device
  int64_t top_k = 0;
  int32_t lookahead = 0;                   // row blocks the copies may run ahead of the tiles
  int32_t* sync = nullptr;
  RowSources sources;                      // R > 1

  bool on() const { return tokens != nullptr || sources.remote(); }
};

// The dense GEMM below stores two adjacent fp32 output columns at once where N is even: its output must
// then be aligned to two elements. The grouped forms store their bf16 outputs by TMA (out, h, out2:
// 128-byte aligned) and KeptGateUp's rows in 16-byte chunks (gate, up and slot 16-byte aligned), so
// their N must be a multiple of 8 (Error otherwise).

// out[m, n] = Σ_kb (Σ_{k in block kb} a[m, k] · b[n, k]) · a_scales[m, kb] · b_scales[n / 128, kb], fp32
// [M, N]: a [M, K] E4M3 in 1×128 tiles (quantize_tiles), b [N, K] E4M3 in 128×128 blocks
// (quantize_blocks: the nn.Linear "out × in" layout), the per-block sums promoted into fp32 with both
// scales. K % 16 == 0 (a K past a multiple of 128 ends in a shorter, zero-filled block). A wait that
// never completes is reported in *status (host-mapped) before the kernel traps.
void gemm_block_scaled(const uint8_t* a, const float* a_scales, int64_t M, int64_t K, const uint8_t* b,
                       const float* b_scales, int64_t N, float* out, DeviceStatus* status, cudaStream_t stream);

// The same per expert, over rows in schedule order (the expert GEMM's kRows mode in FP8): rows
// [expert_offset[e], expert_offset[e + 1]) of a ([capacity, K] E4M3, 1×128 tile scales [capacity,
// blocks_of(K)]) times expert e's b ([experts, N, K] E4M3, 128×128 block scales [experts, blocks_of(N),
// blocks_of(K)]), rounded to bf16 into the same rows of out [capacity, N]. expert_offset (device,
// [experts + 1]) is the schedule's: every expert's rows padded to whole 128-row blocks, the padding rows
// of a zeros (they come out as zeros). Row blocks past expert_offset[experts] are not written, nor any
// when expert_offset[experts] > capacity (a schedule over capacity). pair_rows: the tiles in pairs of
// an expert's row blocks reading the same weights at once (tiles.h; the same outputs, bit for bit).
// half_block_offset (device, [experts + 1], the schedule's; not with pair_rows): each expert's last row
// block that holds at most 64 rows is computed in wide tiles (tiles.h; the same outputs, bit for bit),
// and its rows past 64 (padding rows no kernel reads) are not written.
// A gathered by the kernel itself where `gather` is on (TileGather above): from this rank's token tiles
// only (the dgrad of down at R = 1); remote sources are an Error.
void grouped_gemm_block_scaled(const uint8_t* a, const float* a_scales, int64_t capacity, int64_t K,
                               const uint8_t* b, const float* b_scales, int64_t experts, int64_t N,
                               const int32_t* expert_offset, bf16_t* out, DeviceStatus* status, cudaStream_t stream,
                               const TileGather& gather = {}, bool pair_rows = false,
                               const int32_t* half_block_offset = nullptr);

// Where the gate/up form also keeps g and u (bf16, for the backward): row r's go to row slot[r] of
// gate and up ([rows, N] each; nowhere when slot[r] < 0). All three null: not kept.
struct KeptGateUp {
  bf16_t* gate = nullptr;
  bf16_t* up = nullptr;
  const int32_t* slot = nullptr;  // [capacity] device
};

// Where the gate/up form also quantises h for the down GEMM: codes [capacity, N] and scales [capacity,
// blocks_of(N)], quantize_tiles' bits from the bf16 h (a tile that is not finite reported through
// `report`, its scale NaN). The kernel writes every row of the row blocks below the schedule's total:
// quantize_tiles' rows below the total, since the schedule pads each expert to whole 128-row blocks.
// codes 16-byte aligned, N % 16 == 0. codes null: not quantised.
struct QuantizedH {
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  NonfiniteReport report{};
};

// The gate/up form (the expert GEMM's kRowsSwiGLU in FP8): h[r, n] = silu(g) · u, g and u the grouped
// products of row r with expert e's gate and up ([experts, N, K] E4M3 each, block scales [experts,
// blocks_of(N), blocks_of(K)] each), rounded to bf16 into h [capacity, N] (h from the fp32 g and u;
// `kept` gets them rounded), and quantised into `hq`. h may be null (not stored) where hq or kept is
// given; A gathered by the kernel itself where `gather` is on. As above otherwise.
void grouped_swiglu_block_scaled(const uint8_t* a, const float* a_scales, int64_t capacity, int64_t K,
                                 const uint8_t* gate, const float* gate_scales, const uint8_t* up,
                                 const float* up_scales, int64_t experts, int64_t N, const int32_t* expert_offset,
                                 bf16_t* h, DeviceStatus* status, cudaStream_t stream, KeptGateUp kept = {},
                                 const QuantizedH& hq = {}, const TileGather& gather = {}, bool pair_rows = false,
                                 const int32_t* half_block_offset = nullptr);

// The weight-gradient form (the recipe's wgrad): per expert e, out[e] = Σ over its rows r of
// A[:, r] · B[:, r]ᵀ, [M, N], K being the schedule's rows: a [M, capacity] and b [N, capacity] E4M3 are
// row buffers transposed (transpose_tiles), in 1×128 tiles along the rows (scales [capacity / 128,
// scale_pitch(M or N)], 16-byte aligned), each expert's rows [expert_offset[e], expert_offset[e + 1])
// whole 128-row blocks; rounded to bf16, rows [0, split) of each expert's output into out [experts,
// split, N], the others into out2 [experts, M − split, N] (split = M: out only; else a multiple of 64,
// with out2 given). An expert without rows, or every expert after a schedule over capacity
// (expert_offset[experts] > capacity), gets zeros. out_strides: elements from one expert's output matrix
// to the next in out (src0) and out2 (src1), 0 where they follow one another.
void grouped_weight_grad_block_scaled(const uint8_t* a, const float* a_scales, int64_t M, const uint8_t* b,
                                      const float* b_scales, int64_t N, int64_t capacity, int64_t experts,
                                      const int32_t* expert_offset, bf16_t* out, bf16_t* out2, int64_t split,
                                      DeviceStatus* status, cudaStream_t stream, BatchStrides out_strides = {});

// Load the quantisation kernels and the GEMM kernels into the current context (common/kernel_loading.h
// says why).
void load_quantize_kernels();
void load_gemm_kernels();

}  // namespace lynx::fp8
