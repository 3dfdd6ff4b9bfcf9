// The block-scaled FP8 GEMM kernel's shared pieces (kernel.cuh): its threads and registers, the
// shared-memory layout of each form, the arguments every role reads, and the grouped forms' gather modes.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/status.h"
#include "kernels/expert_gemm/row_gather.cuh"
#include "kernels/fp8/api.h"
#include "kernels/fp8/tiles.h"

namespace lynx::fp8::impl {

constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;
// NOTES: setmaxnreg moves registers within what the CTA got at launch, 384 threads × 168 (the most
// __launch_bounds__(384, 1) allows): the producer warpgroup keeps 40 (one thread issues the TMA loads)
// and the consumers take 232, for the running accumulators and the products in flight: 3 × 64 fp32 a
// thread (two halves' accumulators and one temporary; the dense form's one accumulator and two); at 168
// each the weight-gradient form spilled.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 65536 / kThreads / 8 * 8 * kThreads,
              "register budget");

static_assert(kTileM * kBlock % 1024 == 0 && kTileN * kBlock % 1024 == 0, "stages stay 1024-byte aligned");

// NOTES: as many stages as fit beside the epilogue pieces: 6 of 32 KB (all of 227 KB with the alignment
// pad), 4 of 48 KB in the gate/up form's [128, 256] tiles (192 KB in flight, where 6 × 32 KB held half
// as many products). The grouped form has 3, and a second piece for each warpgroup: with one, its
// epilogue waited for the first half's TMA store to read the piece before staging the second half (~5%
// of the down GEMM's warp samples, ncu, H100, 2026-12-06). The weight gradient likewise (3 stages and
// two pieces), its stages also holding their K block's scales.
template <Form kForm>
struct SharedStorage {
  static constexpr bool kStageScales = kForm == Form::kWeightGrad;
  // A warpgroup's [64, 128] epilogue pieces: one per half where the halves are stored apart.
  static constexpr int kPieces = kForm == Form::kGrouped || kForm == Form::kWeightGrad ? 2 : 1;
  static constexpr int kStages = kPieces == 2 ? 3 : kHalves<kForm> == 2 ? 4 : 6;
  alignas(1024) uint8_t a[kStages][kTileM * kBlock];  // [128 rows, 128 K] E4M3, 128B swizzle
  // [128 columns per half, 128 K] E4M3, 128B swizzle (gate/up: the gate's 128 rows, then the up's)
  alignas(1024) uint8_t b[kStages][kHalves<kForm> * kTileN * kBlock];
  // Each consumer warpgroup's epilogue pieces: [64 rows, 128 columns] bf16 as two [64, 64] boxes, 128B
  // swizzle (a grouped tile's two halves, one each; a SwiGLU tile's h, g and u, one after another).
  alignas(1024) __nv_bfloat16 piece[kPieces][2][2][64 * 64];
  // The weight gradient's: each stage's K block scales of the tile's 128 rows of A and 256 columns of B.
  alignas(16) float scale_a[kStageScales ? kStages : 1][kStageScales ? kTileM : 4];
  alignas(16) float scale_b[kStageScales ? kStages : 1][kStageScales ? kHalves<kForm> * kTileN : 4];
  uint64_t full[kStages];   // producer -> consumers: the stage's bytes have landed
  uint64_t empty[kStages];  // consumers -> producer: every consumer thread is done with the stage
};
template <Form kForm>
constexpr int kSmem = int(sizeof(SharedStorage<kForm>)) + 1024;  // and the 1024-byte alignment
static_assert(kSmem<Form::kDense> <= 227 * 1024 && kSmem<Form::kGrouped> <= 227 * 1024 &&
                  kSmem<Form::kSwiGLU> <= 227 * 1024 && kSmem<Form::kWeightGrad> <= 227 * 1024,
              "shared memory");

// The gate/up form's outputs of h (KernelArgs says what each means).
struct SwiGLUOutputs {
  bool store_h = true;
  uint8_t* h_codes = nullptr;  // h quantised where not null
  float* h_scales = nullptr;
  NonfiniteReport h_report{};
};

// What every role reads: the kernel's arguments (the tensor maps by address: they stay in the kernel's
// parameter space, where TMA reads them).
template <class Out>
struct KernelArgs {
  const CUtensorMap *tma_a, *tma_b, *tma_b2, *tma_out, *tma_out2;
  const float *a_scales, *b_scales, *b2_scales;
  Out* out;
  int32_t M, N;
  DeviceStatus* status;
  KeptGateUp kept;
  // kWeightGrad: an expert's output rows [0, split) go to tma_out ([experts, split, N]), the others to
  // tma_out2 ([experts, M − split, N]); split % 64 == 0 unless split = M, so that no 64-row epilogue
  // piece straddles the two.
  int32_t split;
  // kSwiGLU: h by tma_out (bf16) where store_h; quantised where h_codes is given: its codes into h_codes ([M, N]
  // bytes, N % 16 == 0, 16-byte aligned), its scales into h_scales [M, blocks_of(N)], a non-finite tile reported
  // through h_report.
  bool store_h;
  uint8_t* h_codes;
  float* h_scales;
  NonfiniteReport h_report;
  gemm::RowGather gather;  // a grouped form gathering A itself (kGather)
  RowSources sources;      // kGather == kGatherRemote: each row from its source rank
};

// A grouped form's A: in place, or gathered by the producer warpgroup's warps 1-3 (row_gather.cuh)
// from this rank's token tiles or, at R > 1 (gate/up only), from each row's source rank's.
constexpr int kGatherNone = 0, kGatherLocal = 1, kGatherRemote = 2;
static_assert(kTileM == gemm::kBlockM, "a tile's rows are one row block of the gather's counters");
// NOTES: four 16-byte loads in flight per lane, not the bf16 kernel's eight: the producer warpgroup has
// 40 registers here (the consumers take 232 for two blocks' products in flight).
constexpr int kFp8GatherVecsPerLane = 4;

}  // namespace lynx::fp8::impl
