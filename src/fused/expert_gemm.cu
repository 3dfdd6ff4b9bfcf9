// The grouped expert GEMM kernel: one producer warpgroup (TMA), two consumer warpgroups (wgmma,
// 64 rows each), a static persistent tile scheduler over the 128-row blocks of the schedule.
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

// Tile scheduler: CTA b takes tiles b, b + gridDim.x, ... in m-major order (the n-tiles of one
// 128-row block are consecutive, so concurrent CTAs share A rows and one expert's weights in L2).
// Tiles at or past the rows in use stop the walk: they come last.
struct TileScheduler {
  int32_t tiles_n, tiles;
  int32_t tile;

  __device__ TileScheduler(const Params& p) : tiles_n(p.tiles_n), tile(blockIdx.x) {
    const int32_t used = p.expert_offset[p.experts];
    // A schedule over capacity places no rows: there is nothing to compute.
    const int32_t rows = used <= p.capacity ? used : 0;
    tiles = (rows / kBlockM) * p.tiles_n;
  }
  __device__ bool valid() const { return tile < tiles; }
  __device__ void advance() { tile += gridDim.x; }
  __device__ int32_t m_block() const { return tile / tiles_n; }
  __device__ int32_t n_block() const { return tile % tiles_n; }
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
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(&smem.full[s], 1);
      sm90::mbarrier_init(&smem.empty[s], 2);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- producer: one thread issues every TMA load ----
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x != 0) return;
    sm90::prefetch_tma_descriptor(&tma_a);
    sm90::prefetch_tma_descriptor(&tma_b0);
    if constexpr (kSwiGLU) sm90::prefetch_tma_descriptor(&tma_b1);
    constexpr uint32_t kStageBytes =
        sizeof(__nv_bfloat16) * (kBlockM * kBlockK + Config<kSwiGLU>::kOperandsB * kBlockN * kBlockK);
    static_assert(kStageBytes == 48 * 1024, "stage size");
    int stage = 0;
    uint32_t phase = 0;
    for (TileScheduler sched(p); sched.valid(); sched.advance()) {
      const int32_t row0 = sched.m_block() * kBlockM, col0 = sched.n_block() * kBlockN;
      const int32_t expert = expert_of_row(p.expert_offset, p.experts, row0);
      for (int32_t kb = 0; kb < p.k_blocks; ++kb) {
        sm90::mbarrier_wait(&smem.empty[stage], phase ^ 1, p.status, sm90::Wait::kEmptyStage, sched.tile);
        if (sched.tile == p.stall_task) return;
        sm90::mbarrier_arrive_expect_tx(&smem.full[stage], kStageBytes);
        sm90::tma_load_2d(smem.a[stage], &tma_a, &smem.full[stage], kb * kBlockK, row0);
        sm90::tma_load_3d(smem.b[stage][0], &tma_b0, &smem.full[stage], kb * kBlockK, col0, expert);
        if constexpr (kSwiGLU) sm90::tma_load_3d(smem.b[stage][1], &tma_b1, &smem.full[stage], kb * kBlockK, col0, expert);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  // ---- consumers: warpgroup c computes rows [64c, 64c + 64) of each tile ----
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int c = warpgroup - 1;
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  int stage = 0;
  uint32_t phase = 0;
  float acc0[kBlockN / 2];
  float acc1[kSwiGLU ? kBlockN / 2 : 1];
  for (TileScheduler sched(p); sched.valid(); sched.advance()) {
    // Mainloop: wgmma over the K blocks; a stage is released once the wgmma group after it is issued
    // and its own group has completed (wait_group 1), so one group is always in flight.
    int prev_stage = -1;
    for (int32_t kb = 0; kb < p.k_blocks; ++kb) {
      sm90::mbarrier_wait(&smem.full[stage], phase, p.status, sm90::Wait::kFullStage, sched.tile);
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
      if (prev_stage >= 0 && t == 0) sm90::mbarrier_arrive(&smem.empty[prev_stage]);
      prev_stage = stage;
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    sm90::wgmma_wait<0>();
    if (prev_stage >= 0 && t == 0) sm90::mbarrier_arrive(&smem.empty[prev_stage]);

    // Epilogue: fragments straight to global memory as bf16 pairs.
    const int32_t row_base = sched.m_block() * kBlockM + c * 64 + warp * 16 + lane / 4;
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

template <bool kSwiGLU>
void launch(const ExpertGemmArgs& args, cudaStream_t stream) {
  if (args.capacity % kBlockM || args.k % kBlockK || args.n % 64 || args.capacity > INT32_MAX) {
    throw Error("", "internal: expert GEMM sizes not supported (capacity " + std::to_string(args.capacity) + ", K " +
                        std::to_string(args.k) + ", N " + std::to_string(args.n) + ")");
  }
  const CUtensorMap a = make_tma_2d(args.a, args.capacity, args.k, kBlockM, kBlockK);
  constexpr int kBlockN = Config<kSwiGLU>::kBlockN;
  const CUtensorMap b0 = make_tma_3d(args.b0, args.experts, args.n, args.k, kBlockN, kBlockK);
  const CUtensorMap b1 = kSwiGLU ? make_tma_3d(args.b1, args.experts, args.n, args.k, kBlockN, kBlockK) : b0;
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
  static bool configured = [] {
    LYNX_CUDA(cudaFuncSetAttribute(expert_gemm_kernel<kSwiGLU>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    return true;
  }();
  (void)configured;
  expert_gemm_kernel<kSwiGLU><<<args.sm_count, kThreads, kSmem, stream>>>(a, b0, b1, p);
  LYNX_CHECK_LAUNCH();
}

}  // namespace

void expert_gemm(const ExpertGemmArgs& args, cudaStream_t stream) { launch<false>(args, stream); }
void expert_gemm_swiglu(const ExpertGemmArgs& args, cudaStream_t stream) { launch<true>(args, stream); }

}  // namespace lynx::fused
