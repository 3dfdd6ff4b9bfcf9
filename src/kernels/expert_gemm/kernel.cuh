// The grouped expert GEMM kernel: one producer warpgroup (TMA), two consumer warpgroups (wgmma,
// 64 rows each), a persistent tile scheduler (tiles claimed in order from a device ticket, or a static
// round robin; plan/tiles.h chooses).
// Four modes share the pipeline (A_e = the expert's block of schedule rows):
//   kRowsSwiGLU  C_e = silu(A_e·Gᵀ) ⊙ (A_e·Uᵀ)   G, U: [E, N, K] (K-major)
//   kRows        C_e = A_e · Bᵀ                   B: [E, N, K] (K-major)
//   kRowsMnB     C_e = A_e · [B0; B1]             B0: [E, K0, N], B1: [E, K - K0, N] (N-major)
//   kWeightGrad  C_e = A_eᵀ · B_e                 A, B: [capacity, M] and [capacity, N] row buffers
//                (M- and N-major), K = the expert's rows rounded up to 64 (padding rows hold zeros)
// Epilogue: each consumer warpgroup writes its fragments in [64, 128] pieces into its own swizzled
// shared-memory buffer and one thread stores them with TMA; the stores drain while the warpgroup
// goes on with the next tile's mainloop.
// This file: the kernel, which gives each warpgroup its role (traits.cuh, producer.cuh,
// consumer.cuh, epilogue.cuh; the in-kernel gather on the producer warpgroup's spare warps,
// row_gather.cuh; kRemote: the gather reads each row from its source rank, R > 1).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "device/sm90.cuh"
#include "kernels/expert_gemm/consumer.cuh"
#include "kernels/expert_gemm/producer.cuh"
#include "kernels/expert_gemm/row_gather.cuh"
#include "kernels/expert_gemm/traits.cuh"

namespace lynx::gemm::impl {

template <Mode kMode, bool kFold, bool kRemote>
__global__ void __launch_bounds__(kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_a_half,
                       const __grid_constant__ CUtensorMap tma_a_quarter, const __grid_constant__ CUtensorMap tma_a_fold,
                       const __grid_constant__ CUtensorMap tma_b0, const __grid_constant__ CUtensorMap tma_b1,
                       const __grid_constant__ CUtensorMap tma_b_half, const __grid_constant__ CUtensorMap tma_c0,
                       const __grid_constant__ CUtensorMap tma_c1, const __grid_constant__ CUtensorMap tma_c2,
                       const Params p) {
  using C = Config<kMode, kFold>;
  const bool paired = C::kMayPair && p.cluster > 1;
  extern __shared__ uint8_t smem_raw[];
  // NOTES: the dynamic shared memory starts at the same address in every CTA, so the aligned storage,
  // and each stage, sits at the same offset in both CTAs of a cluster, as multicast loads require.
  auto& smem =
      *reinterpret_cast<SharedStorage<kMode, kFold>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t rank = paired ? sm90::cluster_rank() : 0;

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      sm90::mbarrier_init(&smem.full[s], 1);
      sm90::mbarrier_init(&smem.empty[s], kConsumerThreads + (paired ? kConsumerWarps : 0));
      smem.stage_tile[s] = kNoTile;
    }
    sm90::mbarrier_init(&smem.consumers_done, kConsumerThreads);
    for (int s = 0; s < 2; ++s) {
      sm90::mbarrier_init(&smem.unit_full[s], 1);
      sm90::mbarrier_init(&smem.unit_empty[s], 1);
    }
    sm90::fence_barrier_init();
  }
  // The partner's barriers must be initialised before this CTA arrives on them or multicasts to them.
  if (paired) {
    sm90::cluster_sync();
  } else {
    __syncthreads();
  }

  if (warpgroup == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      sm90::prefetch_tma_descriptor(&tma_a);
      sm90::prefetch_tma_descriptor(&tma_b0);
      if constexpr (C::kSwiGLU || kMode == Mode::kRowsMnB) sm90::prefetch_tma_descriptor(&tma_b1);
      producer(smem, OperandMaps{&tma_a, &tma_a_half, &tma_a_quarter, &tma_a_fold, &tma_b0, &tma_b1, &tma_b_half}, p,
               rank);
      sm90::mbarrier_wait(&smem.consumers_done, 0, p.status, sm90::Wait::kConsumersDone, kNoTile, kConsumersDoneNs);
    } else if (kMode != Mode::kWeightGrad && p.gather.src && threadIdx.x >= 32) {
      gather_rows_warp<kRemote>(p.gather, p.grid, p.sources);  // warps 1-3
    }
  } else {
    sm90::setmaxnreg_inc<kConsumerRegs>();
    consumer<kMode, kFold, !kRemote>(smem, &tma_c0, &tma_c1, &tma_c2, p, warpgroup - 1, rank);
  }
  // NOTES: no CTA of a cluster leaves while its partner may still arrive on its barriers or multicast
  // into its stages. This wait is not bounded itself, but each of the partner's waits is: a stalled
  // partner traps, and the trap ends the grid.
  if (paired) sm90::cluster_sync();
  if constexpr (kMode != Mode::kWeightGrad) {
    if (p.gather.src) finish_gather(p.gather, p.grid);
  }
}

}  // namespace lynx::gemm::impl
