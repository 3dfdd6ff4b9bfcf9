#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "device/activation.cuh"
#include "device/remote.cuh"
#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "common/per_device.h"
#include "kernels/fp8/e4m3.cuh"
#include "kernels/schedule/core.h"
#include "kernels/glue/api.h"
#include "kernels/glue/swiglu_backward.cuh"
#include "kernels/glue/vec8.cuh"

namespace lynx::glue {
namespace {

__device__ __forceinline__ bool row_valid(int64_t row, const int32_t* row_token_slot, const int32_t* total_rows) {
  if (total_rows && row >= *total_rows) return false;
  return !row_token_slot || row_token_slot[row] >= 0;
}

// How many blocks of `kernel` (`threads` threads, no dynamic shared memory) the current device holds at
// once, remembered per device in `cache`.
template <class Kernel>
int resident_blocks(Kernel kernel, int threads, detail::PerDeviceCache& cache) {
  return detail::per_device(cache, [&](int device) {
    int sms = 0, per_sm = 0;
    LYNX_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    LYNX_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    return std::max(1, sms * per_sm);
  });
}

int blocks_for(int64_t threads, int block) {
  const int64_t b = (threads + block - 1) / block;
  return static_cast<int>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

// grid-stride over groups of kGatherRows rows, one group per block at a time; thread v copies the
// 16-byte vectors v, v + blockDim.x, ... of each row of the group. Padding rows get zeros (the weight
// gradients sum over them, and the row GEMMs compute them, within the 64-row blocks they read).
// NOTES: the group's loads are all issued before its stores (kGatherRows independent 16-byte loads in
// flight per thread) and there is no 64-bit division per element: the first version (one warp per
// row, one load-store pair at a time) reached 28% of DRAM bandwidth, a flattened 4-vector version
// with a division per element ran twice as long again.
constexpr int kGatherRows = 4;

// kRemote (R > 1): each row from its source rank's copy (sources), not from src.
// NOTES: a template parameter, not a branch: with the remote path in the one-rank kernel the row
// loads lose their read-only path and the kernels slowed (2026-12-04, lynx-bench A/B).
template <bool kRemote>
__global__ void gather_rows_kernel(Vec8* __restrict__ dst, const Vec8* __restrict__ src,
                                   const int32_t* __restrict__ row_token_slot, const int32_t* total_rows,
                                   int64_t capacity, int64_t top_k, int64_t vecs_per_row, RowSources sources) {
  const int64_t total = *total_rows;
  // NOTES: a schedule over capacity places no rows (the call then reports the overflow); the row
  // arrays hold a previous call's rows or nothing, so none of them may be read.
  if (total > capacity) return;
  for (int64_t r0 = int64_t(blockIdx.x) * kGatherRows; r0 < total; r0 += int64_t(gridDim.x) * kGatherRows) {
    const Vec8* from[kGatherRows];
#pragma unroll
    for (int u = 0; u < kGatherRows; ++u) {
      const int32_t slot = r0 + u < total ? row_token_slot[r0 + u] : -1;
      const Vec8* base = src;
      if constexpr (kRemote) {
        if (slot >= 0) base = static_cast<const Vec8*>(sources.base[sources.row_src_rank[r0 + u]]);
      }
      from[u] = slot >= 0 ? base + (slot / top_k) * vecs_per_row : nullptr;
    }
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
      Vec8 val[kGatherRows];
#pragma unroll
      for (int u = 0; u < kGatherRows; ++u) {
        if (!from[u]) val[u] = Vec8{};
        else if constexpr (kRemote) val[u] = remote::load(from[u] + v);
        else val[u] = from[u][v];
      }
#pragma unroll
      for (int u = 0; u < kGatherRows; ++u) {
        if (r0 + u < total) dst[(r0 + u) * vecs_per_row + v] = val[u];
      }
    }
  }
}

// Token-major gather: blocks [0, token_blocks) walk the tokens, each token row of src read once and
// written to its schedule rows (slot_row, -1 for a slot no local expert takes); the other blocks zero
// the padding rows below *total_rows that a row GEMM's tile reads (sched::core::padding_row_read).
// NOTES: why token-major. The row-major gathers read each token row once per slot, k reads spread
// over the whole launch: where the token rows do not fit in L2 beside what streams through it
// (deepseek-v3: 59 MB of x against the 60 MB L2), most of those re-reads go to DRAM. Here a row is
// read once and its k copies are written while it sits in registers.
constexpr int kScatterThreads = 256;
constexpr int kScatterVecs = 2;  // 16-byte loads in flight per thread
__global__ void __launch_bounds__(kScatterThreads)
    scatter_token_rows_kernel(Vec8* __restrict__ dst, const Vec8* __restrict__ src, const int32_t* __restrict__ slot_row,
                              const int32_t* __restrict__ row_token_slot, const int32_t* total_rows, int64_t capacity,
                              int64_t tokens, int32_t top_k, int64_t vecs_per_row, int32_t token_blocks) {
  const int64_t total = *total_rows;
  // NOTES: a schedule over capacity writes neither slot_row nor the row arrays (see gather_rows_kernel).
  if (total > capacity) return;
  __shared__ int32_t rows[Limits::kMaxTopK > kScatterThreads ? Limits::kMaxTopK : kScatterThreads];
  __shared__ int32_t count;
  if (int32_t(blockIdx.x) < token_blocks) {
    for (int64_t t = blockIdx.x; t < tokens; t += token_blocks) {
      __syncthreads();
      if (int32_t(threadIdx.x) < top_k) rows[threadIdx.x] = slot_row[t * top_k + threadIdx.x];
      __syncthreads();
      const Vec8* from = src + t * vecs_per_row;
      for (int64_t v0 = threadIdx.x; v0 < vecs_per_row; v0 += kScatterThreads * kScatterVecs) {
        Vec8 val[kScatterVecs];
#pragma unroll
        for (int u = 0; u < kScatterVecs; ++u) {
          const int64_t v = v0 + u * kScatterThreads;
          if (v < vecs_per_row) val[u] = from[v];
        }
        for (int32_t j = 0; j < top_k; ++j) {
          const int64_t row = rows[j];
          if (row < 0) continue;
#pragma unroll
          for (int u = 0; u < kScatterVecs; ++u) {
            const int64_t v = v0 + u * kScatterThreads;
            if (v < vecs_per_row) dst[row * vecs_per_row + v] = val[u];
          }
        }
      }
    }
    return;
  }
  const int64_t pad_blocks = gridDim.x - token_blocks;
  for (int64_t r0 = (blockIdx.x - token_blocks) * int64_t(kScatterThreads); r0 < total;
       r0 += pad_blocks * kScatterThreads) {
    __syncthreads();
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    const int64_t r = r0 + threadIdx.x;
    if (r < total && row_token_slot[r] < 0 && sched::core::padding_row_read(row_token_slot, r)) {
      rows[atomicAdd(&count, 1)] = static_cast<int32_t>(r);
    }
    __syncthreads();
    for (int32_t i = 0; i < count; ++i) {
      for (int64_t v = threadIdx.x; v < vecs_per_row; v += kScatterThreads) dst[int64_t(rows[i]) * vecs_per_row + v] = Vec8{};
    }
  }
}

// One thread per 8 elements.
__global__ void swiglu_forward_kernel(Vec8* h, const Vec8* g, const Vec8* u, const int32_t* row_token_slot,
                                      const int32_t* total_rows, int64_t rows, int64_t vecs_per_row) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * vecs_per_row;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (!row_valid(i / vecs_per_row, row_token_slot, total_rows)) continue;
    const Vec8 gv = g[i], uv = u[i];
    Vec8 out;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float2 gf = gv.pair(p), uf = uv.pair(p);
      out.set_pair(p, silu(gf.x) * uf.x, silu(gf.y) * uf.y);
    }
    h[i] = out;
  }
}

// One warp per row, kSwigluWarps rows per block at a time, rows grid-strided over a grid that fits
// the GPU at once (swiglu_backward).
// NOTES: with one 128-thread block per row the grid was the schedule's capacity (~82k blocks at
// qwen3-30b-a3b, a fifth of them past the rows in use), a quarter of the threads idled at I = 768
// (96 vectors per row), and each row's d_topk_weights sum took two block barriers. A lane loads
// kSwigluVecs vectors of each input before it computes any. The sum is reduced in swiglu_backward.cuh's
// fixed order (that of the dgrad of down's FP8 epilogue), so it is bitwise reproducible.
// 3 vectors a lane: a row of I = 768 in one step. At 5 blocks per SM (20 rows in flight) ptxas fits it
// in 96 registers; with 2 vectors at 6 or 8 blocks, and with no minimum of blocks, it spilled.
constexpr int kSwigluWarps = 4;
constexpr int kSwigluVecs = 3;
constexpr int kSwigluBlocksPerSm = 5;

// hw may be da (in place): a lane reads its vectors of da before it writes the same vectors of hw,
// and no lane touches another's (so neither pointer is __restrict__).
// kRemote (R > 1): each row's weight from its source rank's copy, d_topk_weights per row (at 5
// blocks per SM its table lookups spilled). kBySlot: g and u at the row's slot (its second row
// address spilled at 5 blocks too; at 4, 16 rows in flight per SM still keep ~70 KB of loads in flight).
// kQuantize: dg | du also into `codes` (QuantizedDgu; at 5 blocks per SM it spilled). A row's vectors go
// to lanes 32 apart, so a tile's 16 vectors are half a warp's, and with width % 128 == 0 every half-warp
// either has all of a tile's or none of it (the loops' bounds are alike within a half).
template <bool kRemote, bool kBySlot, bool kQuantize>
__global__ void __launch_bounds__(kSwigluWarps * 32, kRemote || kBySlot || kQuantize ? 4 : kSwigluBlocksPerSm)
    swiglu_backward_kernel(
    Vec8* __restrict__ dg, Vec8* __restrict__ du, int64_t out_vecs_per_row, Vec8* hw,
    float* __restrict__ d_topk_weights, const Vec8* da, const Vec8* __restrict__ g,
    const Vec8* __restrict__ u, const float* __restrict__ topk_weights, const int32_t* __restrict__ row_token_slot,
    const int32_t* total_rows, int64_t rows, int64_t vecs_per_row, RowSources weight_sources, bool every_padding_row,
    QuantizedDgu codes) {
  static_assert(!(kRemote && kBySlot), "by slot: one rank");
  // A schedule over capacity placed no rows: row_token_slot holds nothing to follow.
  if (total_rows && *total_rows > rows) return;
  const int64_t used = total_rows ? *total_rows : rows;
  const int lane = threadIdx.x % 32;
  const int64_t stride = int64_t(gridDim.x) * kSwigluWarps;
  for (int64_t row = int64_t(blockIdx.x) * kSwigluWarps + threadIdx.x / 32; row < used; row += stride) {
    const int32_t slot = row_token_slot ? row_token_slot[row] : 0;
    if (row_token_slot && slot < 0) {  // padding: zeros, for the weight gradients
      // ... except in a 64-row half without rows, which no bf16 GEMM reads.
      if (!every_padding_row && sched::core::in_rowless_half(row_token_slot, row)) continue;
      for (int64_t v = lane; v < vecs_per_row; v += 32) {
        dg[row * out_vecs_per_row + v] = Vec8{};
        du[row * out_vecs_per_row + v] = Vec8{};
        if (hw) hw[row * vecs_per_row + v] = Vec8{};
        if constexpr (kQuantize) {
          store_dgu_codes(codes, out_vecs_per_row, row, v, Vec8{}, lane);
          store_dgu_codes(codes, out_vecs_per_row, row, vecs_per_row + v, Vec8{}, lane);
        }
      }
      continue;
    }
    float w;
    if constexpr (kRemote) {
      w = remote::load(static_cast<const float*>(weight_sources.base[weight_sources.row_src_rank[row]]) + slot);
    } else {
      w = topk_weights ? topk_weights[slot] : 1.0f;
    }
    float dot = 0.0f;
    // g and u of the row (at its slot with kBySlot).
    const Vec8* g_row = g + (kBySlot ? int64_t(slot) : row) * vecs_per_row;
    const Vec8* u_row = u + (kBySlot ? int64_t(slot) : row) * vecs_per_row;
    // Every lane through every step (the sum's shuffles): vector v0 + lane + 32q, where it exists.
    for (int64_t v0 = 0; v0 < vecs_per_row; v0 += 32 * kSwigluVecs) {
      Vec8 dav[kSwigluVecs], gv[kSwigluVecs], uv[kSwigluVecs];
#pragma unroll
      for (int q = 0; q < kSwigluVecs; ++q) {
        const int64_t v = v0 + lane + 32 * q;
        if (v < vecs_per_row) dav[q] = da[row * vecs_per_row + v], gv[q] = g_row[v], uv[q] = u_row[v];
      }
#pragma unroll
      for (int q = 0; q < kSwigluVecs; ++q) {
        const int64_t v = v0 + lane + 32 * q;
        if (v0 + 32 * q >= vecs_per_row) break;  // the warp alike
        float dots[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (v < vecs_per_row) {
          Vec8 dgv, duv, hwv;
          swiglu_backward_vector(dav[q], gv[q], uv[q], w, dots, dgv, duv, hwv);
          dg[row * out_vecs_per_row + v] = dgv;
          du[row * out_vecs_per_row + v] = duv;
          if (hw) hw[row * vecs_per_row + v] = hwv;
          if constexpr (kQuantize) {
            store_dgu_codes(codes, out_vecs_per_row, row, v, dgv, lane);
            store_dgu_codes(codes, out_vecs_per_row, row, vecs_per_row + v, duv, lane);
          }
        }
        if (d_topk_weights) {  // the chunks of lanes 0-15 and 16-31, in order (swiglu_backward.cuh)
#pragma unroll
          for (int p = 0; p < 4; ++p) {
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) dots[p] = __fadd_rn(dots[p], __shfl_xor_sync(0xffffffffu, dots[p], o));
          }
          const float chunk = chunk_sum(dots[0], dots[1], dots[2], dots[3]);
          dot = __fadd_rn(dot, __shfl_sync(0xffffffffu, chunk, 0));
          if (v0 + 32 * q + 16 < vecs_per_row) dot = __fadd_rn(dot, __shfl_sync(0xffffffffu, chunk, 16));
        }
      }
    }
    // At R > 1 the sum stays with the row (its source pulls it in the combine).
    if (d_topk_weights && lane == 0) d_topk_weights[kRemote ? row : slot] = dot;
  }
}

// One block per token, threads over 8-element vectors. The k rows are summed in j order, in fp32.
// NOTES: a token's slots and weights, then its rows, are loaded kCombineBatch at a time before any is
// summed: with one slot and one row per step, each row's load sat behind its slot's load and a branch.
constexpr int kCombineBatch = 8;

// kRemote (R > 1): the row of (t, j) from the rank owning its expert (peers), not from rows.
template <bool kRemote>
__global__ void combine_kernel(Vec8* __restrict__ out, const Vec8* __restrict__ rows,
                               const int32_t* __restrict__ slot_row, const float* __restrict__ topk_weights,
                               const float4* __restrict__ base, int64_t tokens, int64_t top_k, int64_t vecs_per_row,
                               const DeviceStatus* status, CombineSources peers) {
  if (status->code != int32_t(StatusCode::kOk)) return;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    // The rank that computed (t, j), at R > 1 (-1: none, a bad route; the status then holds an error).
    const auto owner = [&](int64_t slot) {
      const int32_t id = peers.ids32[slot];
      return id >= 0 ? id / peers.local_experts : -1;
    };
    if (peers.d_topk_weights) {
      for (int64_t j = threadIdx.x; j < top_k; j += blockDim.x) {
        if constexpr (kRemote) {
          const int32_t q = owner(t * top_k + j);
          peers.d_topk_weights[t * top_k + j] =
              q >= 0 ? remote::load(peers.d_topk_rows[q] + slot_row[t * top_k + j]) : 0.0f;
        } else if (slot_row[t * top_k + j] < 0) {
          peers.d_topk_weights[t * top_k + j] = 0.0f;  // not routed (swiglu_backward wrote the routed ones)
        }
      }
    }
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
      float acc[8];
      if (base) {
        const float4 b0 = base[(t * vecs_per_row + v) * 2], b1 = base[(t * vecs_per_row + v) * 2 + 1];
        acc[0] = b0.x, acc[1] = b0.y, acc[2] = b0.z, acc[3] = b0.w;
        acc[4] = b1.x, acc[5] = b1.y, acc[6] = b1.z, acc[7] = b1.w;
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
      }
      for (int64_t j0 = 0; j0 < top_k; j0 += kCombineBatch) {
        int32_t row[kCombineBatch];
        float w[kCombineBatch];
        Vec8 r[kCombineBatch];
#pragma unroll
        for (int u = 0; u < kCombineBatch; ++u) {
          const int64_t j = j0 + u;
          row[u] = j < top_k ? slot_row[t * top_k + j] : -1;
          w[u] = j < top_k && topk_weights ? topk_weights[t * top_k + j] : 1.0f;
        }
        if constexpr (kRemote) {
#pragma unroll
          for (int u = 0; u < kCombineBatch; ++u) {
            const int32_t q = j0 + u < top_k ? owner(t * top_k + j0 + u) : -1;
            r[u] = row[u] >= 0 && q >= 0
                       ? remote::load(static_cast<const Vec8*>(peers.rows[q]) + int64_t(row[u]) * vecs_per_row + v)
                       : Vec8{};
            if (q < 0) row[u] = -1;
          }
        } else {
#pragma unroll
          for (int u = 0; u < kCombineBatch; ++u) {
            r[u] = row[u] >= 0 ? rows[int64_t(row[u]) * vecs_per_row + v] : Vec8{};
          }
        }
#pragma unroll
        for (int u = 0; u < kCombineBatch; ++u) {
          if (row[u] < 0) continue;
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            const float2 f = r[u].pair(p);
            acc[2 * p] = fmaf(w[u], f.x, acc[2 * p]);
            acc[2 * p + 1] = fmaf(w[u], f.y, acc[2 * p + 1]);
          }
        }
      }
      Vec8 o;
#pragma unroll
      for (int p = 0; p < 4; ++p) o.set_pair(p, acc[2 * p], acc[2 * p + 1]);
      out[t * vecs_per_row + v] = o;
    }
  }
}

// One thread a row: its chunks' sums added in order to 0 (swiglu_backward.cuh).
__global__ void sum_row_chunks_kernel(float* __restrict__ d_topk_weights, const float* __restrict__ chunk_sums,
                                      int64_t chunks, const int32_t* __restrict__ row_token_slot,
                                      const int32_t* __restrict__ total_rows, int64_t capacity) {
  const int64_t total = *total_rows;
  if (total > capacity) return;  // a schedule over capacity placed no rows
  for (int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; row < total;
       row += int64_t(gridDim.x) * blockDim.x) {
    const int32_t slot = row_token_slot[row];
    if (slot < 0) continue;
    float dot = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) dot = __fadd_rn(dot, chunk_sums[row * chunks + c]);
    d_topk_weights[slot] = dot;
  }
}

}  // namespace

void load_kernels() { load_module_of(reinterpret_cast<const void*>(&combine_kernel<false>)); }

void sum_row_chunks(float* d_topk_weights, const float* chunk_sums, int64_t chunks, const int32_t* row_token_slot,
                    const int32_t* total_rows, int64_t capacity, cudaStream_t stream) {
  if (chunks <= 0 || !chunk_sums || !row_token_slot || !total_rows) {
    throw Error("chunk_sums", "the chunk sums, their count, the row slots and the total are needed");
  }
  if (capacity == 0 || !d_topk_weights) return;
  const int grid = static_cast<int>(std::min<int64_t>((capacity + 255) / 256, 132 * 8));
  sum_row_chunks_kernel<<<grid, 256, 0, stream>>>(d_topk_weights, chunk_sums, chunks, row_token_slot, total_rows,
                                                  capacity);
  LYNX_CHECK_LAUNCH();
}

void gather_rows(bf16_t* dst, const bf16_t* src, const int32_t* row_token_slot, const int32_t* total_rows,
                 int64_t capacity, int64_t top_k, int64_t width, cudaStream_t stream, const RowSources& sources) {
  const int grid = static_cast<int>(std::min<int64_t>((capacity + kGatherRows - 1) / kGatherRows, 132 * 16));
  (sources.remote() ? gather_rows_kernel<true> : gather_rows_kernel<false>)<<<grid, 256, 0, stream>>>(
      reinterpret_cast<Vec8*>(dst), reinterpret_cast<const Vec8*>(src), row_token_slot, total_rows, capacity, top_k,
      width / 8, sources);
  LYNX_CHECK_LAUNCH();
}

void scatter_token_rows(bf16_t* dst, const bf16_t* src, const int32_t* slot_row, const int32_t* row_token_slot,
                        const int32_t* total_rows, int64_t capacity, int64_t tokens, int64_t top_k, int64_t width,
                        cudaStream_t stream) {
  static detail::PerDeviceCache resident;
  const int fit = resident_blocks(scatter_token_rows_kernel, kScatterThreads, resident);
  // NOTES: an eighth of the resident blocks zero padding rows and the rest walk the tokens: the padding
  // rows a tile reads are a small part of the rows (under a 128-row block per expert, ~5% at deepseek-v3).
  const int token_blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(tokens, fit - fit / 8)));
  const int pad_blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((capacity + kScatterThreads - 1) / kScatterThreads, std::max(1, fit / 8))));
  scatter_token_rows_kernel<<<token_blocks + pad_blocks, kScatterThreads, 0, stream>>>(
      reinterpret_cast<Vec8*>(dst), reinterpret_cast<const Vec8*>(src), slot_row, row_token_slot, total_rows, capacity,
      tokens, static_cast<int32_t>(top_k), width / 8, token_blocks);
  LYNX_CHECK_LAUNCH();
}

void swiglu_forward(bf16_t* h, const bf16_t* g, const bf16_t* u, const int32_t* row_token_slot,
                    const int32_t* total_rows, int64_t rows, int64_t width, cudaStream_t stream) {
  swiglu_forward_kernel<<<blocks_for(rows * width / 8, 256), 256, 0, stream>>>(
      reinterpret_cast<Vec8*>(h), reinterpret_cast<const Vec8*>(g), reinterpret_cast<const Vec8*>(u), row_token_slot,
      total_rows, rows, width / 8);
  LYNX_CHECK_LAUNCH();
}

void swiglu_backward(bf16_t* dg, bf16_t* du, int64_t out_pitch, bf16_t* hw, float* d_topk_weights, const bf16_t* da,
                     const bf16_t* g, const bf16_t* u, const float* topk_weights, const int32_t* row_token_slot,
                     const int32_t* total_rows, int64_t rows, int64_t width, cudaStream_t stream,
                     const RowSources& weight_sources, bool gate_up_by_slot, bool every_padding_row,
                     const QuantizedDgu& codes) {
  if (gate_up_by_slot && (!row_token_slot || weight_sources.remote())) {
    throw Error("", "internal: swiglu_backward: g and u by slot need one rank's row slots");
  }
  if (codes.on() && (width % 128 != 0 || du != dg + width || out_pitch != 2 * width || !every_padding_row)) {
    throw Error("", "internal: swiglu_backward: quantised dg | du need one [rows, 2·width] array, width % 128 == 0");
  }
  const auto pick = [&](bool remote, auto quantize) {
    constexpr bool kQ = decltype(quantize)::value;
    return remote ? swiglu_backward_kernel<true, false, kQ>
           : gate_up_by_slot ? swiglu_backward_kernel<false, true, kQ>
                             : swiglu_backward_kernel<false, false, kQ>;
  };
  const auto variant = [&](bool remote) {
    return codes.on() ? pick(remote, std::true_type{}) : pick(remote, std::false_type{});
  };
  const auto kernel = variant(weight_sources.remote());
  // The grid: what the one-rank kernel holds at once (the remote one holds fewer blocks per SM and
  // strides over the rest).
  static detail::PerDeviceCache resident[2][2];
  const int fits = resident_blocks(variant(false), kSwigluWarps * 32, resident[codes.on()][gate_up_by_slot]);
  const int grid =
      static_cast<int>(std::min<int64_t>(std::max<int64_t>(1, (rows + kSwigluWarps - 1) / kSwigluWarps), fits));
  kernel<<<grid, kSwigluWarps * 32, 0, stream>>>(
      reinterpret_cast<Vec8*>(dg), reinterpret_cast<Vec8*>(du), out_pitch / 8, reinterpret_cast<Vec8*>(hw), d_topk_weights,
      reinterpret_cast<const Vec8*>(da), reinterpret_cast<const Vec8*>(g), reinterpret_cast<const Vec8*>(u),
      topk_weights, row_token_slot, total_rows, rows, width / 8, weight_sources, every_padding_row, codes);
  LYNX_CHECK_LAUNCH();
}

void combine(bf16_t* out, const bf16_t* rows, const int32_t* slot_row, const float* topk_weights, const float* base,
             int64_t tokens, int64_t top_k, int64_t width, const DeviceStatus* status, cudaStream_t stream,
             const CombineSources& peers) {
  const int grid = static_cast<int>(tokens < 65535 * 8 ? tokens : 65535 * 8);
  (peers.rows ? combine_kernel<true> : combine_kernel<false>)<<<grid, 256, 0, stream>>>(reinterpret_cast<Vec8*>(out), reinterpret_cast<const Vec8*>(rows),
                                           slot_row, topk_weights, reinterpret_cast<const float4*>(base), tokens,
                                           top_k, width / 8, status, peers);
  LYNX_CHECK_LAUNCH();
}

}  // namespace lynx::glue
