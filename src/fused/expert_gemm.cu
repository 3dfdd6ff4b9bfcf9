// The grouped expert GEMM kernel: clusters of two CTAs, each CTA one producer warpgroup (TMA) and two
// consumer warpgroups (wgmma, 64 rows each), a static persistent scheduler over pairs of 128-row blocks.
//
// NOTES: the kernel is bound by L2 traffic (48 KB per CTA per K block at 82% of L2 throughput), so
// the two CTAs of a cluster take the two 128-row blocks of one pair and, when both blocks belong to
// the same expert, each loads half of the weight tile and multicasts it to both: 32 KB per CTA per
// K block instead of 48.
#include <algorithm>

#include <cuda.h>
#include <cuda_bf16.h>

#include "common/cuda_check.h"
#include "fused/expert_gemm.h"
#include "fused/sm90.cuh"
#include "fused/tma.h"

namespace lynx::fused {
namespace {

constexpr int kBlockM = 128;  // two consumer warpgroups × 64 rows
constexpr int kBlockK = 64;   // 64 bf16 = 128 bytes: one row of a 128-byte swizzle atom
constexpr int kThreads = 384; // warpgroup 0: producer; 1 and 2: consumers
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + 2 * kConsumerRegs * 128 <= 65536, "register file");

template <bool kSwiGLU>
struct Config {
  static constexpr int kOperandsB = kSwiGLU ? 2 : 1;
  // NOTES: both variants compute a 128 × 256 block of products per tile (gate 128 + up 128 columns,
  // or 256 plain columns): 128 fp32 accumulators per consumer thread, 48 KB per stage, 4 stages.
  static constexpr int kBlockN = kSwiGLU ? 128 : 256;
  static constexpr int kStages = 4;
};

template <bool kSwiGLU>
struct SharedStorage {
  static constexpr int kStages = Config<kSwiGLU>::kStages;
  alignas(1024) __nv_bfloat16 a[kStages][kBlockM * kBlockK];                              // [BLOCK_M, BLOCK_K] bf16, 128B swizzle
  alignas(1024) __nv_bfloat16 b[kStages][Config<kSwiGLU>::kOperandsB][Config<kSwiGLU>::kBlockN * kBlockK]; // [BLOCK_N, BLOCK_K] bf16, 128B swizzle
  uint64_t full[kStages];   // producer -> consumers: the stage's bytes have landed
  uint64_t empty[kStages];  // consumers -> producer: both consumer warpgroups are done with the stage
};
static_assert(sizeof(__nv_bfloat16) * kBlockM * kBlockK % 1024 == 0, "A stages stay 1024-byte aligned");
static_assert(sizeof(__nv_bfloat16) * 128 * kBlockK % 1024 == 0, "B stages stay 1024-byte aligned");
static_assert(sizeof(SharedStorage<true>) + 1024 <= 227 * 1024, "shared memory");
static_assert(sizeof(SharedStorage<false>) + 1024 <= 227 * 1024, "shared memory");

struct Params {
  const int32_t* expert_offset;
  int32_t experts;
  int32_t tiles_m;   // capacity / kBlockM
  int32_t tiles_n;   // ceil(n / BLOCK_N)
  int32_t k_blocks;  // K / kBlockK
  int32_t n;
  int32_t capacity;
  __nv_bfloat16* out;
  __nv_bfloat16* out_gate;
  __nv_bfloat16* out_up;
  DeviceStatus* status;
  int32_t stall_task;  // test hook: the producer stops at this tile, so its consumers must time out
};

// Tile scheduler: cluster c takes pair tiles c, c + clusters, ... A pair tile is two consecutive
// 128-row blocks (one per CTA of the cluster) × one column block, in m-major order (the column blocks
// of one pair are consecutive, so concurrent clusters share A rows and one expert's weights in L2).
// Pairs at or past the rows in use stop the walk: they come last. A CTA whose row block is past the
// rows in use still runs the pipeline (its peer's stage protocol needs it) but stores nothing.
struct TileScheduler {
  int32_t tiles_n, pairs, used_blocks;
  int32_t pair;
  int32_t clusters;

  __device__ TileScheduler(const Params& p) : tiles_n(p.tiles_n), pair(blockIdx.x / 2), clusters(gridDim.x / 2) {
    const int32_t used = p.expert_offset[p.experts];
    // A schedule over capacity places no rows: there is nothing to compute.
    used_blocks = (used <= p.capacity ? used : 0) / kBlockM;
    pairs = (used_blocks + 1) / 2 * p.tiles_n;
  }
  __device__ bool valid() const { return pair < pairs; }
  __device__ void advance() { pair += clusters; }
  __device__ int32_t first_block() const { return pair / tiles_n * 2; }
  __device__ int32_t n_block() const { return pair % tiles_n; }
  __device__ bool has_block(uint32_t rank) const { return first_block() + int32_t(rank) < used_blocks; }
};

// The expert whose (padded) block holds `row`: the last e with expert_offset[e] <= row.
__device__ int32_t expert_of_row(const int32_t* expert_offset, int32_t experts, int32_t row) {
  int32_t lo = 0, hi = experts;  // invariant: offset[lo] <= row < offset[hi]
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (expert_offset[mid] <= row) lo = mid; else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ float silu(float z) { return z / (1.0f + __expf(-z)); }

template <bool kSwiGLU>
__global__ void __launch_bounds__(kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b0,
                       const __grid_constant__ CUtensorMap tma_b1, const Params p) {
  constexpr int kStages = Config<kSwiGLU>::kStages;
  constexpr int kBlockN = Config<kSwiGLU>::kBlockN;
  extern __shared__ uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<SharedStorage<kSwiGLU>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int warpgroup = threadIdx.x / 128;
  const uint32_t rank = sm90::cluster_ctarank(), peer = rank ^ 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(&smem.full[s], 1);
      // Both consumer warpgroups of both CTAs: a stage is free only when neither CTA still reads it,
      // since the peer's producer may multicast into it.
      sm90::mbarrier_init(&smem.empty[s], 4);
    }
    sm90::fence_barrier_init();
  }
  sm90::cluster_sync();

  if (warpgroup == 0) {
    // ---- producer: one thread issues every TMA load ----
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      sm90::prefetch_tma_descriptor(&tma_a);
      sm90::prefetch_tma_descriptor(&tma_b0);
      if constexpr (kSwiGLU) sm90::prefetch_tma_descriptor(&tma_b1);
      constexpr int kHalf = kBlockN / 2;  // B rows each CTA loads when the pair shares its weights
      constexpr uint32_t kStageBytes =
          sizeof(__nv_bfloat16) * (kBlockM * kBlockK + Config<kSwiGLU>::kOperandsB * kBlockN * kBlockK);
      static_assert(kStageBytes == 48 * 1024, "stage size");
      int stage = 0;
      uint32_t phase = 0;
      for (TileScheduler sched(p); sched.valid(); sched.advance()) {
        if (sched.pair == p.stall_task) break;
        const int32_t first = sched.first_block(), own = first + int32_t(rank);
        const int32_t col0 = sched.n_block() * kBlockN;
        const int32_t expert_first = expert_of_row(p.expert_offset, p.experts, first * kBlockM);
        const bool shared_weights = sched.has_block(1) &&
                                    expert_of_row(p.expert_offset, p.experts, (first + 1) * kBlockM) == expert_first;
        const int32_t expert = sched.has_block(rank) ? expert_of_row(p.expert_offset, p.experts, own * kBlockM)
                                                     : expert_first;
        for (int32_t kb = 0; kb < p.k_blocks; ++kb) {
          sm90::mbarrier_wait(&smem.empty[stage], phase ^ 1, p.status, sm90::Wait::kEmptyStage, sched.pair);
          sm90::mbarrier_arrive_expect_tx(&smem.full[stage], kStageBytes);
          sm90::tma_load_2d(smem.a[stage], &tma_a, &smem.full[stage], kb * kBlockK, own * kBlockM);
#pragma unroll
          for (int op = 0; op < Config<kSwiGLU>::kOperandsB; ++op) {
            const CUtensorMap* map = op == 0 ? &tma_b0 : &tma_b1;
            __nv_bfloat16* b = smem.b[stage][op];
            if (shared_weights) {
              sm90::tma_load_3d_multicast(b + rank * kHalf * kBlockK, map, &smem.full[stage], kb * kBlockK,
                                          col0 + int32_t(rank) * kHalf, expert, 0b11);
            } else {
              sm90::tma_load_3d(b, map, &smem.full[stage], kb * kBlockK, col0, expert);
              sm90::tma_load_3d(b + kHalf * kBlockK, map, &smem.full[stage], kb * kBlockK, col0 + kHalf, expert);
            }
          }
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      }
    }
  } else {
    // ---- consumers: warpgroup c computes rows [64c, 64c + 64) of the CTA's row block ----
    sm90::setmaxnreg_inc<kConsumerRegs>();
    const int c = warpgroup - 1;
    const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    // A stage is released to both CTAs' producers: ours and the peer's.
    auto release = [&](int s) {
      if (t == 0) {
        sm90::mbarrier_arrive_cluster(&smem.empty[s], rank);
        sm90::mbarrier_arrive_cluster(&smem.empty[s], peer);
      }
    };
    int stage = 0;
    uint32_t phase = 0;
    float acc0[kBlockN / 2];
    float acc1[kSwiGLU ? kBlockN / 2 : 1];
    for (TileScheduler sched(p); sched.valid(); sched.advance()) {
      // Mainloop: wgmma over the K blocks; a stage is released once the wgmma group after it is
      // issued and its own group has completed (wait_group 1), so one group is always in flight.
      int prev_stage = -1;
      for (int32_t kb = 0; kb < p.k_blocks; ++kb) {
        sm90::mbarrier_wait(&smem.full[stage], phase, p.status, sm90::Wait::kFullStage, sched.pair);
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
          const uint64_t da = sm90::smem_desc_k_major_sw128(&smem.a[stage][c * 64 * kBlockK + kk * 16]);
          const bool accumulate = kb > 0 || kk > 0;
          if constexpr (kBlockN == 256) {
            sm90::wgmma_m64n256k16(acc0, da, sm90::smem_desc_k_major_sw128(&smem.b[stage][0][kk * 16]), accumulate);
          } else {
            sm90::wgmma_m64n128k16(acc0, da, sm90::smem_desc_k_major_sw128(&smem.b[stage][0][kk * 16]), accumulate);
          }
          if constexpr (kSwiGLU) {
            sm90::wgmma_m64n128k16(acc1, da, sm90::smem_desc_k_major_sw128(&smem.b[stage][1][kk * 16]), accumulate);
          }
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>();
        if (prev_stage >= 0) release(prev_stage);
        prev_stage = stage;
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      sm90::wgmma_wait<0>();
      if (prev_stage >= 0) release(prev_stage);
      if (!sched.has_block(rank)) continue;

      // Epilogue: fragments straight to global memory as bf16 pairs.
      const int32_t row_base = (sched.first_block() + int32_t(rank)) * kBlockM + c * 64 + warp * 16 + lane / 4;
      const int32_t col_base = sched.n_block() * kBlockN + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int32_t col = col_base + 8 * j;
        if (col >= p.n) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int64_t at = int64_t(row_base + 8 * half) * p.n + col;
          const float g0 = acc0[4 * j + 2 * half], g1 = acc0[4 * j + 2 * half + 1];
          if constexpr (kSwiGLU) {
            const float u0 = acc1[4 * j + 2 * half], u1 = acc1[4 * j + 2 * half + 1];
            *reinterpret_cast<__nv_bfloat162*>(p.out + at) = __floats2bfloat162_rn(silu(g0) * u0, silu(g1) * u1);
            if (p.out_gate) *reinterpret_cast<__nv_bfloat162*>(p.out_gate + at) = __floats2bfloat162_rn(g0, g1);
            if (p.out_up) *reinterpret_cast<__nv_bfloat162*>(p.out_up + at) = __floats2bfloat162_rn(u0, u1);
          } else {
            *reinterpret_cast<__nv_bfloat162*>(p.out + at) = __floats2bfloat162_rn(g0, g1);
          }
        }
      }
    }
  }
  // Neither CTA leaves while its peer may still arrive on its barriers or multicast into it. The
  // cluster barrier is warp-aligned: the producer's lone thread rejoins its warp first.
  __syncwarp();
  sm90::cluster_sync();
}

template <bool kSwiGLU>
void launch(const ExpertGemmArgs& args, cudaStream_t stream) {
  if (args.capacity % kBlockM || args.k % kBlockK || args.n % 64 || args.capacity > INT32_MAX) {
    throw Error("", "internal: expert GEMM sizes not supported (capacity " + std::to_string(args.capacity) + ", K " +
                        std::to_string(args.k) + ", N " + std::to_string(args.n) + ")");
  }
  const CUtensorMap a = make_tma_2d(args.a, args.capacity, args.k, kBlockM, kBlockK);
  constexpr int kBlockN = Config<kSwiGLU>::kBlockN;
  const CUtensorMap b0 = make_tma_3d(args.b0, args.experts, args.n, args.k, kBlockN / 2, kBlockK);
  const CUtensorMap b1 = kSwiGLU ? make_tma_3d(args.b1, args.experts, args.n, args.k, kBlockN / 2, kBlockK) : b0;
  Params p{};
  p.expert_offset = args.expert_offset;
  p.experts = static_cast<int32_t>(args.experts);
  p.tiles_m = static_cast<int32_t>(args.capacity / kBlockM);
  p.tiles_n = static_cast<int32_t>((args.n + kBlockN - 1) / kBlockN);
  p.k_blocks = static_cast<int32_t>(args.k / kBlockK);
  p.n = static_cast<int32_t>(args.n);
  p.capacity = static_cast<int32_t>(args.capacity);
  p.out = reinterpret_cast<__nv_bfloat16*>(args.out);
  p.out_gate = reinterpret_cast<__nv_bfloat16*>(args.out_gate);
  p.out_up = reinterpret_cast<__nv_bfloat16*>(args.out_up);
  p.status = args.status;
  p.stall_task = args.stall_task;
  constexpr size_t kSmem = sizeof(SharedStorage<kSwiGLU>) + 1024;
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  // NOTES: not every GPC holds an even number of free SMs, so fewer than sm_count / 2 clusters may
  // fit at once; the grid is what fits (the scheduler is persistent, any grid size is correct).
  static int grid = [&] {
    LYNX_CUDA(cudaFuncSetAttribute(expert_gemm_kernel<kSwiGLU>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    config.gridDim = dim3(args.sm_count / 2 * 2);
    int clusters = 0;
    LYNX_CUDA(cudaOccupancyMaxActiveClusters(&clusters, expert_gemm_kernel<kSwiGLU>, &config));
    if (clusters < 1) throw Error("", "internal: no 2-CTA cluster of the expert GEMM fits on this GPU");
    return std::min(2 * clusters, args.sm_count / 2 * 2);
  }();
  config.gridDim = dim3(grid);
  LYNX_CUDA(cudaLaunchKernelEx(&config, expert_gemm_kernel<kSwiGLU>, a, b0, b1, p));
}

}  // namespace

void expert_gemm(const ExpertGemmArgs& args, cudaStream_t stream) { launch<false>(args, stream); }
void expert_gemm_swiglu(const ExpertGemmArgs& args, cudaStream_t stream) { launch<true>(args, stream); }

}  // namespace lynx::fused
