// Grouped expert GEMMs on sm_90a (TMA + wgmma, warp-specialized, persistent) that take the per-expert
// row offsets from device memory: no host synchronisation, capturable in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace lynx::fused {

using bf16_t = uint16_t;

struct ExpertGemmArgs {
  const bf16_t* a = nullptr;              // [capacity, K]  rows in schedule order (expert-major, 128-padded)
  int64_t capacity = 0;                   // multiple of 128
  int64_t k = 0;                          // multiple of 64
  const bf16_t* b0 = nullptr;             // [experts, n, K]  (gate, or the only weight)
  const bf16_t* b1 = nullptr;             // [experts, n, K]  (up; SwiGLU only)
  int64_t experts = 0;
  int64_t n = 0;                          // multiple of 64
  const int32_t* expert_offset = nullptr; // [experts + 1] device; [experts] = rows used (padded total)
  bf16_t* out = nullptr;                  // [capacity, n]
  bf16_t* out_gate = nullptr;             // [capacity, n]  SwiGLU only, may be null
  bf16_t* out_up = nullptr;               // [capacity, n]  SwiGLU only, may be null
  DeviceStatus* status = nullptr;         // where a stalled wait is reported
  int sm_count = 0;
  int32_t stall_task = -1;                // test hook: the producer never loads this tile (-1: off)
};

// out = A·B0ᵀ per expert block of rows.
void expert_gemm(const ExpertGemmArgs& args, cudaStream_t stream);

// out = silu(A·B0ᵀ) ⊙ (A·B1ᵀ), and the two products themselves into out_gate / out_up when given.
void expert_gemm_swiglu(const ExpertGemmArgs& args, cudaStream_t stream);

// Weight gradients per local expert e, over the expert's schedule rows r (its padded block):
//   out[e][i][j] = Σ_r a_t[i][r] · b_t[j][r]     (i < split, or every i when out2 is null)
//   out2[e][i - split][j] = the same             (i >= split)
// a_t: [m, capacity], b_t: [n, capacity] (the per-row operands transposed, zero on padding rows).
// Each output tile is computed by one CTA over the expert's rows in order: deterministic. An expert
// without rows gets exact zeros.
struct WeightGradArgs {
  const bf16_t* a_t = nullptr;
  const bf16_t* b_t = nullptr;
  int64_t m = 0, n = 0, capacity = 0, experts = 0;
  int64_t split = 0;
  const int32_t* expert_offset = nullptr;
  bf16_t* out = nullptr;
  bf16_t* out2 = nullptr;
  DeviceStatus* status = nullptr;
  int sm_count = 0;
};

void expert_weight_grad(const WeightGradArgs& args, cudaStream_t stream);

}  // namespace lynx::fused
