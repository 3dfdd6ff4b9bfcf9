// The SwiGLU backward of one rank's FP8 pass with FP8 weight gradients in one pass (api.h,
// swiglu_backward_fp8): dg | du quantised along the rows for the dgrad of gate/up, and dg | du and
// w·silu(g)⊙u transposed and quantised along the rows' 128-row blocks for the weight gradients, without
// their bf16 rows in between.
#include <cuda_bf16.h>

#include <string>

#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "lynx/error.h"
#include "common/per_device.h"
#include "kernels/fp8/api.h"
#include "kernels/fp8/e4m3.cuh"
#include "kernels/glue/api.h"
#include "kernels/glue/swiglu_backward.cuh"
#include "kernels/glue/vec8.cuh"

namespace lynx::glue {
namespace {

using namespace fp8::e4m3;

// NOTES: a CTA takes one 128-row block and walks its columns 128 at a time, in order: a step's block of
// dg, du and hw (bf16) is one 1×128 tile of each row and one 128-row tile of each column, so both
// quantisations come from one read of g, u and da. Each row's d_topk_weights is summed as the row
// kernel sums it (glue.cu: vector v of a row into lane v % 32's running sum, the vectors in order, then
// the lanes' shuffle tree): here into the row's 32 running sums in shared memory, step after step, so
// that the sums, as every code and scale, are the row kernel's and transpose_tiles' bits.
constexpr int kRows = 128;                 // a CTA's rows
constexpr int kCols = 128;                 // a step's columns of width
constexpr int kVecs = kCols / 8;           // a row's vectors a step
constexpr int kThreads = 256;
constexpr int kTasks = kRows * kVecs / kThreads;  // (row, vector) pairs a thread a step
// NOTES: loads of four tasks in flight a thread (192 B, 48 KB an SM). 256 threads, not 512: at the
// 128 registers that 512 leave, two tasks' loads at once spilled 12 bytes (one task's did not).
constexpr int kTasksAtOnce = 4;
constexpr int kSumPitch = 33;              // a row's 32 running sums, padded against bank conflicts
constexpr int kColumns = 3 * kCols;        // a step's columns of dg, du and hw, transposed
constexpr int kCodesStride = kRows + 16;   // a staged row of transposed codes (16-byte aligned, padded)
static_assert(kRows * kVecs % kThreads == 0 && kThreads % 16 == 0, "a half-warp holds one row's tile");
static_assert(kTasks % kTasksAtOnce == 0, "whole groups of tasks");
static_assert(kRows == fp8::kBlock && kCols == fp8::kBlock, "a step's blocks are e4m3.cuh's column blocks");

struct Shared {
  // The step's dg, du and hw: [3][row][column] bf16; then, transposed, their codes: [3 · 128 columns]
  // rows of kCodesStride bytes.
  alignas(16) __nv_bfloat16 block[3][kRows][kCols];
  float sums[kRows][kSumPitch];
  int32_t slot[kRows];
  float weight[kRows];
};
static_assert(kColumns * kCodesStride <= int(sizeof(Shared::block)), "the codes fit in the block's memory");
constexpr int kSmem = int(sizeof(Shared));

template <bool kBySlot>
__global__ void __launch_bounds__(kThreads, 1)
    swiglu_backward_fp8_kernel(float* __restrict__ d_topk_weights, const Vec8* __restrict__ da,
                               const Vec8* __restrict__ g, const Vec8* __restrict__ u,
                               const float* __restrict__ topk_weights, const int32_t* __restrict__ row_token_slot,
                               const int32_t* __restrict__ total_rows, int64_t capacity, int64_t width,
                               QuantizedDgu rows, TransposedCodes dgu_cols, TransposedCodes hw_cols) {
  extern __shared__ __align__(16) uint8_t raw[];
  Shared& sm = *reinterpret_cast<Shared*>(raw);
  const int64_t total = *total_rows;
  const int64_t r0 = int64_t(blockIdx.x) * kRows;
  if (total > capacity || r0 >= total) return;  // every thread alike: no row here was placed
  const int t = int(threadIdx.x), lane = t % 32;
  const int64_t vecs = width / 8;  // a row's vectors of width
  if (t < kRows) {
    const int64_t row = r0 + t;
    const int32_t slot = row < total ? row_token_slot[row] : -1;
    sm.slot[t] = row < total ? slot : -2;  // -1: a padding row (zeros); -2: past the total (not written)
    sm.weight[t] = slot >= 0 && topk_weights ? topk_weights[slot] : 1.0f;
  }
  for (int i = t; i < kRows * kSumPitch; i += kThreads) (&sm.sums[0][0])[i] = 0.0f;
  __syncthreads();
  for (int64_t c0 = 0; c0 < width; c0 += kCols) {
    const int64_t v0 = c0 / 8;
    // Phase 1: task n of thread t is vector j = t % 16 of row (t + n·kThreads) / 16; a half-warp holds
    // one row's tile. kTasksAtOnce tasks' loads first, then each vector's backward.
    for (int n0 = 0; n0 < kTasks; n0 += kTasksAtOnce) {
      Vec8 dav[kTasksAtOnce], gv[kTasksAtOnce], uv[kTasksAtOnce];
#pragma unroll
      for (int n = 0; n < kTasksAtOnce; ++n) {
        const int i = t + (n0 + n) * kThreads, r = i / kVecs, j = i % kVecs;
        const int32_t slot = sm.slot[r];
        if (slot >= 0) {
          const int64_t at = (kBySlot ? int64_t(slot) : r0 + r) * vecs + v0 + j;
          dav[n] = da[(r0 + r) * vecs + v0 + j], gv[n] = g[at], uv[n] = u[at];
        }
      }
#pragma unroll
      for (int n = 0; n < kTasksAtOnce; ++n) {
        const int i = t + (n0 + n) * kThreads, r = i / kVecs, j = i % kVecs;
        const int32_t slot = sm.slot[r];
        Vec8 dgv{}, duv{}, hwv{};  // zeros: a padding row, or one past the total
        if (slot >= 0) {
          float& sum = sm.sums[r][(v0 + j) % 32];
          float dot = sum;
          swiglu_backward_vector(dav[n], gv[n], uv[n], sm.weight[r], dot, dgv, duv, hwv);
          sum = dot;
        }
        *reinterpret_cast<uint4*>(&sm.block[0][r][8 * j]) = dgv.bits;
        *reinterpret_cast<uint4*>(&sm.block[1][r][8 * j]) = duv.bits;
        *reinterpret_cast<uint4*>(&sm.block[2][r][8 * j]) = hwv.bits;
        if (slot == -2) continue;  // no row codes past the total (the half-warp alike: one row)
        store_dgu_codes(rows, 2 * vecs, r0 + r, v0 + j, dgv, lane);
        store_dgu_codes(rows, 2 * vecs, r0 + r, vecs + v0 + j, duv, lane);
      }
    }
    __syncthreads();
    // Phase 2: column y < 384 is column y % 128 of block y / 128 (dg, du, hw), quantised over the 128 rows
    // by thread y % kThreads (transpose_tiles' steps: the largest magnitude by the bf16 bits; a row past
    // the total counts as zeros), its codes kept until every column is read.
    constexpr int kMine = (kColumns + kThreads - 1) / kThreads;
    uint4 mine[kMine][kRows / 16];
#pragma unroll
    for (int k = 0; k < kMine; ++k) {
      const int y = t + k * kThreads;
      if (y >= kColumns) break;
      const int b = y / kCols, cc = y % kCols;
      const int64_t cols = b < 2 ? 2 * width : width;
      const int64_t c = (b == 1 ? width : 0) + c0 + cc;  // the transposed matrix's row
      const uint32_t m = column_magnitude_bits(sm.block[b], cc);
      const bool finite = m < kInfBits;
      if (!finite) {  // each report by name: a reference chosen between two parameters would copy both
        if (b < 2) {
          report_nonfinite(dgu_cols.report);
        } else {
          report_nonfinite(hw_cols.report);
        }
      }
      const int e = finite ? scale_exponent(amax_of_bits(m)) : 0;
      column_codes(sm.block[b], cc, pow2(-e), mine[k]);
      (b < 2 ? dgu_cols.scales : hw_cols.scales)[(r0 / kRows) * fp8::scale_pitch(cols) + c] = scale_or_nan(e, finite);
    }
    __syncthreads();  // every column read: the block's memory takes the codes
    uint8_t* staged = reinterpret_cast<uint8_t*>(sm.block);
#pragma unroll
    for (int k = 0; k < kMine; ++k) {
      const int y = t + k * kThreads;
      if (y >= kColumns) break;
#pragma unroll
      for (int q = 0; q < kRows / 16; ++q) *reinterpret_cast<uint4*>(staged + y * kCodesStride + 16 * q) = mine[k][q];
    }
    __syncthreads();
    // The codes out, 8 threads a 128-byte row: staged row y is column c0 + y % 128 of block y / 128.
    for (int i = t; i < kColumns * 8; i += kThreads) {
      const int y = i / 8, part = i % 8, yb = y / kCols;
      uint8_t* q = yb < 2 ? dgu_cols.q : hw_cols.q;
      const int64_t col = (yb == 1 ? width : 0) + c0 + y % kCols;
      *reinterpret_cast<uint4*>(q + col * capacity + r0 + 16 * part) =
          *reinterpret_cast<const uint4*>(staged + y * kCodesStride + 16 * part);
    }
    __syncthreads();  // the block's memory free for the next step
  }
  // Each row's d_topk_weights: its 32 running sums in a warp, the row kernel's shuffle tree.
  if (d_topk_weights) {
    for (int r = t / 32; r < kRows; r += kThreads / 32) {
      const int32_t slot = sm.slot[r];
      float dot = sm.sums[r][lane];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      if (lane == 0 && slot >= 0) d_topk_weights[slot] = dot;
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The kernel of each variant, its shared-memory limit raised once per device.
template <bool kBySlot>
auto prepared_kernel() {
  static detail::PerDeviceCache configured;
  detail::per_device(configured, [](int) {
    LYNX_CUDA(cudaFuncSetAttribute(swiglu_backward_fp8_kernel<kBySlot>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   kSmem));
    return 1;
  });
  return swiglu_backward_fp8_kernel<kBySlot>;
}

}  // namespace

void swiglu_backward_fp8(float* d_topk_weights, const bf16_t* da, const bf16_t* g, const bf16_t* u,
                         const float* topk_weights, const int32_t* row_token_slot, const int32_t* total_rows,
                         int64_t capacity, int64_t width, bool gate_up_by_slot, const QuantizedDgu& rows,
                         const TransposedCodes& dgu_cols, const TransposedCodes& hw_cols, cudaStream_t stream) {
  if (width <= 0 || width % kCols != 0) {
    throw Error("width", "must be a positive multiple of 128, got " + std::to_string(width));
  }
  if (capacity % kRows != 0) throw Error("capacity", "must be a multiple of 128, got " + std::to_string(capacity));
  if (!row_token_slot || !total_rows) throw Error("row_token_slot", "the schedule's row slots and total are needed");
  if (!rows.on() || !rows.scales) throw Error("rows", "dg | du's row codes and scales are needed");
  if (!dgu_cols.q || !dgu_cols.scales || !hw_cols.q || !hw_cols.scales) {
    throw Error("dgu_cols", "the transposed codes and scales of dg | du and of hw are needed");
  }
  if (!aligned16(dgu_cols.q) || !aligned16(hw_cols.q) || !aligned16(dgu_cols.scales) || !aligned16(hw_cols.scales)) {
    throw Error("dgu_cols", "the transposed codes and scales must be 16-byte aligned");
  }
  if (capacity == 0) return;
  const auto kernel = gate_up_by_slot ? prepared_kernel<true>() : prepared_kernel<false>();
  kernel<<<unsigned(capacity / kRows), kThreads, kSmem, stream>>>(
      d_topk_weights, reinterpret_cast<const Vec8*>(da), reinterpret_cast<const Vec8*>(g),
      reinterpret_cast<const Vec8*>(u), topk_weights, row_token_slot, total_rows, capacity, width, rows, dgu_cols,
      hw_cols);
  LYNX_CHECK_LAUNCH();
}

void load_swiglu_backward_fp8_kernels() {
  load_module_of(reinterpret_cast<const void*>(&swiglu_backward_fp8_kernel<true>));
  prepared_kernel<true>();
  prepared_kernel<false>();
}

}  // namespace lynx::glue
