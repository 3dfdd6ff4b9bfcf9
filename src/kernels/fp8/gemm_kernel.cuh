// The block-scaled FP8 GEMM kernel (its host side: gemm.cu): persistent CTAs, one per SM, each taking
// output tiles in turn (the next tile's loads overlap this one's epilogue).
//
// Roles: warpgroup 0's first thread is the producer (TMA loads of A and B per 128-wide K block into a
// ring of stages); warpgroups 1 and 2 are the consumers, rows [64c, 64c + 64) of the tile each: four
// m64n128k32 E4M3 wgmma per K block and 128 columns into a temporary fp32 accumulator, then promoted
// into the running one times the row's A scale and the block's B scale (the DeepSeek-V3 recipe). The
// grouped forms' tiles are two such 128-column halves wide ([128, 256]; gate/up: the gate's 128 and the
// up's same 128), one temporary taking each half in turn, as does the weight gradient (its B scales per
// column); the two warpgroups issue independently, so that one's products may keep the tensor cores
// busy while the other promotes. The dense form alternates two temporaries over [128, 128] tiles. The bf16
// outputs leave as the bf16 expert GEMM's do (expert_gemm/epilogue.cuh): each warpgroup's [64, n] piece
// into shared memory with stmatrix, then out by TMA stores that drain while it goes on with its next
// tile (kept g and u row by row, by slot). The gate/up form may instead quantise h itself, in the 1×128
// tiles the down GEMM reads: a tile's 128 columns of h are one such tile of each of its rows.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/status.h"
#include "device/activation.cuh"
#include "device/sm90.cuh"
#include "kernels/expert_gemm/epilogue.cuh"
#include "kernels/expert_gemm/row_gather.cuh"
#include "kernels/fp8/api.h"
#include "kernels/fp8/e4m3.cuh"
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


// Columns col (even) and col + 1 of an fp32 row of N (the dense form): one store of both where N is even
// (the pair is then aligned), else each below N on its own.
__device__ __forceinline__ void store_pair(float* row, int32_t col, int32_t N, float v0, float v1) {
  if (col + 1 < N && N % 2 == 0) {
    *reinterpret_cast<float2*>(row + col) = make_float2(v0, v1);
    return;
  }
  if (col < N) row[col] = v0;
  if (col + 1 < N) row[col + 1] = v1;
}

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
  bool store_h = true, quantize_h = false;
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
  // kSwiGLU: h by tma_out (bf16) where store_h; quantised where quantize_h: its codes by tma_out2 ([M, N]
  // bytes in [64, 128] boxes), its scales into h_scales [M, blocks_of(N)], a non-finite tile reported
  // through h_report.
  bool store_h, quantize_h;
  float* h_scales;
  NonfiniteReport h_report;
  gemm::RowGather gather;  // the gate/up form gathering A itself (kGather)
  RowSources sources;      // kGather == kGatherRemote: each row from its source rank
};

// The gate/up form's A: in place, or gathered by the producer warpgroup's warps 1-3 (row_gather.cuh)
// from this rank's token tiles or, at R > 1, from each row's source rank's.
constexpr int kGatherNone = 0, kGatherLocal = 1, kGatherRemote = 2;
static_assert(kTileM == gemm::kBlockM, "a tile's rows are one row block of the gather's counters");
// NOTES: four 16-byte loads in flight per lane, not the bf16 kernel's eight: the producer warpgroup has
// 40 registers here (the consumers take 232 for two blocks' products in flight).
constexpr int kFp8GatherVecsPerLane = 4;

// ---- producer: warpgroup 0's first thread ----
// The tiles' K blocks into the ring of stages, running ahead into the next tile's while the consumers
// finish a tile; the stages' phases counted over the CTA's whole run (`it`, the K blocks issued).
template <Form kForm, class Out, int kGather>
__device__ __forceinline__ void producer(SharedStorage<kForm>& smem, const TileSpace<kForm>& tiles,
                                         const KernelArgs<Out>& p) {
  constexpr bool kSwiGLU = kForm == Form::kSwiGLU;
  constexpr bool kWeightGrad = kForm == Form::kWeightGrad;
  constexpr int kStages = SharedStorage<kForm>::kStages;
  const int32_t M = p.M, N = p.N;
  sm90::prefetch_tma_descriptor(p.tma_a);
  sm90::prefetch_tma_descriptor(p.tma_b);
  if constexpr (kSwiGLU) sm90::prefetch_tma_descriptor(p.tma_b2);
  int32_t it = 0;
  for (int32_t t = blockIdx.x; t < tiles.count; t += gridDim.x) {
    const Tile tile = tiles[t];
    // The rows of the tile's block, when the kernel gathers A (announced first: row_gather.cuh).
    if constexpr (kGather != kGatherNone) gemm::await_gathered_rows(p.gather, tile.m0 / kTileM, t, p.status);
    // The weight gradient's scales ([K blocks, M or N rounded up to 4]): a K block's of the tile's rows
    // and columns, as far as the rounded rows go (the scales of rows and columns past M and N are read,
    // never stored: their products are zeros and their outputs not stored).
    const int32_t lda = int32_t(scale_pitch(M)), ldb = int32_t(scale_pitch(N));
    const uint32_t a_scale_bytes = kWeightGrad ? 4 * uint32_t(min(kTileM, lda - tile.m0)) : 0;
    const uint32_t b_scale_bytes = kWeightGrad ? 4 * uint32_t(min(kOutN<kForm>, ldb - tile.n0)) : 0;
    const bool second = second_half<kForm>(tile, N);
    const uint32_t bytes = stage_bytes<kForm>(tile, N);
    for (int32_t kb = tile.kb_begin; kb < tile.kb_end; ++kb, ++it) {
      const int stage = it % kStages;
      // The stage's previous use (K block it - kStages) must be released by every consumer thread.
      if (it >= kStages) {
        sm90::mbarrier_wait(&smem.empty[stage], uint32_t(it / kStages + 1) & 1, p.status, sm90::Wait::kEmptyStage, t);
      }
      // NOTES: boxes past M, N or K are zero-filled by the TMA and still count their whole bytes.
      sm90::mbarrier_arrive_expect_tx(&smem.full[stage], bytes + a_scale_bytes + b_scale_bytes);
      if constexpr (kWeightGrad) {
        sm90::bulk_load(smem.scale_a[stage], p.a_scales + int64_t(kb) * lda + tile.m0, a_scale_bytes, &smem.full[stage]);
        sm90::bulk_load(smem.scale_b[stage], p.b_scales + int64_t(kb) * ldb + tile.n0, b_scale_bytes, &smem.full[stage]);
      }
      sm90::tma_load_2d(smem.a[stage], p.tma_a, &smem.full[stage], kb * int32_t(kBlock), tile.m0);
      if constexpr (kSwiGLU) {  // [128 gate rows; the same 128 up rows]
        sm90::tma_load_3d(smem.b[stage], p.tma_b, &smem.full[stage], kb * int32_t(kBlock), tile.n0, tile.expert);
        sm90::tma_load_3d(smem.b[stage] + kTileN * kBlock, p.tma_b2, &smem.full[stage], kb * int32_t(kBlock), tile.n0,
                          tile.expert);
      } else if constexpr (kForm == Form::kGrouped) {  // B rows n0 .. + 127, then (second) n0 + 128 .. + 255
        sm90::tma_load_3d(smem.b[stage], p.tma_b, &smem.full[stage], kb * int32_t(kBlock), tile.n0, tile.expert);
        if (second) {
          sm90::tma_load_3d(smem.b[stage] + kTileN * kBlock, p.tma_b, &smem.full[stage], kb * int32_t(kBlock),
                            tile.n0 + kTileN, tile.expert);
        }
      } else {  // dense, and the weight gradients' transposed rows (theirs in two halves, as the grouped form's)
        sm90::tma_load_2d(smem.b[stage], p.tma_b, &smem.full[stage], kb * int32_t(kBlock), tile.n0);
        if (kWeightGrad && second) {
          sm90::tma_load_2d(smem.b[stage] + kTileN * kBlock, p.tma_b, &smem.full[stage], kb * int32_t(kBlock),
                            tile.n0 + kTileN);
        }
      }
    }
  }
}

// ---- consumers: warpgroup c + 1 computes rows [64c, 64c + 64) of each tile ----
// Fragment of thread t of warpgroup c (warp w, lane l): acc[h][4j + r] is row 64c + 16w + l/4 + 8(r/2),
// column 128h + 8j + 2(l%4) + r%2 of the tile (gate/up: h = 0 the gate's column 8j + .., 1 the up's),
// j in [0, 16).

// NOTES: in the wide forms and the weight gradient the two consumer warpgroups issue their wgmma
// groups independently, sharing only the stages' barriers. They had issued them in turn (each group at a
// named barrier until the other warpgroup had issued its previous one), which gained the loop alone 14
// points of the FP8 rate (61% against 75%, 2026-12-05) while each group's eight descriptors were
// recomputed from their addresses; with the descriptors as offsets (d8a4107) the loop alone reached 88%
// without turns against 81% with them, and the forward's GEMMs 4-7% less time under ncu (H100,
// 2026-12-06; docs/fp8.md).

// The tile's sums over its K blocks into acc (zeroed first). `it`: the K blocks consumed before it.
template <Form kForm, class Out>
__device__ __forceinline__ void mainloop(SharedStorage<kForm>& smem, const TileSpace<kForm>& tiles,
                                         const KernelArgs<Out>& p, const Tile& tile, int32_t t, int32_t it, int c,
                                         float (&acc)[kHalves<kForm>][64]) {
  constexpr bool kSwiGLU = kForm == Form::kSwiGLU;
  constexpr bool kWeightGrad = kForm == Form::kWeightGrad;
  constexpr int kH = kHalves<kForm>;
  constexpr int kStages = SharedStorage<kForm>::kStages;
  const int32_t M = p.M, N = p.N, k_blocks = tiles.k_blocks;
  const int lane = int(threadIdx.x) % 32, warp = (int(threadIdx.x) % 128) / 32;
  const int32_t row0 = tile.m0 + 64 * c + 16 * warp + lane / 4, row1 = row0 + 8;
  const int32_t n = tile.kb_end - tile.kb_begin;
  const bool second = second_half<kForm>(tile, N);
  // Stage 0's descriptors: this warpgroup's 64 rows of A, and B.
  const uint64_t desc_a = sm90::smem_desc_k_major_sw128(&smem.a[0][64 * c * kBlock]);
  const uint64_t desc_b = sm90::smem_desc_k_major_sw128(&smem.b[0][0]);
  // The B scale blocks of the tile's halves (gate/up: the gate's in b_scales, the up's in b2_scales).
  const int64_t b_scale_row = fp8::impl::b_scale_row<kForm>(tile, N, k_blocks, 0);
  const int64_t b2_scale_row = fp8::impl::b_scale_row<kForm>(tile, N, k_blocks, 1);
  const float* b2_scales = kSwiGLU ? p.b2_scales : p.b_scales;
  // NOTES: rows past M and columns past N may end up NaN (their products are zeros, the weight
  // gradient's scales there stale): every epilogue leaves them out.
#pragma unroll
  for (int h = 0; h < kH; ++h) {
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[h][e] = 0.0f;
  }
  // The products of half h of the tile's K block i into d, as one wgmma group (its stage landed).
  // NOTES: each descriptor is stage 0's plus the operand's byte offset / 16 (sm90::smem_desc_offset):
  // recomputed from the address, each of a group's eight cost a mask, a shift and an or, and A's
  // (whose rows depend on c) a move into a uniform register too, ~40 instructions a group on the path
  // from a warpgroup's last promotion to its next wgmma (SASS, 2026-12-06).
  const auto issue_half = [&](float(&d)[64], int32_t i, int h) {
    const int stage = (it + i) % kStages;
    const uint64_t da0 = sm90::smem_desc_offset(desc_a, stage * int(sizeof(smem.a[0])));
    const uint64_t db0 = sm90::smem_desc_offset(desc_b, stage * int(sizeof(smem.b[0])) + h * int(kTileN * kBlock));
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < int(kBlock) / 32; ++kk) {  // k32 steps: 32 bytes along the 128-byte rows
      sm90::wgmma_m64n128k32_e4m3(d, sm90::smem_desc_offset(da0, kk * 32), sm90::smem_desc_offset(db0, kk * 32), kk > 0);
    }
    sm90::wgmma_commit();
  };
  const auto wait_full = [&](int32_t i) {
    const int32_t g = it + i;
    sm90::mbarrier_wait(&smem.full[g % kStages], uint32_t(g / kStages) & 1, p.status, sm90::Wait::kFullStage, t);
  };
  const auto issue = [&](float(&d)[64], int32_t i) {
    wait_full(i);
    issue_half(d, i, 0);
  };
  // Block i's stage back to the producer, once every wgmma reading it has completed.
  const auto release = [&](int32_t i) { sm90::mbarrier_arrive(&smem.empty[(it + i) % kStages]); };
  // The forward forms' scales (a row's per K block, [M, K blocks]; the halves' B blocks), loaded from
  // global memory ahead of their use; the weight gradient's (per row of A and per column of B) come
  // with the stage.
  struct Scales {
    float a0, a1, b, b2;
  };
  const auto scales_of = [&](int32_t i) {
    const int32_t kb = tile.kb_begin + i;
    const auto a_scale = [&](int32_t row) { return row < M ? p.a_scales[int64_t(row) * k_blocks + kb] : 0.0f; };
    return Scales{a_scale(row0), a_scale(row1), p.b_scales[b_scale_row + kb], b2_scales[b2_scale_row + kb]};
  };
  // d, its group completed, into `to` times the rows' scale products s0 (row0) and s1 (row1): exact
  // products of E4M3 values, so the order of the sums is the promotion's alone.
  const auto promote = [&](float(&to)[64], float(&d)[64], float s0, float s1) {
    sm90::fence_registers(d);
#pragma unroll
    for (int e = 0; e < 64; ++e) to[e] = fmaf(d[e], (e % 4) < 2 ? s0 : s1, to[e]);
  };
  float pa[64];
  if constexpr (kWeightGrad) {
    // NOTES: one half's products at a time through one temporary, leaving the overlap to the other
    // warpgroup: with two temporaries it spilled (120 bytes, its scales read from the stage by ld.shared),
    // and ptxas serialised its wgmma.
    const int row = 64 * c + 16 * warp + lane / 4;  // the tile's rows row, row + 8
    // Half h's first column scales of the stage: columns 128h + 8j + 2(l%4) + {0, 1}, j in [0, 8).
    // NOTES: read before the half's group is issued, so that the promotion after its wait starts without
    // waiting for them (read after it, the first FMULs waited on the loads: ~6% of the kernel's warp
    // samples, ncu, H100, 2026-12-06); the other eight after it, behind the first eight's products. All
    // sixteen before it spilled 38 bytes.
    constexpr int kEarlyScales = 8;
    const auto column_scale = [&](int stage, int h, int j) {
      return sm90::ld_shared_x2(&smem.scale_b[stage][kTileN * h + 8 * j + 2 * (lane % 4)]);
    };
    const auto column_scales = [&](float2(&b)[kEarlyScales], int stage, int h) {
#pragma unroll
      for (int j = 0; j < kEarlyScales; ++j) b[j] = column_scale(stage, h, j);
    };
    // pa, its group completed, into half h's running sums times the rows' and the columns' scales.
    const auto promote_columns = [&](float(&to)[64], const float2(&early)[kEarlyScales], int stage, int h, float a0,
                                     float a1) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 b = j < kEarlyScales ? early[j % kEarlyScales] : column_scale(stage, h, j);
        to[4 * j] = fmaf(pa[4 * j], a0 * b.x, to[4 * j]);
        to[4 * j + 1] = fmaf(pa[4 * j + 1], a0 * b.y, to[4 * j + 1]);
        to[4 * j + 2] = fmaf(pa[4 * j + 2], a1 * b.x, to[4 * j + 2]);
        to[4 * j + 3] = fmaf(pa[4 * j + 3], a1 * b.y, to[4 * j + 3]);
      }
    };
    for (int32_t i = 0; i < n; ++i) {
      wait_full(i);
      const int stage = (it + i) % kStages;
      const float a0 = sm90::ld_shared(&smem.scale_a[stage][row]), a1 = sm90::ld_shared(&smem.scale_a[stage][row + 8]);
      const auto half = [&](float(&to)[64], int h) {
        float2 early[kEarlyScales];
        column_scales(early, stage, h);
        issue_half(pa, i, h);
        sm90::wgmma_wait<0>();
        sm90::fence_registers(pa);
        promote_columns(to, early, stage, h, a0, a1);
      };
      half(acc[0], 0);
      if (second) half(acc[1], 1);
      release(i);  // once its scales are read
    }
  } else if constexpr (kH == 2) {
    // Each K block's halves one after another through pa; the scales a block ahead (their loads'
    // latency behind this block's products). Nothing orders the two warpgroups: while one waits for
    // its group and promotes it, the other's may run.
    Scales next = n > 0 ? scales_of(0) : Scales{};
    for (int32_t i = 0; i < n; ++i) {
      const Scales sc = next;
      if (i + 1 < n) next = scales_of(i + 1);
      wait_full(i);
      issue_half(pa, i, 0);
      sm90::wgmma_wait<0>();
      if (!second) release(i);
      promote(acc[0], pa, sc.a0 * sc.b, sc.a1 * sc.b);
      if (second) {
        issue_half(pa, i, 1);
        sm90::wgmma_wait<0>();
        release(i);
        promote(acc[1], pa, sc.a0 * sc.b2, sc.a1 * sc.b2);
      }
    }
  } else {
    // NOTES: pipelined: block i + 1's group is issued before block i's products are promoted, so the
    // tensor cores work on it meanwhile (wait_group 1: only block i's group must have completed).
    float pb[64];
    const auto promote_block = [&](float(&d)[64], int32_t i, const Scales& sc) {
      release(i);
      promote(acc[0], d, sc.a0 * sc.b, sc.a1 * sc.b);
    };
    if (n > 0) issue(pa, 0);
    int32_t i = 0;
    for (; i + 2 < n; i += 2) {
      Scales sc = scales_of(i);
      issue(pb, i + 1);
      sm90::wgmma_wait<1>();
      promote_block(pa, i, sc);
      sc = scales_of(i + 1);
      issue(pa, i + 2);
      sm90::wgmma_wait<1>();
      promote_block(pb, i + 1, sc);
    }
    if (i + 1 < n) {  // two blocks left, in pa and pb
      Scales sc = scales_of(i);
      issue(pb, i + 1);
      sm90::wgmma_wait<1>();
      promote_block(pa, i, sc);
      sc = scales_of(i + 1);
      sm90::wgmma_wait<0>();
      promote_block(pb, i + 1, sc);
    } else if (i < n) {  // one, in pa
      const Scales sc = scales_of(i);
      sm90::wgmma_wait<0>();
      promote_block(pa, i, sc);
    }
    // NOTES: ptxas, not seeing that a tail always follows the loop, adds an empty wait on the exit
    // path (warning C7517). A wgmma_wait<0> here instead made it serialise every wgmma (C7514;
    // tools/sass-check would say SERIAL).
  }
}

// ---- epilogue: the tile's sums out ----

// NOTES: the quantising gate/up epilogue. Each row of a warpgroup's piece is one 1×128 tile of h (n0 is
// a multiple of 128): its largest magnitude (the thread's 32 values of each of its two rows, then the
// four threads of the row: lanes l ^ 1, l ^ 2), its scale, the codes, out by a TMA store of a [64, 128]
// byte box (128-byte swizzle) through the piece's first box, and the scales. The values are h rounded
// to bf16, as the bf16 output holds them, quantised with e4m3.cuh's helpers: the bits quantize_tiles
// gives from that output.

// Fragment word 2j + r of a thread: h of columns 8j + 2(lane % 4) + {0, 1}, row half r, as bf16.
__device__ __forceinline__ float2 bf16_pair(uint32_t w) {
  const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&w);
  return __bfloat1622float2(v);
}

// Warpgroup c's rows [row, row + 64) of h, columns [n0, n0 + 128) (h(j, r): the fragment's values),
// quantised.
template <Form kForm, class Out, class Value>
__device__ __forceinline__ void quantize_h_piece(SharedStorage<kForm>& smem, const KernelArgs<Out>& p, int c,
                                                 int32_t n0, int32_t row, Value h) {
  const int thread = int(threadIdx.x) % 128, warp = thread / 32, lane = thread % 32;
  const int32_t N = p.N;
  uint32_t words[32];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) words[2 * j + r] = gemm::impl::bf16x2_bits(h(j, r));
  }
  // Each row's largest magnitude and finiteness over the tile's columns below N.
  float amax[2] = {0.0f, 0.0f};
  bool bad[2] = {false, false};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int32_t col = n0 + 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float2 v = bf16_pair(words[2 * j + r]);
      if (col < N) {
        bad[r] = bad[r] || !isfinite(v.x);
        amax[r] = fmaxf(amax[r], fabsf(v.x));
      }
      if (col + 1 < N) {
        bad[r] = bad[r] || !isfinite(v.y);
        amax[r] = fmaxf(amax[r], fabsf(v.y));
      }
    }
  }
  float inv[2], scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], o));
      bad[r] = __shfl_xor_sync(0xffffffffu, int(bad[r]), o) != 0 || bad[r];
    }
    const int e = bad[r] ? 0 : e4m3::scale_exponent(amax[r]);
    inv[r] = e4m3::pow2(-e);
    scale[r] = e4m3::scale_or_nan(e, !bad[r]);
  }
  if ((bad[0] || bad[1]) && lane % 4 == 0) e4m3::report_nonfinite(p.h_report);
  // The codes into box 0 as one [64, 128] byte box, 128-byte swizzle (code_offset, tiles.h), once the
  // box's last store has read it and every thread is done with it.
  const uint32_t box = sm90::smem_addr(smem.piece[0][c][0]);
  if (thread == 0) sm90::bulk_wait_group_read<0>();
  sm90::named_barrier_sync(1 + c, 128);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float2 v = bf16_pair(words[2 * j + r]);
      sm90::st_shared_u16(box + code_offset(warp, lane, j, r), e4m3::to_e4m3x2(v.x * inv[r], v.y * inv[r]));
    }
  }
  sm90::fence_proxy_async_shared();
  sm90::named_barrier_sync(1 + c, 128);
  if (thread == 0) {
    sm90::tma_store_2d(p.tma_out2, smem.piece[0][c][0], n0, row);
    sm90::bulk_commit_group();
  }
  if (lane % 4 == 0) {
    const int64_t blocks = blocks_of(N);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int32_t R = row + 16 * warp + lane / 4 + 8 * r;
      if (R < p.M) p.h_scales[int64_t(R) * blocks + n0 / int32_t(kBlock)] = scale[r];
    }
  }
}

// kept_slots: the slots of the kept g and u rows this thread stores (gemm::impl::piece_slots), loaded at
// the tile's start; null: loaded here. previous_second: whether the warpgroup's previous tile stored a
// second half (the grouped form's pieces).
template <Form kForm, class Out>
__device__ __forceinline__ void epilogue(SharedStorage<kForm>& smem, const KernelArgs<Out>& p, const Tile& tile,
                                         int c, const float (&acc)[kHalves<kForm>][64], const int4* kept_slots,
                                         bool previous_second) {
  constexpr bool kSwiGLU = kForm == Form::kSwiGLU;
  constexpr bool kWeightGrad = kForm == Form::kWeightGrad;
  const int32_t M = p.M, N = p.N, m0 = tile.m0, n0 = tile.n0;
  const int lane = int(threadIdx.x) % 32, warp = (int(threadIdx.x) % 128) / 32;
  if constexpr (kForm == Form::kDense) {  // fp32 out: each thread's two rows, two adjacent columns at a time
    const int32_t row0 = m0 + 64 * c + 16 * warp + lane / 4, row1 = row0 + 8;
    float* dst[2] = {row0 < M ? p.out + int64_t(row0) * N : nullptr, row1 < M ? p.out + int64_t(row1) * N : nullptr};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int32_t col = n0 + 8 * j + 2 * (lane % 4);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // rows row0 (acc[4j], acc[4j + 1]) and row1 (acc[4j + 2], acc[4j + 3])
        if (dst[h] != nullptr) store_pair(dst[h], col, N, acc[0][4 * j + 2 * h], acc[0][4 * j + 2 * h + 1]);
      }
    }
  } else {
    // The warpgroup's piece: rows [m0 + 64c, + 64), fragment column group j (columns 8j ..) of half h in
    // row half r at acc[h][4j + 2r], acc[h][4j + 2r + 1]. The TMA stores leave out rows and columns past
    // their tensor.
    const int32_t row = m0 + 64 * c;
    const auto pair = [&](int h, int i) { return make_float2(acc[h][i], acc[h][i + 1]); };
    if constexpr (kSwiGLU) {  // 128 columns: h = silu(g) ⊙ u from the gate's half and the up's
      const auto h = [&](int j, int r) {
        const int i = 4 * j + 2 * r;
        return make_float2(silu(acc[0][i]) * acc[1][i], silu(acc[0][i + 1]) * acc[1][i + 1]);
      };
      if (p.store_h) gemm::impl::store_piece<false>(smem.piece[0][c], p.tma_out, c, n0, row, 0, N, h);
      if (p.kept.gate != nullptr) {  // row by row, by slot
        using gemm::impl::SlotRows;
        const int4 slots =
            kept_slots ? *kept_slots : gemm::impl::piece_slots(SlotRows{p.kept.gate, p.kept.slot, N}, row);
        gemm::impl::store_piece<false>(smem.piece[0][c], SlotRows{p.kept.gate, p.kept.slot, N}, c, n0, row, 0, N,
                                       [&](int j, int r) { return pair(0, 4 * j + 2 * r); }, slots);
        gemm::impl::store_piece<false>(smem.piece[0][c], SlotRows{p.kept.up, p.kept.slot, N}, c, n0, row, 0, N,
                                       [&](int j, int r) { return pair(1, 4 * j + 2 * r); }, slots);
      }
      // Last: the acc registers are dead once it has taken h's words.
      if (p.quantize_h) quantize_h_piece(smem, p, c, n0, row, h);
    } else if constexpr (kWeightGrad) {  // the expert's rows [0, split) to out, the others to out2
      // Each half in its piece, as the grouped form's below (previous_second: the warpgroup's last stored
      // tile's).
      if (row < M) {
        const bool lower = row >= p.split;
        const CUtensorMap* map = lower ? p.tma_out2 : p.tma_out;
        const int32_t out_row = lower ? row - p.split : row;
        if (!previous_second && threadIdx.x % 128 == 0) sm90::bulk_wait_group_read<0>();
        gemm::impl::store_piece<true, 1>(smem.piece[0][c], map, c, n0, out_row, tile.expert, N,
                                         [&](int j, int r) { return pair(0, 4 * j + 2 * r); });
        if (second_half<kForm>(tile, N)) {
          gemm::impl::store_piece<true, 1>(smem.piece[1][c], map, c, n0 + kTileN, out_row, tile.expert, N,
                                           [&](int j, int r) { return pair(1, 4 * j + 2 * r); });
        }
      }
    } else {  // grouped: the first half's columns, then the second's where it has any, each in its piece
      // NOTES: one store group since each piece's last (the other piece's): the previous tile's second
      // half before the first piece, this tile's first half before the second. Where the previous tile
      // had no second half, its first half's store, the last, read the first piece: waited for here.
      if (!previous_second && threadIdx.x % 128 == 0) sm90::bulk_wait_group_read<0>();
      gemm::impl::store_piece<false, 1>(smem.piece[0][c], p.tma_out, c, n0, row, 0, N,
                                        [&](int j, int r) { return pair(0, 4 * j + 2 * r); });
      if (second_half<kForm>(tile, N)) {
        gemm::impl::store_piece<false, 1>(smem.piece[1][c], p.tma_out, c, n0 + kTileN, row, 0, N,
                                          [&](int j, int r) { return pair(1, 4 * j + 2 * r); });
      }
    }
  }
}

// finish_gather (row_gather.cuh) over the producer warpgroup alone, warp by warp: the consumers never
// touch the gather's counters. The last of the grid's producer warps to arrive zeroes them (those of the
// row blocks up to the schedule's total) for the next launch on the stream.
// NOTES: not every thread, as the bf16 kernel does: with the consumers' 232 registers reaching code
// that every thread runs, ptxas serialised their wgmma (C7511), and dropping them back to 40 first
// did too (C7512).
__device__ __forceinline__ void finish_gather_warp(const gemm::RowGather& g, const gemm::TileGrid& grid) {
  const int lane = int(threadIdx.x) % 32;
  __syncwarp();
  int last = 0;
  if (lane == 0) {
    __threadfence();  // the warp's copies and counts before its arrival
    const int32_t warps = 4 * int32_t(gridDim.x);
    last = atomicAdd(&g.sync[gemm::kGatherCtasDone], 1) == warps - 1;
    if (last) __threadfence();  // every warp's before this one zeroes the counters
  }
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __syncwarp();  // every lane's zeros after lane 0's fence
  const int32_t total = grid.expert_offset[grid.experts];
  const int32_t blocks = total <= grid.capacity ? total / gemm::kBlockM : 0;
  for (int32_t i = lane; i < gemm::kGatherSyncHeader + blocks; i += 32) g.sync[i] = 0;
}

// Persistent: each CTA takes tiles t = blockIdx.x, + gridDim.x, ... With kGather, every CTA's warps 1-3
// copy A's rows for all (a CTA without tiles too), and the last producer warp to finish zeroes the
// gather's counters.
template <Form kForm, class Out, int kGather>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                const __grid_constant__ CUtensorMap tma_b2, const float* __restrict__ a_scales,
                const float* __restrict__ b_scales, const float* __restrict__ b2_scales,
                const __grid_constant__ CUtensorMap tma_out, const __grid_constant__ CUtensorMap tma_out2,
                Out* __restrict__ out,
                int32_t M, int32_t N, int32_t K, const int32_t* __restrict__ expert_offset, int32_t experts,
                DeviceStatus* status, KeptGateUp kept, int32_t split, SwiGLUOutputs swiglu, gemm::RowGather gather,
                RowSources sources, bool pair_rows) {
  static_assert(kGather == kGatherNone || kForm == Form::kSwiGLU, "only the gate/up form gathers its rows");
  extern __shared__ uint8_t raw[];
  using Smem = SharedStorage<kForm>;
  Smem& smem = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const KernelArgs<Out> p{&tma_a, &tma_b, &tma_b2, &tma_out, &tma_out2, a_scales, b_scales, b2_scales, out, M, N,
                          status, kept, split, swiglu.store_h, swiglu.quantize_h, swiglu.h_scales, swiglu.h_report,
                          gather, sources};
  // NOTES: broadcast from lane 0, so that ptxas knows it is the same in every lane of a warp and keeps
  // what derives from it (the consumers' A descriptors) in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  const TileSpace<kForm> tiles(M, N, K, expert_offset, experts, pair_rows);
  // Every thread alike, before any barrier (a gathering CTA copies rows for the others, tiles or not).
  if (kGather == kGatherNone && int32_t(blockIdx.x) >= tiles.count) return;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Smem::kStages; ++s) {
      sm90::mbarrier_init(&smem.full[s], 1);
      sm90::mbarrier_init(&smem.empty[s], kConsumerThreads);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    const gemm::TileGrid grid{expert_offset, experts, 0, 0, 0, 0, M, false};
    if (threadIdx.x == 0) {
      producer<kForm, Out, kGather>(smem, tiles, p);
    } else if (kGather != kGatherNone && threadIdx.x >= 32) {
      gemm::gather_rows_warp<kGather == kGatherRemote, kFp8GatherVecsPerLane, true>(p.gather, grid, p.sources);
    }
    if constexpr (kGather != kGatherNone) finish_gather_warp(p.gather, grid);
    return;
  }
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int c = warpgroup - 1;
  int32_t it = 0;      // K blocks consumed before this tile
  bool previous_second = false;  // the previous tile's second half stored (grouped, weight gradient)
  // NOTES: tiles[t]'s binary search is seven global loads in turn at 128 experts, and the tile's first
  // B scales wait for it: each tile's start held ~17% of the down GEMM's warp samples (ncu source
  // counters, H100, 2026-12-05). A warp's search is two loads in turn, and its first round reads the
  // same offsets for every tile: read once here, a tile's search is one load (up to 1024 experts).
  // Before that, ~11% of the down GEMM's samples still waited there (H100, 2026-12-06).
  const int32_t first_round =
      kScheduleRows<kForm> ? gemm::expert_search_first_round(tiles.expert_offset, tiles.experts) : 0;
  for (int32_t t = blockIdx.x; t < tiles.count; t += gridDim.x) {
    Tile tile = tiles.without_expert(t);
    if constexpr (kScheduleRows<kForm>) {
      tile = tiles.at(t, gemm::expert_of_row_warp(tiles.expert_offset, tiles.experts, tiles.search_row(t), first_round));
    }
    // NOTES: the kept rows' slots, loaded in the epilogue, held the gate/up kernel's first row stores for
    // a global load's latency: those stores took ~10% of its warp samples (ncu, H100, 2026-12-06). Loaded
    // at the tile's start instead, but where the kernel pulls rows from other ranks: there the four more
    // registers spilled.
    constexpr bool kPreloadSlots = kForm == Form::kSwiGLU && kGather != kGatherRemote;
    int4 kept_slots = make_int4(-1, -1, -1, -1);
    if (kPreloadSlots && p.kept.gate != nullptr) {
      kept_slots = gemm::impl::piece_slots(gemm::impl::SlotRows{p.kept.gate, p.kept.slot, p.N}, tile.m0 + 64 * c);
    }
    float acc[kHalves<kForm>][64];
    mainloop(smem, tiles, p, tile, t, it, c, acc);
    it += tile.kb_end - tile.kb_begin;
    epilogue(smem, p, tile, c, acc, kPreloadSlots ? &kept_slots : nullptr, previous_second);
    // (the weight gradient's warpgroup stores nothing where its rows lie past M)
    if (kForm != Form::kWeightGrad || tile.m0 + 64 * c < p.M) previous_second = second_half<kForm>(tile, p.N);
  }
  // The stores must finish before the CTA's shared memory goes away.
  if (kForm != Form::kDense && threadIdx.x % 128 == 0) sm90::bulk_wait_group<0>();
}

}  // namespace lynx::fp8::impl
