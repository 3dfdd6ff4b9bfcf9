// The expert GEMM's epilogue: a consumer warpgroup's fp32 fragments, as bf16, into its swizzled
// shared-memory piece with stmatrix, then out with TMA stores that drain while the warpgroup goes on
// with its next tile (plain, swapped and folded-tail pieces).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "device/sm90.cuh"
#include "kernels/expert_gemm/traits.cuh"

namespace lynx::gemm::impl {

// Two fp32 values as the bf16 pair of one stmatrix register (round to nearest).
__device__ __forceinline__ uint32_t bf16x2_bits(float2 v) {
  const __nv_bfloat162 packed = __floats2bfloat162_rn(v.x, v.y);
  return *reinterpret_cast<const uint32_t*>(&packed);
}

// NOTES: rows by slot straight from the fragments (store_fragment_rows), not staged in a piece: a row's
// 16-byte chunk of eight columns lies in a quad's four lanes (two bf16 each), and a 4×4 transpose of
// 4-byte words within the quad (two shfl_xor rounds) gives lane q the chunks 4m + q of its two rows. The
// staged stores (store_piece to SlotRows) take two named barriers a piece and a shared-memory round trip.

// Words a[i] of quad lane i become a[0..3] of lane q: a[i] = lane i's a[q] (q = lane % 4).
__device__ __forceinline__ void quad_transpose(uint32_t (&a)[4], int q) {
  const bool hi = (q & 2) != 0, lo = (q & 1) != 0;
  // Off-diagonal 2×2 blocks: lanes 0, 1 trade their words 2, 3 for lanes 2, 3's words 0, 1.
  uint32_t r0 = __shfl_xor_sync(0xffffffffu, hi ? a[0] : a[2], 2);
  uint32_t r1 = __shfl_xor_sync(0xffffffffu, hi ? a[1] : a[3], 2);
  if (hi) {
    a[0] = r0;
    a[1] = r1;
  } else {
    a[2] = r0;
    a[3] = r1;
  }
  // Within each 2×2 block: even lanes trade their words 1, 3 for odd lanes' words 0, 2.
  r0 = __shfl_xor_sync(0xffffffffu, lo ? a[0] : a[1], 1);
  r1 = __shfl_xor_sync(0xffffffffu, lo ? a[2] : a[3], 1);
  if (lo) {
    a[0] = r0;
    a[2] = r1;
  } else {
    a[1] = r0;
    a[3] = r1;
  }
}

// The slots of this thread's two fragment rows of its warpgroup's piece at schedule row `row`: rows
// row + 16·warp + lane / 4 and 8 further.
__device__ __forceinline__ int2 fragment_slots(const int32_t* slot, int32_t row) {
  const int thread = int(threadIdx.x) % 128;
  const int32_t r0 = row + 16 * (thread / 32) + (thread % 32) / 4;
  return make_int2(__ldg(slot + r0), __ldg(slot + r0 + 8));
}

// 128 columns from col of this thread's two fragment rows (acc[4j + 2r], acc[4j + 2r + 1]: columns
// 8j + 2(lane % 4) + {0, 1} of row half r), rounded to bf16, into rows slots.x and slots.y of to.dst
// (fragment_slots; nowhere where a slot is -1); 16-byte chunks at or past n are not stored (n % 8 == 0).
__device__ __forceinline__ void store_fragment_rows(const SlotRows& to, int2 slots, int32_t n, int32_t col,
                                                    const float* acc) {
  const int q = int(threadIdx.x) % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int32_t slot = r == 0 ? slots.x : slots.y;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      uint32_t a[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = 4 * (4 * m + i) + 2 * r;  // column group 4m + i, row half r
        a[i] = bf16x2_bits(make_float2(acc[e], acc[e + 1]));
      }
      quad_transpose(a, q);
      const int32_t c = col + 8 * (4 * m + q);
      if (slot >= 0 && c < n) {
        *reinterpret_cast<uint4*>(to.dst + int64_t(slot) * to.pitch + c) = make_uint4(a[0], a[1], a[2], a[3]);
      }
    }
  }
}

// Stores the boxes of warpgroup `wg`'s epilogue piece at (col, row[, batch]) of `map`, once all of its
// threads have written them; columns at or past n are not stored.
struct NoSlots {};

// What a piece's store needs before the piece is staged: nothing for TMA; row by row, the slots of the
// four piece rows this thread stores, 4·(thread / 8) .. + 3 (one 16-byte load, in flight while the
// piece is staged).
__device__ __forceinline__ NoSlots piece_slots(const CUtensorMap*, int32_t) { return {}; }
__device__ __forceinline__ int4 piece_slots(const SlotRows& to, int32_t row) {
  return __ldg(reinterpret_cast<const int4*>(to.slot + row) + (threadIdx.x % 128) / 8);
}

template <bool k3d, int kPieceBoxes>
__device__ __forceinline__ void store_piece_boxes(__nv_bfloat16 (&buf)[kPieceBoxes][64 * 64], const CUtensorMap* map,
                                                  int wg, int32_t col, int32_t row, int32_t batch, int32_t n,
                                                  NoSlots = {}) {
  sm90::fence_proxy_async_shared();
  sm90::named_barrier_sync(1 + wg, 128);
  if (threadIdx.x % 128 == 0) {
#pragma unroll
    for (int b = 0; b < kPieceBoxes; ++b) {
      if (col + 64 * b >= n) break;
      if constexpr (k3d) {
        sm90::tma_store_3d(map, buf[b], col + 64 * b, row, batch);
      } else {
        sm90::tma_store_2d(map, buf[b], col + 64 * b, row);
      }
    }
    sm90::bulk_commit_group();
  }
}

// Stores the boxes of warpgroup `wg`'s epilogue piece at schedule rows row .. row + 63 row by row, once
// all of its threads have written them: piece row r to row slot[row + r] of to.dst (nowhere where it is
// -1), from column col; 16-byte chunks at or past n are not stored. `slots`: piece_slots(to, row).
// NOTES: each thread copies the 16-byte chunk thread % 8 of four rows out of the swizzled piece with
// plain loads and stores; the next piece's barrier (store_piece*) comes after every thread's last read
// of this one. Its slots are loaded before the piece is staged: loaded here, row by row, their latency
// cost the forward 3% at qwen3-30b-a3b (2026-12-04, f635d05). A piece goes out row by row or with
// TMA by its kernel's code, not by a run-time choice, and this loop is not unrolled: either made ptxas
// serialise the gate/up kernels' wgmma ("insufficient register resources", C7511; tools/sass-check).
template <bool k3d, int kPieceBoxes>
__device__ __forceinline__ void store_piece_boxes(__nv_bfloat16 (&buf)[kPieceBoxes][64 * 64], const SlotRows& to,
                                                  int wg, int32_t col, int32_t row, int32_t, int32_t n, int4 slots) {
  sm90::named_barrier_sync(1 + wg, 128);
  const int thread = threadIdx.x % 128, c = thread % 8, first = 4 * (thread / 8);
  // Chunk c of piece row r sits at chunk c ^ (r % 8) of the row.
#pragma unroll 1
  for (int q = 0; q < 4; ++q) {
    const int32_t slot = q == 0 ? slots.x : q == 1 ? slots.y : q == 2 ? slots.z : slots.w;
    if (slot < 0) continue;
    const int r = first + q;
    uint4* out = reinterpret_cast<uint4*>(to.dst + int64_t(slot) * to.pitch + col + 8 * c);
#pragma unroll
    for (int b = 0; b < kPieceBoxes; ++b) {
      if (col + 64 * b + 8 * c >= n) break;  // chunks past n (the FP8 GEMMs' N need only be a multiple of 8)
      out[8 * b] = *reinterpret_cast<const uint4*>(&buf[b][r * 64 + ((c ^ (r % 8)) * 8)]);
    }
  }
}

// One epilogue piece of consumer warpgroup `wg`: 64 rows × 64·kPieceBoxes columns, value(j, r) giving the two
// fp32 values of fragment column group j (columns 8j + 2(lane % 4) + {0, 1}) in row half r, stored at
// (col, row[, batch]) of `map` (a tensor map, or SlotRows: row by row). Columns at or past n are not stored
// (SlotRows: 16-byte chunks, so n % 8 == 0; their slots loaded first, in flight while the piece is staged).
// kLaterStores: how many of the warpgroup's newest store groups may still be reading when `buf` is
// overwritten: at most the number committed since the last one that read `buf` (which staged other
// buffers).
template <bool k3d, int kLaterStores = 0, int kPieceBoxes, class Dst, class Value>
__device__ __forceinline__ void store_piece(__nv_bfloat16 (&buf)[kPieceBoxes][64 * 64], const Dst& map, int wg,
                                            int32_t col, int32_t row, int32_t batch, int32_t n, Value value) {
  const auto slots = piece_slots(map, row);
  const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
  // The previous piece's store must be done reading the buffer before it is overwritten.
  if (thread == 0) sm90::bulk_wait_group_read<kLaterStores>();
  sm90::named_barrier_sync(1 + wg, 128);
  // One stmatrix.x4 per two column groups: matrices (j, r) = (2q, 0), (2q, 1), (2q + 1, 0), (2q + 1, 1),
  // the lane's fragment values as they are. Lane t addresses row t % 8 of matrix t / 8: piece row
  // R = 16 warp + 8 (t / 8 % 2) + t % 8, column group 2q + t / 16. 128-byte swizzle: 16-byte chunk
  // j % 8 of row R sits at chunk (j % 8) ^ (R % 8); rows are 128-byte aligned, so the XOR acts on the
  // address, and R % 8 = t % 8.
  const uint32_t lane_base = sm90::smem_addr(buf[0]) + (warp * 16 + (lane / 8 % 2) * 8 + lane % 8) * 128 +
                             (((lane / 16) ^ (lane % 8)) * 16);
  const auto pack = [&](int j, int r) { return bf16x2_bits(value(j, r)); };
#pragma unroll
  for (int q = 0; q < 4 * kPieceBoxes; ++q) {
    const uint32_t at = (lane_base ^ (((2 * q) % 8) * 16)) + (q / 4) * 64 * 64 * 2;
    sm90::stmatrix_x4(at, pack(2 * q, 0), pack(2 * q, 1), pack(2 * q + 1, 0), pack(2 * q + 1, 1));
  }
  store_piece_boxes<k3d>(buf, map, wg, col, row, batch, n, slots);
}

// One epilogue piece of a warpgroup whose products were swapped (swapped_products): its [64, 64]
// boxes b get rows 0-15 from value(b, i), the two fp32 values of fragment registers i, i + 1 (i = 4j +
// 2h) of the box's [64 columns, 16 rows] product, and zeros in rows 16-63 (padding rows, which every
// piece stores as zeros). Stored at (col, row) of `map` (as store_piece); columns at or past n are not
// stored.
template <int kPieceBoxes, class Dst, class Value>
__device__ __forceinline__ void store_swapped_piece(__nv_bfloat16 (&buf)[kPieceBoxes][64 * 64], const Dst& map, int wg,
                                                    int32_t col, int32_t row, int32_t n, Value value) {
  const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
  const auto slots = piece_slots(map, row);
  if (thread == 0) sm90::bulk_wait_group_read<0>();
  sm90::named_barrier_sync(1 + wg, 128);
  // Rows 16-63: 48 rows of 128 bytes per box, three 16-byte stores per thread and box.
#pragma unroll
  for (int b = 0; b < kPieceBoxes; ++b) {
#pragma unroll
    for (int u = 0; u < 3; ++u) {
      const int chunk = thread + 128 * u;
      *reinterpret_cast<uint4*>(&buf[b][(16 + chunk / 8) * 64 + (chunk % 8) * 8]) = make_uint4(0, 0, 0, 0);
    }
  }
  // Rows 0-15: one stmatrix.x4.trans per box. Matrix 2j + h of a warp holds the product's rows 16w +
  // 8h .. + 7 (the box's columns) × columns 8j .. + 7 (the box's rows), stored transposed: lane t
  // addresses box row 8j + t % 8 (j, h from t / 8), where the warp's 8 columns are 16-byte chunk
  // 2w + h, swizzled to (2w + h) ^ (t % 8).
  const int mi = lane / 8, h = mi % 2, j = mi / 2, rho = lane % 8;
  const uint32_t lane_off = (8 * j + rho) * 128 + (((2 * warp + h) ^ rho) * 16);
  const auto pack = [&](int b, int i) { return bf16x2_bits(value(b, i)); };
#pragma unroll
  for (int b = 0; b < kPieceBoxes; ++b) {
    sm90::stmatrix_x4_trans(sm90::smem_addr(buf[b]) + lane_off, pack(b, 0), pack(b, 2), pack(b, 4), pack(b, 6));
  }
  store_piece_boxes<false>(buf, map, wg, col, row, 0, n, slots);
}

// The epilogue box of a folded tail (tile_scheduler.h): the [64 columns, kFoldRows rows] product of
// one weight slice, transposed into rows 0 .. kFoldRows - 1 of a [64, 64] box, and zeros in rows
// kFoldRows .. 63 (padding rows, which every piece stores as zeros). value(i): the two fp32 values of
// fragment registers i, i + 1, i = 4j + 2h: product row 16w + l/4 + 8h, columns 8j + 2(l%4) + {0, 1}.
// Stored at (col, row) of `map` (as store_piece); columns at or past n are not stored.
template <class Dst, class Value>
__device__ __forceinline__ void store_fold_box(__nv_bfloat16 (&buf)[1][64 * 64], const Dst& map, int wg, int32_t col,
                                               int32_t row, int32_t n, Value value) {
  const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
  const auto slots = piece_slots(map, row);
  if (thread == 0) sm90::bulk_wait_group_read<0>();
  sm90::named_barrier_sync(1 + wg, 128);
  constexpr int kZeroChunks = (64 - kFoldRows) * 8;  // 16-byte chunks of rows kFoldRows .. 63
#pragma unroll
  for (int chunk = thread; chunk < kZeroChunks; chunk += 128) {
    *reinterpret_cast<uint4*>(&buf[0][(kFoldRows + chunk / 8) * 64 + (chunk % 8) * 8]) = make_uint4(0, 0, 0, 0);
  }
  // Rows 0 .. kFoldRows - 1: one stmatrix.trans of kFoldRows / 4 matrices. Matrix 2j + h of a warp
  // holds the product's rows 16w + 8h .. + 7 (the box's columns) × its columns 8j .. + 7 (the box's
  // rows), stored transposed: lane t addresses box row 8j + t % 8 (j, h from t / 8), where the warp's
  // 8 columns are 16-byte chunk 2w + h, swizzled to (2w + h) ^ (t % 8).
  const int mi = lane / 8, h = mi % 2, j = mi / 2 % (kFoldRows / 8), rho = lane % 8;
  const uint32_t at = sm90::smem_addr(buf[0]) + (8 * j + rho) * 128 + (((2 * warp + h) ^ rho) * 16);
  if constexpr (kFoldRows == 8) {
    sm90::stmatrix_x2_trans(at, bf16x2_bits(value(0)), bf16x2_bits(value(2)));
  } else {
    sm90::stmatrix_x4_trans(at, bf16x2_bits(value(0)), bf16x2_bits(value(2)), bf16x2_bits(value(4)),
                            bf16x2_bits(value(6)));
  }
  store_piece_boxes<false>(buf, map, wg, col, row, 0, n, slots);
}

}  // namespace lynx::gemm::impl
